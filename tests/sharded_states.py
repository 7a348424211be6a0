"""Run by tests/test_memory_pallas.py in a subprocess with 8 host CPU devices: the LMU layer
through its kernels (interpret mode) on a 4 x 2 mesh, the sequences split over both axes.
Prints its weighted output sum and the gradients of its parameters and input, the device
count, and how often the layer's traced forward holds a shard_map and each forward kernel, as
one JSON object."""

import os

flags = os.environ.get("XLA_FLAGS", "")  # the suite's (conftest.py), and 8 devices
os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import dataclasses  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from test_memory_pallas import KERNELS, layer_loss, odd_layer  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
impls = dataclasses.replace(KERNELS, mesh=mesh)
loss, grads = layer_loss(impls, NamedSharding(mesh, P(mesh.axis_names)), batch=8)
out = {"loss": float(loss), "grads": [np.asarray(g).tolist() for g in jax.tree.leaves(grads)]}
# What the layer's program holds: the kernels, each device's on its share (traced only).
layer, u = odd_layer(impls), jax.ShapeDtypeStruct((8, 40, 37), np.float32)
params = jax.eval_shape(layer.init, jax.random.key(0), u)
program = str(jax.make_jaxpr(layer.apply)(params, u))
out["program"] = {
    name: program.count(name)
    for name in ("shard_map[", "name=states_forward", "name=attention_forward")
}
print(json.dumps({**out, "devices": len(jax.devices())}))
