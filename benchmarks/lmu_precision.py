"""The error of every parallel memory mode against the float64 recurrence, on this device.

    python benchmarks/lmu_precision.py [--batch 2] [--n 1024] [--channels 204] [--out FILE]

The paper's largest layer (q = 220, theta = 350; L of shape (3q', q) = (66, 220) for the
reduced memory) on random N(0, 1) inputs. Each mode's output is compared with
``lmu.memory_reference`` (numpy, float64): rms and max of |out - ref| relative to max |ref|,
and rms of |out - ref| / rms(ref). Modes: the FFT paths (complex64), and ``memory_chunked`` in
"exact" and "fast" precision for several chunk lengths. On a GPU, "exact" is also run with
each candidate dot algorithm (``--exact-algorithms``, ``lmu.EXACT_ALGORITHMS``), so the one
``ops.resolve`` takes here (``Impls.exact_algorithm``) can be checked against the others.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, print_table, versions, write_json

from lmuscale import lmu, ops
from lmuscale.models import named_config

ALGORITHMS = lmu.EXACT_ALGORITHMS


def errors(out, ref) -> dict:
    diff = np.abs(np.asarray(out, np.float64) - ref)
    peak = np.abs(ref).max()
    return {
        "max_rel_to_peak": float(diff.max() / peak),
        "rms_rel_to_peak": float(np.sqrt(np.mean(diff**2)) / peak),
        "rms_rel_to_rms": float(np.sqrt(np.mean(diff**2) / np.mean(ref**2))),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--channels", type=int, default=204)
    parser.add_argument("--order", type=int, default=220)
    parser.add_argument("--reduced", type=int, default=66, help="rows of L (3 q')")
    parser.add_argument("--theta", type=float, default=350.0)
    parser.add_argument("--chunks", nargs="+", type=int, default=[32, 64, 128])
    parser.add_argument(
        "--exact-algorithms",
        nargs="*",
        choices=sorted(ALGORITHMS),
        default=None,
        help="dot algorithms to try as 'exact' (default: none on CPU, all on an accelerator)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    info = machine()
    algorithms = args.exact_algorithms
    if algorithms is None:
        algorithms = [] if info["platform"] == "cpu" else sorted(ALGORITHMS)
    out = args.out or Path(__file__).parent / "results" / f"lmu_precision-{info['platform']}.json"

    rng = np.random.default_rng(0)
    q, theta, n = args.order, args.theta, args.n
    u64 = rng.standard_normal((args.batch, n, args.channels))
    l64 = rng.standard_normal((args.reduced, q)) / np.sqrt(q)
    start = time.perf_counter()
    ref_full = lmu.memory_reference(u64, q, theta)
    ref_reduced = ref_full @ l64.T
    print(f"float64 reference in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    u, l_KxQ = jnp.asarray(u64, jnp.float32), jnp.asarray(l64, jnp.float32)
    h = lmu.impulse_response(q, theta, n, dtype=np.float32)

    runs = {
        ("full", "fft (complex64)"): lambda: lmu.memory_fft(u, h),
        ("reduced", "fft (complex64)"): lambda: lmu.memory_reduced(u, h, l_KxQ),
    }
    default = ops.resolve(named_config("lmu-1M")).exact_algorithm  # a run's on this device
    for precision in lmu.PRECISIONS:
        for c in args.chunks:
            for kind, proj in (("full", None), ("reduced", l_KxQ)):
                runs[(kind, f"chunked {precision} c={c}")] = lambda proj=proj, c=c, p=precision: (
                    lmu.memory_chunked(
                        u, q, theta, proj, chunk=c, precision=p, exact_algorithm=default
                    )[0]
                )
    rows = []
    for (kind, mode), run in runs.items():
        result = jax.jit(run)()
        rows.append(
            {
                "memory": kind,
                "mode": mode,
                **errors(result, ref_full if kind == "full" else ref_reduced),
            }
        )
    for name in algorithms:
        for kind, proj in (("full", None), ("reduced", l_KxQ)):
            c = lmu.DEFAULT_CHUNK
            result = jax.jit(
                lambda proj=proj, c=c, name=name: lmu.memory_chunked(
                    u, q, theta, proj, chunk=c, exact_algorithm=name
                )[0]
            )()
            ref = ref_full if kind == "full" else ref_reduced
            rows.append(
                {"memory": kind, "mode": f"chunked exact={name} c={c}", **errors(result, ref)}
            )

    print_table(
        f"memory error against float64, n {n}, d {args.channels}, q {q}, 3q' {args.reduced} "
        f"({info['device_kind']}; exact here = {default})",
        ("memory", "mode", "max/peak", "rms/peak", "rms/rms"),
        [
            (
                r["memory"],
                r["mode"],
                f"{r['max_rel_to_peak']:.1e}",
                f"{r['rms_rel_to_peak']:.1e}",
                f"{r['rms_rel_to_rms']:.1e}",
            )
            for r in rows
        ],
        left=2,
    )
    write_json(
        out,
        {
            "benchmark": "lmu_precision",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": info,
            "versions": versions(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "exact_default": default,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
