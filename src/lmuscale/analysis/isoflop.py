"""Compute-optimal frontiers from a sweep (Hoffmann et al. 2022). Approach 2: a parabola in
log10 N through each FLOP budget's final losses (``fit_isoflop``) has its vertex at N_opt(C),
and D_opt(C) = C / f(N_opt) tokens (f: training FLOPs per token); ``fit_frontier`` fits
N_opt ∝ C^a and D_opt ∝ C^b. Approach 1 (``envelope``): N ∝ C^a along the lowest loss at each
FLOP count. Neither takes a minimum it cannot bracket; intervals are bootstrap percentile ones.
Data that cannot support a fit gives a result whose ``error`` says why; ``ValueError`` is
only for misuse (mixed families, runs without FLOPs, a ``ci`` outside (0, 1)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lmuscale.analysis.curves import Curve
from lmuscale.analysis.results import Run, groups_within
from lmuscale.scaling.fits import check_ci, interval_text, percentile_interval, unresolved

MIN_SIZES = 3  # distinct sizes a parabola needs
MIN_BUDGETS = 2  # bracketed budgets a frontier needs
_CHUNK = 128  # envelope bootstrap replicates evaluated at once (memory: chunk x curves x points)


@dataclass(frozen=True)
class Interval:
    """A point estimate with its percentile confidence interval: NaN, with ``why``, where the
    bootstrap cannot resolve one (``lmuscale.scaling.fits.unresolved``)."""

    estimate: float
    lo: float
    hi: float
    why: str | None = None

    def __contains__(self, value: float) -> bool:
        return self.lo <= value <= self.hi

    def text(self, spec: str = ".4g") -> str:
        """ "estimate [lo, hi]", or "estimate, no interval (why)"."""
        shown = interval_text(self.lo, self.hi, self.why, spec)
        return f"{self.estimate:{spec}}{' ' if shown.startswith('[') else ', '}{shown}"


@dataclass(frozen=True)
class IsoFlopFit:
    """Approach 2 for one family at one ``budget`` (training FLOPs).

    ``coef``: (c0, c1, c2) of loss = c0 x^2 + c1 x + c2, x = log10 N (None with under 3
    sizes). ``n_opt``, ``d_opt`` and ``loss_opt`` (nats) are None, with ``error`` saying why,
    when the minimum is not bracketed or the parabola not convex. ``n_opt_samples`` and
    ``d_opt_samples``: the ``kept`` bootstrap replicates of log10 N_opt and log10 D_opt.
    """

    family: str
    budget: float
    runs: tuple[Run, ...]
    coef: tuple[float, float, float] | None
    n_opt: Interval | None
    d_opt: Interval | None
    loss_opt: float | None
    n_opt_samples: np.ndarray = field(repr=False, compare=False)
    error: str | None
    kept: int = 0
    d_opt_samples: np.ndarray = field(
        default_factory=lambda: np.zeros(0), repr=False, compare=False
    )


@dataclass(frozen=True)
class Frontier:
    """Approach 2 across budgets for one family: N_opt ∝ C^a and D_opt ∝ C^b. ``fits`` holds
    every budget; the lines are (slope, intercept) of log10 N_opt (D_opt) on log10 C over the
    bracketed ones."""

    family: str
    fits: tuple[IsoFlopFit, ...]
    a: Interval | None
    b: Interval | None
    n_line: tuple[float, float] | None
    d_line: tuple[float, float] | None
    error: str | None


@dataclass(frozen=True)
class Envelope:
    """Approach 1 for one family: the lowest loss over its runs at each FLOP count.

    ``flops`` (G,) is a log-spaced grid, ``loss`` (G,) the envelope (nats) and ``n`` (G,) the
    N reaching it, NaN where no curve covers the point. ``a`` is the slope (``line``) of log10
    n on log10 flops over ``used``: the points reached by neither the smallest nor the
    largest size.
    """

    family: str
    flops: np.ndarray = field(compare=False)
    loss: np.ndarray = field(compare=False)
    n: np.ndarray = field(compare=False)
    a: Interval | None
    error: str | None
    used: np.ndarray = field(default_factory=lambda: np.zeros(0, bool), compare=False)
    line: tuple[float, float] | None = None
    kept: int = 0
    trials: tuple[str, ...] = ()  # the runs whose curves it was drawn from


def budgets(runs: list[Run], rtol: float = 0.05) -> list[tuple[float, list[Run]]]:
    """One family's runs grouped by training FLOPs (``groups_within`` ``rtol``): (budget, runs)
    pairs, the budget the group's geometric mean and its runs ordered by N."""
    if not rtol >= 0:
        raise ValueError(f"rtol must be >= 0, got {rtol}")
    families = sorted({r.family for r in runs})
    if len(families) > 1:
        raise ValueError(f"expected one family's runs, got {', '.join(families)}")
    for run in runs:
        _need_flops(run)
    return [
        (
            float(10 ** np.mean(np.log10([r.flops for r in group]))),
            sorted(group, key=lambda r: (r.n, r.trial)),
        )
        for group in groups_within(runs, lambda r: r.flops, rtol)
    ]


def fit_isoflop(
    family: str,
    budget: float,
    runs: list[Run],
    *,
    n_boot: int = 1000,
    ci: float = 0.95,
    seed: int | np.random.Generator = 0,
) -> IsoFlopFit:
    """Fit a parabola in log10 N to the final losses of ``runs`` (one family, one budget); its
    vertex is N_opt. The bootstrap resamples the sizes, and each size's runs (seeds), and
    drops replicates with under 3 sizes, a parabola not convex or a vertex outside the sizes.
    """
    check_ci(ci)
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a positive number of FLOPs, got {budget}")
    for run in runs:
        if run.family != family:
            raise ValueError(f"{run.trial}: family {run.family}, not {family}")
        _need_flops(run)
    runs = tuple(sorted(runs, key=lambda r: (r.n, r.trial)))

    def refused(error, coef=None) -> IsoFlopFit:
        return IsoFlopFit(family, budget, runs, coef, None, None, None, np.zeros(0), error)

    x_P = np.log10([r.n for r in runs])
    loss_P = np.array([r.loss for r in runs], dtype=float)
    sizes_S, size_P = np.unique(x_P, return_inverse=True)
    if len(sizes_S) < MIN_SIZES:
        return refused(f"needs {MIN_SIZES} sizes, has {len(sizes_S)}")
    coef = tuple(float(c) for c in np.polyfit(x_P, loss_P, 2))
    count_S = np.bincount(size_P)
    mean_S = np.bincount(size_P, weights=loss_P) / count_S
    lowest = int(np.argmin(mean_S))
    if lowest in (0, len(sizes_S) - 1):
        edge = "smallest" if lowest == 0 else "largest"
        return refused(
            f"not bracketed: the lowest loss is at the {edge} size tried "
            f"(N={10 ** sizes_S[lowest]:.3g})",
            coef,
        )
    c0, c1, _ = coef
    if c0 <= 0:
        return refused(f"not convex: the parabola in log10 N curves down (c0 = {c0:.3g})", coef)
    vertex = -c1 / (2 * c0)
    if not sizes_S[0] <= vertex <= sizes_S[-1]:
        below = vertex < sizes_S[0]
        edge = "below the smallest" if below else "above the largest"
        return refused(
            f"not bracketed: the parabola's minimum (N={10**vertex:.3g}) is {edge} size tried "
            f"(N={10 ** sizes_S[0 if below else -1]:.3g})",
            coef,
        )
    # f interpolated linearly in log-log between the sizes tried (one f per size)
    logf_S = np.bincount(size_P, weights=np.log10([r.flops_per_token for r in runs])) / count_S
    log_c = math.log10(budget)
    n_S = _bootstrap_vertices(x_P, loss_P, size_P, n_boot, np.random.default_rng(seed))
    d_S = log_c - np.interp(n_S, sizes_S, logf_S)
    log_d = log_c - float(np.interp(vertex, sizes_S, logf_S))
    n_lo, n_hi, n_why = _percentiles(n_S, ci)
    d_lo, d_hi, d_why = _percentiles(d_S, ci)
    n_opt = Interval(10**vertex, 10**n_lo, 10**n_hi, n_why)
    d_opt = Interval(10**log_d, 10**d_lo, 10**d_hi, d_why)
    loss_opt = float(np.polyval(coef, vertex))
    return IsoFlopFit(family, budget, runs, coef, n_opt, d_opt, loss_opt, n_S, None, len(n_S), d_S)


def fit_frontier(
    family: str,
    runs: list[Run],
    *,
    n_boot: int = 1000,
    ci: float = 0.95,
    seed: int = 0,
    rtol: float = 0.05,
) -> Frontier:
    """Approach 2 for the runs of ``family`` among ``runs``: ``fit_isoflop`` at each of their
    ``budgets``, then log10 N_opt and log10 D_opt on log10 C over the bracketed budgets."""
    check_ci(ci)
    mine = [r for r in runs if r.family == family]
    if not mine:
        return Frontier(family, (), None, None, None, None, f"no runs of family {family}")
    groups = budgets(mine, rtol)
    rngs = np.random.default_rng(seed).spawn(len(groups) + 1)
    fits = tuple(
        fit_isoflop(family, budget, group, n_boot=n_boot, ci=ci, seed=rng)
        for (budget, group), rng in zip(groups, rngs[:-1], strict=True)
    )
    good = [f for f in fits if f.n_opt is not None]
    if len(good) < MIN_BUDGETS:
        why = "; ".join(f"C={f.budget:.3g}: {f.error}" for f in fits if f.error)
        error = f"needs {MIN_BUDGETS} bracketed budgets, has {len(good)}"
        return Frontier(family, fits, None, None, None, None, error + (f" ({why})" if why else ""))
    logc_J = np.log10([f.budget for f in good])
    logn_J = np.log10([f.n_opt.estimate for f in good])
    logd_J = np.log10([f.d_opt.estimate for f in good])
    n_line = tuple(float(v) for v in np.polyfit(logc_J, logn_J, 1))
    d_line = tuple(float(v) for v in np.polyfit(logc_J, logd_J, 1))
    n_RxJ, d_RxJ = _paired_replicates(good, n_boot, rngs[-1])
    a = Interval(n_line[0], *_percentiles(_slopes(logc_J, n_RxJ), ci))
    b = Interval(d_line[0], *_percentiles(_slopes(logc_J, d_RxJ), ci))
    return Frontier(family, fits, a, b, n_line, d_line, None)


def envelope(
    family: str,
    curves: list[Curve],
    *,
    points: int = 60,
    n_boot: int = 1000,
    ci: float = 0.95,
    seed: int = 0,
) -> Envelope:
    """Approach 1 for the curves of ``family`` among ``curves``: the lower envelope of their
    losses (each linear in log10 FLOPs inside its own range) at ``points`` log-spaced FLOP
    counts spanning them all. The bootstrap resamples the curves."""
    check_ci(ci)
    if points < 2:
        raise ValueError(f"points must be >= 2, got {points}")
    mine = [c for c in curves if c.run.family == family]
    if not mine:
        empty = np.zeros(0)
        return Envelope(family, empty, empty, empty, None, f"no curves of family {family}")
    logc_K = []
    for curve in mine:
        with np.errstate(divide="ignore", invalid="ignore"):  # tokens <= 0: refused below
            logc = np.log10(curve.flops)  # names the trial when the table has no flops_per_token
        loss = np.asarray(curve.loss, dtype=float)
        if (
            len(logc) == 0
            or len(logc) != len(loss)
            or not np.all(np.isfinite(logc))
            or np.any(np.diff(logc) <= 0)
            or not np.all(np.isfinite(loss))
        ):
            raise ValueError(
                f"{curve.run.trial}: a curve needs one finite loss per evaluation, at positive "
                f"tokens in increasing order; got {len(logc)} tokens and {len(loss)} losses"
            )
        logc_K.append(logc)
    lo = min(c[0] for c in logc_K)
    hi = max(c[-1] for c in logc_K)
    grid_G = np.linspace(lo, hi, points)  # exact at both ends, so the ends are covered
    loss_KxG = np.full((len(mine), points), np.inf)
    for k, (curve, logc) in enumerate(zip(mine, logc_K, strict=True)):
        inside = (grid_G >= logc[0]) & (grid_G <= logc[-1])
        loss_KxG[k, inside] = np.interp(grid_G[inside], logc, curve.loss)
    logn_K = np.log10([c.run.n for c in mine])
    chosen = np.ones((1, len(mine)), bool)
    env_G, logn_G, used_G = (v[0] for v in _envelopes(loss_KxG, logn_K, chosen))
    flops, loss, n = 10**grid_G, env_G, 10**logn_G
    sizes = np.unique(logn_K)
    if len(sizes) < 2:
        error = f"needs 2 sizes, has 1 (N={10 ** sizes[0]:.3g})"
        return Envelope(family, flops, loss, n, None, error, used_G)
    inner = np.unique(logn_G[used_G])
    if len(inner) < 2:
        error = (
            f"needs the envelope reached by 2 sizes other than the smallest and largest "
            f"(N={10 ** sizes[0]:.3g}, N={10 ** sizes[-1]:.3g}), has {len(inner)}"
        )
        return Envelope(family, flops, loss, n, None, error, used_G)
    line = tuple(float(v) for v in np.polyfit(grid_G[used_G], logn_G[used_G], 1))
    rng = np.random.default_rng(seed)
    slopes = []
    for start in range(0, n_boot, _CHUNK):
        count = min(_CHUNK, n_boot - start)
        draws_RxK = rng.integers(0, len(mine), (count, len(mine)))
        chosen_RxK = np.zeros((count, len(mine)), bool)
        chosen_RxK[np.arange(count)[:, None], draws_RxK] = True
        _, logn_RxG, used_RxG = _envelopes(loss_KxG, logn_K, chosen_RxK)
        slopes.append(_masked_slopes(grid_G, logn_RxG, used_RxG))
    slopes = np.concatenate(slopes) if slopes else np.zeros(0)
    a = Interval(line[0], *_percentiles(slopes, ci))
    trials = tuple(c.run.trial for c in mine)
    return Envelope(family, flops, loss, n, a, None, used_G, line, len(slopes), trials)


def _bootstrap_vertices(x_P, loss_P, size_P, n_boot, rng) -> np.ndarray:
    """log10 N_opt of every kept replicate, (R,). ``x_P`` is sorted, so each size's runs are
    contiguous. A replicate is a weight per run: how many times it was drawn."""
    count_S = np.bincount(size_P)
    start_S = np.concatenate([[0], np.cumsum(count_S)[:-1]])
    sizes = len(count_S)
    drawn_RxS = rng.integers(0, sizes, (n_boot, sizes))
    seeds_RxS = count_S[drawn_RxS]
    most = int(count_S.max())
    pick_RxSxM = (rng.random((n_boot, sizes, most)) * seeds_RxS[..., None]).astype(int)
    real_RxSxM = np.arange(most) < seeds_RxS[..., None]
    run_RxSxM = start_S[drawn_RxS][..., None] + pick_RxSxM
    rows_RxSxM = np.broadcast_to(np.arange(n_boot)[:, None, None], run_RxSxM.shape)
    weight_RxP = np.zeros((n_boot, len(x_P)))
    np.add.at(weight_RxP, (rows_RxSxM[real_RxSxM], run_RxSxM[real_RxSxM]), 1.0)
    distinct_R = (np.diff(np.sort(drawn_RxS, axis=1), axis=1) != 0).sum(axis=1) + 1
    weight_RxP = weight_RxP[distinct_R >= MIN_SIZES]
    # weighted normal equations, centred on the middle of the sizes for conditioning
    centre = (x_P[0] + x_P[-1]) / 2
    u_P = x_P - centre
    design_Px3 = np.stack([u_P**2, u_P, np.ones_like(u_P)], axis=1)
    gram_Rx3x3 = np.einsum("rp,pi,pj->rij", weight_RxP, design_Px3, design_Px3)
    rhs_Rx3 = np.einsum("rp,pi,p->ri", weight_RxP, design_Px3, loss_P)
    coef_Rx3 = np.linalg.solve(gram_Rx3x3, rhs_Rx3[..., None])[..., 0]
    c0_R, c1_R = coef_Rx3[:, 0], coef_Rx3[:, 1]
    convex = c0_R > 0
    vertex_R = centre - c1_R[convex] / (2 * c0_R[convex])
    inside = (vertex_R >= x_P[0]) & (vertex_R <= x_P[-1])
    return vertex_R[inside]


def _paired_replicates(fits, n_boot, rng) -> tuple[np.ndarray, np.ndarray]:
    """log10 N_opt and log10 D_opt, (R, J): replicate i of every budget, or, when the budgets
    kept different numbers, ``n_boot`` draws with replacement from each budget's replicates
    (the same draw for N and D, which stay paired)."""
    kept = [f.kept for f in fits]
    if min(kept) == 0:
        return np.zeros((0, len(fits))), np.zeros((0, len(fits)))
    if len(set(kept)) == 1:
        pick = [np.arange(kept[0])] * len(fits)
    else:
        pick = [rng.integers(0, k, n_boot) for k in kept]
    n_RxJ = np.stack([f.n_opt_samples[i] for f, i in zip(fits, pick, strict=True)], axis=1)
    d_RxJ = np.stack([f.d_opt_samples[i] for f, i in zip(fits, pick, strict=True)], axis=1)
    return n_RxJ, d_RxJ


def _envelopes(loss_KxG, logn_K, chosen_RxK):
    """The envelope of the chosen curves, per replicate: loss (R, G) and log10 N (R, G), both
    NaN where no chosen curve covers the point, and the points that are inside the chosen
    sizes (R, G): covered and reached by neither the smallest nor the largest chosen size."""
    masked_RxKxG = np.where(chosen_RxK[:, :, None], loss_KxG[None], np.inf)
    best_RxG = np.argmin(masked_RxKxG, axis=1)
    loss_RxG = np.take_along_axis(masked_RxKxG, best_RxG[:, None, :], axis=1)[:, 0]
    covered_RxG = np.isfinite(loss_RxG)
    logn_RxG = np.where(covered_RxG, logn_K[best_RxG], np.nan)
    smallest_R = np.where(chosen_RxK, logn_K, np.inf).min(axis=1)
    largest_R = np.where(chosen_RxK, logn_K, -np.inf).max(axis=1)
    with np.errstate(invalid="ignore"):
        used_RxG = (logn_RxG > smallest_R[:, None]) & (logn_RxG < largest_R[:, None])
    return np.where(covered_RxG, loss_RxG, np.nan), logn_RxG, used_RxG


def _masked_slopes(x_G, y_RxG, used_RxG) -> np.ndarray:
    """Least-squares slope of y on x over each row's used points; rows whose used points have
    fewer than two distinct y are dropped."""
    w_RxG = used_RxG.astype(float)
    y_RxG = np.where(used_RxG, y_RxG, 0.0)
    top_R = np.where(used_RxG, y_RxG, -np.inf).max(axis=1)
    spread = top_R - np.where(used_RxG, y_RxG, np.inf).min(axis=1)
    ok = np.isfinite(spread) & (spread > 0)
    w_RxG, y_RxG = w_RxG[ok], y_RxG[ok]
    total_R = w_RxG.sum(axis=1)
    xbar_R = (w_RxG @ x_G) / total_R
    ybar_R = (w_RxG * y_RxG).sum(axis=1) / total_R
    dx_RxG = x_G[None] - xbar_R[:, None]
    sxy = (w_RxG * dx_RxG * (y_RxG - ybar_R[:, None])).sum(axis=1)
    sxx = (w_RxG * dx_RxG**2).sum(axis=1)
    return sxy / sxx


def _slopes(x_J, y_RxJ) -> np.ndarray:
    """Least-squares slope of each row of y on x, (R,)."""
    dx_J = x_J - x_J.mean()
    return (y_RxJ @ dx_J) / (dx_J @ dx_J)


def _percentiles(samples, ci) -> tuple[float, float, str | None]:
    """(lo, hi, why): the interval, NaN with ``why`` where it is not resolved."""
    samples = np.asarray(samples, dtype=float)
    samples = samples[np.isfinite(samples)]
    lo, hi = percentile_interval(samples, ci)
    return float(lo), float(hi), unresolved(samples, ci)


def _need_flops(run: Run) -> None:
    if run.flops_per_token is None:
        raise ValueError(
            f"{run.trial}: no flops_per_token; compute budgets need the results table's "
            "flops_per_token column"
        )
