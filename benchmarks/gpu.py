"""Everything one GPU should tell us, in one process, into one JSON named after the device.

    python benchmarks/gpu.py                      (the default parts; not yet timed on a GPU)
    python benchmarks/gpu.py --time-budget 420 --microbatches 8 --only train/lmu profile ...
    bash benchmarks/gpu_session.sh     (what matters most first; nothing started after 7 min)
    python benchmarks/gpu.py --only 'train/lmu*' block
    python benchmarks/gpu.py --only 'plan/*' --budget-gb 80      (compiles only; runs on CPU)

Parts (``--only`` takes shell patterns of these names):

- ``train/FAMILY``: each Table 3 size's paper config (``experiments/owt2.py``: bfloat16, the
  micro-batch plan) at --batch x --seq-len tokens (512 x 1024): the planned micro-batches,
  XLA's memory estimate, the device's peak bytes in use so far in the process (it only grows,
  so it bounds each model's peak from above), the median step time of --steps steps after
  a warm-up step, tokens/s and MFU by Table 2's FLOP count, and the ops that ran
  (``ops.Impls.record``: ``loss_impl`` from --loss-impl, and for the LMU families
  ``memory_impl`` from --memory-impl, "auto" by default, resolved; the layout and forms). An
  out-of-memory or other failure is recorded in the model's row, and the rest go on. Rows of
  another loss_impl or memory_impl are kept. With --tuned-loss (and --loss-impl pallas) the
  fused loss at the swept d and dtype (lmu-1M's) runs in the form and tiling that this
  device's JSON's ``loss_tiles`` part timed fastest among those that agreed with the
  reference loss, not the committed ones, and those models' rows say which (``loss_tuned``;
  kept beside the committed code's rows, and left out of the sweeps' dry-run estimates):
  one GPU session measures the step as the tuning would make it.
- ``plan/FAMILY``: the same configs compiled and planned only, no step run (not a default
  part). On a CPU it checks that every paper config compiles and fits a budget such as
  --budget-gb 80, by XLA:CPU's estimate: a CPU has no flash attention and lays buffers out
  its own way, so a GPU's estimates differ.
- ``long``: lmu-55k, transformer-55k and lmu_g-55k at n = --long-seq-len (8192), with
  --batch x --seq-len / n sequences per step and the plan.
- ``block``: one LMU block of lmu-1M (FFN, implicit attention, FFN) at --block-batch x
  --block-seq-len (64 x 1024), forward and forward+backward, in --block-dtypes (bfloat16 and
  float32): of --block-impls (default all), the FFT memory, and per --block-chunks the XLA
  chunked path as a run resolves it (on a GPU one product written channels last), in each
  layout ("steps-last", "channels-last") and through the LMU layer's kernels ("pallas"), with
  TFLOP/s and each one's largest differences from the resolved path
  (``lmu_memory.bench_block``).
- ``loss``: the cross-entropy's forward+backward alone at d = 48 and 204, --xent-batch x
  --seq-len tokens (64 x 1024), bfloat16 and float32, by the XLA path and by the fused Pallas
  kernels (skipped where they cannot run), with the kernels' largest differences from the
  XLA path (``cross_entropy.py --part loss``), and by the flash kernels in bfloat16.
- ``flash``: the flash loss's kernels (``ops.cross_entropy_flash``) at the paper's shapes:
  d = 48 and 204 in bfloat16, --xent-batch x --seq-len tokens, with XLA's path and the fused
  Triton kernels: their times and their largest differences from XLA's. Not a default part
  (``loss`` has it); ``gpu_session.sh`` runs it first.
- ``loss_tiles``: each fused loss kernel alone under a grid of tiles, warps and stages at
  d = 204 in bfloat16, --xent-batch x --seq-len tokens, no launch started after
  --tiles-seconds (``cross_entropy.py --part loss-tiles``, leaving out the launches that
  ``kernel_resources.py --loss-launches`` found spilling or over an H100's shared memory);
  then the whole loss in both forms under the default and the fastest launches, each also
  with the width split, with their tilings and their differences from the reference (what
  --tuned-loss reads); skipped where the kernels cannot run. Not a default part.
- ``attention``: cuDNN's flash attention (``layers.causal_attention``) against XLA's in
  bfloat16 at n = 1024 for Table 3's head widths, outputs and gradients; recorded as skipped
  where cuDNN's is not used (a CPU, float32, older GPUs).
- ``precision``: --precision-model (lmu-55k) trained by ``lmuscale.train.run`` for --loss-steps
  steps in float32 and in bfloat16 on the embedded Shakespeare plays (GPT-2 tokens, prepared
  into --loss-data on first use), and the two loss curves compared.
- ``profile``: lmu-1M's and transformer-1M's paper train steps, then lmu-1M's with its chunk
  products in the layers' order off a GPU (``PROFILED``), compiled for one micro-batch of
  --profile-batch sequences, --profile-steps of them traced by ``jax.profiler``; the
  --profile-top operations by time per step (the devices' kernels where the trace has them,
  else the host's), with the trace's folder under ``results/profile-<device>/``.
- ``xla_options``: the same micro-batch steps compiled with each of ``XLA_OPTIONS`` (command
  buffers, the tiling search, the autotuning level) and timed; only on a GPU (not a default
  part).

Parts run in the order --only names them. --time-budget starts no part or model after that many
seconds (the JSON's ``not_started`` lists them), and --microbatches sets the train parts'
micro-batches instead of planning them (a compile per count tried).

The JSON (``results/gpu-<device>.json``, --out, or in --out-dir) is written after every part and
every model of a train part, and keeps the parts of earlier runs on the same device, so parts
can be run one at a time: a ``train/``, ``plan/`` or ``long`` part run again
replaces the rows of the models it ran and keeps the others; other parts are replaced whole.
``sweeps/owt2.py`` reads its ``train/*`` rows at 512 x 1024 for ``--dry-run``'s estimates.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import functools
import gc
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, print_table, slug, timed_steps, train_step_for, versions, write_json
from lmu_memory import BLOCK_IMPLS, SHAPES, bench_block

from lmuscale import ops
from lmuscale.data.tokenizer import GPT2_VOCAB
from lmuscale.models import count_params, flops_per_token
from lmuscale.models.sizes import FAMILIES, NAMES, SIZES
from lmuscale.ops.cross_entropy_pallas import Tiling
from lmuscale.outcomes import ConfigError
from lmuscale.train import config as config_lib
from lmuscale.train import memory, run
from lmuscale.train import step as step_lib
from lmuscale.train.metrics import device_peak, mfu

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = ROOT / "experiments" / "owt2.py"
LONG_MODELS = ("lmu-55k", "transformer-55k", "lmu_g-55k")
DTYPES = ("bfloat16", "float32")
GB = 1e9


def paper_config(
    name: str,
    seq_len: int,
    batch: int,
    budget_gb: float,
    dtype: str | None = None,
    loss_impl: str = "auto",
    memory_impl: str = "auto",
    microbatches: int = 0,
):
    """experiments/owt2.py's config ``name`` at ``batch`` x ``seq_len`` tokens per step, in
    ``microbatches`` (0: the fewest that fit, planned by compiling the step for each count)."""
    config = config_lib.load(f"{EXPERIMENT}:{name}")
    items = [
        f"data.seq_len={seq_len}",
        f"train.global_batch={batch}",
        f"train.memory_budget_gb={budget_gb}",
        f"train.microbatches={microbatches}",
        f"model.loss_impl={loss_impl}",
    ]
    if "memory_impl" in config.model:
        items.append(f"model.memory_impl={memory_impl}")
    if "max_len" in config.model and config.model.max_len < seq_len:
        items.append(f"model.max_len={seq_len}")  # the transformer's learned positions
    if dtype:
        items.append(f"model.dtype={dtype}")
    with config.unlocked():
        return config_lib.override(config, items)


def _planned(config, impls):
    """``(plan, compiled step, init, mesh, seconds)`` of a paper config, its ops as ``impls``
    says (None: as a run of it would, ``ops.resolve``)."""
    model = config_lib.model_config(config.model)
    train_step, init, mesh, abstract = train_step_for(model, config.data.seq_len, impls=impls)
    start = time.perf_counter()
    plan, compiled = memory.plan_train_step(train_step, abstract, config, mesh)
    return plan, compiled, init, mesh, time.perf_counter() - start


def _peak_gb() -> float | None:
    stats = jax.devices()[0].memory_stats()
    return stats["peak_bytes_in_use"] / GB if stats and "peak_bytes_in_use" in stats else None


def _model_row(name: str, config) -> dict:
    model = config_lib.model_config(config.model)
    family, _, size = name.partition("-")
    return {
        "model": name,
        "family": family,
        "size": size,
        "non_embedding_params": count_params(model).non_embedding,
        "seq_len": config.data.seq_len,
        "batch": config.train.global_batch,
        "dtype": model.dtype,
        **ops.resolve(model).record(),  # what runs, never "auto"
        "train_flops_per_token": flops_per_token(model, config.data.seq_len).train,
    }


def _plan_fields(plan: memory.Plan, seconds: float) -> dict:
    return {
        "microbatches": plan.microbatches,
        "estimate_gb": plan.estimate.total / GB,
        "budget_gb": plan.budget.bytes / GB if plan.budget else None,
        "budget_source": plan.budget.source if plan.budget else None,
        "plan_seconds": seconds,
    }


def measure_train(name: str, config, steps: int, impls=None) -> dict:
    row = _model_row(name, config)
    plan, compiled, init, mesh, seconds = _planned(config, impls)
    row.update(_plan_fields(plan, seconds))
    state = step_lib.init_state(init, mesh)
    micro, seq_len = plan.microbatches, config.data.seq_len
    shape = (micro, config.train.global_batch // micro, seq_len + 1)
    vocab = config_lib.model_config(config.model).vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, shape, dtype=np.int32)
    tokens = step_lib.to_global(tokens, step_lib.batch_sharding(mesh, 3, axis=1))
    state, first = timed_steps(compiled, state, tokens, 1)
    state, times = timed_steps(compiled, state, tokens, steps)
    step_seconds = statistics.median(times)
    speed = config.train.global_batch * seq_len / step_seconds
    flops = row["train_flops_per_token"]
    row.update(
        {
            "first_step_seconds": first[0],
            "step_seconds": step_seconds,
            "step_seconds_all": times,
            "tokens_per_second": speed,
            "model_flops_per_second": speed * flops,
            "mfu": mfu(speed, flops, mesh.devices.size, device_peak(row["dtype"])),
            "peak_gb_so_far": _peak_gb(),
        }
    )
    return row


def measure_plan(name: str, config, impls=None) -> dict:
    row = _model_row(name, config)
    plan, _, _, _, seconds = _planned(config, impls)
    row.update(_plan_fields(plan, seconds))
    return row


def seconds_since_start() -> float:
    """Seconds since this process started, its imports (JAX, the GPU's start) included: from
    /proc on Linux, else since this module was imported."""
    try:  # the 22nd field of /proc/self/stat: the start, in clock ticks after boot
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, AttributeError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


class Deadline:
    """--time-budget: once ``seconds`` have passed since the process started, no part and no
    model is started (0: no budget), and what was not started is listed. A session lent a GPU
    has minutes of device time in all, so its first command runs what matters most first
    (``gpu_session.sh``) and ends on time rather than being killed in the middle."""

    def __init__(self, seconds: float = 0.0):
        self.seconds, self.not_started = seconds, []

    def passed(self, label: str) -> bool:
        """Whether the budget is spent; if so ``label`` is listed as not started."""
        spent = self.seconds > 0 and seconds_since_start() >= self.seconds
        if spent:
            self.not_started.append(label)
            print(f"  {label}: not started, the time budget is spent", file=sys.stderr, flush=True)
        return spent


DEADLINE = Deadline()


def _guarded(label: str, measure, *args, show=None) -> dict | None:
    """``measure(*args)``, or a row naming the failure (an out-of-memory, say); ``show`` (default
    ``_print_row``) prints it. None, and nothing run, once --time-budget is spent."""
    if DEADLINE.passed(label):
        return None
    try:
        row = measure(*args)
    except Exception as error:
        row = {"model": label, "error": f"{type(error).__name__}: {error}"[:500]}
    gc.collect()  # the state and executables of one model are gone before the next
    (show or _print_row)(row)
    return row


def _print_row(row: dict) -> None:
    if "error" in row:
        print(f"  {row['model']}: {row['error'][:200]}", file=sys.stderr, flush=True)
        return
    speed = row.get("tokens_per_second")
    print(
        f"  {row['model']} n={row['seq_len']}"
        + (f" (loss tuned: {row['loss_tuned']})" if "loss_tuned" in row else "")
        + f": micro-batches {row['microbatches']}, "
        f"estimate {row['estimate_gb']:.2f} GB"
        + (f", {row['step_seconds'] * 1e3:.1f} ms/step, {speed:,.0f} tokens/s" if speed else ""),
        file=sys.stderr,
        flush=True,
    )


def part_train(family: str, args, plan_only: bool, keep=None) -> dict:
    """Each size's row; ``keep(rows)`` is called with the rows so far after each one."""
    rows = []
    for size in args.sizes:
        name = f"{family}-{size}"
        measure = measure_plan if plan_only else measure_train
        extra = () if plan_only else (args.steps,)

        def one(name=name, measure=measure, extra=extra):
            config = paper_config(
                name,
                args.seq_len,
                args.batch,
                args.budget_gb,
                microbatches=args.microbatches,
                **_impls(args),
            )
            model = config_lib.model_config(config.model)
            tuned = args.tuned() if args.tuned else None
            impls, tuned = tuned_impls(model, ops.resolve(model), tuned)
            row = measure(name, config, *extra, impls)
            return _with_tuning(row, tuned)  # None at another width

        row = _guarded(name, one)
        if row is not None and "error" in row:
            # the kernels it asked for, as a row that ran would name them (``merged``'s key)
            row = {**row, **_kernels_asked(name, args, args.seq_len, args.batch)}
            if args.tuned and _tuned_width(name, args):
                row["loss_tuned"] = None  # replaces the last tuned row only
        _append(rows, row, keep, args.seq_len, args.batch)
    return {"rows": rows}


def _paper_model(name: str, args, seq_len: int, batch: int):
    """``name``'s paper config's model under --loss-impl and --memory-impl, or None where the
    config cannot be built."""
    try:
        config = paper_config(name, seq_len, batch, args.budget_gb, **_impls(args))
        return config_lib.model_config(config.model)
    except Exception:
        return None


def _tuned_width(name: str, args) -> bool:
    """Whether --tuned-loss would run ``name``'s loss tuned: its d and dtype are the swept."""
    model = _paper_model(name, args, args.seq_len, args.batch)
    return model is not None and (model.d, jnp.dtype(model.dtype).name) == SWEPT


def _kernels_asked(name: str, args, seq_len: int, batch: int) -> dict:
    """The kernel switches of ``name``'s paper config under --loss-impl and --memory-impl, for
    a model that failed: as they resolve here, or as asked where they cannot ("pallas" off a
    GPU; where the config itself cannot be built, the loss's alone)."""
    model = _paper_model(name, args, seq_len, batch)
    if model is None:
        return {} if args.loss_impl == "auto" else {"loss_impl": args.loss_impl}
    try:
        record = ops.resolve(model).record()
        return {key: record[key] for key in ("loss_impl", "memory_impl") if key in record}
    except ConfigError:
        asked = {"loss_impl": model.loss_impl, "memory_impl": getattr(model, "memory_impl", None)}
        return {key: impl for key, impl in asked.items() if impl not in (None, "auto")}


def _append(rows: list, row: dict | None, keep, seq_len: int, batch: int) -> None:
    """``row`` (None: not started) into ``rows``; an error row gets the shape it was for, so
    that a later run of the same model and shape replaces it (``merged``)."""
    if row is not None:
        if "error" in row:
            row = {**row, "seq_len": seq_len, "batch": batch}
        rows.append(row)
        if keep:
            keep(rows)


def part_long(args, keep=None) -> dict:
    batch = max(1, args.batch * args.seq_len // args.long_seq_len)
    rows = []
    for name in LONG_MODELS:

        def one(name=name):
            config = paper_config(name, args.long_seq_len, batch, args.budget_gb, **_impls(args))
            return measure_train(name, config, args.steps)

        row = _guarded(name, one)
        if row is not None and "error" in row:
            row = {**row, **_kernels_asked(name, args, args.long_seq_len, batch)}
        _append(rows, row, keep, args.long_seq_len, batch)
    return {"rows": rows}


def part_block(args) -> dict:
    shape = {**SHAPES["paper"], "n": args.block_seq_len}
    impls = [impl for impl in BLOCK_IMPLS if impl == "xla" or impl in args.block_impls]
    rows = bench_block(
        shape, args.block_batch, args.steps, args.block_chunks, args.block_dtypes, impls
    )
    return {"rows": rows}


def tuned_loss_from(record: dict, source) -> dict:
    """What --tuned-loss runs: of the fused loss's forms and tilings that the loss_tiles part of
    ``record`` (this device's JSON, read from ``source``) timed whole, the fastest:
    ``{"label", "dh_from_forward", "tiling", "loss_ms", "default_ms", "committed_ms", "d",
    "dtype", "sweep_session"}``: beside its time, the default tiling's in the same form, and
    the committed code's (the dh kernel, the default tiling). Only
    losses whose values and gradients agreed with the reference's (``LOSS_AGREEMENT``) are
    taken. A ValueError naming ``source`` and what it lacks where that part is missing, was
    skipped or timed no such loss (in the model's row: the parts run before it are kept)."""
    part = record.get("parts", {}).get("loss_tiles")
    if not isinstance(part, dict):
        raise ValueError(
            f"--tuned-loss: {source} has no loss_tiles part; run gpu.py --only loss_tiles on "
            "this GPU first"
        )
    if "skipped" not in part and part.get("loss_reference") != REFERENCE_LOSS:
        raise ValueError(
            f'--tuned-loss: {source}\'s parts["loss_tiles"]: the reference loss '
            f"({REFERENCE_LOSS}) did not run, so no loss was checked against it"
        )
    timed, tilings = part.get("loss_ms"), part.get("tilings")
    if not timed or not isinstance(tilings, dict) or set(timed) - set(tilings):
        why = part.get("skipped") or "no loss timed under a tiling it records"
        raise ValueError(f'--tuned-loss: {source}\'s parts["loss_tiles"]: {why}')
    # Only a loss whose values and gradients agreed with the reference's on this GPU.
    agreed = {k: ms for k, ms in timed.items() if _agrees(part.get("loss_diffs", {}).get(k))}
    if not agreed:
        raise ValueError(
            f'--tuned-loss: {source}\'s parts["loss_tiles"]: no timed loss has differences '
            f"from the reference's within {LOSS_AGREEMENT} (loss_diffs)"
        )
    label = min(agreed, key=agreed.get)
    form = label.split(", ")[0]  # "dh kernel" or "dh from the forward"
    try:
        tiling = Tiling.from_dict(tilings[label])
    except (TypeError, ValueError) as error:
        raise ValueError(
            f'--tuned-loss: {source}\'s parts["loss_tiles"]["tilings"]["{label}"]: {error}'
        ) from None
    return {
        "label": label,
        "dh_from_forward": form == "dh from the forward",
        "tiling": tiling,
        "loss_ms": timed[label],
        "default_ms": timed.get(f"{form}, default"),
        "committed_ms": timed.get(f"{COMMITTED_FORM}, default"),
        "d": part["d"],
        "dtype": part["dtype"],
        "sweep_session": part.get("args", {}).get("session"),
    }


# The largest differences from the reference loss (the dh kernel at the default tiling) that
# --tuned-loss accepts in a timed loss: its mean loss, absolute; dh and dw relative to their
# largest entries. In bfloat16 the kernels' gradients differ from XLA's by up to 5.1e-3 of the
# largest (the H200, gpu-nvidia-h200.json's loss part); a tiling that computes something else
# (a part of the width left out, say) differs by order 1.
LOSS_AGREEMENT = {
    "loss_max_abs_diff": 1e-3,
    "dh_max_diff_rel_to_max": 2e-2,
    "dw_max_diff_rel_to_max": 2e-2,
}
REFERENCE_LOSS = "dh kernel, default"


def _agrees(diffs) -> bool:
    return isinstance(diffs, dict) and all(
        isinstance(diffs.get(key), int | float) and diffs[key] <= bound
        for key, bound in LOSS_AGREEMENT.items()
    )


def tuned_impls(model, impls: ops.Impls, tuned: dict | None):
    """``(impls, tuned)``: what ``model``'s ops (a model config's) run under --tuned-loss
    (``tuned``, from ``tuned_loss_from``; None: as committed): ``impls``, with the fused loss
    in ``tuned``'s form and tiling where it runs the kernels at ``tuned``'s (d, dtype);
    ``tuned`` again where it does, else None."""
    width = (model.d, jnp.dtype(model.dtype).name)
    if tuned is None or impls.loss != "pallas" or width != (tuned["d"], tuned["dtype"]):
        return impls, None
    kernels = ops.LossKernels(tiling=tuned["tiling"], dh_from_forward=tuned["dh_from_forward"])
    return dataclasses.replace(impls, loss_kernels=kernels), tuned


# The committed code's form of the fused loss (ops.LossKernels' default).
COMMITTED_FORM = "dh kernel"


def _with_tuning(row: dict, tuned: dict | None) -> dict:
    """A train row whose loss ran as --tuned-loss chose says so: the label (its presence a key
    of its rows, beside the kernels: a tuned run replaces the last one's row, not the committed
    code's), the tiling, the loss's times alone that chose it, and the session of the sweep
    that timed them."""
    if tuned is None or "error" in row:
        return row
    return {
        **row,
        "loss_tuned": tuned["label"],
        "loss_tiling": dataclasses.asdict(tuned["tiling"]),
        "loss_tuned_ms": {
            "tuned": tuned["loss_ms"],
            "default": tuned["default_ms"],
            "committed": tuned["committed_ms"],
        },
        "loss_tuned_session": tuned["sweep_session"],
    }


def _impls(args) -> dict:
    return {"loss_impl": args.loss_impl, "memory_impl": args.memory_impl}


def part_loss(args) -> dict:
    """The cross-entropy alone, each implementation (``cross_entropy.measure_losses``)."""
    from cross_entropy import measure_losses, print_loss_rows

    rows = measure_losses(
        (48, 204), ("bfloat16", "float32"), args.xent_batch, args.seq_len, args.xent_repeats
    )
    print_loss_rows(rows, f"cross-entropy, {args.xent_batch} x {args.seq_len} tokens")
    return {"rows": rows}


def part_flash(args) -> dict:
    """The flash loss's kernels at the paper's shapes (--xent-batch x --seq-len tokens, d = 48
    and 204, bfloat16): values and gradients against XLA's path, and their times beside XLA's
    and the fused Triton kernels'."""
    from cross_entropy import measure_losses, print_loss_rows

    impls = ("xla", "pallas", "flash")
    rows = measure_losses(
        (48, 204), ("bfloat16",), args.xent_batch, args.seq_len, args.xent_repeats, impls
    )
    print_loss_rows(rows, f"flash loss, {args.xent_batch} x {args.seq_len} tokens")
    return {"rows": rows}


# kernel_resources.py --loss-launches's compile for an H100: the loss_tiles part leaves out the
# launches it found spilling or over shared memory.
LOSS_LAUNCH_RESOURCES = (
    Path(__file__).parent / "results" / "kernel_resources-sm90a-loss-launches.json"
)


# The (d, dtype) the loss_tiles part sweeps, and so the loss --tuned-loss tunes: lmu-1M's.
SWEPT = (204, "bfloat16")


def part_loss_tiles(args) -> dict:
    """Each fused loss kernel alone under the grid of launches at lmu-1M's d = 204 in bfloat16
    (``cross_entropy.sweep_launches``): no launch of the grid started after --tiles-seconds or
    past --time-budget (each kernel's default launch and the loss's timings run besides)."""
    from cross_entropy import print_tile_record, sweep_launches, unfit_launches

    budget = args.tiles_seconds
    if DEADLINE.seconds:
        budget = min(budget, DEADLINE.seconds - seconds_since_start())
    width, dtype = SWEPT
    record = sweep_launches(
        width,
        dtype,
        args.xent_batch,
        args.seq_len,
        GPT2_VOCAB,
        budget=budget,
        unfit=unfit_launches(LOSS_LAUNCH_RESOURCES, width, dtype),
    )
    record = {"d": width, "dtype": dtype, **record}
    print_tile_record(record)
    return record


def part_precision(args) -> dict:
    """--precision-model's paper config (lmu-55k) in float32 and bfloat16, trained by ``run``
    on the plays."""
    curves, summaries = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for dtype in ("float32", "bfloat16"):
            config = paper_config(
                args.precision_model, args.loss_seq_len, args.loss_batch, 0.0, dtype
            )
            warmup = max(1, args.loss_steps // 10)
            every = max(1, args.loss_steps // 3)
            config_lib.override(
                config,
                [
                    f"data.path={args.loss_data}",
                    "data.source=shakespeare",
                    "data.prepare=true",
                    f"train.steps={args.loss_steps}",
                    f"optim.warmup_steps={warmup}",
                    f"eval.every={every}",
                    f"eval.global_batch={args.loss_batch}",
                    "eval.batches=8",
                    "eval.final_batches=16",
                    f"checkpoint.every={args.loss_steps}",
                    "log.every=1",
                    "log.progress=false",
                    "log.tensorboard=false",
                ],
            )
            workdir = Path(scratch) / dtype
            summaries[dtype] = run(config, workdir, progress=False)
            with open(workdir / "metrics.jsonl") as f:
                curves[dtype] = [json.loads(line)["loss"] for line in f]
    f32, bf16 = np.array(curves["float32"]), np.array(curves["bfloat16"])
    tail = max(1, len(f32) // 6)
    return {
        "model": args.precision_model,
        "steps": args.loss_steps,
        "batch": args.loss_batch,
        "seq_len": args.loss_seq_len,
        "loss_float32": curves["float32"],
        "loss_bfloat16": curves["bfloat16"],
        "max_abs_difference": float(np.abs(f32 - bf16).max()),
        "mean_difference_last_sixth": float((bf16 - f32)[-tail:].mean()),
        "val_loss": {k: s["val_loss"] for k, s in summaries.items()},
        "test_loss": {k: s["test_loss"] for k, s in summaries.items()},
    }


def part_attention(args) -> dict:
    """cuDNN's attention against XLA's, both in bfloat16, and both against float32."""
    from lmuscale.ops.attention import causal_attention

    if ops.attention_implementation(jnp.bfloat16, jax.devices()[0]) != "cudnn":
        return {"rows": [], "skipped": f"cuDNN attention is not used on {machine()['device_kind']}"}
    rows = []
    for width in (13, 24, 28, 34, 36):
        keys = jax.random.split(jax.random.key(width), 4)
        shape = (4, args.seq_len, 4, width)
        q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32) for key in keys)

        def loss(q, k, v, cotangent, implementation):
            y = causal_attention(q, k, v, implementation).astype(jnp.float32)
            return jnp.sum(y * cotangent)

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=4)
        half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        want = grad(q, k, v, cotangent, "xla")
        row = {"head_width": width, "seq_len": args.seq_len}
        for implementation in ("cudnn", "xla"):
            got = grad(*half, cotangent, implementation)
            errors = [
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
            ]
            row[implementation] = {"loss": errors[0], "dq_dk_dv": max(errors[1:])}
        rows.append(row)
        print(f"  attention width {width}: {row}", file=sys.stderr, flush=True)
    return {"rows": rows}


PROFILE_MODELS = ("lmu-1M", "transformer-1M")


# What the profile part traces, by label: the model, and what its ops run besides what a run
# resolves. After the two models, lmu-1M with its chunk products in a CPU's layout
# (steps-last), as every GPU step measured before the GPU's channels-last one was
# (gpu-nvidia-h200.json's included): the two micro-batches compare.
PROFILED = {
    "lmu-1M": ("lmu-1M", {}),
    "transformer-1M": ("transformer-1M", {}),
    "lmu-1M steps-last": ("lmu-1M", {"memory_layout": "steps-last"}),
}
# XLA's GPU options to try on the micro-batch steps, each against the default. Command buffers
# (CUDA graphs) by default cover fusions and library calls; the chunk-state scan and the loss
# are while loops, which the WHILE and CONDITIONAL types add. A flag this XLA does not know is
# an error in its row.
XLA_OPTIONS = {
    "default": {},
    "command buffers with loops": {
        "xla_gpu_enable_command_buffer": ",".join(
            ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "WHILE", "CONDITIONAL")
        )
    },
    "no command buffers": {"xla_gpu_enable_command_buffer": ""},
    "exhaustive tiling search": {"xla_gpu_exhaustive_tiling_search": True},
    "autotune level 4": {"xla_gpu_autotune_level": 4},
}


def micro_batch_step(name: str, args, options: dict | None = None, **impls):
    """``name``'s paper train step for one micro-batch of --profile-batch sequences, compiled
    with XLA ``options``, its ops as a run resolves them changed by ``impls`` (``ops.Impls``'s
    fields): ``(compiled, state, tokens)``."""
    config = paper_config(name, args.seq_len, args.profile_batch, args.budget_gb)
    model = config_lib.model_config(config.model)
    chosen = dataclasses.replace(ops.resolve(model), **impls)
    train_step, init, mesh, abstract = train_step_for(model, args.seq_len, impls=chosen)
    sharding = step_lib.batch_sharding(mesh, 3, axis=1)
    shape = (1, args.profile_batch, args.seq_len + 1)
    abstract_tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    compiled = train_step.lower(abstract, abstract_tokens).compile(options or None)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, shape, dtype=np.int32)
    return compiled, step_lib.init_state(init, mesh), step_lib.to_global(tokens, sharding)


def hlo_sources(hlo_text: str) -> dict:
    """Instruction name -> the JAX operation it came from (its ``op_name`` metadata), each name
    also as a GPU's kernels spell it in a trace, dots as underscores (``gemm_fusion_dot.233``,
    ``gemm_fusion_dot_233``)."""
    found = re.findall(r'^\s*(?:ROOT )?%(\S+) = .*?op_name="([^"]*)"', hlo_text, re.MULTILINE)
    return {spelled: op for name, op in found for spelled in (name.replace(".", "_"), name)}


def top_operations(folder: Path, steps: int, sources: dict) -> list[dict]:
    """Operations by total time per step in a jax.profiler trace: ``{"op", "ms", "count",
    "source"}``, the source from ``hlo_sources`` of the compiled step: by the event's
    ``hlo_op``, else by its name (on a GPU, a kernel replayed in a command buffer, a CUDA
    graph, has the buffer's name as ``hlo_op`` and its fusion's as its own name).

    The devices' events where the trace has a device process (a GPU's kernels); otherwise the
    host's, less the Python tracer's calls and the runtime's wrappers around them."""
    (path,) = folder.glob("plugins/profile/*/perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    devices = {pid for pid, name in names.items() if name.startswith("/device:")}
    totals, counts, ops = {}, {}, {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        name = e["name"]
        ops.setdefault(name, (e.get("args", {}).get("hlo_op", name), name))
        if devices and e["pid"] not in devices:
            continue
        if not devices and (name.startswith(("$", "end: ", "PjitFunction")) or "::" in name):
            continue
        totals[name] = totals.get(name, 0.0) + e["dur"]
        counts[name] = counts.get(name, 0) + 1
    ranked = sorted(totals, key=totals.get, reverse=True)
    return [
        {
            "op": n,
            "ms": totals[n] / 1e3 / steps,
            "count": counts[n] / steps,
            "source": next((sources[op] for op in ops[n] if op in sources), "")[-120:],
        }
        for n in ranked
    ]


def _show(row: dict, result: str = "step_seconds") -> None:
    print(
        f"  {row['model']} {row.get('options', '')}: {row.get(result, row.get('error'))}",
        file=sys.stderr,
        flush=True,
    )


def profile_one(label: str, args, folder: Path, **impls) -> dict:
    """The profile of ``label`` (``PROFILED``), its ops changed by ``impls`` besides."""
    name, changes = PROFILED[label]
    compiled, state, tokens = micro_batch_step(name, args, **{**changes, **impls})
    state, _ = timed_steps(compiled, state, tokens, 2)  # after compiling, warm
    if folder.exists():
        shutil.rmtree(folder)
    jax.profiler.start_trace(str(folder), create_perfetto_trace=True)
    try:
        state, times = timed_steps(compiled, state, tokens, args.profile_steps)
    finally:
        jax.profiler.stop_trace()
    hlo = compiled.as_text()
    ops = top_operations(folder, args.profile_steps, hlo_sources(hlo))
    # The optimized program beside its trace, so that a fusion the trace names can be read
    # after the GPU is gone
    (folder / "compiled_hlo.txt.gz").write_bytes(gzip.compress(hlo.encode()))
    return {
        "model": label,
        "batch": args.profile_batch,
        "seq_len": args.seq_len,
        "step_seconds": statistics.median(times),
        "traced_ms_per_step": sum(op["ms"] for op in ops),
        "top_ops": ops[: args.profile_top],
        "trace": str(folder.relative_to(ROOT)),
        "hlo": str((folder / "compiled_hlo.txt.gz").relative_to(ROOT)),
    }


def profile_folder_name(label: str) -> str:
    """The folder of ``label``'s trace in ``results/profile-<device>/`` (``gpu_session.sh``
    copies each trace out as ``profile-<folder>.json.gz``)."""
    return label.replace(" ", "-")


def part_profile(args) -> dict:
    root = ROOT / "benchmarks" / "results" / f"profile-{slug(machine()['device_kind'])}"
    rows = [
        _guarded(label, profile_one, label, args, root / profile_folder_name(label), show=_show)
        for label in PROFILED
    ]
    return {"rows": [row for row in rows if row is not None]}


def time_options(name: str, label: str, args) -> dict:
    options = XLA_OPTIONS[label]
    start = time.perf_counter()
    compiled, state, tokens = micro_batch_step(name, args, options)
    compile_seconds = time.perf_counter() - start
    state, _ = timed_steps(compiled, state, tokens, 1)
    state, times = timed_steps(compiled, state, tokens, args.steps)
    return {
        "model": name,
        "options": label,
        "flags": options,
        "batch": args.profile_batch,
        "compile_seconds": compile_seconds,
        "step_seconds": statistics.median(times),
        "step_seconds_all": times,
    }


def part_xla_options(args) -> dict:
    if jax.default_backend() != "gpu":
        return {"rows": [], "skipped": f"XLA's GPU options need a GPU, not {jax.default_backend()}"}
    rows = []
    for name in PROFILE_MODELS:
        for label in XLA_OPTIONS:
            row = _guarded(name, time_options, name, label, args, show=_show)
            if row is not None:
                rows.append({"options": label, **row})
    return {"rows": rows}


def parts(args, keep=None) -> dict:
    """Every part's name and a function computing it; ``keep(name, rows)`` is given the rows of
    a ``train/``, ``plan/`` or ``long`` part so far, after each model."""

    def keeper(name):
        return (lambda rows: keep(name, rows)) if keep else None

    table = {}
    for family in args.families:
        table[f"train/{family}"] = lambda family=family: part_train(
            family, args, False, keeper(f"train/{family}")
        )
    for family in args.families:
        table[f"plan/{family}"] = lambda family=family: part_train(
            family, args, True, keeper(f"plan/{family}")
        )
    table["long"] = lambda: part_long(args, keeper("long"))
    table["block"] = lambda: part_block(args)
    table["loss"] = lambda: part_loss(args)
    table["flash"] = lambda: part_flash(args)
    table["loss_tiles"] = lambda: part_loss_tiles(args)
    table["attention"] = lambda: part_attention(args)
    table["precision"] = lambda: part_precision(args)
    table["profile"] = lambda: part_profile(args)
    table["xla_options"] = lambda: part_xla_options(args)
    return table


def chosen(names, patterns) -> list[str]:
    """The parts ``patterns`` match, in the patterns' order (a part once, where its first
    pattern puts it), so that ``--only`` says what runs first."""
    picked = []
    for pattern in patterns:
        matches = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matches:
            raise SystemExit(f"--only {pattern!r} matches no part; parts: {', '.join(names)}")
        picked += [n for n in matches if n not in picked]
    return picked


DEFAULT_PARTS = ["train/*", "long", "block", "loss", "attention", "precision", "profile"]
MERGED_BY_MODEL = ("train/", "plan/", "long")


def summary_tables(record: dict) -> None:
    rows = []
    for name, part in record["parts"].items():
        if not name.startswith(("train/", "plan/")) and name != "long":
            continue
        for r in part["rows"]:
            if "error" in r:
                rows.append((name, r["model"], "-", "-", "-", "-", "-", r["error"][:50]))
                continue
            ms = f"{r['step_seconds'] * 1e3:,.1f}" if "step_seconds" in r else "-"
            speed = f"{r['tokens_per_second']:,.0f}" if "tokens_per_second" in r else "-"
            util = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
            peak = f"{r['peak_gb_so_far']:.1f}" if r.get("peak_gb_so_far") else "-"
            rows.append(
                (
                    name,
                    f"{r['model']} n={r['seq_len']}, {_kernels(r)}",
                    r["microbatches"],
                    f"{r['estimate_gb']:.2f}",
                    peak,
                    ms,
                    speed,
                    util,
                )
            )
    if rows:
        print_table(
            f"train steps on {record['machine']['device_kind']}",
            ("part", "model", "micro", "est. GB", "peak GB", "ms/step", "tokens/s", "MFU"),
            rows,
            left=2,
        )
    block = record["parts"].get("block")
    if block:
        from lmu_memory import print_block_rows

        print_block_rows(block["rows"], "one lmu-1M block (d 204, q 220, q' 22), median times")
    loss = record["parts"].get("loss")
    if loss:
        from cross_entropy import print_loss_rows

        args = loss["args"]
        print_loss_rows(loss["rows"], f"cross-entropy, {args['xent_batch']} x {args['seq_len']}")
    for r in record["parts"].get("profile", {}).get("rows", []):
        if "error" in r:
            continue
        print_table(
            f"{r['model']}, one micro-batch of {r['batch']} x {r['seq_len']}: "
            f"{r['step_seconds'] * 1e3:.1f} ms, the top operations per step",
            ("operation", "ms", "count", "from"),
            [
                (op["op"][:40], f"{op['ms']:.2f}", f"{op['count']:g}", op["source"][-70:])
                for op in r["top_ops"]
            ],
        )
    options = record["parts"].get("xla_options", {}).get("rows", [])
    if options:
        print_table(
            "XLA's GPU options, one micro-batch",
            ("model", "options", "ms/step"),
            [
                (
                    r["model"],
                    r["options"],
                    f"{r['step_seconds'] * 1e3:.1f}" if "step_seconds" in r else r["error"][:40],
                )
                for r in options
            ],
            left=2,
        )
    precision = record["parts"].get("precision")
    if precision:
        print(
            f"\n{precision['model']}, {precision['steps']} steps: bfloat16 - float32 training "
            f"loss, max |difference| {precision['max_abs_difference']:.4f} nats, mean over the "
            f"last sixth {precision['mean_difference_last_sixth']:+.4f}; val loss float32 "
            f"{precision['val_loss']['float32']:.4f}, bfloat16 "
            f"{precision['val_loss']['bfloat16']:.4f}"
        )


def merged(old_rows: list[dict], new_rows: list[dict]) -> list[dict]:
    """``new_rows`` and the ``old_rows`` of other models or shapes (e.g. sizes not run now)."""

    def key(row):  # rows from before a switch was recorded ran the XLA path
        impls = (row.get("loss_impl", "xla"), row.get("memory_impl", "xla"))
        shape = row.get("model"), row.get("seq_len"), row.get("batch")
        return *shape, *impls, "loss_tuned" in row  # a tuned row replaces the last tuned one

    replaced = {key(row) for row in new_rows}
    return [row for row in old_rows if key(row) not in replaced] + new_rows


def _kernels(row: dict) -> str:
    """``xla loss`` or ``xla loss, pallas memory``: the kernels a train row ran."""
    text = f"{row.get('loss_impl', 'xla')} loss"
    if row.get("loss_tuned"):
        text += f" ({row['loss_tuned']})"
    return text + (f", {row['memory_impl']} memory" if "memory_impl" in row else "")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=DEFAULT_PARTS, metavar="PATTERN")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512, help="sequences per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after a warm-up)")
    parser.add_argument(
        "--microbatches",
        type=int,
        default=0,
        help="train/, plan/: micro-batches per step (0: the fewest that fit, planned by "
        "compiling the step for each count, as the paper configs do)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="start no part or model after this many seconds (0: no budget)",
    )
    parser.add_argument("--budget-gb", type=float, default=0.0, help="0: the device's default")
    parser.add_argument("--long-seq-len", type=int, default=8192)
    parser.add_argument("--block-batch", type=int, default=64)
    parser.add_argument("--block-seq-len", type=int, default=1024)
    parser.add_argument("--block-chunks", nargs="+", type=int, default=[64])
    parser.add_argument(
        "--block-dtypes", nargs="+", default=["bfloat16", "float32"], choices=DTYPES
    )
    parser.add_argument(
        "--block-impls",
        nargs="+",
        default=list(BLOCK_IMPLS),
        choices=BLOCK_IMPLS,
        help="block: the memories timed (the XLA chunked path always, the others' reference)",
    )
    parser.add_argument(
        "--precision-model",
        default="lmu-55k",
        choices=NAMES,
        help="precision: the paper config trained in float32 and bfloat16",
    )
    parser.add_argument("--loss-steps", type=int, default=300)
    parser.add_argument("--loss-batch", type=int, default=32)
    parser.add_argument("--loss-seq-len", type=int, default=1024)
    parser.add_argument("--loss-data", type=Path, default=ROOT / "data" / "shakespeare-gpt2")
    parser.add_argument("--profile-batch", type=int, default=64, help="sequences, one micro-batch")
    parser.add_argument(
        "--loss-impl",
        choices=ops.LOSS.choices,
        default="auto",
        help="model.loss_impl of train/, long",
    )
    parser.add_argument(
        "--memory-impl",
        choices=ops.IMPLS,
        default="auto",
        help="model.memory_impl of train/, long (LMU families)",
    )
    parser.add_argument(
        "--tuned-loss",
        action="store_true",
        help="train/: the fused loss (--loss-impl pallas) in the form and tiling that this "
        "device's JSON's loss_tiles part timed fastest, not the committed ones; the rows say so",
    )
    parser.add_argument("--xent-batch", type=int, default=64, help="loss: sequences")
    parser.add_argument("--xent-repeats", type=int, default=10, help="loss: timed calls")
    parser.add_argument(
        "--tiles-seconds", type=float, default=240, help="loss_tiles: no launch started after"
    )
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--profile-top", type=int, default=10)
    parser.add_argument(
        "--session",
        default="",
        help="a name shared by the runs of one session: the JSON's not_started then lists "
        "what each of them left out (default: this run's alone)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, help="the JSON (default results/gpu-<device>.json)")
    where.add_argument("--out-dir", type=Path, help="write gpu-<device>.json in this folder")
    args = parser.parse_args(argv)
    DEADLINE.seconds, DEADLINE.not_started = args.time_budget, []
    info = machine()
    filename = f"gpu-{slug(info['device_kind'])}.json"
    out = args.out or (args.out_dir or ROOT / "benchmarks" / "results") / filename
    record = {"parts": {}}
    if out.exists():
        old = json.loads(out.read_text())
        if old.get("machine", {}).get("device_kind") == info["device_kind"]:
            record = old
    args.tuned = None  # with --tuned-loss: what it runs, read from the JSON when a model starts
    if args.tuned_loss:  # (a loss_tiles part of this run before it counts)
        if args.loss_impl != "pallas":
            parser.error("--tuned-loss tunes the fused loss: give --loss-impl pallas")
        args.tuned = functools.partial(tuned_loss_from, record, out)
    timings = record.setdefault("part_seconds", {})
    settings = {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "tuned"
    }
    earlier = dict(record["parts"])  # the parts of earlier runs, which rows are merged into
    left_out = record.get("not_started", {})
    same_session = args.session and left_out.get("session") == args.session
    left_out_before = left_out.get("what", []) if same_session else []

    def keep(name: str, result: dict, partial: bool = False, cut=()) -> None:
        """``name``'s result into the record, written at once: a run stopped part-way keeps
        every part, and every model of a part, that finished. ``cut``: its models that the
        time budget left out."""
        result = {**result, "args": settings}
        old = earlier.get(name)
        if old and name.startswith(MERGED_BY_MODEL):
            result["rows"] = merged(old["rows"], result["rows"])
        if partial or cut:
            result["unfinished"] = True  # the models after these had not run (yet)
        if cut:
            result["not_started"] = list(cut)
        record["parts"][name] = result
        save()

    def save() -> None:
        record.update(
            benchmark="gpu",
            machine=info,
            versions=versions(),
            written=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            peak_flops={d: device_peak(d) for d in ("bfloat16", "float32")},
            # what --time-budget left out, in this run (and this --session's earlier ones)
            not_started={
                "session": args.session,
                "time_budget_s": args.time_budget,
                "what": left_out_before + DEADLINE.not_started,
            },
        )
        write_json(out, record, quiet=True)

    table = parts(args, keep=lambda name, rows: keep(name, {"rows": rows}, partial=True))
    for name in chosen(list(table), args.only):
        if DEADLINE.passed(name):
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        start, before = time.perf_counter(), len(DEADLINE.not_started)
        result = table[name]()
        cut = DEADLINE.not_started[before:]
        if cut and not result.get("rows") and "skipped" not in result:
            continue  # every model of it was left out by the time budget
        timings[name] = time.perf_counter() - start
        keep(name, result, cut=cut)
        print(f"{name}: {timings[name]:.0f} s", file=sys.stderr, flush=True)
    save()
    if DEADLINE.not_started:
        print(
            f"not started, the time budget of {args.time_budget:g} s being spent: "
            + ", ".join(DEADLINE.not_started),
            file=sys.stderr,
            flush=True,
        )
    summary_tables(record)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
