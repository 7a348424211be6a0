"""The train step with the custom-VJP cross-entropy against the one it replaced.

``python benchmarks/cross_entropy.py [--models lmu-1M transformer-1M] [--batch 8] [--time 3]``

The replaced loss rematerialised each chunk: its backward pass computed every chunk's logits
again. For each model, the full train step (Adam, schedule, the loss) is compiled both ways
and XLA's own accounting is printed: bytes accessed and FLOPs (``cost_analysis``), temporary
buffers (``memory_analysis``); with ``--time N``, also the median of N steps of each, run in
turn, and the median ratio of the pairs. Writes JSON.

XLA's cost analysis counts the body of a loop once, however many times it runs: with more
than one chunk of positions the figures hold one chunk's loss. ``--loss-chunk`` equal to
batch x seq_len makes the loss one chunk, so its counts are whole (and its memory is not).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    compiled_figures,
    machine,
    print_table,
    timed_steps,
    train_step_for,
    versions,
    write_json,
)

from lmuscale.models import base, named_config
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
    base.cross_entropy = lambda h, w, targets, _: loss(h, w, targets, chunk)
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["lmu-1M", "transformer-1M"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--time", type=int, default=0, help="timed steps (0: compile only)")
    parser.add_argument("--loss-chunk", type=int, default=base.LOSS_CHUNK)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cross_entropy.json"))
    args = parser.parse_args(argv)
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
