"""Data efficiency: how many training tokens two families need to reach the same loss, from
the runs' evaluation curves. The LMU paper (v1) claims a ratio of 10 (transformer / LMU). The
caller ensures both were evaluated on the same validation data and tokenizer."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from lmuscale.analysis.curves import Curve
from lmuscale.analysis.results import label

# a's size counts as inside b's range when it is within this relative margin of an end
RANGE_RTOL = 1e-9


def tokens_to_target(curve: Curve, target: float) -> float | None:
    """The training tokens at which ``curve`` first reaches ``target`` (nats), the loss taken
    as linear in log10(tokens) between evaluations; non-finite losses are passed over. None
    when no evaluation reaches the target, or the first already does (unmeasured crossing)."""
    tokens = np.asarray(curve.tokens, dtype=float)
    loss = np.asarray(curve.loss, dtype=float)
    if tokens.ndim != 1 or tokens.shape != loss.shape:
        raise ValueError(
            f"{curve.run.trial}: a curve needs one loss per evaluation, got tokens of shape "
            f"{tokens.shape} and loss of shape {loss.shape}"
        )
    keep = np.isfinite(loss) & np.isfinite(tokens) & (tokens > 0)
    tokens, loss = tokens[keep], loss[keep]
    below = np.flatnonzero(loss <= target)
    if below.size == 0 or below[0] == 0:
        return None
    i = int(below[0])
    x0, x1 = np.log10(tokens[i - 1]), np.log10(tokens[i])
    y0, y1 = loss[i - 1], loss[i]
    f = (y0 - target) / (y0 - y1)  # y0 > target >= y1, so 0 < f <= 1
    return float(10 ** (x0 + f * (x1 - x0)))


@dataclass(frozen=True)
class DataEfficiency:
    """Tokens to a target loss, family a against family b, at a's sizes. The arrays follow
    ``n`` (ascending); with ``error`` set they are empty and ``ratio_geomean`` is None."""

    target: float  # the loss the comparison is made at (nats)
    families: tuple[str, str]  # (a, b)
    reached: dict[str, float | None]  # trial -> tokens to target (None: not reached/measurable)
    n: np.ndarray  # a's sizes inside b's measured range (non-embedding parameters)
    tokens_a: np.ndarray  # a's tokens to target at those sizes
    tokens_b: np.ndarray  # b's, interpolated linearly in log10 tokens against log10 N
    ratio: np.ndarray  # tokens_b / tokens_a (> 1: family a needs fewer tokens)
    ratio_geomean: float | None
    error: str | None  # why nothing could be compared
    left_out: tuple[str, ...] = field(default=())  # one line per size left out, with why


def data_efficiency(
    curves: list[Curve], a: str, b: str, target: float | None = None
) -> DataEfficiency:
    """Compare the training tokens families ``a`` and ``b`` need to reach ``target`` (nats;
    default: the largest of the curves' minima). b's tokens are interpolated linearly in
    (log10 N, log10 tokens) at a's sizes inside b's range, never extrapolated. Problems with
    the data come back as ``error``; a bad argument raises ``ValueError``."""
    if a == b:
        raise ValueError(f"compare two different families, got {a!r} twice")
    if target is not None and not (math.isfinite(target) and target > 0):
        raise ValueError(f"target must be a positive loss in nats, got {target!r}")
    mine = [c for c in curves if c.run.family in (a, b)]
    trials = [c.run.trial for c in mine]
    repeated = sorted({t for t in trials if trials.count(t) > 1})
    if repeated:
        raise ValueError(f"two curves for trial(s) {', '.join(repeated)}; give one per run")
    reached, left_out = {}, []

    def failed(error, target=math.nan):
        empty = np.zeros(0)
        return DataEfficiency(
            target, (a, b), reached, empty, empty, empty, empty, None, error, tuple(left_out)
        )

    for family in (a, b):
        if not any(c.run.family == family for c in mine):
            have = sorted({c.run.family for c in curves})
            return failed(
                f"no {label(family)} curves (the curves given are of "
                f"{', '.join(have) if have else 'no family'})"
            )
    if target is None:
        lows = [
            float(np.min(c.loss[np.isfinite(c.loss)])) for c in mine if np.isfinite(c.loss).any()
        ]
        if not lows:
            return failed(f"no {label(a)} or {label(b)} curve has a finite loss")
        target = max(lows)
    target = float(target)
    reached = {c.run.trial: tokens_to_target(c, target) for c in mine}
    sizes = {
        f: _sizes([c for c in mine if c.run.family == f], reached, target, left_out) for f in (a, b)
    }
    for family in (b, a):
        if not sizes[family]:
            why = f"no {label(family)} size reaches loss {target:.4g} after its first evaluation"
            return failed(why, target)
    n_b = np.array(sorted(sizes[b]))
    lo, hi = n_b[0], n_b[-1]
    inside = [n for n in sorted(sizes[a]) if lo * (1 - RANGE_RTOL) <= n <= hi * (1 + RANGE_RTOL)]
    if not inside:
        have = ", ".join(f"{n:.3g}" for n in sorted(sizes[a]))
        return failed(
            f"no {label(a)} size lies inside the {label(b)}'s measured sizes "
            f"(N {lo:.3g} to {hi:.3g}; {label(a)} has N {have})",
            target,
        )
    n = np.array(inside)
    tokens_a = np.array([sizes[a][x] for x in inside])
    log_tokens_b = np.log10([sizes[b][x] for x in n_b])
    tokens_b = 10 ** np.interp(np.log10(n), np.log10(n_b), log_tokens_b)
    ratio = tokens_b / tokens_a
    geomean = float(np.exp(np.mean(np.log(ratio))))
    return DataEfficiency(
        target, (a, b), reached, n, tokens_a, tokens_b, ratio, geomean, None, tuple(left_out)
    )


def _sizes(curves, reached, target, left_out) -> dict[float, float]:
    """N -> the tokens that size needs to reach ``target``: per budget the geometric mean over
    its runs (seeds), where every run has one; then the fewest over the budgets (an IsoFLOP
    grid trains one N at several). A line in ``left_out`` per size with none."""
    by_n = defaultdict(lambda: defaultdict(list))
    for c in curves:
        by_n[c.run.n][c.run.tokens].append(c)
    sizes = {}
    for n, budgets in sorted(by_n.items()):
        measured, why = [], []
        for group in budgets.values():
            missing = [c for c in group if reached[c.run.trial] is None]
            if missing:
                why += [f"{c.run.trial} {_why_not(c, target)}" for c in missing]
            else:
                measured.append(np.exp(np.mean([np.log(reached[c.run.trial]) for c in group])))
        if measured:
            sizes[n] = float(min(measured))
        else:
            family = label(next(iter(budgets.values()))[0].run.family)
            left_out.append(f"{family} N={n:.4g}: {'; '.join(why)}")
    return sizes


def _why_not(curve: Curve, target: float) -> str:
    loss = curve.loss[np.isfinite(curve.loss)]
    if loss.size == 0:
        return "has no finite loss"
    if loss.min() > target:
        return f"never reaches {target:.4g} (its lowest loss is {loss.min():.4g})"
    return f"is already at or below {target:.4g} at its first evaluation ({loss[0]:.4g})"
