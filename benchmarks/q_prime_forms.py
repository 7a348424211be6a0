"""The channels-last attention's q' x q' products on a GPU, asking XLA for each precision of
``ops.Impls.q_prime_precision``.

    python benchmarks/q_prime_forms.py [--budget SECONDS] [--steps 10] [--forms FORM ...]
        [--out benchmarks/results/q_prime_forms.json]

Compiles lmu-1M's paper train step for one micro-batch of 64 x 1024 tokens (as
``gpu.py``'s profile part), its ops as a run resolves them with the memory written channels
last: the attention's scores and its gradient's dgelu(Q), dgelu(K) are matrix products
batched over the positions with bf16 operands summed in float32, asking XLA for its highest
precision ("products", a run's) or its default ("products, default precision": the same
sums, not yet timed), and times --steps steps of each (the median); then, where --budget
allows, the paper step at 512 x 1024 in 8 micro-batches in the faster form, with the
cross-entropy "auto" picks and with XLA's, and a ``jax.profiler`` trace of its micro-batch
(the top operations, and the trace as ``profile-<model>-q-prime.json.gz`` beside --out).
Each row is written as soon as it is timed. The earlier forms' measurements (sums over
broadcast products, float32 operands: results/q_prime_forms-h100.json, -h200.json) are in
the README. ``SMOKE=1`` runs the script on a CPU at tiny shapes, with the GPU's layout, to
check it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu
from common import machine, print_table, slug, timed_steps, versions, write_json

from lmuscale import ops
from lmuscale.train import config as config_lib

# Each form: what its ops run besides what a run resolves (``ops.Impls``'s fields), the memory
# written channels last on any backend.
FORMS = {
    "products": {"memory_layout": "channels-last"},
    "products, default precision": {
        "memory_layout": "channels-last",
        "q_prime_precision": "default",
    },
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
        settings = FORMS[form]
        compile_start = time.perf_counter()
        try:
            compiled, state, tokens = gpu.micro_batch_step(MODEL, options, **settings)
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
    for loss in ("auto", "xla"):
        if left() <= 0:
            break
        config = gpu.paper_config(MODEL, seq_len, batch, 0.0, loss_impl=loss, microbatches=8)
        resolved = ops.resolve(config_lib.model_config(config.model))
        row = gpu.measure_train(MODEL, config, 5, dataclasses.replace(resolved, **FORMS[best]))
        record["train"].append({"form": best, **row})
        write_json(args.out, record, quiet=True)
        print(
            f"{MODEL} {batch} x {seq_len}, {row['loss_impl']} loss: "
            f"{1e3 * row['step_seconds']:.1f} ms, MFU {row['mfu']}"
        )
    if left() > 0:
        record["profile"] = {"form": best, **profile(options, args.out.parent, FORMS[best])}
        write_json(args.out, record, quiet=True)
    write_json(args.out, record)


def profile(options, out: Path, impls: dict) -> dict:
    """``gpu.py``'s profile of lmu-1M's micro-batch, its ops changed by ``impls``; its Perfetto
    trace copied to ``out``."""
    folder = gpu.ROOT / "benchmarks" / "results" / f"profile-{slug(machine()['device_kind'])}"
    row = gpu.profile_one(MODEL, options, folder / f"{MODEL}-q-prime", **impls)
    for trace in (gpu.ROOT / row["trace"]).rglob("perfetto_trace.json.gz"):
        (out / f"profile-{MODEL}-q-prime.json.gz").write_bytes(trace.read_bytes())
    for op in row["top_ops"]:
        print(f"{op['ms']:8.2f} ms {op['count']:5.0f}  {op['op'][:80]}")
    return row


if __name__ == "__main__":
    main()
