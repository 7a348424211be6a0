"""The cross-entropy's implementations: the loss alone, and the train step around it.

    python benchmarks/cross_entropy.py --part loss [--widths 48 204] [--batch 64]
    python benchmarks/cross_entropy.py --part loss-tiles [--widths 204] [--dtypes bfloat16]
        [--kernels dw forward_expected dh forward] [--tiles 32 64 128] [--warps 4 8 16]
        [--stages 1 2 3] [--resources kernel_resources-sm90a-loss-launches.json]
        [--budget SECONDS] [--interpret --vocab V]
    python benchmarks/cross_entropy.py [--models lmu-1M transformer-1M] [--batch 8] [--time 3]

``--part loss``: the loss's forward+backward alone (the gradients of the mean loss with
respect to h and the tied embedding w), for each implementation ("xla": the custom VJP over
token chunks; "pallas": ``ops.cross_entropy_pallas`` with its dh kernel; "pallas, dh from the
forward": dh from the forward's expected embeddings (``ops.LossKernels.dh_from_forward``); the
kernels on a GPU where they run, else the row says why not) at d in --widths, --batch x
--seq-len tokens (64 x 1024: the paper configs' micro-batch), V = 50,257, bfloat16 and
float32 activations. Each row: the median ms of --repeats calls after a warm-up, TFLOP/s on
the useful matrix FLOPs (6 N V d: logits, dh, dw; the kernels execute 10 N V d, recomputing
the logits twice, or 8 with dh from the forward), bytes per call, and for the kernels their
largest differences from the XLA path's losses and gradients at the same inputs. Bytes: for
"xla", XLA's count for one 1024-token chunk times the chunks (its cost analysis counts a loop
body once); for the kernels, a lower bound, each kernel's operands read once and outputs
written once, and beside it (``tile_loads_gb``) every tile load counted as if no cache held
any (the forward and dh kernels load all of w once per tile of tokens).

``--part loss-tiles``: each fused kernel alone (``ops.cross_entropy_pallas``: dw, the forward that
also forms the expected embeddings, dh and the plain forward, in that order) under every
launch of a grid, rows x step tiles of --tiles, --warps and --stages (81 a kernel by default),
at the same inputs. --resources leaves out the launches that ``kernel_resources.py
--loss-launches`` found spilling or over an H100's shared memory. Each row: the median ms of
--repeats calls, and the largest difference from the default tiling's output relative to its
largest value (a launch changes the order of the sums, and in the forward that forms the
expected embeddings, in bfloat16, how its probabilities round). Then each kernel's fastest
launch, and the loss's forward+backward in both forms (the dh kernel, dh from the forward)
under those launches and under ``default_tiling``'s, each also with d held in power-of-two
parts (``split width``: 204 as 128 + 64 + 16, not padded to 256). No launch of the grid starts
after --budget seconds; each kernel's default launch (the reference) and the loss's timings
(up to eight) run whatever the budget.
--interpret runs the kernels in Pallas's interpret mode, on any backend, at a small --vocab
(a CPU check of the script; its times mean nothing).

``--part step`` (the default): the full train step with the custom-VJP cross-entropy against
the one it replaced, which rematerialised each chunk (its backward pass computed every
chunk's logits again). For each model, the step is compiled both ways and XLA's own
accounting is printed: bytes accessed and FLOPs (``cost_analysis``), temporary buffers
(``memory_analysis``); with ``--time N``, also the median of N steps of each, run in turn,
and the median ratio of the pairs. Its cost analysis also counts the loss's loop body once:
with more than one chunk of positions the figures hold one chunk's loss. ``--loss-chunk``
equal to batch x seq_len makes the loss one chunk, so its counts are whole (and its memory is
not). Every part writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    compiled_figures,
    machine,
    print_table,
    slug,
    timed_steps,
    train_step_for,
    versions,
    write_json,
)

from lmuscale import ops
from lmuscale.data.tokenizer import GPT2_VOCAB
from lmuscale.models import build, named_config
from lmuscale.models.base import logits_from_hidden
from lmuscale.ops import cross_entropy_flash as flash
from lmuscale.ops import cross_entropy_pallas as fused_loss
from lmuscale.ops.cross_entropy import LOSS_CHUNK, cross_entropy
from lmuscale.train import step as step_lib


def rematerialised(h_BxTxD, w_VxD, targets_BxT, chunk=LOSS_CHUNK):
    """The cross-entropy as it was: a checkpointed ``lax.map`` over chunks of positions."""
    batch, length, width = h_BxTxD.shape
    count = batch * length
    chunk = max(1, min(chunk, count))
    pad = -count % chunk
    h_JxcxD = jnp.pad(h_BxTxD.reshape(count, width), ((0, pad), (0, 0))).reshape(-1, chunk, width)
    targets_Jxc = jnp.pad(targets_BxT.reshape(count), (0, pad)).reshape(-1, chunk)

    @jax.checkpoint
    def one_chunk(args):
        h_cxD, targets_c = args
        logits_cxV = logits_from_hidden(h_cxD, w_VxD)
        picked_c = jnp.take_along_axis(logits_cxV, targets_c[:, None], axis=-1)[:, 0]
        return jax.nn.logsumexp(logits_cxV, axis=-1) - picked_c

    losses = lax.map(one_chunk, (h_JxcxD, targets_Jxc)).reshape(-1)
    return losses[:count].reshape(batch, length)


def compiled_step(name: str, batch: int, seq_len: int, loss, chunk: int):
    """``(compiled train step, its initial state, tokens)`` of ``name``'s model with ``loss``
    as its cross-entropy (a subclass whose ``loss`` calls it)."""
    config = named_config(name, batch_chunk=0) if name.startswith("lmu") else named_config(name)
    built = build(config, ops.resolve(config))

    class WithLoss(type(built)):
        def loss(self, inputs_BxT, targets_BxT):
            per_position = loss(self.hidden(inputs_BxT), self.embed.embedding, targets_BxT, chunk)
            return per_position.mean(), per_position

    model = WithLoss(config, impls=built.impls)
    train_step, init, mesh, abstract = train_step_for(config, seq_len, model=model)
    tokens = jnp.zeros((1, batch, seq_len + 1), jnp.int32)
    return train_step.lower(abstract, tokens).compile(), step_lib.init_state(init, mesh), tokens


def measure(name: str, batch: int, seq_len: int, repeats: int, chunk: int) -> list[dict]:
    """Both losses' figures; with ``repeats``, their steps timed in turn (A B A B ...), so a
    drift of the machine's speed moves both alike, and the median ratio of each pair."""
    steps = {
        label: compiled_step(name, batch, seq_len, loss, chunk)
        for label, loss in (("custom VJP", cross_entropy), ("recomputed", rematerialised))
    }
    rows = {
        label: {"model": name, "loss": label, **compiled_figures(step)}
        for label, (step, *_) in steps.items()
    }
    if repeats:
        states = {
            label: timed_steps(step, state, tokens, 1)[0]
            for label, (step, state, tokens) in steps.items()
        }
        times = {label: [] for label in steps}
        for _ in range(repeats):
            for label, (step, _, tokens) in steps.items():
                states[label], (seconds,) = timed_steps(step, states[label], tokens, 1)
                times[label].append(seconds)
        for label, row in rows.items():
            row["median_s"] = statistics.median(times[label])
        ratios = [a / b for a, b in zip(times["custom VJP"], times["recomputed"], strict=True)]
        rows["custom VJP"]["ratio_to_recomputed"] = statistics.median(ratios)
    return list(rows.values())


# "pallas": the fused kernels with the dh kernel; then dh from the forward's expected
# embeddings (``ops.LossKernels.dh_from_forward``; the models run the first); "flash": the
# flash kernels (``ops.cross_entropy_flash``, bfloat16 and float16 only).
DH_FROM_FORWARD = "pallas, dh from the forward"
LOSS_IMPLS = ("xla", "pallas", DH_FROM_FORWARD, "flash")


def loss_inputs(batch: int, seq_len: int, width: int, dtype: str, vocab: int = GPT2_VOCAB):
    """Random ``(h, w, targets)`` made on the device: h as a final norm's output, w a float32
    parameter with logits of order 1."""
    key_h, key_w, key_t = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(key_h, (batch, seq_len, width), jnp.dtype(dtype))
    w = (2.0 / width**0.5) * jax.random.normal(key_w, (vocab, width), jnp.float32)
    return h, w, jax.random.randint(key_t, (batch, seq_len), 0, vocab)


def loss_program(impl: str):
    """``(h, w, targets) -> (losses, dh, dw)``: the gradients of the mean loss, jitted."""

    def loss(h, w, targets):
        if impl in ("xla", "flash"):
            return cross_entropy(h, w, targets, impl=impl)
        return fused_loss.cross_entropy(h, w, targets, dh_from_forward=impl == DH_FROM_FORWARD)

    def run(h, w, targets):
        losses, pullback = jax.vjp(lambda h, w: loss(h, w, targets), h, w)
        dh, dw = pullback(jnp.full(losses.shape, 1.0 / losses.size, jnp.float32))
        return losses, dh, dw

    return jax.jit(run)


def xla_bytes(tokens: int, width: int, dtype: str, vocab: int) -> float | None:
    """XLA's bytes accessed for one chunk of ``LOSS_CHUNK`` tokens, times the chunks."""
    chunk = min(tokens, LOSS_CHUNK)
    shapes = (
        jax.ShapeDtypeStruct((1, chunk, width), jnp.dtype(dtype)),
        jax.ShapeDtypeStruct((vocab, width), jnp.float32),
        jax.ShapeDtypeStruct((1, chunk), jnp.int32),
    )
    one = compiled_figures(loss_program("xla").lower(*shapes).compile()).get("bytes_accessed")
    return None if one is None else one * -(-tokens // chunk)


def kernel_bytes(
    tokens: int, width: int, dtype: str, vocab: int, dh_from_forward: bool = False
) -> tuple[float, float]:
    """Bounds on the fused kernels' memory traffic at their padded shapes and default tiles:
    ``(compulsory, every tile load)``.

    compulsory: each operand read once and each output written once (three passes over h
    and w, lse and the target logit out, lse, targets and the cotangent in to each backward
    kernel, dh and the float32 dw out; ``dh_from_forward``: two passes, and the float32
    expected embeddings written and read). Every tile load: each program of the forward and
    dh kernels loads all of w, and each of the dw kernel's all of h, as if no cache held any.
    """
    wide, tiling = fused_loss.padded_width(width), fused_loss.default_tiling(width, dtype)
    n = -(-tokens // tiling.token_multiple) * tiling.token_multiple
    v = -(-vocab // tiling.vocab_multiple) * tiling.vocab_multiple
    item = jnp.dtype(dtype).itemsize
    h, w = n * wide * item, v * wide * item
    passes = 2 if dh_from_forward else 3
    # lse and the target logit out; lse, targets and g into each backward kernel; dh; dw.
    small = 2 * 4 * n + (passes - 1) * 3 * 4 * n + h + v * wide * 4
    if dh_from_forward:
        small += 2 * n * wide * 4  # the expected embeddings, written and read
    compulsory = passes * (h + w) + small
    # Each program of the forward and dh kernels loads all of w, each of dw's all of h.
    w_loads = n // tiling.forward.rows + (0 if dh_from_forward else n // tiling.dh.rows)
    every_load = (passes - 1) * h + w_loads * w + w + (v // tiling.dw.rows) * h + small
    return compulsory, every_load


def _largest_differences(outputs, reference) -> dict:
    losses, dh, dw = (np.asarray(x, np.float64) for x in outputs)
    ref_losses, ref_dh, ref_dw = (np.asarray(x, np.float64) for x in reference)
    return {
        "loss_max_abs_diff": float(np.abs(losses - ref_losses).max()),
        "dh_max_diff_rel_to_max": float(np.abs(dh - ref_dh).max() / np.abs(ref_dh).max()),
        "dw_max_diff_rel_to_max": float(np.abs(dw - ref_dw).max() / np.abs(ref_dw).max()),
    }


def _timed_calls(program, args, repeats: int) -> tuple[object, list[float]]:
    """``program(*args)``'s outputs from a first call (it compiles, and warms up), and the
    seconds of ``repeats`` calls after it."""
    outputs = jax.block_until_ready(program(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - start)
    return outputs, times


def measure_loss(impl, width, dtype, batch, seq_len, repeats, reference=None):
    """One implementation at one shape: ``(row, outputs)``; outputs None where not run."""
    tokens, vocab = batch * seq_len, GPT2_VOCAB
    row = {"impl": impl, "d": width, "dtype": dtype, "batch": batch, "seq_len": seq_len}
    kernels = ops.LOSS.kernels["flash" if impl == "flash" else "pallas"]
    reason = kernels.unsupported(dtype, jax.devices()) if impl != "xla" else None
    if reason is not None:
        return {**row, "skipped": reason}, None
    h, w, targets = loss_inputs(batch, seq_len, width, dtype, vocab)
    program = loss_program(impl)
    outputs, times = _timed_calls(program, (h, w, targets), repeats)
    seconds = statistics.median(times)
    useful = 6 * tokens * vocab * width
    if impl == "xla":
        executed, moved = useful, xla_bytes(tokens, width, dtype, vocab)
        row["bytes_counted_by"] = "XLA's cost analysis of one chunk, times the chunks"
    elif impl == "flash":
        blocks = flash.Blocks()
        padded = -(-vocab // blocks.vocab_multiple) * blocks.vocab_multiple
        # FLOPs per N V d: the forward's logits and E_p[w] 4, dw's two products 4.
        executed, moved = 8 * tokens * padded * flash.padded_width(width), None
        row.update(blocks=dataclasses.asdict(blocks))
    else:
        tiling, by_forward = fused_loss.default_tiling(width, dtype), impl == DH_FROM_FORWARD
        padded = -(-vocab // tiling.vocab_multiple) * tiling.vocab_multiple
        # FLOPs per N V d: the forward's logits 2 (4 with E_p[w]), dh's 4, dw's 4.
        executed = (8 if by_forward else 10) * tokens * padded * fused_loss.padded_width(width)
        moved, every_load = kernel_bytes(tokens, width, dtype, vocab, by_forward)
        row.update(
            dh_from_forward=by_forward,
            tiling=dataclasses.asdict(tiling),
            bytes_counted_by="compulsory traffic, a lower bound (kernel_bytes)",
            tile_loads_gb=every_load / 1e9,
        )
    row.update(
        median_ms=seconds * 1e3,
        all_ms=[t * 1e3 for t in times],
        useful_tflop=useful / 1e12,
        executed_tflop=executed / 1e12,
        useful_tflops_per_s=useful / seconds / 1e12,
        executed_tflops_per_s=executed / seconds / 1e12,
        bytes_gb=None if moved is None else moved / 1e9,
        mean_loss=float(outputs[0].mean()),
    )
    if reference is not None:
        row.update(_largest_differences(outputs, reference), compared_with="xla")
    return row, outputs


def measure_losses(widths, dtypes, batch, seq_len, repeats, impls=LOSS_IMPLS) -> list[dict]:
    """Every implementation at every (d, dtype); the kernel compared with the XLA path's
    outputs at the same inputs where both ran."""
    rows = []
    for width in widths:
        for dtype in dtypes:
            reference = None
            for impl in impls:
                try:
                    row, outputs = measure_loss(
                        impl, width, dtype, batch, seq_len, repeats, reference
                    )
                except Exception as error:  # an out-of-memory, a lowering failure: say so
                    row, outputs = {"impl": impl, "d": width, "dtype": dtype}, None
                    row["error"] = f"{type(error).__name__}: {error}"[:500]
                if impl == "xla":
                    reference = outputs
                rows.append(row)
                outputs = None
    return rows


# The kernels the sweep times: ``fused_loss.Tiling``'s three, and "forward_expected", the
# forward that also forms the expected embeddings (``ops.LossKernels.dh_from_forward``; its launch
# is ``tiling.forward``). Swept in this order: dw, the longest (15.2 ms of lmu-1M's micro-batch
# on the H200 at d = 204), and the form that would replace the next two (13.4 and 7.2 ms) first,
# so that a spent budget leaves out the least.
KERNELS = fused_loss.KERNELS
SWEEP_ORDER = ("dw", "forward_expected", "dh", "forward")
# Each kernel's launches that --part loss-tiles tries, unless told others: tiles of 32 to 128
# rows along each of its two axes, 4 to 16 warps, 1 to 3 pipelining stages. Compiled for an
# H100 at d = 204 in bfloat16 (kernel_resources-sm90a-loss-launches.json), dh and dw hold
# 128-row tiles without spilling at a step of 32 with 8 warps or 16 (at most 128 registers a
# thread; dw from 2 stages), and dh also at a step of 64 with 8 warps.
SWEEP_TILES, SWEEP_WARPS, SWEEP_STAGES = (32, 64, 128), (4, 8, 16), (1, 2, 3)


def launch_candidates(tiles=SWEEP_TILES, warps=SWEEP_WARPS, stages=SWEEP_STAGES) -> list:
    """Every ``fused_loss.Launch`` of the given tiles (rows and step), warps and stages."""
    return [
        fused_loss.Launch(rows, step, n_warps, n_stages)
        for rows in tiles
        for step in tiles
        for n_warps in warps
        for n_stages in stages
    ]


def unfit_launches(path: Path, width: int, dtype: str) -> frozenset:
    """The ``(kernel, Launch)`` pairs that ``kernel_resources.py --loss-launches`` (its JSON at
    ``path``) found spilling registers or over an H100's shared memory at (``width``,
    ``dtype``)."""
    unfit = set()
    try:
        for row in json.loads(path.read_text())["rows"]:
            if row.get("d") != width or not row["case"].startswith(f"loss d={width} {dtype} "):
                continue
            if row.get("fits_h100") and row.get("spill_store_bytes") == 0:
                continue
            warps, stages = row["num_warps"], row["num_stages"]
            launch = fused_loss.Launch(row["rows"], row["step"], warps, stages)
            unfit.add((row["kernel"].removesuffix("_kernel"), launch))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(
            f"--resources {path}: not kernel_resources.py --loss-launches's JSON "
            f"({type(error).__name__}: {error})"
        ) from None
    return frozenset(unfit)


def _padding(kernel: str, launch) -> object:
    """A tiling whose padding is that of ``launch`` run as ``kernel``: the forward kernels' and
    dh's rows are tokens, dw's the vocabulary."""
    if kernel == "dw":
        return fused_loss.Tiling.shared(launch.step, launch.rows)
    return fused_loss.Tiling.shared(launch.rows, launch.step)


@functools.cache  # the default launch is a reference, the lse's source and a candidate
def _kernel_program(kernel: str, launch, vocab: int, interpret: bool):
    """``kernel`` alone under ``launch``, jitted, on the unpadded (h, w, targets) and the
    per-token lse and cotangent (N,): the forward's lse, the expected embeddings (N, d), dh
    (N, d) or dw (V, d)."""
    tiling = _padding(kernel, launch)

    def run(h_BxTxD, w_VxD, targets_BxT, lse_N, g_N):
        count, width = targets_BxT.size, h_BxTxD.shape[-1]
        h_NxD, w_pad, targets_N = fused_loss.operands(h_BxTxD, w_VxD, targets_BxT, tiling)
        if kernel.startswith("forward"):
            expected = kernel == "forward_expected"
            outputs = fused_loss.forward_call(
                h_NxD, w_pad, targets_N, vocab, launch, interpret, expected=expected
            )
            return outputs[-1][:count, :width] if expected else outputs[0][:count]
        pad = (0, h_NxD.shape[0] - count)
        lse_N, g_N = jnp.pad(lse_N, pad), jnp.pad(g_N, pad)
        args = (h_NxD, w_pad, targets_N, lse_N, g_N, vocab, launch, interpret)
        if kernel == "dh":
            return fused_loss.dh_call(*args)[:count, :width]
        return fused_loss.dw_call(*args)[:vocab, :width]

    return jax.jit(run)


def _median_ms(program, args, repeats: int) -> float:
    return statistics.median(_timed_calls(program, args, repeats)[1]) * 1e3


def sweep_launches(
    width: int,
    dtype: str,
    batch: int,
    seq_len: int,
    vocab: int,
    kernels=SWEEP_ORDER,
    candidates=None,
    repeats: int = 5,
    budget: float = float("inf"),
    interpret: bool = False,
    unfit=frozenset(),
) -> dict:
    """Each of ``kernels`` alone under each launch of ``candidates`` (``launch_candidates()``),
    at one (d, dtype): rows of the median ms and the largest difference from the default
    tiling's output relative to its largest value; then the fastest launch of each kernel, and
    the loss's forward+backward in both forms (the dh kernel, dh from the forward) under the
    default tiling and under those launches, each also with the width split where that pads d
    less (``fused_loss.Tiling.split_width``; ``loss_ms``, and by the same labels ``tilings``,
    each one's tiling for ``Tiling.from_dict``, ``loss_diffs``, its differences from the
    ``loss_reference``, the dh kernel at the default tiling, timed first (if it fails, no loss
    is timed against it), and ``loss_errors``, those that failed). No launch of
    ``candidates`` is started after ``budget`` seconds (those left are counted in
    ``not_started``); each kernel's default launch, its reference, and the loss's timings run
    whatever the budget. ``unfit``:
    ``(kernel, Launch)`` pairs not run (``unfit_launches``), counted in ``left_out``."""
    reason = None if interpret else ops.unsupported_reason()
    if reason is not None:
        return {"skipped": reason}
    started = time.monotonic()
    candidates = launch_candidates() if candidates is None else candidates
    h, w, targets = loss_inputs(batch, seq_len, width, dtype, vocab)
    default = fused_loss.default_tiling(width, dtype)
    g = jnp.full((targets.size,), 1 / targets.size, jnp.float32)  # the mean loss's cotangent
    forward = _kernel_program("forward", default.forward, vocab, interpret)
    args = (h, w, targets, forward(h, w, targets, g, g), g)  # the forward reads no lse, no g
    record = {"d": width, "dtype": dtype, "batch": batch, "seq_len": seq_len, "vocab": vocab}
    record.update(default=dataclasses.asdict(default), rows=[], not_started=0, left_out=0)
    best = {}
    for kernel in kernels:
        reference_launch = getattr(default, kernel.removesuffix("_expected"))
        reference = np.asarray(_kernel_program(kernel, reference_launch, vocab, interpret)(*args))
        scale = float(np.abs(reference).max())
        for launch in candidates:
            if (kernel, launch) in unfit and launch != reference_launch:
                record["left_out"] += 1
                continue
            if time.monotonic() - started > budget:
                record["not_started"] += 1
                continue
            row = {"kernel": kernel, "impl": "pallas", **dataclasses.asdict(launch)}
            try:
                program = _kernel_program(kernel, launch, vocab, interpret)
                row["median_ms"] = _median_ms(program, args, repeats)
                got = np.asarray(program(*args), np.float64)
                row["max_diff_rel_to_max"] = float(np.abs(got - reference).max() / scale)
            except Exception as error:  # a launch Triton refuses (shared memory, say)
                row["error"] = f"{type(error).__name__}: {error}"[:300]
            record["rows"].append(row)
            print(_sweep_line(row), file=sys.stderr, flush=True)
            if "median_ms" in row and row["median_ms"] < best.get(kernel, (np.inf,))[0]:
                best[kernel] = (row["median_ms"], launch)
    record["fastest"] = {k: dataclasses.asdict(launch) for k, (_, launch) in best.items()}
    # The loss's forward+backward in each form, at the default tiling and at the fastest
    # launches of the kernels that form runs, where all of them were timed.
    forms = {"dh kernel": (False, KERNELS), "dh from the forward": (True, ("forward", "dw"))}
    record["loss_ms"], record["tilings"], record["loss_diffs"], record["loss_errors"] = (
        {},
        {},
        {},
        {},
    )
    reference = None  # the dh kernel at the default tiling, the first timed (if it ran)
    for form, (by_forward, needs) in forms.items():
        timed = {
            k: best.get(f"{k}_expected" if by_forward and k == "forward" else k) for k in needs
        }
        tilings = {"default": default}
        if all(timed.values()):
            fastest = {k: launch for k, (_, launch) in timed.items()}
            tilings["fastest"] = fused_loss.Tiling(
                fastest["forward"], fastest.get("dh", default.dh), fastest["dw"]
            )
        # Each also with d held in parts (its launches found at the whole width).
        for name, tiling in list(tilings.items()):
            if fused_loss.padded_width(width, True) < fused_loss.padded_width(width):
                tilings[f"{name}, split width"] = dataclasses.replace(tiling, split_width=True)
        for name, tiling in tilings.items():
            label = f"{form}, {name}"
            try:
                program = _loss_program(tiling, by_forward, interpret)
                outputs, times = _timed_calls(program, (h, w, targets), repeats)
            except Exception as error:  # a tiling Triton refuses: the others are kept
                record["loss_errors"][label] = f"{type(error).__name__}: {error}"[:300]
                continue
            if label == "dh kernel, default":  # the first timed: the others' reference
                reference, record["loss_reference"] = outputs, label
            record["loss_ms"][label] = statistics.median(times) * 1e3
            record["tilings"][label] = dataclasses.asdict(tiling)
            if reference is not None:  # else --tuned-loss takes none of them
                (loss, (dh, dw)), (ref_loss, (ref_dh, ref_dw)) = outputs, reference
                found = _largest_differences((loss, dh, dw), (ref_loss, ref_dh, ref_dw))
                record["loss_diffs"][label] = found
    return record


def _loss_program(tiling, dh_from_forward: bool, interpret: bool):
    def loss(h, w, targets):
        return fused_loss.cross_entropy(
            h, w, targets, tiling=tiling, dh_from_forward=dh_from_forward, interpret=interpret
        ).mean()

    return jax.jit(jax.value_and_grad(loss, (0, 1)))


def _sweep_line(row: dict) -> str:
    launch = (
        f"{row['kernel']:>7} {row['rows']:>3} x {row['step']:<3} {row['warps']}w {row['stages']}s"
    )
    if "error" in row:
        return f"  {launch}: {row['error'][:120]}"
    return f"  {launch}: {row['median_ms']:.2f} ms (max diff {row['max_diff_rel_to_max']:.1e})"


def print_loss_rows(rows: list[dict], title: str) -> None:
    def cell(row, key, fmt):
        return fmt.format(row[key]) if row.get(key) is not None else "-"

    print_table(
        title,
        ("impl", "d", "dtype", "ms", "TFLOP/s useful", "executed", "GB moved", "max diff vs xla"),
        [
            (
                r["impl"],
                r["d"],
                r["dtype"],
                cell(r, "median_ms", "{:.2f}"),
                cell(r, "useful_tflops_per_s", "{:.3g}"),
                cell(r, "executed_tflops_per_s", "{:.3g}"),
                cell(r, "bytes_gb", "{:.2f}")
                + (f" to {r['tile_loads_gb']:.1f}" if "tile_loads_gb" in r else ""),
                (
                    f"loss {r['loss_max_abs_diff']:.1e}, dh {r['dh_max_diff_rel_to_max']:.1e}, "
                    f"dw {r['dw_max_diff_rel_to_max']:.1e}"
                    if "loss_max_abs_diff" in r
                    else (r.get("skipped") or r.get("error") or "")[:70]
                ),
            )
            for r in rows
        ],
        left=3,
    )


def main_loss(args) -> None:
    rows = measure_losses(args.widths, args.dtypes, args.batch, args.seq_len, args.repeats)
    print_loss_rows(
        rows,
        f"cross-entropy forward+backward, {args.batch} x {args.seq_len} tokens, "
        f"V = {GPT2_VOCAB}, {machine()['device_kind']}",
    )
    shapes = {"batch": args.batch, "seq_len": args.seq_len, "vocab": GPT2_VOCAB}
    write_json(args.out, {"machine": machine(), "versions": versions(), **shapes, "rows": rows})


def main_tiles(args) -> None:
    candidates = launch_candidates(args.tiles, args.warps, args.stages)
    records = []
    for width in args.widths:
        for dtype in args.dtypes:
            record = sweep_launches(
                width,
                dtype,
                args.batch,
                args.seq_len,
                args.vocab,
                kernels=args.kernels,
                candidates=candidates,
                repeats=args.repeats,
                budget=args.budget,
                interpret=args.interpret,
                unfit=unfit_launches(args.resources, width, dtype) if args.resources else (),
            )
            records.append({"d": width, "dtype": dtype, **record})
            print_tile_record(records[-1], args.top)
    write_json(
        args.out,
        {
            "machine": machine(),
            "versions": versions(),
            "interpret": args.interpret,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "vocab": args.vocab,
            "records": records,
        },
    )


def print_tile_record(record: dict, top: int = 5) -> None:
    """``sweep_launches``'s record: the ``top`` fastest launches of each kernel, and the loss
    under each kernel's fastest against the default tiling."""
    title = f"fused loss kernels at d = {record['d']}, {record['dtype']}"
    if "skipped" in record:
        print(f"{title}: not run ({record['skipped']})")
        return
    default, rows = record["default"], []
    for kernel in dict.fromkeys(r["kernel"] for r in record["rows"]):
        mine = [r for r in record["rows"] if r["kernel"] == kernel and "median_ms" in r]
        mine.sort(key=lambda r: r["median_ms"])
        launch = default[kernel.removesuffix("_expected")]
        base_launch = {k: launch[k] for k in ("rows", "step", "warps", "stages")}
        for r in mine[:top]:
            is_default = {k: r[k] for k in base_launch} == base_launch
            rows.append(
                (
                    kernel,
                    f"{r['rows']} x {r['step']}",
                    r["warps"],
                    r["stages"],
                    f"{r['median_ms']:.2f}",
                    f"{r['max_diff_rel_to_max']:.1e}",
                    "default" if is_default else "",
                )
            )
    failed = sum("error" in r for r in record["rows"])
    print_table(
        f"{title}, {record['batch']} x {record['seq_len']} tokens, V = {record['vocab']}, "
        f"{machine()['device_kind']}: the {top} fastest launches of each kernel "
        f"({len(record['rows'])} run, {failed} refused, {record['left_out']} left out as "
        f"unfit, {record['not_started']} not started)",
        ("kernel", "rows x step", "warps", "stages", "ms", "max diff", ""),
        rows,
        left=2,
    )
    for name, ms in record.get("loss_ms", {}).items():
        diffs = record.get("loss_diffs", {}).get(name, {})
        against = ", ".join(f"{key} {value:.1e}" for key, value in diffs.items())
        print(
            f"loss forward+backward, {name} tiling: {ms:.2f} ms"
            + (f" (differences: {against})" if against else "")
        )
    for name, error in record.get("loss_errors", {}).items():
        print(f"loss forward+backward, {name} tiling: failed, {error[:150]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("step", "loss", "loss-tiles"), default="step")
    parser.add_argument("--models", nargs="+", default=["lmu-1M", "transformer-1M"])
    parser.add_argument("--batch", type=int, help="sequences (step: 8, loss: 64)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--time", type=int, default=0, help="timed steps (0: compile only)")
    parser.add_argument("--loss-chunk", type=int, default=LOSS_CHUNK)
    parser.add_argument("--widths", nargs="+", type=int, default=[48, 204], help="loss: d")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, help="loss: timed calls (10; loss-tiles: 5)")
    tiles = parser.add_argument_group("loss-tiles: the launches tried, and what stops the sweep")
    tiles.add_argument("--kernels", nargs="+", choices=SWEEP_ORDER, default=list(SWEEP_ORDER))
    tiles.add_argument("--tiles", nargs="+", type=int, default=list(SWEEP_TILES))
    tiles.add_argument("--warps", nargs="+", type=int, default=list(SWEEP_WARPS))
    tiles.add_argument("--stages", nargs="+", type=int, default=list(SWEEP_STAGES))
    tiles.add_argument("--budget", type=float, default=float("inf"), help="seconds")
    tiles.add_argument("--top", type=int, default=5, help="launches printed per kernel")
    tiles.add_argument(
        "--resources",
        type=Path,
        help="kernel_resources.py --loss-launches's JSON: leave out the launches that spill "
        "or overflow shared memory there",
    )
    tiles.add_argument("--vocab", type=int, default=GPT2_VOCAB)
    tiles.add_argument(
        "--interpret", action="store_true", help="Pallas's interpret mode (any backend; slow)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    kind = machine()["device_kind"]
    if args.out is None:
        name = {"step": "cross_entropy", "loss": "cross_entropy_loss"}.get(args.part)
        name = name or "cross_entropy_tiles"
        args.out = Path("benchmarks/results") / f"{name}-{slug(kind)}.json"
    if args.part == "loss":
        args.batch, args.repeats = args.batch or 64, args.repeats or 10
        main_loss(args)
        return
    if args.part == "loss-tiles":
        args.batch, args.repeats = args.batch or 64, args.repeats or 5
        main_tiles(args)
        return
    args.batch = args.batch or 8
    rows = []
    for name in args.models:
        rows += measure(name, args.batch, args.seq_len, args.time, args.loss_chunk)
    gb = lambda v: "-" if v is None else f"{v / 1e9:.2f}"  # noqa: E731
    print_table(
        f"train step at ({args.batch}, {args.seq_len}) tokens, loss chunks of {args.loss_chunk}, "
        f"{machine()['device_kind']}",
        ("model", "cross-entropy", "GB accessed", "GFLOP", "temp GB", "step s", "paired ratio"),
        [
            (
                r["model"],
                r["loss"],
                gb(r.get("bytes_accessed")),
                gb(r.get("flops")),
                gb(r.get("temp_size_in_bytes")),
                f"{r['median_s']:.3f}" if "median_s" in r else "-",
                f"{r['ratio_to_recomputed']:.3f}" if "ratio_to_recomputed" in r else "",
            )
            for r in rows
        ],
        left=2,
    )
    shapes = {"batch": args.batch, "seq_len": args.seq_len, "loss_chunk": args.loss_chunk}
    write_json(args.out, {"machine": machine(), "versions": versions(), **shapes, "rows": rows})


if __name__ == "__main__":
    main()
