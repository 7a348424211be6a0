"""Fits tested by extrapolation, and predictions with intervals for a new run.

A ``Law`` is a fitted form with what its prediction interval needs. Fits are to log L, so the
interval for one new run's loss is log L^ +- t_(dof) sqrt(g' Cov g + s^2): Cov the Gauss-Newton
covariance of the parameters (exact OLS for the power law; for the Huber-fitted Chinchilla form
an approximation), s^2 the residual variance, dof the residual degrees of freedom. With 5 sizes
and a saturating law this covers a held-out size's loss at its nominal rate; a normal quantile
in place of t does not (tests/test_extrapolate.py). A ``Line`` is an IsoFLOP frontier
(log10 N_opt or D_opt on log10 C) with each budget's bootstrap variance. ``holdout`` and
``line_holdout`` refit without the largest sizes (budgets) and predict them; ``save_fits`` and
``load_fits`` are fits.json, which ``python -m lmuscale.scaling predict`` reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import optimize, stats

from lmuscale.files import atomic_write_json, read_tagged_json
from lmuscale.outcomes import DataError
from lmuscale.scaling.fits import FITTERS, FORMS, Fit, FitError, check_ci, human

FORMAT = "lmuscale.fits"
VERSION = 1
FORM_NAMES = {
    "power_law": "power law",
    "saturating": "saturating",
    "chinchilla": "Chinchilla",
    "n_opt": "N_opt ∝ C^a",
    "d_opt": "D_opt ∝ C^b",
}


@dataclass(frozen=True)
class Law:
    """A fitted form (``FORMS``) and its prediction interval's needs: ``cov`` (k, k) of the
    parameters, None where the data cannot give one (``why`` says why); ``sigma``: the residual
    SD of log L (nats, over ``dof`` degrees of freedom)."""

    form: str
    estimate: np.ndarray
    cov: np.ndarray | None
    sigma: float
    dof: int
    why: str | None = None
    family: str = ""
    name: str = ""
    tokens: float | None = None  # the training budget of a one-budget fit
    steps: float | None = None
    learning_rate: float | None = None
    trials: tuple[str, ...] = ()
    n: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    loss: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    points_tokens: np.ndarray | None = field(default=None, repr=False)

    @property
    def params(self) -> dict[str, float]:
        return dict(zip(FORMS[self.form], map(float, self.estimate), strict=True))

    def predict(self, n, tokens=None) -> np.ndarray:
        """The fitted loss (nats) at ``n`` (and ``tokens`` for "chinchilla")."""
        return np.exp(_log_model(self.form, self.estimate, n, tokens)[0])

    def interval(self, n, tokens=None, *, ci: float = 0.9):
        """(predicted, low, high) losses at ``n``: the ``ci`` prediction interval for one new
        run; low and high are NaN where there is none (``why``)."""
        check_ci(ci)
        log_l, grad_PxK = _log_model(self.form, self.estimate, n, tokens)
        if self.cov is None:
            nan = np.full(log_l.shape, np.nan)
            return np.exp(log_l), nan, nan
        var = np.einsum("...i,ij,...j->...", grad_PxK, self.cov, grad_PxK) + self.sigma**2
        half = stats.t.ppf(0.5 + ci / 2, self.dof) * np.sqrt(np.maximum(var, 0))
        return np.exp(log_l), np.exp(log_l - half), np.exp(log_l + half)

    def n_for_loss(self, target: float, *, ci: float = 0.9, top: float = 1e18):
        """(N, low, high): the N at which a saturating law reaches ``target``, and the N whose
        prediction interval holds ``target`` (high is inf when it does up to ``top``)."""
        if self.form != "saturating":
            raise ValueError(f"only a saturating law can be inverted, not {self.form}")
        e, a, alpha = self.estimate
        if target <= e:
            raise FitError(
                f"{self.name or self.family}: a target loss of {target:g} is at or below this "
                f"fit's E = {e:.4g}, which no N reaches"
            )
        n = (a / (target - e)) ** (1 / alpha)
        if self.cov is None:
            return n, math.nan, math.nan
        grid = np.geomspace(1.0, top, 2000)
        _, low, high = self.interval(grid, ci=ci)
        inside = (low <= target) & (target <= high)
        if not inside.any():  # the band is narrower than the grid's spacing: n itself
            return n, n, n

        def edge(i, j, bound):  # where the interval's ``bound`` (1 low, 2 high) is target
            def f(x):
                return float(self.interval(math.exp(x), ci=ci)[bound]) - target

            return math.exp(optimize.brentq(f, math.log(grid[i]), math.log(grid[j])))

        first, last = np.flatnonzero(inside)[[0, -1]]
        lo = grid[0] if first == 0 else edge(first - 1, first, 1)
        return n, lo, math.inf if last == len(grid) - 1 else edge(last, last + 1, 2)


def law(fit: Fit, **meta) -> Law:
    """The ``Law`` of ``fit`` (its Gauss-Newton covariance at the estimate); ``meta``: Law's
    descriptive fields (family, name, tokens, steps, learning_rate, trials)."""
    log_l, jac_PxK = _log_model(fit.form, fit.estimate, fit.n, fit.tokens)
    residual = np.log(fit.loss) - log_l
    k = len(fit.estimate)
    dof = len(fit.loss) - k
    data = {"n": fit.n, "loss": fit.loss, "points_tokens": fit.tokens}
    if dof <= 0:
        why = f"{len(fit.loss)} points for {k} parameters leave no residual to measure noise"
        return Law(fit.form, fit.estimate, None, math.nan, dof, why, **data, **meta)
    sigma = float(np.sqrt(residual @ residual / dof))
    # in relative (log) units for the positive parameters, so that J'J is well conditioned
    scale = np.array([abs(v) if p in ("Nc", "E", "A", "B") else 1.0 for p, v in fit.params.items()])
    scaled = jac_PxK * scale
    if not np.all(np.isfinite(scaled)) or np.linalg.matrix_rank(scaled) < k:
        why = "the points cannot tell the parameters apart"
        return Law(fit.form, fit.estimate, None, sigma, dof, why, **data, **meta)
    cov = sigma**2 * np.linalg.inv(scaled.T @ scaled) * np.outer(scale, scale)
    return Law(fit.form, fit.estimate, cov, sigma, dof, None, **data, **meta)


def _log_model(form, estimate, n, tokens=None):
    """log L at ``n`` (P,) and its gradient in the parameters (P, k)."""
    n = np.asarray(n, dtype=float)
    p = dict(zip(FORMS[form], np.asarray(estimate, dtype=float), strict=True))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if form == "power_law":
            log_ratio = np.log(p["Nc"]) - np.log(n)
            grad = [np.broadcast_to(p["alpha"] / p["Nc"], n.shape), log_ratio]
            return p["alpha"] * log_ratio, np.stack(grad, axis=-1)
        term_a = n ** -p["alpha"]
        loss = p["E"] + p["A"] * term_a
        grad = [np.ones_like(n), term_a, -p["A"] * term_a * np.log(n)]
        if form == "chinchilla":
            if tokens is None:
                raise ValueError("a chinchilla law needs tokens to predict")
            d = np.asarray(tokens, dtype=float)
            term_b = d ** -p["beta"]
            loss = loss + p["B"] * term_b
            grad += [term_b, -p["B"] * term_b * np.log(d)]
        return np.log(loss), np.stack(np.broadcast_arrays(*grad), axis=-1) / loss[..., None]


@dataclass(frozen=True)
class Heldout:
    """One held-out run (or budget, for a frontier) and its prediction: losses in nats, or
    N_opt / D_opt for "n_opt" / "d_opt"; ``x``: the run's N (the budget's FLOPs)."""

    family: str
    name: str
    form: str
    held_out: int  # how many of the largest sizes (budgets) the refit left out
    trial: str
    x: float
    tokens: float | None
    measured: float
    predicted: float
    lo: float
    hi: float
    n_points: int  # points the refit used
    why: str | None = None  # why lo and hi are NaN

    @property
    def error(self) -> float:
        return self.predicted - self.measured

    @property
    def covered(self) -> bool:
        return bool(self.lo <= self.measured <= self.hi)


@dataclass(frozen=True)
class Refusal:
    family: str
    name: str
    form: str
    held_out: int
    why: str


@dataclass
class Extrapolation:
    """The hold-out tests: predictions of held-out runs, and the tests the data refused."""

    ci: float
    records: list[Heldout] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)

    def extend(self, other: Extrapolation) -> Extrapolation:
        self.records += other.records
        self.refusals += other.refusals
        return self

    def markdown(self) -> list[str]:
        out = ["## Fits tested by extrapolation", ""]
        out += [
            f"Each fit again without its largest size (then the largest two); each held-out "
            f"run's loss against the {self.ci:.0%} prediction interval for one run.",
            "",
        ]
        losses = [r for r in self.records if r.form in FITTERS]
        if losses:
            out += [
                "| fit | form | held out | trial | N | measured | predicted [lo, hi] | "
                "error (nats) | covered |",
                "|---|---|---:|---|---:|---:|---|---:|---|",
            ]
            out += [
                f"| {r.name} | {FORM_NAMES[r.form]} | {r.held_out} | {r.trial} | "
                f"{human(r.x)} | {r.measured:.4f} | {r.predicted:.4f} {_bracket(r, '.4f')} | "
                f"{r.error:+.4f} | {_yes(r)} |"
                for r in losses
            ]
        lines = [r for r in self.records if r.form not in FITTERS]
        if lines:
            out += [
                "",
                "| frontier | line | held-out budget C | measured | predicted [lo, hi] | "
                "predicted / measured | covered |",
                "|---|---|---:|---:|---|---:|---|",
            ]
            out += [
                f"| {r.name} | {FORM_NAMES[r.form]} | {r.x:.3g} | {human(r.measured)} | "
                f"{human(r.predicted)} {_bracket(r, None)} | {r.predicted / r.measured:.3g} | "
                f"{_yes(r)} |"
                for r in lines
            ]
        if not self.records:
            out.append("No fit could be tested: see the last section.")
        return [*out, ""]

    def csv_rows(self) -> list[dict]:
        """Rows in fits.csv's columns: a held-out run's predicted loss (with its interval) and
        its measured loss; one row with ``error`` per refused test."""

        def test(r: Heldout | Refusal) -> dict:
            fit = f"{r.name}, holding out {r.held_out}"
            return {"fit": fit, "family": r.family, "form": r.form, "ci": self.ci}

        rows = []
        for r in self.records:
            what = f"N={human(r.x)}" if r.form in FITTERS else f"C={r.x:.3g}"
            quantity = {"n_opt": "N_opt", "d_opt": "D_opt"}.get(r.form, "loss")
            common = {**test(r), "n_points": r.n_points, "tokens": r.tokens}
            lo, hi = (r.lo, r.hi) if np.isfinite(r.lo) else (None, None)
            pre = f"{quantity} at {what} ({r.trial})"
            rows.append(
                {**common, "parameter": f"{pre}, predicted", "estimate": r.predicted}
                | {"ci_low": lo, "ci_high": hi}
            )
            rows.append({**common, "parameter": f"{pre}, measured", "estimate": r.measured})
        return rows + [{**test(r), "error": r.why} for r in self.refusals]


def _bracket(r: Heldout, fmt) -> str:
    if not np.isfinite(r.lo):
        return f"(no interval: {r.why})"
    show = human if fmt is None else (lambda v: format(v, fmt))
    return f"[{show(r.lo)}, {show(r.hi)}]"


def _yes(r: Heldout) -> str:
    return "—" if not np.isfinite(r.lo) else ("yes" if r.covered else "**no**")


def holdout(
    form: str,
    n,
    loss,
    tokens=None,
    *,
    trials=None,
    family: str = "",
    name: str = "",
    ci: float = 0.9,
    held_out=(1, 2),
    grid=None,
) -> Extrapolation:
    """Refit ``form`` without the runs at the largest ``k`` distinct N, for each k in
    ``held_out``, and predict each held-out run's loss with its ``ci`` prediction interval.
    A k the data cannot support (too few sizes left for any residual) is a ``Refusal``.
    ``grid``: the nonlinear forms' starts (default: their fitter's)."""
    check_ci(ci)
    n = np.asarray(n, dtype=float)
    loss = np.asarray(loss, dtype=float)
    tokens = None if tokens is None else np.asarray(tokens, dtype=float)
    trials = [f"#{i}" for i in range(len(n))] if trials is None else list(trials)
    name = name or family
    result = Extrapolation(ci)
    sizes = np.unique(n)
    k_params = len(FORMS[form])
    for k in held_out:
        keep = n < sizes[-k] if k < len(sizes) else np.zeros(len(n), bool)
        left = len(np.unique(n[keep]))
        if form != "chinchilla" and left <= k_params:
            why = (
                f"{left} sizes left for {k_params} parameters; needs {k_params + 1} to leave a "
                "residual to measure the noise"
            )
            result.refusals.append(Refusal(family, name, form, k, why))
            continue
        if form == "chinchilla" and keep.sum() <= k_params:
            why = f"{keep.sum()} runs left for {k_params} parameters"
            result.refusals.append(Refusal(family, name, form, k, why))
            continue
        data = (n[keep], loss[keep]) if tokens is None else (n[keep], tokens[keep], loss[keep])
        try:
            starts = {} if grid is None else {"grid": grid}
            fitted = law(FITTERS[form](*data, n_boot=0, ci=ci, **starts))
        except FitError as e:
            result.refusals.append(Refusal(family, name, form, k, str(e)))
            continue
        out = ~keep
        d = None if tokens is None else tokens[out]
        predicted, lo, hi = fitted.interval(n[out], d, ci=ci)
        for i, j in enumerate(np.flatnonzero(out)):
            result.records.append(
                Heldout(
                    family,
                    name,
                    form,
                    k,
                    trials[j],
                    float(n[j]),
                    None if tokens is None else float(tokens[j]),
                    float(loss[j]),
                    float(predicted[i]),
                    float(lo[i]),
                    float(hi[i]),
                    int(keep.sum()),
                    fitted.why,
                )
            )
    return result


@dataclass(frozen=True)
class Line:
    """log10 y = slope log10 C + intercept by least squares through bracketed budgets: ``x``
    log10 C (J,), ``y`` log10 N_opt or D_opt (J,), ``var`` the variance of each y (J,)."""

    x: np.ndarray
    y: np.ndarray
    var: np.ndarray

    def interval(self, budget, *, ci: float = 0.9, own_var=None):
        """(predicted, low, high) of y at ``budget`` FLOPs as a new budget would measure it:
        the wider of (a) a normal interval from the budgets' variances (the line's, plus
        ``own_var`` for the new one; default: that of the budget nearest in log C) and (b) with
        3 or more budgets, the OLS prediction interval from the scatter about the line (Student's
        t on J - 2 dof), which also holds a frontier that is not quite a line."""
        check_ci(ci)
        x = np.log10(np.asarray(budget, dtype=float))
        slope, intercept = np.polyfit(self.x, self.y, 1)
        centre = self.x.mean()
        sxx = np.sum((self.x - centre) ** 2)
        # the prediction is sum_j c_j y_j
        c_XxJ = 1 / len(self.x) + np.multiply.outer(x - centre, self.x - centre) / sxx
        if own_var is None:
            own_var = self.var[np.argmin(np.abs(np.subtract.outer(x, self.x)), axis=-1)]
        half = stats.norm.ppf(0.5 + ci / 2) * np.sqrt(c_XxJ**2 @ self.var + own_var)
        dof = len(self.x) - 2
        if dof > 0:
            s2 = np.sum((self.y - (slope * self.x + intercept)) ** 2) / dof
            ols = stats.t.ppf(0.5 + ci / 2, dof) * np.sqrt(s2 * (1 + np.sum(c_XxJ**2, axis=-1)))
            half = np.fmax(half, ols)
        y = slope * x + intercept
        return 10**y, 10 ** (y - half), 10 ** (y + half)


def line_holdout(line: Line, *, family="", name="", form="n_opt", ci=0.9) -> Extrapolation:
    """Refit ``line`` without its largest budget and predict that budget's y (with its own
    variance) with the ``ci`` interval; a ``Refusal`` with fewer than 3 budgets."""
    result = Extrapolation(ci)
    name = name or family
    if len(line.x) < 3:
        why = f"{len(line.x)} bracketed budgets; a line and a held-out one need 3"
        result.refusals.append(Refusal(family, name, form, 1, why))
        return result
    order = np.argsort(line.x)
    rest, last = order[:-1], order[-1]
    short = Line(line.x[rest], line.y[rest], line.var[rest])
    budget = float(10 ** line.x[last])
    predicted, lo, hi = (float(v) for v in short.interval(budget, ci=ci, own_var=line.var[last]))
    measured = float(10 ** line.y[last])
    trial = f"C={budget:.3g}"
    why = None if np.isfinite(lo) else "a budget's parabola leaves no residual to measure noise"
    record = (family, name, form, 1, trial, budget, None, measured, predicted, lo, hi, len(rest))
    result.records.append(Heldout(*record, why))
    return result


def save_fits(path, laws: list[Law], frontiers: dict[str, dict[str, Line]], flops: dict) -> None:
    """fits.json, atomically: the ``laws``, each family's frontier lines ("n_opt", "d_opt") and
    its training FLOPs per token as log10 f = slope log10 N + intercept (``flops``: family ->
    (slope, intercept))."""

    def num(v):
        return None if v is None or not np.isfinite(v) else float(v)

    def arr(v):
        return None if v is None else [num(x) for x in np.ravel(v)]

    payload = {
        "format": FORMAT,
        "version": VERSION,
        "fits": [
            {
                "family": w.family,
                "name": w.name,
                "form": w.form,
                "tokens": num(w.tokens),
                "steps": num(w.steps),
                "learning_rate": num(w.learning_rate),
                "trials": list(w.trials),
                "n": arr(w.n),
                "loss": arr(w.loss),
                "points_tokens": arr(w.points_tokens),
                "parameters": dict(zip(FORMS[w.form], arr(w.estimate), strict=True)),
                "cov": None if w.cov is None else np.asarray(w.cov).tolist(),
                "sigma": num(w.sigma),
                "dof": w.dof,
                "why_no_interval": w.why,
            }
            for w in laws
        ],
        "frontiers": {
            family: {
                key: {"log10_C": arr(v.x), "log10_y": arr(v.y), "var": arr(v.var)}
                for key, v in lines.items()
            }
            for family, lines in frontiers.items()
        },
        "flops_per_token": {
            family: {"slope": num(s), "intercept": num(i)} for family, (s, i) in flops.items()
        },
    }
    atomic_write_json(path, payload)


@dataclass
class FitsFile:
    path: Path
    laws: list[Law]
    frontiers: dict[str, dict[str, Line]]
    flops: dict[str, tuple[float, float]]

    def flops_per_token(self, family: str, n):
        """Training FLOPs per token at ``n``, or None without a line for ``family``."""
        if family not in self.flops:
            return None
        slope, intercept = self.flops[family]
        return 10 ** (slope * np.log10(n) + intercept)


def load_fits(path) -> FitsFile:
    """Read fits.json; a ``DataError`` names the file and the key that is wrong."""
    path = Path(path)
    hint = " (python -m lmuscale.analysis writes fits.json)"
    top = read_tagged_json(path, FORMAT, VERSION, DataError, "fits file", hint)

    def get(obj, key, where, kind=None):
        if not isinstance(obj, dict) or key not in obj:
            raise DataError(f"{path}: {where} has no {key!r}")
        value = obj[key]
        if kind is not None and value is not None and not isinstance(value, kind):
            what = "a number" if kind == (int, float) else f"a {kind.__name__}"
            raise DataError(f"{path}: {where}.{key} is {value!r}, not {what}")
        return value

    def floats(obj, key, where, optional=False):
        value = get(obj, key, where)
        if value is None and optional:
            return None
        try:
            return np.array(value, dtype=float)
        except (TypeError, ValueError):
            raise DataError(f"{path}: {where}.{key} is {value!r}, not numbers") from None

    laws = []
    for i, item in enumerate(get(top, "fits", "the file", list)):
        where = f"fits[{i}]"
        form = get(item, "form", where, str)
        if form not in FORMS:
            raise DataError(f"{path}: {where}.form is {form!r}, not one of {', '.join(FORMS)}")
        params = get(item, "parameters", where, dict)
        estimate = np.array([floats(params, p, f"{where}.parameters") for p in FORMS[form]])
        cov = floats(item, "cov", where, optional=True)
        if cov is not None and cov.shape != (len(estimate),) * 2:
            raise DataError(f"{path}: {where}.cov has shape {cov.shape}, not k x k")
        sigma = get(item, "sigma", where, (int, float))
        laws.append(
            Law(
                form,
                estimate,
                cov,
                math.nan if sigma is None else float(sigma),
                int(get(item, "dof", where, int)),
                get(item, "why_no_interval", where, str),
                get(item, "family", where, str),
                get(item, "name", where, str),
                get(item, "tokens", where, (int, float)),
                get(item, "steps", where, (int, float)),
                get(item, "learning_rate", where, (int, float)),
                tuple(get(item, "trials", where, list)),
                floats(item, "n", where),
                floats(item, "loss", where),
                floats(item, "points_tokens", where, optional=True),
            )
        )
        problem = _broken(laws[-1])
        if problem:
            raise DataError(f"{path}: {where} ({laws[-1].name or form}): {problem}")
    frontiers = {}
    for family, lines in get(top, "frontiers", "the file", dict).items():
        frontiers[family] = {}
        for key, v in lines.items():
            where = f"frontiers.{family}.{key}"
            arrays = [floats(v, k, where) for k in ("log10_C", "log10_y", "var")]
            if len({a.shape for a in arrays}) > 1 or arrays[0].ndim != 1:
                shapes = ", ".join(str(a.shape) for a in arrays)
                raise DataError(f"{path}: {where}: log10_C, log10_y and var have shapes {shapes}")
            x, y, var = arrays  # a var is NaN where a budget's parabola had 3 sizes
            if (
                not (np.isfinite(x).all() and np.isfinite(y).all())
                or (var < 0).any()
                or (np.isinf(var).any())
            ):
                raise DataError(f"{path}: {where}: values that are not finite, or a negative var")
            frontiers[family][key] = Line(*arrays)
    flops = {}
    for family, v in get(top, "flops_per_token", "the file", dict).items():
        where = f"flops_per_token.{family}"
        line = [get(v, key, where, (int, float)) for key in ("slope", "intercept")]
        if None in line or not all(map(math.isfinite, line)):
            raise DataError(f"{path}: {where} has a slope or intercept that is not a number")
        flops[family] = (float(line[0]), float(line[1]))
    return FitsFile(path, laws, frontiers, flops)


SCALES = ("Nc", "A", "B")  # the parameters that are positive by the forms' definition


def _broken(w: Law) -> str | None:
    """The first of ``w``'s invariants that fails (what ``law`` makes always holds them)."""
    for name, value in w.params.items():
        if not math.isfinite(value) or (name in SCALES and value <= 0):
            kind = "positive" if name in SCALES else "finite"
            return f"parameter {name} is {value}, not a {kind} number"
    points = len(w.loss)
    lengths = {"n": len(w.n), "loss": points}
    if w.points_tokens is not None or w.form == "chinchilla":
        lengths["points_tokens"] = -1 if w.points_tokens is None else len(w.points_tokens)
    if len(set(lengths.values())) > 1 or w.n.ndim != 1 or w.loss.ndim != 1:
        return "the point lists differ in length: " + ", ".join(
            f"{k} {v}" for k, v in lengths.items()
        )
    data = [w.n, w.loss] + ([] if w.points_tokens is None else [w.points_tokens])
    if not all(np.isfinite(a).all() and (a > 0).all() for a in data):
        return "a point's n, loss or tokens is not a positive number"
    k = len(w.estimate)
    if w.dof != points - k:
        return f"dof is {w.dof}, but {points} points and {k} parameters leave {points - k}"
    if not (math.isnan(w.sigma) or 0 <= w.sigma < math.inf):
        return f"sigma is {w.sigma}, not a standard deviation (>= 0)"
    if w.cov is not None:
        if math.isnan(w.sigma) or w.dof <= 0:
            return "a covariance without a residual sigma over positive dof"
        if not np.isfinite(w.cov).all():
            return "its covariance is not finite"
        sd = np.sqrt(np.abs(np.diag(w.cov)))
        if (np.abs(w.cov - w.cov.T) > 1e-6 * np.outer(sd, sd)).any():
            return "its covariance is not symmetric"  # beyond an inverse's rounding
        if (np.diag(w.cov) < 0).any():
            return "its covariance has a negative variance"
    return None
