"""The analysis's fits tested by extrapolation (``extrapolate``), its fits.json
(``write_fits_json``) and the figure of predicted against measured held-out values."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
from matplotlib.lines import Line2D

from lmuscale.analysis.figures import STYLE, add_notes, color, human, panels
from lmuscale.analysis.results import label
from lmuscale.scaling.extrapolate import (
    FITTERS,
    FORM_NAMES,
    Extrapolation,
    Line,
    holdout,
    law,
    line_holdout,
    save_fits,
)

MARKERS = {"power_law": "o", "saturating": "s", "chinchilla": "D", "n_opt": "^", "d_opt": "v"}


def extrapolate(group_fits, frontiers, *, ci: float = 0.9) -> Extrapolation:
    """Hold-out tests of every fitted ``GroupFit`` (the largest size, then the largest two) and
    of every frontier's N_opt and D_opt lines (the largest bracketed budget)."""
    result = Extrapolation(ci)
    for g in group_fits:
        if g.fit is not None:
            f = g.fit
            grid = warm_starts(f) if g.form == "chinchilla" else None
            meta = dict(trials=g.trials, family=g.family, name=g.name, grid=grid)
            result.extend(holdout(g.form, f.n, f.loss, f.tokens, ci=ci, **meta))
    for frontier in frontiers:
        name = f"{label(frontier.family)}, IsoFLOP frontier"
        for form, line in frontier_lines(frontier).items():
            result.extend(line_holdout(line, family=frontier.family, name=name, form=form, ci=ci))
    return result


def warm_starts(fit) -> dict:
    """Starts for refitting a Chinchilla ``fit`` on part of its data: its own optimum and two
    values of each parameter around it (3^5 = 243 starts, not the 4,500 of a first fit)."""
    p = fit.params
    own = {"a": np.log(p["A"]), "alpha": p["alpha"], "b": np.log(p["B"]), "beta": p["beta"]}
    own["e"] = np.log(p["E"])
    spread = {"a": 5.0, "alpha": 0.25, "b": 5.0, "beta": 0.25, "e": 0.5}
    return {k: own[k] + np.array([0.0, -spread[k], spread[k]]) for k in own}


def frontier_lines(frontier) -> dict[str, Line]:
    """The N_opt and D_opt lines ("n_opt", "d_opt") through a ``Frontier``'s bracketed budgets,
    each budget's variance of log10 N_opt from its parabola by the delta method (its size
    bootstrap overstated it about threefold on synthetic sweeps), and of log10 D_opt from that
    times the slope of log f on log N squared; {} with no bracketed budget."""
    good = [f for f in frontier.fits if f.n_opt is not None]
    if not good:
        return {}
    x = np.log10([f.budget for f in good])
    var_n = np.array([_vertex_var(f) for f in good])
    slope_f = np.array([_flops_slope(f.runs) for f in good])
    return {
        "n_opt": Line(x, np.log10([f.n_opt.estimate for f in good]), var_n),
        "d_opt": Line(x, np.log10([f.d_opt.estimate for f in good]), var_n * slope_f**2),
    }


def _vertex_var(fit) -> float:
    """Delta-method variance of log10 N_opt = -c1 / (2 c0) of an ``IsoFlopFit``'s parabola."""
    x = np.log10([r.n for r in fit.runs])
    loss = np.array([r.loss for r in fit.runs])
    dof = len(x) - 3
    if dof <= 0:
        return math.nan
    design = np.stack([x**2, x, np.ones_like(x)], axis=1)
    c0, c1, _ = fit.coef
    s2 = np.sum((loss - design @ np.array(fit.coef)) ** 2) / dof
    grad = np.array([c1 / (2 * c0**2), -1 / (2 * c0), 0.0])
    return float(s2 * grad @ np.linalg.pinv(design.T @ design) @ grad)


def _flops_slope(runs) -> float:
    """d log f / d log N over ``runs`` (1 with fewer than two sizes)."""
    n = np.log10([r.n for r in runs])
    if np.ptp(n) == 0:
        return 1.0
    return float(np.polyfit(n, np.log10([r.flops_per_token for r in runs]), 1)[0])


def write_fits_json(path, group_fits, frontiers, runs) -> None:
    """fits.json for ``python -m lmuscale.scaling predict``: every fitted ``GroupFit`` (with
    its runs' learning rate where they share one), the ``frontiers``' lines, and each family's
    training FLOPs per token against N (a log-log line through ``runs``)."""
    by_trial = {r.trial: r for r in runs}
    laws = []
    for g in group_fits:
        if g.fit is None:
            continue
        rates = {by_trial[t].learning_rate for t in g.trials if t in by_trial}
        rate = rates.pop() if len(rates) == 1 else None
        meta = dict(family=g.family, name=g.name, tokens=g.tokens, steps=g.steps)
        laws.append(law(g.fit, **meta, learning_rate=rate, trials=g.trials))
    lines = {f.family: frontier_lines(f) for f in frontiers}
    flops = {}
    for family in sorted({r.family for r in runs}):
        points = {(r.n, r.flops_per_token) for r in runs if r.family == family}
        points = [p for p in points if p[1] is not None]
        if len({n for n, _ in points}) >= 2:
            n, f = np.log10(np.array(sorted(points))).T
            slope, intercept = np.polyfit(n, f, 1)
            flops[family] = (float(slope), float(intercept))
    save_fits(path, laws, {k: v for k, v in lines.items() if v}, flops)


def figure(extrapolation: Extrapolation, unit: str = "nats per token"):
    """Predicted against measured for every held-out run (left; losses) and held-out budget
    (right, when a frontier was tested; N_opt and D_opt), with the prediction intervals and the
    diagonal. Colour: family; marker: form; hollow: two sizes held out."""
    records = extrapolation.records
    losses = [r for r in records if r.form in FITTERS]
    optima = [r for r in records if r.form not in FITTERS]
    notes = []
    with matplotlib.rc_context(STYLE):
        fig, axes = panels(2 if optima else 1)
        for ax, group in zip(axes, (losses, optima) if optima else (losses,), strict=True):
            values = [v for r in group for v in (r.measured, r.lo, r.hi) if np.isfinite(v)]
            span = (max(values) - min(values)) if values else 0.0
            for r in group:
                # nudged sideways by form and held-out count, so equal x stay apart
                slot = 2 * list(MARKERS).index(r.form) % 6 + r.held_out - 2.5
                x = r.measured * 1.01**slot if group is optima else r.measured + 0.008 * span * slot
                face = color(r.family) if r.held_out == 1 else "none"
                err = np.array([[r.predicted - r.lo], [r.hi - r.predicted]])
                ax.errorbar(
                    x,
                    r.predicted,
                    yerr=None if not np.isfinite(r.lo) else err,
                    fmt=MARKERS[r.form],
                    color=color(r.family),
                    mfc=face,
                    ms=5,
                    capsize=2,
                    lw=1,
                    zorder=3,
                )
            if values:
                lo, hi = min(values), max(values)
                pad = 0.05 * (hi - lo or abs(hi) or 1)
                lo, hi = lo - pad, hi + pad
                if group is optima:
                    lo, hi = min(values) / 1.3, max(values) * 1.3
                ax.plot([lo, hi], [lo, hi], color="#777777", lw=1, ls=":", zorder=1)
                ax.set_xlim(lo, hi)
                ax.set_ylim(lo, hi)
            else:
                ax.text(0.5, 0.5, "nothing held out", ha="center", transform=ax.transAxes)
        ax = axes[0]
        ax.set_xlabel(f"Measured loss of the held-out run ({unit})")
        ax.set_ylabel(f"Predicted loss ({unit})")
        ax.set_title("Fits without their largest sizes")
        if optima:
            ax = axes[1]
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("Measured at the held-out budget")
            ax.set_ylabel("Predicted by the line without it")
            ax.set_title("IsoFLOP frontiers without their largest budget")
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: human(v)))
                axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        families = sorted({r.family for r in records})
        forms = [f for f in MARKERS if any(r.form == f for r in records)]
        handles = [
            Line2D([], [], color=color(f), marker="o", ls="", label=label(f)) for f in families
        ]
        handles += [
            Line2D([], [], color="#444444", marker=MARKERS[f], ls="", label=FORM_NAMES[f])
            for f in forms
        ]
        if any(r.held_out > 1 for r in records):
            hollow = {"marker": "o", "mfc": "none", "ls": ""}
            handles.append(Line2D([], [], color="#444444", label="two held out", **hollow))
        handles.append(Line2D([], [], color="#777777", ls=":", label="predicted = measured"))
        fig.legend(handles=handles, loc="outside right upper", frameon=False)
        covered = [r.covered for r in records if np.isfinite(r.lo)]
        notes.append(
            f"Bars: {extrapolation.ci:.0%} prediction intervals for one run (one budget); "
            f"{sum(covered)} of {len(covered)} held-out values lie inside theirs. Markers at one "
            "measured value are nudged sideways to stay apart."
        )
        if extrapolation.refusals:
            count = len(extrapolation.refusals)
            notes.append(f"{count} hold-out test(s) were refused (too few sizes): see fits.md.")
        no_interval = [r for r in records if not np.isfinite(r.lo)]
        if no_interval:  # drawn without a bar
            notes.append(
                f"{len(no_interval)} prediction(s) without an interval: {no_interval[0].why}."
            )
        add_notes(fig, notes)
    return fig
