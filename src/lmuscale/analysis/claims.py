"""The paper's three claims, read off a study's own runs: what the console and fits.md end with.

1. At equal N the LMU's loss is below the transformer's (Figure 3): the two power-law fits at
   the LMU's budget, compared at the geometric middle of the sizes both families have.
2. LMU_G keeps improving with context where the LMU flattens (Figure 4): each LMU_G run's mean
   per-position loss beyond position ``POSITION`` against the LMU run nearest in N.
3. A transformer needs about 10x the LMU's tokens to reach its loss (Figure 5): the tokens each
   family's learning curves take to reach one loss, at the LMU's sizes (``efficiency``).

Each reading says whether its interval supports the claim, contradicts it, or cannot tell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from lmuscale.analysis.results import Results, label
from lmuscale.scaling.fits import human

POSITION = 100  # Figure 4's claim is about the context beyond this position
CLAIMS = (
    "at equal N the LMU's loss is below the transformer's (Figure 3)",
    "LMU_G keeps improving with context beyond the LMU's (Figure 4)",
    "a transformer needs about 10x the LMU's tokens to match it (Figure 5)",
)


@dataclass(frozen=True)
class Reading:
    claim: str  # the paper's claim, in words
    text: str  # what these runs say, with the numbers
    verdict: str  # "supported", "contradicted", "inconclusive" or "not read"

    def line(self) -> str:
        return f"{self.claim}: {self.verdict}: {self.text}"


def read_claims(grid: Results, fits, efficiency, ci: float) -> list[Reading]:
    """The three readings from the paper-grid runs ``grid``, the fits in N (``GroupFit``s) and
    the data-efficiency comparisons, each interval at level ``ci``."""
    return [
        _gap(grid, fits, ci),
        _context(grid, ci),
        _tokens(efficiency),
    ]


def _verdict(lo: float, hi: float, supports_above: float) -> str:
    """Whether [lo, hi] lies wholly above ``supports_above`` (supported), wholly below it
    (contradicted), or holds it."""
    if lo > supports_above:
        return "supported"
    if hi < supports_above:
        return "contradicted"
    return "inconclusive"


def _gap(grid: Results, fits, ci: float) -> Reading:
    base = grid.base_tokens if grid.runs else None
    power = {
        g.family: g.fit
        for g in fits
        if g.fit is not None and g.form == "power_law" and g.role == "grid" and g.tokens == base
    }
    if "lmu" not in power or "transformer" not in power:
        why = "needs power-law fits of both the LMU and the transformer at the LMU's budget"
        return Reading(CLAIMS[0], why, "not read")
    lmu, transformer = power["lmu"], power["transformer"]
    low = max(lmu.n.min(), transformer.n.min())
    high = min(lmu.n.max(), transformer.n.max())
    if low > high:
        return Reading(CLAIMS[0], "the two families' sizes do not overlap", "not read")
    n = math.sqrt(low * high)
    gap = float(transformer.predict(n) - lmu.predict(n))
    k = min(len(lmu.samples), len(transformer.samples))
    if k < 10:
        text = f"the transformer's loss minus the LMU's is {gap:+.3f} {grid.unit} at N = {human(n)}"
        return Reading(CLAIMS[0], f"{text} (too few resamples for an interval)", "inconclusive")
    gaps = [
        float(transformer.predict(n, params=b) - lmu.predict(n, params=a))
        for a, b in zip(lmu.samples[:k], transformer.samples[:k], strict=True)
    ]
    lo, hi = np.quantile(gaps, [(1 - ci) / 2, (1 + ci) / 2])
    text = (
        f"at N = {human(n)} (the middle of the sizes both have), the transformer's loss minus "
        f"the LMU's is {gap:+.3f} [{lo:+.3f}, {hi:+.3f}] {grid.unit} ({ci:.0%} bootstrap "
        f"interval of the two power-law fits at {human(base)} tokens; positive: the LMU lower)"
    )
    return Reading(CLAIMS[0], text, _verdict(lo, hi, 0.0))


def _context(grid: Results, ci: float) -> Reading:
    base = grid.base_tokens if grid.runs else None
    runs = {f: [r for r in grid.group(f, base) if r.per_position] for f in ("lmu", "lmu_g")}
    if not runs["lmu"] or not runs["lmu_g"]:
        why = f"needs LMU and LMU_G runs with per-position losses at {human(base or 0)} tokens"
        return Reading(CLAIMS[1], why, "not read")
    length = min(len(r.per_position) for r in runs["lmu"] + runs["lmu_g"])
    if length <= POSITION:
        why = f"the runs' context is {length} positions, not beyond position {POSITION}"
        return Reading(CLAIMS[1], why, "not read")
    differences = []
    for g in runs["lmu_g"]:
        nearest = min(runs["lmu"], key=lambda r: abs(math.log(r.n / g.n)))
        later = slice(POSITION, length)
        differences.append(np.mean(nearest.per_position[later]) - np.mean(g.per_position[later]))
    d = float(np.mean(differences))
    pairs = f"{len(differences)} LMU_G run{'s' if len(differences) > 1 else ''}"
    text = (
        f"beyond position {POSITION}, the LMU's mean per-position loss minus LMU_G's is "
        f"{d:+.3f} {grid.unit} at the nearest N (positive: LMU_G lower; mean over {pairs}"
    )
    if len(differences) < 2:
        return Reading(CLAIMS[1], text + "; one pair gives no interval)", "inconclusive")
    half = stats.t.ppf((1 + ci) / 2, len(differences) - 1) * stats.sem(differences)
    text += f"; {ci:.0%} t interval over them [{d - half:+.3f}, {d + half:+.3f}])"
    return Reading(CLAIMS[1], text, _verdict(d - half, d + half, 0.0))


def _tokens(efficiency) -> Reading:
    found = [e for e in efficiency if e.families == ("lmu", "transformer")]
    if not found or found[0].ratio_geomean is None:
        why = found[0].error if found else "needs learning curves of LMU and transformer runs"
        return Reading(CLAIMS[2], why, "not read")
    e = found[0]
    lo, hi = float(np.min(e.ratio)), float(np.max(e.ratio))
    sizes = f"{len(e.n)} size{'s' if len(e.n) > 1 else ''}"
    text = (
        f"to reach a loss of {e.target:.4f}, the {label('transformer').lower()} needs "
        f"{e.ratio_geomean:.3g}x the LMU's tokens at equal N (geometric mean over {sizes}, "
        f"range [{lo:.3g}, {hi:.3g}]; the paper: about 10x)"
    )
    return Reading(CLAIMS[2], text, _verdict(lo, hi, 1.0))
