"""Published scaling curves: Kaplan et al. (2020) for transformers, the LSTM and LMU fits quoted
by the LMU paper, and how many transformer steps it takes to reach a given loss.

Losses are in nats per GPT-2 token; N counts non-embedding parameters; S counts optimiser steps
at a batch of ``batch_tokens`` tokens (Kaplan's standard: 512 x 1024). See REFERENCE §3.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import optimize

BATCH_TOKENS = 512 * 1024  # the paper's batch: 512 sequences of 1024 tokens
PAPER_STEPS = 25_000  # the LMU paper's budget (13.1B tokens)
TABLE3_SIZES = (55_000, 100_000, 200_000, 300_000, 500_000, 1_000_000)

# Kaplan eq 1.6 and its companions (Table 1 / eq 5.4 of arXiv 2001.08361).
NC_NS = 6.5e13
ALPHA_N_NS = 0.077
SC = 2.1e3
ALPHA_S = 0.76
B_STAR = 2e8  # tokens
ALPHA_B = 0.21


@dataclass(frozen=True)
class PowerLaw:
    """L(N) = (Nc / N)^alpha, i.e. (N / Nc)^-alpha."""

    nc: float
    alpha: float
    label: str = ""

    def __call__(self, n):
        return (self.nc / _positive(n, "N")) ** self.alpha


# Eq 1.1: transformers trained to convergence (early-stopped), no step limit.
KAPLAN_CONVERGED = PowerLaw(8.8e13, 0.076, "Transformer, converged (Kaplan eq 1.1)")
# Kaplan prints no LSTM formula; the LMU paper quotes this one, presumably fitted to Kaplan's
# Figure 7, for LSTMs with 10x the transformer's steps.
LSTM = PowerLaw(7.45e14, 0.071, "LSTM (LMU paper's fit to Kaplan Fig. 7)")
LMU_PAPER = PowerLaw(1.95e14, 0.072, "LMU (paper's fit)")
LMU_G_PAPER = PowerLaw(3.80e14, 0.069, "LMU_G (paper's fit)")
# Eq 1.6 with unlimited steps, (Nc/N)^alpha_N: the transformer's infinite-training limit.
transformer_floor = PowerLaw(NC_NS, ALPHA_N_NS, "Transformer, eq 1.6 with unlimited steps")


def critical_batch(loss):
    """Kaplan's Bcrit(L) = B* / L^(1/alpha_B), in tokens."""
    return B_STAR / _positive(loss, "loss") ** (1 / ALPHA_B)


def min_steps(steps, loss, batch_tokens=BATCH_TOKENS):
    """Smin(S) = S / (1 + Bcrit(L) / B): the steps S at batch B would take at a huge batch."""
    return steps / (1 + critical_batch(loss) / batch_tokens)


def transformer_loss(n, steps, batch_tokens=BATCH_TOKENS):
    """Kaplan eq 1.6: L(N, S) = (Nc/N)^alpha_N + (Sc/Smin(S))^alpha_S, solved for L (Smin
    depends on Bcrit(L)); broadcasts over ``n`` and ``steps``. The right side falls as L
    rises, so L - rhs(L) has one root, between the floor (Nc/N)^alpha_N and rhs of it."""
    solve = np.vectorize(_solve_eq_1_6, otypes=[float])
    out = solve(_positive(n, "N"), _positive(steps, "steps"), float(batch_tokens))
    return out[()] if out.ndim == 0 else out


def _solve_eq_1_6(n: float, steps: float, batch_tokens: float) -> float:
    floor = (NC_NS / n) ** ALPHA_N_NS
    if np.isinf(steps):
        return floor

    def rhs(loss: float) -> float:
        return floor + (SC / min_steps(steps, loss, batch_tokens)) ** ALPHA_S

    high = rhs(floor)
    if high - rhs(high) == 0:
        return high
    return optimize.brentq(lambda loss: loss - rhs(loss), floor, high, xtol=1e-13, rtol=1e-15)


def steps_to_match(loss, n, batch_tokens=BATCH_TOKENS):
    """Steps a size-N transformer needs (eq 1.6, batch ``batch_tokens``) to reach ``loss``:
    Smin = Sc / (L - (Nc/N)^alpha_N)^(1/alpha_S) and S = Smin (1 + Bcrit(L)/B); ``inf`` at or
    below the infinite-training limit (as the paper's LMU fit is, REFERENCE §3)."""
    loss, n = np.broadcast_arrays(_positive(loss, "loss"), _positive(n, "N"))
    gap = loss - transformer_floor(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        smin = SC / np.where(gap > 0, gap, np.nan) ** (1 / ALPHA_S)
        steps = smin * (1 + critical_batch(loss) / batch_tokens)
    steps = np.where(gap > 0, steps, np.inf)
    return steps[()] if steps.ndim == 0 else steps


def reference_table(sizes=TABLE3_SIZES, steps=PAPER_STEPS, batch_tokens=BATCH_TOKENS):
    """The reference curves at ``sizes``: one dict per size, losses in nats per token."""
    sizes = np.asarray(sizes, dtype=float)
    columns = {
        "N": sizes,
        f"transformer_{_k(steps)}_steps": transformer_loss(sizes, steps, batch_tokens),
        f"transformer_{_k(10 * steps)}_steps": transformer_loss(sizes, 10 * steps, batch_tokens),
        "transformer_converged_eq_1_1": KAPLAN_CONVERGED(sizes),
        "transformer_floor_eq_1_6": transformer_floor(sizes),
        "lstm": LSTM(sizes),
        "lmu_paper": LMU_PAPER(sizes),
        "lmu_g_paper": LMU_G_PAPER(sizes),
    }
    return [{key: float(value[i]) for key, value in columns.items()} for i in range(len(sizes))]


def reference_markdown(sizes=TABLE3_SIZES, steps=PAPER_STEPS, batch_tokens=BATCH_TOKENS):
    """``reference_table`` as the lines of a Markdown table."""
    rows = reference_table(sizes, steps, batch_tokens)
    keys = list(rows[0])
    out = ["| " + " | ".join(keys) + " |", "|" + "---:|" * len(keys)]
    for row in rows:
        cells = [f"{row['N']:,.0f}"] + [f"{row[k]:.4f}" for k in keys[1:]]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _k(steps: float) -> str:
    return f"{steps / 1000:g}k" if steps >= 1000 else f"{steps:g}"


def _positive(x, name: str):
    x = np.asarray(x, dtype=float)
    if np.any(np.isnan(x)) or np.any(x <= 0):
        raise ValueError(f"{name} must be positive numbers, got {x}")
    return x
