"""Training time against sequence length, parallel LMU vs its recurrence (paper Fig. 1, right).

    python benchmarks/parallel_lmu_training.py [--lengths 250 500 1000 2000 4000]
        [--batch 16] [--repeats 5] [--out FILE]

One Adam training step of the psMNIST-style model (``experiments/psmnist.py``: a
``ParallelLMU`` with a 1-unit encoder, order 468, 346 relu units, theta = n, then a 10-way
softmax) on a batch of random sequences of length n, in three forms of the same function:
- final: only the last state, one contraction with the impulse response (eq 25; what the
  classifier trains with);
- fft:   every state by FFT convolution (eq 26), the output read at the last step;
- scan:  every state by the recurrence in ``lax.scan`` (eq 19, the paper's "LTI version").
Times are medians over --repeats steps after one warm-up (compile) step; the table gives each
mode's time per step and the speed-up of each parallel form over the scan.
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
import optax
from common import machine, print_table, versions, write_json

from lmuscale.layers import ParallelLMU

MODES = ("final", "fft", "scan")
ORDER, UNITS, CLASSES = 468, 346, 10


def model(mode: str, length: int):
    layer = ParallelLMU(
        units=UNITS,
        order=ORDER,
        theta=float(length),
        memory_dim=1,
        output_activation="relu",
        return_sequences=mode != "final",
        mode="scan" if mode == "scan" else "fft",
    )

    def logits(params, x_BxTx1):
        o = layer.apply(params["lmu"], x_BxTx1)
        o_BxO = o if mode == "final" else o[:, -1]
        return o_BxO @ params["head"]

    return layer, logits


def time_step(mode: str, length: int, batch: int, repeats: int) -> float:
    layer, logits = model(mode, length)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.random((batch, length, 1), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, CLASSES, batch))
    params = {
        "lmu": layer.init(jax.random.key(0), x[:1]),
        "head": jnp.zeros((UNITS, CLASSES)),
    }
    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(
            lambda p: optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()
        )(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = (params, optimizer.init(params))
    jax.block_until_ready(step(*state))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        *state, loss = step(*state)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[250, 500, 1000, 2000, 4000])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows, records = [], []
    for length in args.lengths:
        seconds = {m: time_step(m, length, args.batch, args.repeats) for m in args.modes}
        records.append({"length": length, "seconds_per_step": seconds})
        row = [length] + [f"{seconds[m] * 1e3:.1f}" for m in args.modes]
        if "scan" in seconds:
            row += [f"{seconds['scan'] / seconds[m]:.1f}x" for m in args.modes if m != "scan"]
        rows.append(tuple(row))
        print(
            f"n={length}: " + ", ".join(f"{m} {s * 1e3:.1f} ms" for m, s in seconds.items()),
            file=sys.stderr,
        )
    header = ["n"] + [f"{m} ms/step" for m in args.modes]
    if "scan" in args.modes:
        header += [f"{m} speed-up" for m in args.modes if m != "scan"]
    print_table(
        f"Parallel-LMU training step (batch {args.batch}, order {ORDER}, {UNITS} units) on "
        f"{jax.devices()[0].device_kind}",
        tuple(header),
        rows,
    )
    platform = jax.devices()[0].platform
    out = args.out or Path(__file__).parent / "results" / f"parallel_lmu_training-{platform}.json"
    write_json(
        out,
        {
            "benchmark": "parallel_lmu_training",
            "machine": machine(),
            "versions": versions(),
            "shapes": {"batch": args.batch, "order": ORDER, "units": UNITS, "classes": CLASSES},
            "repeats": args.repeats,
            "results": records,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
