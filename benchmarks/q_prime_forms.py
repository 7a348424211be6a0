"""Experiment: lmu-1M's micro-batch step on a GPU under each form of the channels-last
attention's q' x q' sums (layers.Q_PRIME_FORM, layers.SCORES_FORM), then the best form's
paper step (512 x 1024, 8 micro-batches) and its profile. Writes $OUT/q_prime_forms.json."""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
import gpu
import jax
from common import machine, timed_steps, versions, write_json

from lmuscale import layers

START = time.perf_counter()
BUDGET = float(sys.argv[1]) if len(sys.argv) > 1 else 230.0
OUT = Path(os.environ.get("OUT", "benchmarks/results"))
FORMS = [
    ("broadcast", "reduce"),
    ("dots", "reduce"),
    ("rows66", "reduce"),
    ("dots", "dots"),
    ("broadcast", "dots"),
    ("rows66", "dots"),
]
SMOKE = bool(os.environ.get("SMOKE"))  # a CPU check of this script at tiny shapes
SEQ, MICRO, BATCH = (64, 1, 8) if SMOKE else (1024, 64, 512)
args = argparse.Namespace(
    seq_len=SEQ, profile_batch=MICRO, budget_gb=0.0, profile_steps=3, profile_top=20
)
if SMOKE:
    layers.channels_last_memory = lambda: True
record = {"machine": machine(), "versions": versions(), "micro_batch": [], "train": []}


def left() -> float:
    return BUDGET - (time.perf_counter() - START)


def forms(q, s):
    return mock.patch.multiple(layers, Q_PRIME_FORM=q, SCORES_FORM=s)


for q, s in FORMS:
    if left() < 20:
        break
    try:
        t0 = time.perf_counter()
        with forms(q, s):
            compiled, state, tokens = gpu.micro_batch_step("lmu-1M", args)
        compile_s = time.perf_counter() - t0
        state, first = timed_steps(compiled, state, tokens, 2)
        state, times = timed_steps(compiled, state, tokens, 10)
        row = {
            "q_prime": q,
            "scores": s,
            "compile_seconds": compile_s,
            "step_seconds": statistics.median(times),
            "step_seconds_all": times,
        }
    except Exception as error:  # one form's failure leaves the others
        row = {"q_prime": q, "scores": s, "error": repr(error)[:2000]}
    record["micro_batch"].append(row)
    write_json(OUT / "q_prime_forms.json", record, quiet=True)
    print(
        q,
        s,
        row.get("step_seconds", row.get("error")),
        f"({time.perf_counter() - START:.0f} s)",
        flush=True,
    )

timed = [r for r in record["micro_batch"] if "step_seconds" in r]
best = min(timed, key=lambda r: r["step_seconds"])
best_forms = (best["q_prime"], best["scores"])
record["best"] = best_forms
for loss in ("pallas", "xla"):
    if left() < 45:
        break
    config = gpu.paper_config("lmu-1M", SEQ, BATCH, 0.0, loss_impl=loss, microbatches=8)
    try:
        with forms(*best_forms):
            row = gpu.measure_train("lmu-1M", config, 5)
    except Exception as error:
        row = {"loss_impl": loss, "error": repr(error)[:2000]}
    row["forms"] = best_forms
    record["train"].append(row)
    write_json(OUT / "q_prime_forms.json", record, quiet=True)
    print(
        "train",
        loss,
        row.get("step_seconds"),
        row.get("mfu"),
        f"({time.perf_counter() - START:.0f} s)",
        flush=True,
    )

if left() > 25:
    folder = Path("/tmp/profile-best")
    with forms(*best_forms):
        compiled, state, tokens = gpu.micro_batch_step("lmu-1M", args)
    state, _ = timed_steps(compiled, state, tokens, 2)
    jax.profiler.start_trace(str(folder), create_perfetto_trace=True)
    try:
        state, times = timed_steps(compiled, state, tokens, args.profile_steps)
    finally:
        jax.profiler.stop_trace()
    ops = gpu.top_operations(folder, args.profile_steps, gpu.hlo_sources(compiled.as_text()))
    record["profile"] = {
        "forms": best_forms,
        "step_seconds": statistics.median(times),
        "traced_ms_per_step": sum(op["ms"] for op in ops),
        "top_ops": ops[:25],
    }
    write_json(OUT / "q_prime_forms.json", record, quiet=True)
    for trace in folder.rglob("perfetto_trace.json.gz"):
        (OUT / "profile-lmu-1M-best.json.gz").write_bytes(trace.read_bytes())
    for op in ops[:25]:
        print(f"{op['ms']:8.2f} {op['count']:5.0f} {op['op'][:70]}")
print(f"done in {time.perf_counter() - START:.0f} s")
