"""Training time against sequence length, parallel LMU vs its recurrence (paper Fig. 1, right).

    python benchmarks/parallel_lmu_training.py [--lengths 250 500 1000 2000 4000]
        [--batch 16] [--repeats 5] [--out FILE]

One Adam training step of the psMNIST model's computation (``experiments/psmnist.py``: eqs
18-20 with a 1-unit encoder, order 468, 346 relu units read at the last step, theta = n, then
a 10-way softmax), written out here with ``lmuscale.lmu``'s memory functions so that the three
forms differ only in how they reach the last state, on random sequences of length n:
- final: only the last state, one contraction with the impulse response (eq 25; what the
  classifier trains with);
- fft:   every state by FFT convolution (eq 26), then the last one;
- scan:  every state by the recurrence in ``lax.scan`` (eq 19, the paper's "LTI version"),
  then the last one.
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

from lmuscale import lmu

MODES = ("final", "fft", "scan")
ORDER, UNITS, CLASSES = 468, 346, 10


def logits_fn(mode: str, length: int):
    """The classifier's logits with the memory in ``mode``; only the last state is read out
    in every mode, so the modes differ in how they reach it and nothing else."""
    h_TxQ = lmu.impulse_response(ORDER, float(length), length, dtype=np.float32)
    abar, bbar = lmu.discretize(ORDER, float(length), dtype=np.float32)

    def logits(params, x_BxTx1):
        u_BxTx1 = x_BxTx1 * params["encoder"][0] + params["encoder"][1]
        if mode == "final":
            m_BxCxQ = lmu.memory_final(u_BxTx1, h_TxQ)
        elif mode == "fft":
            m_BxCxQ = lmu.memory_fft(u_BxTx1, h_TxQ)[:, -1]
        else:
            m_BxCxQ = lmu.memory_scan(u_BxTx1, abar, bbar)[:, -1]
        features = jnp.concatenate([m_BxCxQ.reshape(len(m_BxCxQ), -1), x_BxTx1[:, -1]], -1)
        o_BxO = jax.nn.relu(features @ params["readout"][0] + params["readout"][1])
        return o_BxO @ params["head"]

    return logits


def time_step(mode: str, length: int, batch: int, repeats: int) -> float:
    logits = logits_fn(mode, length)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.random((batch, length, 1), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, CLASSES, batch))
    params = {
        "encoder": (jnp.ones(()), jnp.zeros(())),
        "readout": (
            jnp.asarray(rng.normal(0, 0.05, (ORDER + 1, UNITS)), jnp.float32),
            jnp.zeros(UNITS),
        ),
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
