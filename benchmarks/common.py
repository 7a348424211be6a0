"""What every benchmark script shares: the machine and versions record, a text table, JSON out."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import resource
import time
from pathlib import Path

import jax
import numpy as np
import scipy

from lmuscale import __version__, ops
from lmuscale.files import atomic_write_json
from lmuscale.models import build
from lmuscale.train import base_config, optim
from lmuscale.train import step as step_lib


def machine() -> dict:
    device = jax.devices()[0]
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        # NVIDIA's "major.minor" (None on a CPU): what ops.resolve reads.
        "compute_capability": getattr(device, "compute_capability", None),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "system": platform.platform(),
    }


def slug(device_kind: str) -> str:
    """A device's name for a file name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "flax": importlib.metadata.version("flax"),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "lmuscale": __version__,
    }


def print_table(title: str, header: tuple, rows: list[tuple], left: int = 1) -> None:
    """Columns after the first ``left`` are right-aligned (numbers)."""
    table = [tuple(header)] + [tuple(str(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(table):
        cells = (
            cell.ljust(w) if j < left else cell.rjust(w)
            for j, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        print("  ".join(cells))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_json(out: Path, record: dict, quiet: bool = False) -> None:
    """Write atomically: a reader never sees half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, record)
    if not quiet:
        print(f"\nwrote {out}")


def train_step_for(config, seq_len: int, devices=None, impls=None, model=None):
    """The jitted train step of ``lmuscale.train`` (Adam, schedule, plateau scale, norms, the
    chunked loss) for a model config, on a mesh of ``devices`` (default: all of them), its ops
    run as ``impls`` says (default: as a run of it would, ``ops.resolve``); ``model``: a model
    of the config to train instead of ``build``'s.

    Returns ``(train_step, init, mesh, abstract_state)``; ``step_lib.init_state(init, mesh)``
    makes the state.
    """
    train = base_config(config)
    if model is None:
        model = build(config, ops.resolve(config, devices) if impls is None else impls)
    tx, lr = optim.optimizer(train.optim, train.train.steps)
    init = step_lib.init_fn(model, tx, optim.plateau(train.optim), 0, seq_len)
    mesh = step_lib.make_mesh(1, devices=devices)
    abstract = jax.eval_shape(init)
    return step_lib.make_train_step(model, tx, lr, mesh, abstract), init, mesh, abstract


def abstract_step_inputs(mesh, abstract_state, batch: int, seq_len: int):
    """``(state, tokens)`` to lower a ``train_step_for`` step at, as shapes placed on ``mesh``:
    one micro-batch of ``batch`` sequences of ``seq_len`` tokens."""
    import jax.numpy as jnp

    shardings = step_lib.state_shardings(mesh, abstract_state)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
    )
    tokens = jax.ShapeDtypeStruct(
        (1, batch, seq_len + 1), jnp.int32, sharding=step_lib.batch_sharding(mesh, 3, axis=1)
    )
    return state, tokens


def timed_steps(train_step, state, tokens, repeats: int) -> tuple[dict, list[float]]:
    """Run ``repeats`` train steps, each waited for: ``(state, seconds of each)``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = train_step(state, tokens)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return state, times


def compiled_figures(compiled) -> dict:
    """XLA's own accounting of a compiled function: buffer sizes and bytes accessed."""
    figures = {}
    memory = compiled.memory_analysis()
    if memory is not None:
        for key in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes"):
            figures[key] = getattr(memory, key, None)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    if cost:
        figures["bytes_accessed"] = cost.get("bytes accessed")
        figures["flops"] = cost.get("flops")
    return figures


def peak_memory() -> int | None:
    """Peak memory so far in this process: the device's peak bytes in use on an accelerator,
    the peak resident set on a CPU (whose JAX device reports no statistics)."""
    stats = jax.devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"]
    if jax.default_backend() == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return None
