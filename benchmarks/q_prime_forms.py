"""The channels-last attention's q' x q' sums on a GPU, in each form of ``layers.Q_PRIME_SUMS``
and ``layers.NARROW_PRODUCTS``.

    python benchmarks/q_prime_forms.py [--budget SECONDS] [--steps 10] [--forms FORM ...]
        [--out benchmarks/results/q_prime_forms.json]

Compiles lmu-1M's paper train step for one micro-batch of 64 x 1024 tokens (as
``gpu.py``'s profile part) with the attention's scores and its gradient's dgelu(Q), dgelu(K)
formed by matrix products batched over the positions with bf16 operands ("products", the
layers' form), the same asking XLA for its default precision rather than the highest
("products, default precision", ``layers.NARROW_PRECISION``: the same sums, not yet timed),
with float32 operands ("products, float32 operands") and by sums over broadcast products
("elementwise"), and times --steps steps of each (the median);
then, where --budget allows, the paper step at 512 x 1024 in 8 micro-batches in the faster
form, with the cross-entropy "auto" picks and with XLA's, and a ``jax.profiler`` trace of its
micro-batch (the top operations, and the trace as ``profile-<model>-q-prime.json.gz`` beside
--out). Each row is written as soon as it is timed. A compile on an H100 took 21-63 s.

On an H100 (results/q_prime_forms-h100.json, 2026-11-28; the experiment's six forms, of which
"dots/dots" is "products" and "broadcast/reduce" "elementwise"), lmu-1M's micro-batch took
124.1 ms by products (then with float32 operands) against 149.8 elementwise. On an H200
(results/q_prime_forms-h200.json, 2026-11-28, the forms of commit a7d1a83), by products
with bf16 operands 84.9 ms, with float32 operands 97.7, with bf16 only in the forward's
scores 92.5, and that with XLA's Triton gemms off (cuBLAS) 117.8; the paper step with bf16
operands 663.7 ms (6.3% MFU) with the fused cross-entropy, 782.3 with XLA's. ``SMOKE=1``
runs the script on a CPU at tiny shapes, with the GPU's layout, to check it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
import gpu
from common import machine, print_table, slug, timed_steps, versions, write_json

from lmuscale import layers

# Each form: the layers' module settings patched while it is traced, and XLA's options for its
# compile (none now; the experiment's fourth form turned XLA's Triton gemms off).
FORMS = {
    "products": ({"Q_PRIME_SUMS": "products", "NARROW_PRODUCTS": True}, {}),
    "products, default precision": (
        {"Q_PRIME_SUMS": "products", "NARROW_PRODUCTS": True, "NARROW_PRECISION": "default"},
        {},
    ),
    "products, float32 operands": ({"Q_PRIME_SUMS": "products", "NARROW_PRODUCTS": False}, {}),
    "elementwise": ({"Q_PRIME_SUMS": "elementwise", "NARROW_PRODUCTS": False}, {}),
}
MODEL = "lmu-1M"  # one of gpu.py's profiled models
SMOKE = bool(os.environ.get("SMOKE"))


def main(argv=None) -> None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; nothing starts after")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/q_prime_forms.json"))
    args = parser.parse_args(argv)
    seq_len, micro, batch = (64, 1, 8) if SMOKE else (1024, 64, 512)
    options = argparse.Namespace(
        seq_len=seq_len, profile_batch=micro, budget_gb=0.0, profile_steps=3, profile_top=20
    )
    if SMOKE:
        layers.channels_last_memory = lambda: True

    def left() -> float:
        return args.budget - (time.perf_counter() - start)

    record = {
        "benchmark": "q_prime_forms",
        "machine": machine(),
        "versions": versions(),
        "model": MODEL,
        "micro_batch": [],
        "train": [],
    }
    for form in args.forms:
        if left() <= 0:
            break
        settings, xla = FORMS[form]
        compile_start = time.perf_counter()
        try:
            with mock.patch.multiple(layers, **settings):
                compiled, state, tokens = gpu.micro_batch_step(MODEL, options, xla)
            compile_seconds = time.perf_counter() - compile_start
            state, _ = timed_steps(compiled, state, tokens, 2)
            state, times = timed_steps(compiled, state, tokens, args.steps)
        except Exception as error:  # a form that fails to compile or run is a row, not the end
            record["micro_batch"].append(
                {"form": form, "error": f"{type(error).__name__}: {error}"[:2000]}
            )
            write_json(args.out, record, quiet=True)
            print(f"{form}: {type(error).__name__}: {str(error)[:300]}", file=sys.stderr)
            continue
        record["micro_batch"].append(
            {
                "form": form,
                **settings,
                "xla_options": xla,
                "batch": micro,
                "seq_len": seq_len,
                "compile_seconds": compile_seconds,
                "step_seconds": statistics.median(times),
                "step_seconds_all": times,
            }
        )
        write_json(args.out, record, quiet=True)
        print(f"{form}: {1e3 * statistics.median(times):.1f} ms", file=sys.stderr, flush=True)
    rows = [r for r in record["micro_batch"] if "error" not in r]
    print_table(
        f"{MODEL}, one micro-batch of {micro} x {seq_len}",
        ("q' sums", "ms", "compile s"),
        [
            (r["form"], f"{1e3 * r['step_seconds']:.1f}", f"{r['compile_seconds']:.0f}")
            for r in rows
        ],
    )
    if not rows:
        return
    best = min(rows, key=lambda r: r["step_seconds"])["form"]
    with mock.patch.multiple(layers, **FORMS[best][0]):
        for loss in ("auto", "xla"):
            if left() <= 0:
                break
            config = gpu.paper_config(MODEL, seq_len, batch, 0.0, loss_impl=loss, microbatches=8)
            row = gpu.measure_train(MODEL, config, 5)
            record["train"].append({"form": best, **row})
            write_json(args.out, record, quiet=True)
            print(
                f"{MODEL} {batch} x {seq_len}, {row['loss_impl']} loss: "
                f"{1e3 * row['step_seconds']:.1f} ms, MFU {row['mfu']}"
            )
        if left() > 0:
            record["profile"] = {"form": best, **profile(options, args.out.parent)}
            write_json(args.out, record, quiet=True)
    write_json(args.out, record)


def profile(options, out: Path) -> dict:
    """``gpu.py``'s profile of lmu-1M's micro-batch, in the form patched in now; its Perfetto trace
    copied to ``out``."""
    folder = gpu.ROOT / "benchmarks" / "results" / f"profile-{slug(machine()['device_kind'])}"
    row = gpu.profile_one(MODEL, options, folder / f"{MODEL}-q-prime")
    for trace in (gpu.ROOT / row["trace"]).rglob("perfetto_trace.json.gz"):
        (out / f"profile-{MODEL}-q-prime.json.gz").write_bytes(trace.read_bytes())
    for op in row["top_ops"]:
        print(f"{op['ms']:8.2f} ms {op['count']:5.0f}  {op['op'][:80]}")
    return row


if __name__ == "__main__":
    main()
