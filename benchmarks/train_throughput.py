"""Tokens/s and MFU of the full train step (the one ``lmuscale.train`` runs), per model and n.

    python benchmarks/train_throughput.py [--families lmu lmu_g transformer]
        [--sizes 55k ... 1M] [--seq-lens 1024 4096 8192] [--tokens 65536]
        [--dtype float32|bfloat16] [--steps 5] [--microbatches 1] [--set KEY=VALUE ...]
        [--out FILE]

For each family, Table 3 size and sequence length n, it builds the jitted, donated train step of
``lmuscale.train.step`` (Adam, schedule, plateau scale, norms, the chunked loss) on a mesh of
all devices, with a batch of max(1, --tokens // n) sequences per step, and times --steps steps
after one warm-up (compile) step; tokens/s is the median. MFU = tokens/s x training FLOPs per
token (``flops_per_token(config, n).train``) / (devices x peak FLOP/s), with the peak from
``lmuscale.train.metrics.PEAK_FLOPS`` (or --peak-flops); none is known for CPUs. The
transformer's learned positions are sized to n. --microbatches splits each step's batch for
gradient accumulation. Each row also records XLA's memory and cost analysis of the compiled
step and the peak memory so far in the process (the device's peak bytes in use; the peak RSS
on a CPU): run one model per process for a clean peak. Failures (e.g. out of memory) are recorded,
not fatal.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from common import (
    compiled_figures,
    machine,
    peak_memory,
    print_table,
    timed_steps,
    train_step_for,
    versions,
    write_json,
)

from lmuscale.models import count_params, flops_per_token, named_config
from lmuscale.models.sizes import FAMILIES, SIZES
from lmuscale.train import step as step_lib
from lmuscale.train.metrics import device_peak, mfu


def parse_setting(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE a Python literal (a bare word is a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def measure(
    name: str,
    seq_len: int,
    batch: int,
    dtype: str,
    steps: int,
    peak,
    microbatches: int = 1,
    settings: dict | None = None,
) -> dict:
    positions = {"max_len": seq_len} if name.startswith("transformer") else {}
    config = named_config(name, dtype=dtype, **positions, **(settings or {}))
    train_step, init, mesh, _ = train_step_for(config, seq_len)
    data = step_lib.data_parallel_size(mesh)
    batch = max(batch, data) // data * data
    state = step_lib.init_state(init, mesh)
    rng = np.random.default_rng(0)
    micro = max(1, min(microbatches, batch))
    batch = batch // micro * micro
    shape = (micro, batch // micro, seq_len + 1)
    tokens = rng.integers(0, config.vocab_size, shape, dtype=np.int32)
    tokens = step_lib.to_global(tokens, step_lib.batch_sharding(mesh, 3, axis=1))
    train_step = train_step.lower(state, tokens).compile()
    figures = compiled_figures(train_step)
    start = time.perf_counter()
    state, metrics = train_step(state, tokens)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    state, times = timed_steps(train_step, state, tokens, steps)
    seconds = statistics.median(times)
    flops = flops_per_token(config, seq_len)
    speed = batch * seq_len / seconds
    return {
        "model": name,
        "seq_len": seq_len,
        "batch": batch,
        "microbatches": micro,
        "dtype": dtype,
        "settings": settings or {},
        "non_embedding_params": count_params(config).non_embedding,
        "train_flops_per_token": flops.train,
        "step_seconds": seconds,
        "step_seconds_all": times,
        "first_step_seconds": compile_s,
        "tokens_per_second": speed,
        "mfu": mfu(speed, flops.train, mesh.devices.size, peak),
        "loss": float(metrics["loss"]),
        "compiled": figures,
        "peak_bytes_in_use": peak_memory(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 8192])
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per step")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=1, help="gradient accumulation")
    parser.add_argument(
        "--set",
        nargs="+",
        type=parse_setting,
        default=[],
        metavar="KEY=VALUE",
        help="model config fields for every model (e.g. batch_chunk=0 memory_mode=fft)",
    )
    parser.add_argument("--peak-flops", type=float, default=0.0, help="per device")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    peak = device_peak(args.dtype, args.peak_flops)
    results, rows = [], []
    for seq_len in args.seq_lens:
        for family in args.families:
            for size in args.sizes:
                name = f"{family}-{size}"
                batch = max(1, args.tokens // seq_len)
                try:
                    r = measure(
                        name,
                        seq_len,
                        batch,
                        args.dtype,
                        args.steps,
                        peak,
                        args.microbatches,
                        dict(args.set),
                    )
                except Exception as error:  # an OOM on one model must not lose the others
                    r = {"model": name, "seq_len": seq_len, "batch": batch, "error": repr(error)}
                results.append(r)
                if "error" in r:
                    rows.append((name, seq_len, batch, "-", "-", "-", r["error"][:60]))
                else:
                    rows.append(
                        (
                            name,
                            seq_len,
                            r["batch"],
                            f"{r['step_seconds'] * 1e3:,.1f}",
                            f"{r['tokens_per_second']:,.0f}",
                            "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                            "",
                        )
                    )
                print(*rows[-1], flush=True)
    info = machine()
    print_table(
        f"train step on {jax.device_count()} x {info['device_kind']} ({args.dtype})",
        ("model", "n", "batch", "ms/step", "tokens/s", "MFU", "error"),
        rows,
    )
    kind = info["platform"]
    out = args.out or Path(__file__).parent / "results" / f"train_throughput-{kind}.json"
    write_json(
        out,
        {
            "benchmark": "train_throughput",
            "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": info,
            "versions": versions(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "peak_flops": peak,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
