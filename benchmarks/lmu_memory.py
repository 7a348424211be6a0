"""Time the LMU memory: every parallel mode against the lax.scan recurrence, forward and backward.

    python benchmarks/lmu_memory.py [--batch 1] [--shapes paper long] [--modes ...]
        [--chunks 32 64 128] [--precisions exact fast] [--block] [--repeats 5] [--out FILE]

Shapes (channels d, order q, reduced order q', window theta = 350):
- paper: the paper's largest layer, n = 1024, d = 204, q = 220, q' = 22 (Table 3, 1M row);
- long:  the same layer at n = 8192.

Modes (the full memory (B, n, d, q), or the reduced one (B, n, d, 3q') that the implicit
attention uses, L of shape (3q', q) for Q, K and V together):
- scan:     the full memory by the recurrence (the baseline);
- fft:      the full memory by FFT convolution;
- chunked:  the full memory by ``lmu.memory_chunked`` (L = I), per chunk c and precision;
- reduced:  the reduced memory by FFT (``lmu.memory_reduced``, appendix A.1);
- reduced_chunked: the reduced memory by ``lmu.memory_chunked``, per chunk c and precision;
- final:    the last state only (B, d, q), one contraction.

Forward+backward is the gradient of 0.5 * sum(output^2) with respect to the input (and to L for
the reduced modes). Times are medians over --repeats runs after one warm-up (compile) run; the
table gives each mode's speed-up over the scan (or over reduced, the FFT path, for the reduced
modes) and XLA's ``cost_analysis()`` bytes accessed of the compiled function. A scan body is
counted once by XLA, so the scan's bytes are not comparable. --block also times one whole
``LMUBlock`` of the 1M model (FFN, implicit attention, FFN) per memory mode on (batch, n, d).
The JSON holds the machine, versions, shapes and every time.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, print_table, versions, write_json

from lmuscale import lmu
from lmuscale.models import named_config
from lmuscale.models.lmu import LMUBlock

SHAPES = {
    "paper": {"n": 1024, "d": 204, "q": 220, "q_prime": 22, "theta": 350.0},
    "long": {"n": 8192, "d": 204, "q": 220, "q_prime": 22, "theta": 350.0},
}
MODES = ("scan", "fft", "chunked", "reduced", "reduced_chunked", "final")


def mode_functions(shape: dict, modes, chunks, precisions) -> dict:
    """For each mode name, ``(fn, reduced)``: a function of (u, L) returning its output."""
    q, theta, n = shape["q"], shape["theta"], shape["n"]
    h = lmu.impulse_response(q, theta, n, dtype=np.float32)
    abar, bbar = lmu.discretize(q, theta, dtype=np.float32)
    functions = {
        "scan": (lambda u, l_KxQ: lmu.memory_scan(u, abar, bbar), False),
        "fft": (lambda u, l_KxQ: lmu.memory_fft(u, h), False),
        "reduced": (lambda u, l_KxQ: lmu.memory_reduced(u, h, l_KxQ), True),
        "final": (lambda u, l_KxQ: lmu.memory_final(u, h), False),
    }
    for precision in precisions:
        for c in chunks:

            def full(u, l_KxQ, c=c, precision=precision):
                return lmu.memory_chunked(u, q, theta, chunk=c, precision=precision)[0]

            def reduced(u, l_KxQ, c=c, precision=precision):
                return lmu.memory_chunked(u, q, theta, l_KxQ, chunk=c, precision=precision)[0]

            functions[f"chunked/{precision}/{c}"] = (full, False)
            functions[f"reduced_chunked/{precision}/{c}"] = (reduced, True)
    return {name: value for name, value in functions.items() if name.split("/")[0] in set(modes)}


def time_call(jitted, args, repeats: int) -> dict:
    """Compile once, then time: first (warm-up) run and the median of ``repeats`` more.

    Also XLA's bytes accessed of the compiled function.
    """
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return {
        "compile_s": compile_s,
        "first_s": first,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "bytes_accessed": cost.get("bytes accessed") if cost else None,
    }


def time_phases(label: str, forward, backward, args, repeats: int) -> dict:
    """``{"forward": ..., "forward_backward": ...}`` timings; a failure (an out-of-memory in one
    mode, say) is recorded in its phase rather than raised, so the other modes still run."""
    phases = {}
    for phase, jitted in (("forward", forward), ("forward_backward", backward)):
        try:
            phases[phase] = time_call(jitted, args, repeats)
        except Exception as error:
            phases[phase] = {"error": repr(error)[:300]}
    print(
        f"  {label:<31} fwd {_ms(phases['forward'])} ms   "
        f"fwd+bwd {_ms(phases['forward_backward'])} ms",
        file=sys.stderr,
        flush=True,
    )
    return phases


def bench_shape(name, shape, batch, repeats, modes, chunks, precisions) -> list[dict]:
    rng = np.random.default_rng(0)
    u = jnp.asarray(rng.standard_normal((batch, shape["n"], shape["d"])), jnp.float32)
    l_KxQ = jnp.asarray(
        rng.standard_normal((3 * shape["q_prime"], shape["q"])) / np.sqrt(shape["q"]),
        jnp.float32,
    )
    rows = []
    for mode, (fn, reduced) in mode_functions(shape, modes, chunks, precisions).items():

        def loss(u, l_KxQ, fn=fn):
            return 0.5 * jnp.sum(jnp.square(fn(u, l_KxQ)))

        forward = jax.jit(fn)
        backward = jax.jit(jax.grad(loss, argnums=(0, 1) if reduced else 0))
        row = {"shape": name, "mode": mode, "reduced": reduced}
        row["output"] = list(jax.eval_shape(fn, u, l_KxQ).shape)
        row.update(time_phases(f"{name:<6} {mode}", forward, backward, (u, l_KxQ), repeats))
        rows.append(row)
    add_speedups(rows)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """Each row's speed-up over its baseline: scan for the full memory, the FFT for reduced."""
    for row in rows:
        base_mode = "reduced" if row["reduced"] else "scan"
        base = next(
            (r for r in rows if r["shape"] == row["shape"] and r["mode"] == base_mode), None
        )
        for phase in ("forward", "forward_backward"):
            ok = base and "median_s" in base[phase] and "median_s" in row[phase]
            row[phase]["speedup"] = base[phase]["median_s"] / row[phase]["median_s"] if ok else None
            row[phase]["baseline"] = base_mode


def bench_block(shape: dict, batch: int, repeats: int, chunks, dtype: str) -> list[dict]:
    """One LMUBlock of the 1M model, forward+backward, per memory mode."""
    rng = np.random.default_rng(0)
    config = named_config("lmu-1M", dtype=dtype, batch_chunk=0)  # the paper's largest block
    x = jnp.asarray(rng.standard_normal((batch, shape["n"], config.d)), jnp.float32)
    rows = []
    variants = [("fft", lmu.DEFAULT_CHUNK)] + [("chunked", c) for c in chunks]
    for memory_mode, c in variants:
        block = LMUBlock(dataclasses.replace(config, memory_mode=memory_mode, memory_chunk=c))
        params = block.init(jax.random.key(0), x[:1, :8])

        def loss(params, x, block=block):
            return 0.5 * jnp.sum(jnp.square(block.apply(params, x).astype(jnp.float32)))

        name = "fft" if memory_mode == "fft" else f"chunked/{c}"
        forward = jax.jit(block.apply)
        backward = jax.jit(jax.grad(loss, argnums=(0, 1)))
        row = {"mode": name, "batch": batch, "n": shape["n"], "dtype": dtype}
        row.update(time_phases(f"block  {name}", forward, backward, (params, x), repeats))
        rows.append(row)
    return rows


def _ms(phase: dict) -> str:
    return f"{phase['median_s'] * 1e3:10.2f}" if "median_s" in phase else "     error"


def _gb(phase: dict) -> str:
    value = phase.get("bytes_accessed")
    return "-" if value is None else f"{value / 1e9:.2f}"


def print_rows(rows: list[dict], block_rows: list[dict], batch: int) -> None:
    def speedup(phase):
        value = phase.get("speedup")
        return "-" if value is None else f"{value:.1f}x"

    header = ("shape", "mode", "output", "fwd ms", "speed-up", "fwd+bwd ms", "speed-up", "GB")
    table = [
        (
            r["shape"],
            r["mode"],
            "x".join(map(str, r["output"])),
            _ms(r["forward"]).strip(),
            speedup(r["forward"]),
            _ms(r["forward_backward"]).strip(),
            speedup(r["forward_backward"]),
            _gb(r["forward_backward"]),
        )
        for r in rows
    ]
    print_table(
        f"LMU memory, batch {batch}, float32 input, median times; speed-up over scan (full "
        "memory) or over reduced (the FFT path); GB = bytes accessed of fwd+bwd",
        header,
        table,
        left=3,
    )
    if block_rows:
        table = [
            (
                r["mode"],
                f"{r['batch']}x{r['n']}",
                r["dtype"],
                _ms(r["forward"]).strip(),
                _ms(r["forward_backward"]).strip(),
                _gb(r["forward_backward"]),
            )
            for r in block_rows
        ]
        print_table(
            "One LMU block of lmu-1M (d 204, q 220, q' 22), median times",
            ("memory", "input", "dtype", "fwd ms", "fwd+bwd ms", "GB"),
            table,
            left=3,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1, help="sequences per call")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["paper", "long"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--chunks", nargs="+", type=int, default=[32, 64, 128])
    parser.add_argument("--precisions", nargs="+", choices=lmu.PRECISIONS, default=["exact"])
    parser.add_argument("--block", action="store_true", help="also time one LMU block")
    parser.add_argument("--block-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after the warm-up")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.repeats < 1 or min(args.chunks) < 1:
        parser.error("--batch, --repeats and --chunks must be >= 1")

    info = machine()
    out = args.out or Path(__file__).parent / "results" / f"lmu_memory-{info['platform']}.json"
    print(
        f"device: {info['device_kind']} ({info['platform']}), batch {args.batch}", file=sys.stderr
    )
    rows, block_rows = [], []
    for name in args.shapes:
        shape = SHAPES[name]
        rows += bench_shape(
            name, shape, args.batch, args.repeats, args.modes, args.chunks, args.precisions
        )
        if args.block:
            block_rows += bench_block(
                shape, args.batch, args.repeats, args.chunks, args.block_dtype
            )
    print_rows(rows, block_rows, args.batch)

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
        "block": block_rows,
    }
    write_json(out, record)


if __name__ == "__main__":
    main()
