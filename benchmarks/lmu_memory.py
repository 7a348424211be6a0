"""Time the LMU memory: every parallel mode against the lax.scan recurrence, forward and backward.

    python benchmarks/lmu_memory.py [--batch 1] [--shapes paper long] [--repeats 5] [--out FILE]

Shapes (channels d, order q, reduced order q', window theta = 350):
- paper: the paper's largest layer, n = 1024, d = 204, q = 220, q' = 22 (Table 3, 1M row);
- long:  the same layer at n = 8192.

Modes:
- scan:    the full memory (B, n, d, q) by the recurrence (the baseline);
- fft:     the full memory by FFT convolution;
- reduced: the reduced-order memory for Q, K and V together, L of shape (3q', q), by FFT
           (appendix A.1; what the implicit attention uses);
- final:   the last state only (B, d, q), one contraction.

Forward+backward is the gradient of 0.5 * sum(output^2) with respect to the input (and to L for
the reduced mode). Times are medians over --repeats runs after one warm-up (compile) run. The
table gives each mode's speed-up over the scan; the JSON holds the machine, versions, shapes
and every time, so two runs can be compared as a ratio.
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
from common import machine, print_table, versions, write_json

from lmuscale import lmu

SHAPES = {
    "paper": {"n": 1024, "d": 204, "q": 220, "q_prime": 22, "theta": 350.0},
    "long": {"n": 8192, "d": 204, "q": 220, "q_prime": 22, "theta": 350.0},
}
MODES = ("scan", "fft", "reduced", "final")


def mode_functions(shape: dict) -> dict:
    """For each mode, a function of (u, L) returning its output."""
    h = lmu.impulse_response(shape["q"], shape["theta"], shape["n"], dtype=np.float32)
    abar, bbar = lmu.discretize(shape["q"], shape["theta"], dtype=np.float32)
    return {
        "scan": lambda u, l_KxQ: lmu.memory_scan(u, abar, bbar),
        "fft": lambda u, l_KxQ: lmu.memory_fft(u, h),
        "reduced": lambda u, l_KxQ: lmu.memory_reduced(u, h, l_KxQ),
        "final": lambda u, l_KxQ: lmu.memory_final(u, h),
    }


def time_call(fn, args, repeats: int) -> dict:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return {"first_s": first, "median_s": statistics.median(times), "min_s": min(times)}


def bench_shape(name: str, shape: dict, batch: int, repeats: int, modes) -> list[dict]:
    rng = np.random.default_rng(0)
    u = jnp.asarray(rng.standard_normal((batch, shape["n"], shape["d"])), jnp.float32)
    l_KxQ = jnp.asarray(
        rng.standard_normal((3 * shape["q_prime"], shape["q"])) / np.sqrt(shape["q"]),
        jnp.float32,
    )
    rows = []
    for mode, fn in mode_functions(shape).items():
        if mode not in modes:
            continue

        def loss(u, l_KxQ, fn=fn):
            return 0.5 * jnp.sum(jnp.square(fn(u, l_KxQ)))

        argnums = (0, 1) if mode == "reduced" else 0
        forward = jax.jit(fn)
        backward = jax.jit(jax.grad(loss, argnums=argnums))
        out_shape = jax.eval_shape(fn, u, l_KxQ).shape
        row = {"shape": name, "mode": mode, "output": list(out_shape)}
        row["forward"] = time_call(forward, (u, l_KxQ), repeats)
        row["forward_backward"] = time_call(backward, (u, l_KxQ), repeats)
        print(
            f"  {name:<6} {mode:<8} fwd {row['forward']['median_s'] * 1e3:10.2f} ms   "
            f"fwd+bwd {row['forward_backward']['median_s'] * 1e3:10.2f} ms",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    baseline = {r["shape"]: r for r in rows if r["mode"] == "scan"}
    for row in rows:
        base = baseline.get(row["shape"])
        for phase in ("forward", "forward_backward"):
            row[phase]["speedup_vs_scan"] = (
                base[phase]["median_s"] / row[phase]["median_s"] if base else None
            )
    return rows


def print_rows(rows: list[dict], batch: int) -> None:
    def fmt(seconds):
        return f"{seconds * 1e3:.2f}"

    def speedup(value):
        return "-" if value is None else f"{value:.1f}x"

    header = ("shape", "mode", "output", "fwd ms", "vs scan", "fwd+bwd ms", "vs scan")
    table = [
        (
            r["shape"],
            r["mode"],
            "x".join(map(str, r["output"])),
            fmt(r["forward"]["median_s"]),
            speedup(r["forward"]["speedup_vs_scan"]),
            fmt(r["forward_backward"]["median_s"]),
            speedup(r["forward_backward"]["speedup_vs_scan"]),
        )
        for r in rows
    ]
    print_table(f"LMU memory, batch {batch}, float32, median times", header, table, left=3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1, help="sequences per call")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["paper", "long"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after the warm-up")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.repeats < 1:
        parser.error("--batch and --repeats must be >= 1")

    info = machine()
    out = args.out or Path(__file__).parent / "results" / f"lmu_memory-{info['platform']}.json"
    print(
        f"device: {info['device_kind']} ({info['platform']}), batch {args.batch}", file=sys.stderr
    )
    rows = []
    for name in args.shapes:
        rows += bench_shape(name, SHAPES[name], args.batch, args.repeats, args.modes)
    print_rows(rows, args.batch)

    record = {
        "benchmark": "lmu_memory",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "versions": versions(),
        "batch": args.batch,
        "repeats": args.repeats,
        "dtype": "float32",
        "shapes": {name: SHAPES[name] for name in args.shapes},
        "results": rows,
    }
    write_json(out, record)


if __name__ == "__main__":
    main()
