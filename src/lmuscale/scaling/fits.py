"""Scaling-law fits with standard errors, bootstrap confidence intervals and residuals.

Three forms (``FORMULAS``), all fitted to log L so every point counts by its relative error.
The nonlinear ones are log L = LSE(a - alpha log N, [b - beta log D,] e) with A = exp(a),
B = exp(b), E = exp(e), fitted by L-BFGS from a grid of starts. CIs are percentile intervals
over a case bootstrap; resamples with fewer distinct points than the form needs are dropped.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from lmuscale.outcomes import DataError

HUBER_DELTA = 1e-3
# Hoffmann et al.'s grid of initialisations (REFERENCE §3): 5 x 5 x 5 x 6 x 6 = 4,500 starts.
CHINCHILLA_GRID = {
    "alpha": np.arange(0.0, 2.01, 0.5),
    "beta": np.arange(0.0, 2.01, 0.5),
    "e": np.arange(-1.0, 1.01, 0.5),
    "a": np.arange(0.0, 25.01, 5.0),
    "b": np.arange(0.0, 25.01, 5.0),
}
# The same grid without the data term, for L = E + A / N^alpha: 150 starts.
SATURATING_GRID = {key: CHINCHILLA_GRID[key] for key in ("alpha", "e", "a")}
# Bootstrap refits restart from the full fit's optimum and the best few distinct grid optima.
BOOTSTRAP_RESTARTS = 8
MIN_SAMPLES = 10  # bootstrap samples below which an interval is NaN
MIN_DISTINCT = 10  # distinct resampled values below which an interval is NaN

FORMS = {
    "power_law": ("Nc", "alpha"),
    "saturating": ("E", "A", "alpha"),
    "chinchilla": ("E", "A", "alpha", "B", "beta"),
}
FORMULAS = {
    "power_law": "L = (Nc / N)^alpha",
    "saturating": "L = E + A / N^alpha",
    "chinchilla": "L = E + A / N^alpha + B / D^beta",
}


class FitError(DataError):
    """The data cannot support the fit (too few points, too few distinct sizes, bad values)."""


@dataclass(frozen=True)
class Fit:
    """A fitted form. Arrays of parameters follow ``names``; losses are in nats."""

    form: str
    names: tuple[str, ...]
    estimate: np.ndarray
    stderr: np.ndarray  # analytic (OLS / Gauss-Newton); bootstrap SD for "chinchilla"
    ci_low: np.ndarray
    ci_high: np.ndarray
    ci: float
    samples: np.ndarray  # (n_ok, k) bootstrap estimates
    n_boot: int  # resamples drawn (``len(samples)`` of them were usable)
    n: np.ndarray  # non-embedding parameters of each point
    tokens: np.ndarray | None  # training tokens of each point ("chinchilla" only)
    loss: np.ndarray

    @property
    def residuals(self) -> np.ndarray:
        """log(loss) - log(prediction), per point, in input order."""
        return np.log(self.loss) - np.log(self.predict(self.n, self.tokens))

    @property
    def params(self) -> dict[str, float]:
        return dict(zip(self.names, map(float, self.estimate), strict=True))

    @property
    def rms_residual(self) -> float:
        return float(np.sqrt(np.mean(self.residuals**2)))

    def predict(self, n, tokens=None, params=None):
        """The fitted loss at ``n`` (and ``tokens`` for "chinchilla"), in nats."""
        p = dict(zip(self.names, self.estimate if params is None else params, strict=True))
        n = np.asarray(n, dtype=float)
        if self.form == "power_law":
            return (p["Nc"] / n) ** p["alpha"]
        loss = p["E"] + p["A"] / n ** p["alpha"]
        if self.form == "chinchilla":
            if tokens is None:
                raise ValueError("a chinchilla fit needs tokens to predict")
            loss = loss + p["B"] / np.asarray(tokens, dtype=float) ** p["beta"]
        return loss

    def band(self, n, tokens=None):
        """(low, high): the CI of the prediction at each ``n``; NaN with too few resamples."""
        n = np.asarray(n, dtype=float)
        with np.errstate(over="ignore", invalid="ignore"):  # a far n can overflow a sample
            predicted = [self.predict(n, tokens, s) for s in self.samples]
            return percentile_interval(np.reshape(predicted, (-1, *n.shape)), self.ci)

    @property
    def unresolved(self) -> list[str | None]:
        """Per parameter: why its bootstrap gives no interval (None where it does)."""
        return unresolved(self.samples.reshape(-1, len(self.names)), self.ci)


def unresolved(samples, ci: float) -> list[str | None]:
    """Why the bootstrap ``samples`` (R,) or (R, K) give no interval, per column (a str for
    (R,)): too few usable resamples, too few distinct values, or a zero-width interval."""
    samples = np.asarray(samples, dtype=float)
    columns = samples.reshape(samples.shape[0], int(np.prod(samples.shape[1:]))).T
    reasons = []
    for values in columns:
        values = values[np.isfinite(values)]
        ordered = np.sort(values)  # values within 1e-7 of each other are one (rounding noise)
        distinct = 1 + int(np.sum(np.diff(ordered) > 1e-7 * np.abs(ordered[1:])))
        if len(values) < MIN_SAMPLES:
            reasons.append(f"{len(values)} usable resamples, under {MIN_SAMPLES}")
        elif distinct < MIN_DISTINCT:
            plural = "s" if distinct != 1 else ""
            reasons.append(f"the resamples give only {distinct} distinct value{plural}")
        else:
            tail = 50 * (1 - ci)
            low, high = np.percentile(values, [tail, 100 - tail])
            same = high - low <= 1e-9 * max(abs(low), abs(high), 1e-300)
            reasons.append(f"zero width: {ci:.0%} of the resamples agree" if same else None)
    return reasons[0] if samples.ndim == 1 else reasons


def percentile_interval(samples, ci: float):
    """(low, high): the central ``ci`` interval of ``samples`` along their first axis; NaN
    where ``unresolved`` gives a reason."""
    samples = np.asarray(samples, dtype=float)
    if len(samples) < MIN_SAMPLES:
        nan = np.full(samples.shape[1:], np.nan)
        return nan, nan
    tail = 50 * (1 - ci)
    low, high = np.percentile(samples, [tail, 100 - tail], axis=0)
    why = np.reshape(np.array(unresolved(samples, ci), dtype=object), low.shape)
    bad = why != None  # noqa: E711 (element-wise)
    return np.where(bad, np.nan, low), np.where(bad, np.nan, high)


def human(x: float) -> str:
    """55000 -> "55k", 1.3e10 -> "13B", inf -> "inf": counts of parameters, tokens, FLOPs."""
    if math.isfinite(x):
        x = float(f"{x:.3g}")  # rounded first: 999.6k is "1M", not "1e+03k"
    for scale, suffix in zip((1e18, 1e15, 1e12, 1e9, 1e6, 1e3), "EPTBMk", strict=True):
        if math.isfinite(x) and abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def interval_text(low, high, why: str | None = None, spec: str = ".4g") -> str:
    """ "[low, high]", or "no interval (why)" where the bootstrap could not resolve one."""
    if why is None and not (np.isfinite(low) and np.isfinite(high)):
        why = "too few usable resamples"
    if why is not None:
        return f"no interval ({why})"
    return f"[{low:{spec}}, {high:{spec}}]"


def check_ci(ci) -> None:
    if not 0 < ci < 1:
        raise ValueError(f"ci must be in (0, 1), got {ci}")


def fit_power_law(n, loss, *, n_boot: int = 1000, ci: float = 0.95, seed: int = 0) -> Fit:
    """L = (Nc / N)^alpha by least squares of log L on log N. Standard errors are OLS's (NaN
    with exactly 2 points); Nc's comes from log Nc by the delta method."""
    n, loss = _check(n, loss, None, form="power_law")
    x, y = np.log(n), np.log(loss)

    def solve(idx):
        slope, intercept = np.polyfit(x[idx], y[idx], 1)
        # slope ~ 0: Nc beyond float range (inf, or 0 by underflow), a sample that is dropped
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            nc = np.exp(-intercept / slope)
        return np.array([nc if nc > 0 else np.nan, -slope])

    estimate = solve(np.arange(len(n)))
    resamples = _resamples(np.stack([n], axis=1), 2, n_boot, seed)
    samples = np.array([solve(idx) for idx in resamples]).reshape(-1, 2)
    return _make_fit(
        "power_law", estimate, _power_law_stderr(x, y), samples, n_boot, ci, n, None, loss
    )


def _power_law_stderr(x, y):
    dof = len(x) - 2
    if dof <= 0:
        return np.full(2, np.nan)
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    sigma2 = np.sum((y - design @ coef) ** 2) / dof
    cov = sigma2 * np.linalg.inv(design.T @ design)
    intercept, slope = coef
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # slope 0: Nc unbounded
        grad = np.array([-1 / slope, intercept / slope**2])  # of log Nc = -intercept / slope
        se_log_nc = np.sqrt(grad @ cov @ grad)
        return np.array([np.exp(-intercept / slope) * se_log_nc, np.sqrt(cov[1, 1])])


def fit_saturating(
    n, loss, *, n_boot: int = 1000, ci: float = 0.95, seed: int = 0, grid=None
) -> Fit:
    """L = E + A / N^alpha by least squares on log L, from every start of ``grid`` (default
    ``SATURATING_GRID``). Standard errors are Gauss-Newton's (NaN with exactly 3 points, or
    where the data cannot tell the parameters apart)."""
    n, loss = _check(n, loss, None, form="saturating")
    problem = _LSEProblem(np.log(n), None, np.log(loss), delta=None)
    theta, restarts = problem.best(grid or SATURATING_GRID)
    resamples = _resamples(np.stack([n], axis=1), 3, n_boot, seed)
    samples = _natural(problem.bootstrap(resamples, restarts))
    return _make_fit(
        "saturating", _natural(theta), problem.stderr(theta), samples, n_boot, ci, n, None, loss
    )


def fit_chinchilla(
    n,
    tokens,
    loss,
    *,
    n_boot: int = 200,
    ci: float = 0.95,
    seed: int = 0,
    delta: float = HUBER_DELTA,
    grid=None,
) -> Fit:
    """L = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022, approach 3): a Huber loss on
    log L, from every start of ``grid`` (default ``CHINCHILLA_GRID``); ``stderr`` is the
    bootstrap SD. Needs 3 or more distinct N and D (with two budgets any beta fits)."""
    n, loss, tokens = _check(n, loss, tokens, form="chinchilla")
    problem = _LSEProblem(np.log(n), np.log(tokens), np.log(loss), delta=delta)
    theta, restarts = problem.best(grid or CHINCHILLA_GRID)
    points = np.stack([n, tokens], axis=1)

    def need(idx):
        return len(set(tokens[idx])) > 2 and len(set(n[idx])) > 2

    resamples = _resamples(points, 5, n_boot, seed, need)
    samples = _natural(problem.bootstrap(resamples, restarts))
    samples = samples[np.all(np.isfinite(samples), axis=1)]
    stderr = samples.std(axis=0, ddof=1) if len(samples) >= MIN_SAMPLES else np.full(5, np.nan)
    return _make_fit("chinchilla", _natural(theta), stderr, samples, n_boot, ci, n, tokens, loss)


FITTERS = {"power_law": fit_power_law, "saturating": fit_saturating, "chinchilla": fit_chinchilla}


def _check(n, loss, tokens, *, form: str):
    names = FORMS[form]
    n = np.asarray(n, dtype=float).ravel()
    loss = np.asarray(loss, dtype=float).ravel()
    arrays = {"N": n, "loss": loss}
    if tokens is not None:
        arrays["tokens"] = tokens = np.asarray(tokens, dtype=float).ravel()
    for name, values in arrays.items():
        if len(values) != len(n):
            raise FitError(f"{form}: {name} has {len(values)} values but N has {len(n)}")
        bad = ~np.isfinite(values) | (values <= 0)
        if bad.any():
            raise FitError(
                f"{form}: {name} must be finite and positive; got {values[bad].tolist()} "
                f"at positions {np.flatnonzero(bad).tolist()}"
            )
    points = np.stack([n] if tokens is None else [n, tokens], axis=1)
    distinct = len(np.unique(points, axis=0))
    if distinct < len(names):
        what = "distinct N" if tokens is None else "distinct (N, D) points"
        raise FitError(
            f"{form} ({FORMULAS[form]}) has {len(names)} parameters and needs at least "
            f"{len(names)} {what}; got {distinct} (N = {sorted(set(n.tolist()))})"
        )
    # E + B / D^beta has three parameters, so two budgets (or two sizes for E + A / N^alpha)
    # fit any beta (alpha) equally well.
    for name, values in (("N", n), ("D", tokens)):
        if form != "power_law" and values is not None and len(np.unique(values)) < 3:
            shown = ", ".join(f"{v:.4g}" for v in np.unique(values))
            raise FitError(
                f"{form} ({FORMULAS[form]}) needs at least three distinct {name} to tell E from "
                f"the {name} term; got {shown}"
            )
    return (n, loss) if tokens is None else (n, loss, tokens)


def _resamples(points, k, n_boot, seed, need=None) -> np.ndarray:
    """Case-bootstrap index sets (R, P) with ``k`` or more distinct points (and ``need``)."""
    rng = np.random.default_rng(seed)
    count = len(points)
    kept = []
    for _ in range(n_boot):
        idx = rng.integers(0, count, count)
        if len(np.unique(points[idx], axis=0)) >= k and (need is None or need(idx)):
            kept.append(idx)
    return np.array(kept, dtype=int).reshape(-1, count)


def _make_fit(form, estimate, stderr, samples, n_boot, ci, n, tokens, loss) -> Fit:
    check_ci(ci)
    samples = samples[np.all(np.isfinite(samples), axis=1)]
    low, high = percentile_interval(samples, ci)
    return Fit(
        form=form,
        names=FORMS[form],
        estimate=np.asarray(estimate, dtype=float),
        stderr=np.asarray(stderr, dtype=float),
        ci_low=low,
        ci_high=high,
        ci=ci,
        samples=samples,
        n_boot=n_boot,
        n=n,
        tokens=tokens,
        loss=loss,
    )


def _natural(theta):
    """(a, alpha[, b, beta], e) -> (E, A, alpha[, B, beta]), along the last axis."""
    a, alpha, *b_beta, e = np.moveaxis(np.asarray(theta, dtype=float), -1, 0)
    with np.errstate(over="ignore"):  # an inf sample is dropped (``_make_fit``)
        natural = [np.exp(e), np.exp(a), alpha]
        if b_beta:
            natural += [np.exp(b_beta[0]), b_beta[1]]
    return np.stack(natural, axis=-1)


class _LSEProblem:
    """log L ~ LSE(a - alpha x [, b - beta z], e), with x = log N, z = log D, y = log L.

    theta is (a, alpha, e) without z and (a, alpha, b, beta, e) with it. The objective is
    0.5 * sum r^2 (``delta`` None) or sum Huber_delta(r), with r = LSE(...) - y. Data may carry
    a leading batch axis (one problem per bootstrap resample); thetas always do.
    """

    def __init__(self, x, z, y, delta):
        self.x, self.z, self.y, self.delta = x, z, y, delta
        self.keys = ("a", "alpha", "e") if z is None else ("a", "alpha", "b", "beta", "e")

    def _parts(self, theta_SxU, rows=None):
        """Residuals (S, P) and d LSE / d theta [(S, P) per unknown]; ``rows``: the problems of
        batched data that ``theta_SxU`` belongs to."""
        x, z, y = self.x, self.z, self.y
        if rows is not None and x.ndim == 2:
            x, y = x[rows], y[rows]
            z = None if z is None else z[rows]
        a, alpha, *b_beta, e = theta_SxU.T[:, :, None]  # each (S, 1)
        terms = [a - alpha * x]
        if z is not None:
            b, beta = b_beta
            terms.append(b - beta * z)
        terms.append(np.broadcast_to(e, terms[0].shape))
        top = np.maximum.reduce(terms)
        exps = [np.exp(t - top) for t in terms]
        total = sum(exps)
        r = top + np.log(total) - y
        w = [ex / total for ex in exps]
        if z is None:
            return r, [w[0], -w[0] * x, w[1]]
        return r, [w[0], -w[0] * x, w[1], -w[1] * z, w[2]]

    def values(self, theta_SxU, rows=None):
        """Objective (S,) and its gradient (S, U) for a batch of parameter vectors."""
        r, dlse = self._parts(theta_SxU, rows)
        if self.delta is None:
            value, psi = 0.5 * np.sum(r**2, axis=-1), r
        else:
            d = self.delta
            absr = np.abs(r)
            value = np.sum(np.where(absr <= d, 0.5 * r**2, d * (absr - 0.5 * d)), axis=-1)
            psi = np.clip(r, -d, d)
        grad = np.stack([np.sum(psi * g, axis=-1) for g in dlse], axis=-1)
        return value, grad

    def polish(self, start):
        """scipy's L-BFGS-B from ``start``, to tight tolerances (a single problem)."""

        def fun(theta):
            value, grad = self.values(theta[None])
            return float(value[0]), grad[0]

        result = optimize.minimize(
            fun, start, jac=True, method="L-BFGS-B", options={"maxiter": 2000, "ftol": 1e-15}
        )
        return result.x, float(result.fun)

    def best(self, grid) -> tuple[np.ndarray, list[np.ndarray]]:
        """L-BFGS from every start of the ``grid`` at once, the best few distinct ends polished
        by scipy's L-BFGS-B: (lowest, polished ends lowest first: ``bootstrap``'s restarts)."""
        starts_SxU = np.array(list(itertools.product(*(grid[k] for k in self.keys))), dtype=float)
        theta, value = batched_lbfgs(self.values, starts_SxU)
        order = np.argsort(np.where(np.isfinite(value), value, np.inf))
        candidates: list[np.ndarray] = []
        for i in order:
            if not np.isfinite(value[i]):
                break
            if all(np.max(np.abs(theta[i] - t)) > 1e-3 for t in candidates):
                candidates.append(theta[i])
            if len(candidates) == BOOTSTRAP_RESTARTS:
                break
        if not candidates:
            raise FitError("no start of the optimiser reached a finite objective")
        polished = sorted((self.polish(t) for t in candidates), key=lambda item: item[1])
        return polished[0][0], [t for t, _ in polished]

    def bootstrap(self, resamples_RxP, restarts) -> np.ndarray:
        """Refit every resample at once, L-BFGS from each of ``restarts`` (the thetas ``best``
        returns); (R, U) thetas of the best restart per resample."""
        starts = np.array(restarts)
        count, k = len(starts), starts.shape[1]
        if len(resamples_RxP) == 0:
            return np.zeros((0, k))
        idx = np.repeat(resamples_RxP, count, axis=0)
        z = None if self.z is None else self.z[idx]
        batch = _LSEProblem(self.x[idx], z, self.y[idx], self.delta)
        theta, value = batched_lbfgs(batch.values, np.tile(starts, (len(resamples_RxP), 1)))
        value = np.where(np.isfinite(value), value, np.inf).reshape(-1, count)
        best = np.argmin(value, axis=1)
        theta = theta.reshape(-1, count, k)[np.arange(len(best)), best]
        return theta[np.isfinite(value[np.arange(len(best)), best])]

    def stderr(self, theta) -> np.ndarray:
        """Gauss-Newton standard errors of (E, A, alpha) for the squared loss."""
        k = len(theta)
        dof = self.y.shape[-1] - k
        if dof <= 0:
            return np.full(k, np.nan)
        r, dlse = self._parts(np.asarray(theta)[None])
        jac = np.stack([g[0] for g in dlse], axis=1)
        try:
            cov = np.sum(r**2) / dof * np.linalg.inv(jac.T @ jac)
        except np.linalg.LinAlgError:
            return np.full(k, np.nan)
        se = np.sqrt(np.clip(np.diag(cov), 0, None))
        a, _, e = theta
        return np.array([np.exp(e) * se[2], np.exp(a) * se[0], se[1]])  # E = e^e, A = e^a


HALVINGS = 6
_dot = functools.partial(np.einsum, "ij,ij->i")  # row by row: (S, U) and (S, U) -> (S,)


def batched_lbfgs(fun, theta_SxU, *, memory=10, max_iter=300, gtol=1e-10, ftol=1e-10):
    """Minimise S independent problems at once with L-BFGS and a backtracking Armijo search.

    ``fun(theta, rows) -> (values, grads)`` evaluates the problems ``rows`` (all when None) at
    ``theta`` (len(rows), U). A problem stops when its gradient is below ``gtol``, a step gains
    less than ``ftol`` relative, or a steepest-descent search finds no decrease (a failed
    L-BFGS direction is retried as steepest descent). Returns (theta (S, U), values (S,)).
    """
    theta = np.array(theta_SxU, dtype=float)
    with np.errstate(all="ignore"):
        value, grad = fun(theta, None)
        s_hist, y_hist = np.zeros((memory, *theta.shape)), np.zeros((memory, *theta.shape))
        rho = np.zeros((memory, len(theta)))
        fresh = np.ones(len(theta), dtype=bool)  # no history yet: steepest descent, short step
        active = np.isfinite(value) & np.all(np.isfinite(grad), axis=1)
        for it in range(max_iter):
            active &= np.max(np.abs(grad), axis=1) > gtol
            a = np.flatnonzero(active)  # only the problems still running cost anything
            if not len(a):
                break
            g0, x0, f0 = grad[a], theta[a], value[a]
            newest = (it - 1) % memory
            direction, slope, reset = _direction(g0, s_hist[:, a], y_hist[:, a], rho[:, a], newest)
            rho[:, a[reset]], fresh[a[reset]] = 0, True
            x1, f1, g1, accepted = _line_search(fun, a, x0, f0, g0, direction, slope, fresh[a])
            scale = np.maximum(np.maximum(np.abs(f0), np.abs(f1)), 1e-300)
            # Only a failed steepest-descent search means convergence; L-BFGS ones are retried.
            retry = ~accepted & ~fresh[a]
            rho[:, a[retry]], fresh[a] = 0, retry
            active[a] = (accepted & (f0 - f1 > ftol * scale)) | retry
            s_new, y_new = x1 - x0, g1 - g0
            curv = _dot(s_new, y_new)
            keep = accepted & (curv > 1e-300)
            s_hist[it % memory, a] = np.where(keep[:, None], s_new, 0)
            y_hist[it % memory, a] = np.where(keep[:, None], y_new, 0)
            rho[it % memory, a] = np.where(keep, 1 / np.where(keep, curv, 1), 0)
            theta[a], value[a], grad[a] = x1, f1, g1
    return theta, value


def _direction(g_SxU, s_WxSxU, y_WxSxU, rho_WxS, newest):
    """L-BFGS two-loop recursion for S problems: gradients g_SxU, ring buffers of W (s, y) pairs
    last written at slot ``newest`` (rho = 0: empty). Returns direction (S, U), slope along g
    (S,) and reset (S,): non-descent directions, replaced by -g; the caller clears their history."""
    order = (newest - np.arange(len(rho_WxS))) % len(rho_WxS)  # newest pair first
    q, alphas = g_SxU.copy(), np.zeros(rho_WxS.shape)
    for i in order:
        alphas[i] = rho_WxS[i] * _dot(s_WxSxU[i], q)
        q -= alphas[i][:, None] * y_WxSxU[i]
    sy, yy = _dot(s_WxSxU[newest], y_WxSxU[newest]), _dot(y_WxSxU[newest], y_WxSxU[newest])
    gamma = np.where(rho_WxS[newest] > 0, sy / np.where(yy > 0, yy, 1), 1.0)
    r = gamma[:, None] * q
    for i in order[::-1]:
        r += s_WxSxU[i] * (alphas[i] - rho_WxS[i] * _dot(y_WxSxU[i], r))[:, None]
    direction = -r
    slope = _dot(direction, g_SxU)
    reset = ~(slope < 0) | ~np.isfinite(slope)
    direction[reset] = -g_SxU[reset]
    slope[reset] = -_dot(g_SxU[reset], g_SxU[reset])
    return direction, slope, reset


def _line_search(fun, rows_S, x0_SxU, f0_S, g0_SxU, direction_SxU, slope_S, first_S):
    """Backtracking Armijo search for S problems (``rows_S`` of ``fun``) from x0 along
    ``direction_SxU``; ``first_S`` marks unscaled directions (no history). Returns (x1 (S, U),
    f1 (S,), g1 (S, U), accepted (S,)); x1, f1, g1 stay x0, f0, g0 where none was accepted."""
    step, accepted = np.ones(len(rows_S)), np.zeros(len(rows_S), dtype=bool)
    # An unscaled direction is as long as the gradient: a first step of at most 1.
    step[first_S] = np.minimum(1.0, 1.0 / np.max(np.abs(g0_SxU[first_S]), axis=1))
    x1, f1, g1 = x0_SxU.copy(), f0_S.copy(), g0_SxU.copy()
    # The full step first (usually taken), then HALVINGS smaller ones per call: t/2, t/4, ...
    for attempt in range(1 + 60 // HALVINGS):
        idx = np.flatnonzero(~accepted)
        if not len(idx):
            break
        tries = 1 if attempt == 0 else HALVINGS
        shrink = 0.5 ** np.arange(attempt > 0, tries + (attempt > 0))
        t = step[idx, None] * shrink  # (m, tries)
        trial = x0_SxU[idx, None, :] + t[..., None] * direction_SxU[idx, None, :]
        v, g = fun(trial.reshape(-1, trial.shape[-1]), np.repeat(rows_S[idx], tries))
        v, g = v.reshape(t.shape), g.reshape(trial.shape)
        ok = np.isfinite(v) & (v <= f0_S[idx, None] + 1e-4 * t * slope_S[idx, None])
        found = ok.any(axis=1)
        pick, done = np.argmax(ok, axis=1)[found], idx[found]
        x1[done], f1[done], g1[done] = trial[found, pick], v[found, pick], g[found, pick]
        accepted[done] = True
        step[idx[~found]] *= shrink[-1]
    return x1, f1, g1, accepted
