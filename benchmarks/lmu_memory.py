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
``LMUBlock`` of the 1M model (FFN, implicit attention, FFN) on (batch, n, d) in each of
--block-dtypes: the FFT memory, and per chunk the XLA chunked path as a run resolves it here
(on a GPU one product written channels last), in each layout, and on a GPU through the LMU
layer's kernels (``bench_block``), with TFLOP/s by ``block_flops``.
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

from lmuscale import lmu, ops
from lmuscale.models import named_config
from lmuscale.models.lmu import LMUBlock

SHAPES = {
    "paper": {"n": 1024, "d": 204, "q": 220, "q_prime": 22, "theta": 350.0},
    "long": {"n": 8192, "d": 204, "q": 220, "q_prime": 22, "theta": 350.0},
}
MODES = ("scan", "fft", "chunked", "reduced", "reduced_chunked", "final")


def mode_functions(shape: dict, modes, chunks, precisions) -> dict:
    """For each mode name, ``(fn, reduced)``: a function of (u, L) returning its output; the
    chunked memory's exact products as a run here would compute them (``ops.resolve``)."""
    q, theta, n = shape["q"], shape["theta"], shape["n"]
    exact = {"exact_algorithm": ops.resolve(named_config("lmu-1M")).exact_algorithm}
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
                return lmu.memory_chunked(u, q, theta, chunk=c, precision=precision, **exact)[0]

            def reduced(u, l_KxQ, c=c, precision=precision):
                args = (u, q, theta, l_KxQ)
                return lmu.memory_chunked(*args, chunk=c, precision=precision, **exact)[0]

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


# The block's memories: the FFT, and the chunked one in XLA as a run here resolves it ("xla")
# or in either layout (``ops.Impls.memory_layout``) on any backend, or on a GPU through the
# LMU layer's kernels ("pallas").
BLOCK_IMPLS = ("fft", "xla", "steps-last", "channels-last", "pallas")


def block_flops(config, batch: int, n: int, chunk: int) -> float:
    """One LMUBlock's forward FLOPs by the chunked algorithm, unpadded: the three chunk
    products 2 (c + q) 3q' per channel and position, the chunk states and their passing, the
    attention's sums (scores 2 d q'^2, w 2 q'^2, output 2 d q') and the two FFNs (4 d d' per
    token each). The same count for the XLA path and the kernels, so their TFLOP/s compare as
    speeds; forward+backward counts 3x."""
    d, q, k = config.d, config.q, config.q_prime
    c = min(chunk, n)
    chunks = -(-n // c)
    positions = batch * chunks * c
    products = 2 * positions * d * (c + q) * 3 * k
    states = 2 * positions * d * q + 2 * batch * chunks * d * q * q
    attention = positions * (2 * d * k * k + 2 * k * k + 2 * d * k)
    ffns = 4 * batch * n * d * (config.pre_ffn_dim + config.post_ffn_dim)
    return float(products + states + attention + ffns)


def _largest_differences(got, want) -> dict:
    """A variant's output and gradients against the XLA path's at the same inputs: the largest
    absolute difference over the largest magnitude, of the output and of any gradient."""

    def relative(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

    (out, grads), (out_want, grads_want) = got, want
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(grads_want), strict=True)
    return {
        "output_max_diff_rel_to_max": relative(out, out_want),
        "grad_max_diff_rel_to_max": max(relative(a, b) for a, b in pairs),
    }


def bench_block(
    shape: dict, batch: int, repeats: int, chunks, dtypes, impls=BLOCK_IMPLS, model="lmu-1M"
) -> list[dict]:
    """One LMUBlock of ``model``, forward and forward+backward, per memory: the FFT ("fft"),
    the chunked products and attention in XLA as a run here resolves them ("xla": on a GPU
    one product written channels last, elsewhere three in the steps-last layout), or in
    either layout on any backend ("steps-last", "channels-last"), or on a GPU through the
    LMU layer's kernels ("pallas", ``ops.memory_pallas``), for each chunk and dtype.
    Rows: ``mode`` ("fft", "chunked/C", "steps-last/C", "channels-last/C" or "pallas/C"),
    ``impl``, ``chunk``, the ops as they ran (``ops.Impls.record``), times (``time_phases``),
    TFLOP/s by ``block_flops`` for the chunked rows, and for the layouts and the kernels their
    largest differences from the "xla" row at the same chunk."""
    rng = np.random.default_rng(0)
    rows = []
    for dtype in dtypes:
        config = named_config(model, dtype=dtype, batch_chunk=0)
        resolved = ops.resolve(config)
        x = jnp.asarray(rng.standard_normal((batch, shape["n"], config.d)), jnp.float32)
        variants = [("fft", lmu.DEFAULT_CHUNK)] * ("fft" in impls)
        chunked = ("xla", "steps-last", "channels-last", "pallas")
        variants += [(impl, c) for c in chunks for impl in chunked if impl in impls]
        outputs = {}  # the XLA path's output and gradients in this dtype, per chunk
        for impl, c in variants:
            name = "fft" if impl == "fft" else f"{'chunked' if impl == 'xla' else impl}/{c}"
            if impl == "pallas" and jax.default_backend() != "gpu":
                print(f"block  {name} {dtype}: the LMU layer's kernels need a GPU; not timed")
                continue
            if impl == "pallas":  # the state and attention kernels around XLA's products
                changes = {"memory": "pallas", "memory_layout": "channels-last"}
            else:
                layout = impl if impl.endswith("-last") else resolved.memory_layout
                changes = {"memory_layout": layout}
            block_impls = dataclasses.replace(resolved, **changes)
            row = {"mode": name, "impl": impl, "chunk": c, "batch": batch, "n": shape["n"]}
            row.update(dtype=dtype, **block_impls.record())
            mode = "fft" if impl == "fft" else "chunked"
            block_config = dataclasses.replace(config, memory_chunk=c, memory_mode=mode)
            block = LMUBlock(block_config, block_impls)
            params = block.init(jax.random.key(0), x[:1, :8])  # the same values for every row

            def loss(params, x, block=block):
                return 0.5 * jnp.sum(jnp.square(block.apply(params, x).astype(jnp.float32)))

            forward = jax.jit(block.apply)
            backward = jax.jit(jax.grad(loss, argnums=(0, 1)))
            row.update(
                time_phases(f"block  {name} {dtype}", forward, backward, (params, x), repeats)
            )
            if impl != "fft" and "error" not in row["forward_backward"]:
                try:
                    result = (forward(params, x), backward(params, x))
                    if impl == "xla":
                        outputs[c] = result
                    elif c in outputs:
                        row.update(_largest_differences(result, outputs[c]))
                except Exception as error:  # an out-of-memory holding both: say so
                    row["comparison_error"] = f"{type(error).__name__}: {error}"[:300]
            if impl != "fft":
                flops = block_flops(config, batch, shape["n"], c)
                row["forward_flops"] = flops
                for phase, count in (("forward", flops), ("forward_backward", 3 * flops)):
                    if "median_s" in row[phase]:
                        row[phase]["tflops_per_s"] = count / row[phase]["median_s"] / 1e12
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
        print_block_rows(block_rows, "One LMU block of lmu-1M (d 204, q 220, q' 22), median times")


def _tflops(phase: dict) -> str:
    value = phase.get("tflops_per_s")
    return "-" if value is None else f"{value:.3g}"


def print_block_rows(block_rows: list[dict], title: str) -> None:
    """The block rows as a table: times, TFLOP/s (``block_flops``), XLA's bytes, and each
    variant's largest differences from the XLA path (or why a row did not run)."""
    table = []
    for r in block_rows:
        if "skipped" in r:
            cells = ("-",) * 5
            note = r["skipped"]
        else:
            cells = (
                _ms(r["forward"]).strip(),
                _tflops(r["forward"]),
                _ms(r["forward_backward"]).strip(),
                _tflops(r["forward_backward"]),
                _gb(r["forward_backward"]),
            )
            note = r.get("comparison_error", "")
            if "output_max_diff_rel_to_max" in r:
                out, grads = r["output_max_diff_rel_to_max"], r["grad_max_diff_rel_to_max"]
                note = f"out {out:.1e}, grads {grads:.1e}"
        table.append((r["mode"], f"{r['batch']}x{r['n']}", r["dtype"], *cells, note[:70]))
    header = ("memory", "input", "dtype", "fwd ms", "TFLOP/s", "fwd+bwd ms", "TFLOP/s", "GB")
    print_table(title, (*header, "vs xla"), table, left=3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1, help="sequences per call")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["paper", "long"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--chunks", nargs="+", type=int, default=[32, 64, 128])
    parser.add_argument("--precisions", nargs="+", choices=lmu.PRECISIONS, default=["exact"])
    parser.add_argument("--block", action="store_true", help="also time one LMU block")
    parser.add_argument(
        "--block-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"]
    )
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
                shape, args.batch, args.repeats, args.chunks, args.block_dtypes
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
