"""The cross-entropy's implementations: the loss alone, and the train step around it.

    python benchmarks/cross_entropy.py --part loss [--widths 48 204] [--batch 64]
    python benchmarks/cross_entropy.py [--models lmu-1M transformer-1M] [--batch 8] [--time 3]

``--part loss``: the loss's forward+backward alone (the gradients of the mean loss with
respect to h and the tied embedding w), for each implementation ("xla": the custom VJP over
token chunks; "pallas": ``models.fused_loss``, on a GPU where it runs, else the row says why
not) at d in --widths, --batch x --seq-len tokens (64 x 1024: the paper configs'
micro-batch), V = 50,257, bfloat16 and float32 activations. Each row: the median ms of
--repeats calls after a warm-up, TFLOP/s on the useful matrix FLOPs (6 N V d: logits, dh, dw;
the kernels execute 10 N V d, recomputing the logits twice), bytes per call, and for the
kernel its largest differences from the XLA path's losses and gradients at the same inputs.
Bytes: for "xla", XLA's count for one 1024-token chunk times the chunks (its cost analysis
counts a loop body once); for "pallas", a lower bound, each kernel's operands read once and
outputs written once, and beside it (``tile_loads_gb``) every tile load counted as if no
cache held any (the forward and dh kernels load all of w once per tile of tokens).

``--part step`` (the default): the full train step with the custom-VJP cross-entropy against
the one it replaced, which rematerialised each chunk (its backward pass computed every
chunk's logits again). For each model, the step is compiled both ways and XLA's own
accounting is printed: bytes accessed and FLOPs (``cost_analysis``), temporary buffers
(``memory_analysis``); with ``--time N``, also the median of N steps of each, run in turn,
and the median ratio of the pairs. Its cost analysis also counts the loss's loop body once:
with more than one chunk of positions the figures hold one chunk's loss. ``--loss-chunk``
equal to batch x seq_len makes the loss one chunk, so its counts are whole (and its memory is
not). Both parts write JSON.
"""

from __future__ import annotations

import argparse
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

from lmuscale.data.tokenizer import GPT2_VOCAB
from lmuscale.models import base, fused_loss, named_config
from lmuscale.train import step as step_lib


def rematerialised(h_BxTxD, w_VxD, targets_BxT, chunk=base.LOSS_CHUNK):
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
        logits_cxV = base.logits_from_hidden(h_cxD, w_VxD)
        picked_c = jnp.take_along_axis(logits_cxV, targets_c[:, None], axis=-1)[:, 0]
        return jax.nn.logsumexp(logits_cxV, axis=-1) - picked_c

    losses = lax.map(one_chunk, (h_JxcxD, targets_Jxc)).reshape(-1)
    return losses[:count].reshape(batch, length)


def compiled_step(name: str, batch: int, seq_len: int, loss, chunk: int):
    """``(compiled train step, its initial state, tokens)`` with ``loss`` as the model's
    cross-entropy (swapped in while the step is traced)."""
    kept = base.cross_entropy
    base.cross_entropy = lambda h, w, targets, *_: loss(h, w, targets, chunk)
    try:
        config = named_config(name, batch_chunk=0) if name.startswith("lmu") else named_config(name)
        train_step, init, mesh, abstract = train_step_for(config, seq_len)
        tokens = jnp.zeros((1, batch, seq_len + 1), jnp.int32)
        return train_step.lower(abstract, tokens).compile(), step_lib.init_state(init, mesh), tokens
    finally:
        base.cross_entropy = kept


def measure(name: str, batch: int, seq_len: int, repeats: int, chunk: int) -> list[dict]:
    """Both losses' figures; with ``repeats``, their steps timed in turn (A B A B ...), so a
    drift of the machine's speed moves both alike, and the median ratio of each pair."""
    steps = {
        label: compiled_step(name, batch, seq_len, loss, chunk)
        for label, loss in (("custom VJP", base.cross_entropy), ("recomputed", rematerialised))
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


LOSS_IMPLS = ("xla", "pallas")


def loss_inputs(batch: int, seq_len: int, width: int, dtype: str, vocab: int = GPT2_VOCAB):
    """Random ``(h, w, targets)`` made on the device: h as a final norm's output, w a float32
    parameter with logits of order 1."""
    key_h, key_w, key_t = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(key_h, (batch, seq_len, width), jnp.dtype(dtype))
    w = (2.0 / width**0.5) * jax.random.normal(key_w, (vocab, width), jnp.float32)
    return h, w, jax.random.randint(key_t, (batch, seq_len), 0, vocab)


def loss_program(impl: str):
    """``(h, w, targets) -> (losses, dh, dw)``: the gradients of the mean loss, jitted."""

    def run(h, w, targets):
        losses, pullback = jax.vjp(lambda h, w: base.cross_entropy(h, w, targets, impl=impl), h, w)
        dh, dw = pullback(jnp.full(losses.shape, 1.0 / losses.size, jnp.float32))
        return losses, dh, dw

    return jax.jit(run)


def xla_bytes(tokens: int, width: int, dtype: str, vocab: int) -> float | None:
    """XLA's bytes accessed for one chunk of ``base.LOSS_CHUNK`` tokens, times the chunks."""
    chunk = min(tokens, base.LOSS_CHUNK)
    shapes = (
        jax.ShapeDtypeStruct((1, chunk, width), jnp.dtype(dtype)),
        jax.ShapeDtypeStruct((vocab, width), jnp.float32),
        jax.ShapeDtypeStruct((1, chunk), jnp.int32),
    )
    one = compiled_figures(loss_program("xla").lower(*shapes).compile()).get("bytes_accessed")
    return None if one is None else one * -(-tokens // chunk)


def kernel_bytes(tokens: int, width: int, dtype: str, vocab: int) -> tuple[float, float]:
    """Bounds on the fused kernels' memory traffic at their padded shapes and default tiles:
    ``(compulsory, every tile load)``.

    compulsory: each operand read once and each output written once (three passes over h
    and w, lse and the target logit out, lse, targets and the cotangent in to each backward
    kernel, dh and the float32 dw out). Every tile load: the forward and dh kernels load all
    of w once per tile of tokens and the dw kernel all of h once per tile of the vocabulary,
    as if no cache held any of it.
    """
    wide = fused_loss.padded_width(width)
    token_tile, vocab_tile = fused_loss.tiles(width, dtype)
    token_tiles, vocab_tiles = -(-tokens // token_tile), -(-vocab // vocab_tile)
    item = jnp.dtype(dtype).itemsize
    h, w = token_tiles * token_tile * wide * item, vocab_tiles * vocab_tile * wide * item
    per_token = 4 * token_tiles * token_tile
    small = 2 * per_token + 2 * 3 * per_token + h + vocab_tiles * vocab_tile * wide * 4
    compulsory = 3 * (h + w) + small
    every_load = 2 * (h + token_tiles * w) + (w + vocab_tiles * h) + small
    return compulsory, every_load


def _largest_differences(outputs, reference) -> dict:
    losses, dh, dw = (np.asarray(x, np.float64) for x in outputs)
    ref_losses, ref_dh, ref_dw = (np.asarray(x, np.float64) for x in reference)
    return {
        "loss_max_abs_diff": float(np.abs(losses - ref_losses).max()),
        "dh_max_diff_rel_to_max": float(np.abs(dh - ref_dh).max() / np.abs(ref_dh).max()),
        "dw_max_diff_rel_to_max": float(np.abs(dw - ref_dw).max() / np.abs(ref_dw).max()),
    }


def measure_loss(impl, width, dtype, batch, seq_len, repeats, reference=None):
    """One implementation at one shape: ``(row, outputs)``; outputs None where not run."""
    tokens, vocab = batch * seq_len, GPT2_VOCAB
    row = {"impl": impl, "d": width, "dtype": dtype, "batch": batch, "seq_len": seq_len}
    reason = fused_loss.unsupported_reason() if impl == "pallas" else None
    if reason is not None:
        return {**row, "skipped": reason}, None
    h, w, targets = loss_inputs(batch, seq_len, width, dtype, vocab)
    program = loss_program(impl)
    outputs = jax.block_until_ready(program(h, w, targets))  # compiles, and warms up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(h, w, targets))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    useful = 6 * tokens * vocab * width
    if impl == "xla":
        executed, moved = useful, xla_bytes(tokens, width, dtype, vocab)
        row["bytes_counted_by"] = "XLA's cost analysis of one chunk, times the chunks"
    else:
        token_tile, vocab_tile = fused_loss.tiles(width, dtype)
        padded = -(-vocab // vocab_tile) * vocab_tile
        executed = 10 * tokens * padded * fused_loss.padded_width(width)
        moved, every_load = kernel_bytes(tokens, width, dtype, vocab)
        row.update(
            token_tile=token_tile,
            vocab_tile=vocab_tile,
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("step", "loss"), default="step")
    parser.add_argument("--models", nargs="+", default=["lmu-1M", "transformer-1M"])
    parser.add_argument("--batch", type=int, help="sequences (step: 8, loss: 64)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--time", type=int, default=0, help="timed steps (0: compile only)")
    parser.add_argument("--loss-chunk", type=int, default=base.LOSS_CHUNK)
    parser.add_argument("--widths", nargs="+", type=int, default=[48, 204], help="loss: d")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=10, help="loss: timed calls")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    kind = machine()["device_kind"]
    if args.out is None:
        name = "cross_entropy" if args.part == "step" else "cross_entropy_loss"
        args.out = Path("benchmarks/results") / f"{name}-{slug(kind)}.json"
    if args.part == "loss":
        args.batch = args.batch or 64
        main_loss(args)
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
