"""Run by tests/test_train_sharding.py in a subprocess with 8 host CPU devices.

Prints one JSON object: the losses and final parameters of the same train steps on an 8-way
data mesh and a 4 x 2 (data, model) mesh, plus a whole ``run`` on the 4 x 2 mesh. The test
computes the same steps on one device in its own (one-device) process, with ``steps``.
"""

import os
import sys

if __name__ == "__main__":  # before jax is imported; not when the test imports ``steps``
    flags = os.environ.get("XLA_FLAGS", "")  # the suite's (conftest.py), and 8 devices
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import json

import jax
import numpy as np
from small_config import small

from lmuscale.data import TrainBatches, open_dataset
from lmuscale.models import build
from lmuscale.train import model_config, optim, run
from lmuscale.train import step as step_lib


def config(data: str):
    """The small config with 16 sequences a step in 2 micro-batches: the steps' and the runs'."""
    out = small(data)
    out.train.update(global_batch=16, microbatches=2)
    return out


def steps(config, mesh, n: int):
    model = build(model_config(config.model))
    tx, lr = optim.optimizer(config.optim, config.train.steps)
    init = step_lib.init_fn(model, tx, optim.plateau(config.optim), 0, config.data.seq_len)
    abstract = jax.eval_shape(init)
    state = step_lib.init_state(init, mesh)
    train_step = step_lib.make_train_step(model, tx, lr, mesh, abstract)
    batches = TrainBatches(open_dataset(config.data.path), seq_len=32, global_batch=16, seed=0)
    microbatches = step_lib.MicroBatches(mesh, 2)  # of 8 sequences each
    losses, layouts = [], set()
    for s in range(n):
        tokens = microbatches.place(batches(s))
        state, metrics = train_step(state, tokens)
        losses.append([float(metrics["loss"]), float(metrics["grad_norm"])])
    for leaf in jax.tree.leaves(state["params"]):
        layouts.add(json.dumps(list(leaf.sharding.spec)))
    params = [np.asarray(leaf).ravel().tolist() for leaf in jax.tree.leaves(state["params"])]
    return {"losses": losses, "params": params, "layouts": sorted(layouts)}


def main(data: str, workdir: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    out = {}
    for name, model_axis in [("8", 1), ("4x2", 2)]:
        out[name] = steps(config(data), step_lib.make_mesh(model_axis, jax.devices()), 5)
    # The same config as the steps: with the test's compilation cache, the run loads the
    # 4 x 2 train step and init compiled just above.
    run_config = config(data)
    run_config.mesh.model = 2
    out["run"] = run(run_config, workdir)
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
