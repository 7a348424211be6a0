"""Run by tests/test_cross_entropy_flash.py in a subprocess with 8 host CPU devices: the flash
loss (blocked form) on a 4 x 2 mesh, tokens split over both axes, w replicated. Prints its mean
loss, dh, dw and the device count as one JSON object."""

import os

flags = os.environ.get("XLA_FLAGS", "")  # the suite's (conftest.py), and 8 devices
os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from test_cross_entropy_flash import inputs, mean_loss  # noqa: E402

from lmuscale.ops import cross_entropy_flash as flash  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
h, w, targets = inputs(8, 9, 20, 70, seed=7)


def sharded(h, w, targets):
    return flash.cross_entropy(
        h, w, targets, mode="blocked", mesh=mesh, batch_axes=("data", "model")
    )


loss, (dh, dw) = jax.jit(lambda h, w: mean_loss(sharded, h, w, targets))(h, w)
out = {"loss": float(loss), "dh": np.asarray(dh).tolist(), "dw": np.asarray(dw).tolist()}
print(json.dumps({**out, "devices": len(jax.devices())}))
