"""A short demo of the Legendre memory: encode a signal, read it back delayed, check every mode.

``python -m lmuscale.demo [--order 16] [--theta 64] [--steps 4096] [--seed 0]``
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from lmuscale import lmu


def smoothed_noise(steps: int, width: int = 16, seed: int = 0) -> np.ndarray:
    """White noise smoothed twice by a ``width``-step moving average, shape (steps,)."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(steps + 2 * (width - 1))
    box = np.ones(width) / width
    return np.convolve(np.convolve(noise, box, "valid"), box, "valid")


def delay_nrmse(signal_T: np.ndarray, read_T: np.ndarray, delay: int, skip: int) -> float:
    """NRMSE of ``read_T[t]`` against ``signal_T[t - delay]`` for t >= skip (std-normalised)."""
    target = signal_T[skip - delay : len(signal_T) - delay]
    error = read_T[skip:] - target
    return float(np.sqrt(np.mean(error**2)) / np.std(target))


def mode_errors(u_BxTxC: np.ndarray, order: int, theta: float) -> dict[str, float]:
    """Max abs error of each float32 mode against the float64 recurrence, over max|m|."""
    n = u_BxTxC.shape[1]
    reference = lmu.memory_reference(u_BxTxC, order, theta)
    scale = np.abs(reference).max()
    h_TxQ = lmu.impulse_response(order, theta, n)
    abar, bbar = lmu.discretize(order, theta)
    u = jnp.asarray(u_BxTxC, jnp.float32)
    l_KxQ = np.random.default_rng(1).standard_normal((max(order // 4, 1), order)) / np.sqrt(order)

    step = jax.jit(lmu.memory_step)
    state = jnp.zeros(u.shape[:1] + u.shape[2:] + (order,), jnp.float32)
    for t in range(n):
        state = step(state, u[:, t], abar, bbar)

    def error(value, target):
        return float(np.abs(np.asarray(value, np.float64) - target).max() / scale)

    return {
        "fft": error(jax.jit(lmu.memory_fft)(u, h_TxQ), reference),
        "scan": error(jax.jit(lmu.memory_scan)(u, abar, bbar), reference),
        "step": error(state, reference[:, -1]),
        "final": error(jax.jit(lmu.memory_final)(u, h_TxQ), reference[:, -1]),
        "reduced": error(
            jax.jit(lmu.memory_reduced)(u, h_TxQ, l_KxQ), reference @ l_KxQ.T.astype(np.float64)
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--order", type=int, default=16, help="q, Legendre coefficients")
    parser.add_argument("--theta", type=int, default=64, help="window, in time steps")
    parser.add_argument("--steps", type=int, default=4096, help="signal length")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps <= args.theta:
        parser.error(f"--steps ({args.steps}) must exceed --theta ({args.theta})")

    start = time.perf_counter()
    signal_T = smoothed_noise(args.steps, seed=args.seed)
    h_TxQ = lmu.impulse_response(args.order, args.theta, args.steps)
    u_1xTx1 = jnp.asarray(signal_T, jnp.float32)[None, :, None]
    m_TxQ = lmu.memory_fft(u_1xTx1, h_TxQ)[0, :, 0]

    print(f"Legendre memory: order q={args.order}, window theta={args.theta} steps")
    print(f"signal: {args.steps} steps of white noise smoothed twice by a 16-step average\n")
    print("read-back of u(t - delay) from the memory, after the first theta steps")
    print(f"{'delay':>7}  {'NRMSE':>8}")
    for delay in sorted({0, args.theta // 4, args.theta // 2, 3 * args.theta // 4, args.theta}):
        read_T = np.asarray(lmu.decode(m_TxQ, args.theta, delay))
        print(f"{delay:>7}  {delay_nrmse(signal_T, read_T, delay, args.theta):>8.4f}")

    print("\nevery mode in float32 against the float64 recurrence (max abs error / max|m|)")
    errors = mode_errors(np.asarray(u_1xTx1, np.float64), args.order, args.theta)
    for mode, value in errors.items():
        print(f"{mode:>8}  {value:.2e}")
    print(f"\ndone in {time.perf_counter() - start:.1f} s on {jax.devices()[0].platform}")


if __name__ == "__main__":
    from lmuscale.outcomes import run_main

    sys.exit(run_main(lambda: main() or 0))
