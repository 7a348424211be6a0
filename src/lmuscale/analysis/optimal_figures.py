"""Figures of the compute-optimal analyses, in the style of Figures 3-5 (``figures``)."""

from __future__ import annotations

import matplotlib
import numpy as np

from lmuscale.analysis.figures import MARKERS, NOTE_WIDTH, STYLE, add_notes, color, human, panels
from lmuscale.analysis.results import label

STAR = {"ms": 9, "mec": "black", "mew": 0.5, "zorder": 5}  # a chosen optimum


def isoflop_figure(frontiers, unit: str):
    """Loss against N at each budget, one panel per family: the runs (the spread of seeds
    as a bar), the fitted parabola, and its minimum N_opt with its CI."""
    notes = []
    with matplotlib.rc_context(STYLE):
        fig, axes = panels(len(frontiers))
        for ax, frontier in zip(axes, frontiers, strict=True):
            tints = _tints(frontier.family, len(frontier.fits))
            for fit, tint in zip(frontier.fits, tints, strict=True):
                n, mean, lo, hi = _spread(fit.runs)
                ax.errorbar(
                    n,
                    mean,
                    yerr=[mean - lo, hi - mean],
                    fmt=MARKERS.get(fit.family, "o"),
                    color=tint,
                    ms=4,
                    capsize=2,
                    lw=0.8,
                    label=f"C = {fit.budget:.2g} FLOPs",
                )
                if fit.coef is not None and fit.n_opt is not None:
                    x = np.linspace(np.log10(n.min()), np.log10(n.max()), 100)
                    ax.plot(10**x, np.polyval(fit.coef, x), color=tint, lw=1)
                    best = fit.n_opt
                    ax.errorbar(
                        [best.estimate],
                        [fit.loss_opt],
                        xerr=[[best.estimate - best.lo], [best.hi - best.estimate]],
                        fmt="*",
                        color=tint,
                        capsize=3,
                        **STAR,
                    )
                if fit.error:
                    notes.append(f"{label(fit.family)}, C = {fit.budget:.2g}: {fit.error}.")
            ax.set_title(f"{label(frontier.family)}: IsoFLOP curves (* = N_opt, 95% CI)")
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: human(x)))
            ax.set_xlabel("non-embedding parameters N")
            ax.set_ylabel(f"validation loss ({unit})")
            ax.legend(loc="best", frameon=False, fontsize=7)
        add_notes(fig, notes, NOTE_WIDTH + 30)
    return fig


def optimal_figure(frontiers, envelopes=()):
    """N_opt(C) and D_opt(C) of every family on one pair of axes: the IsoFLOP minima with
    their CIs, the fitted power laws (exponent and CI in the legend) and, where given, the
    N along the lower envelope of the evaluation curves (Chinchilla's approach 1)."""
    notes = []
    with matplotlib.rc_context(STYLE):
        fig, (ax_n, ax_d) = panels(2)
        for frontier in frontiers:
            c = color(frontier.family)
            fits = [f for f in frontier.fits if f.n_opt is not None]
            if frontier.error:
                notes.append(f"{label(frontier.family)}: {frontier.error}.")
            for ax, which, line, symbol, exponent in (
                (ax_n, "n_opt", frontier.n_line, "a", frontier.a),
                (ax_d, "d_opt", frontier.d_line, "b", frontier.b),
            ):
                if not fits:
                    continue
                budget = np.array([f.budget for f in fits])
                value = [getattr(f, which) for f in fits]
                est = np.array([v.estimate for v in value])
                err = [est - [v.lo for v in value], [v.hi for v in value] - est]
                ax.errorbar(
                    budget,
                    est,
                    yerr=err,
                    fmt=MARKERS.get(frontier.family, "o"),
                    color=c,
                    capsize=3,
                    ms=5,
                    label=f"{label(frontier.family)}, IsoFLOP minima",
                )
                if line is not None and exponent is not None:
                    grid = np.geomspace(budget.min() / 1.5, budget.max() * 1.5, 50)
                    ax.plot(
                        grid,
                        10 ** (line[0] * np.log10(grid) + line[1]),
                        color=c,
                        lw=1.2,
                        label=f"{label(frontier.family)} fit: {symbol} = "
                        f"{exponent.estimate:.2f} [{exponent.lo:.2f}, {exponent.hi:.2f}]",
                    )
        for envelope in envelopes:
            if envelope.error or len(envelope.flops) == 0:
                if envelope.error:
                    notes.append(f"{label(envelope.family)} envelope: {envelope.error}.")
                continue
            a = envelope.a
            text = "" if a is None else f", a = {a.estimate:.2f} [{a.lo:.2f}, {a.hi:.2f}]"
            # the points the exponent was fitted to: not those reached by the smallest or the
            # largest size, where the optimum may lie beyond the sizes tried
            used = np.asarray(envelope.used, bool)
            ax_n.plot(
                envelope.flops[used],
                envelope.n[used],
                color=color(envelope.family),
                lw=0.8,
                ls=":",
                drawstyle="steps-post",
                label=f"{label(envelope.family)}, lower envelope{text}",
            )
        for ax, what in ((ax_n, "N_opt (non-embedding parameters)"), (ax_d, "D_opt (tokens)")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("compute C (training FLOPs)")
            ax.set_ylabel(what)
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: human(x)))
            if ax.get_legend_handles_labels()[0]:  # D_opt is empty with envelopes alone
                ax.legend(loc="upper left", frameon=False, fontsize=6.5)
        ax_n.set_title("Compute-optimal model size")
        ax_d.set_title("Compute-optimal training tokens")
        add_notes(fig, notes, NOTE_WIDTH + 30)
    return fig


def tokens_figure(curves, efficiency, unit: str):
    """Validation loss against training tokens, one line per run (darker = larger N), the
    target loss, where each run reaches it, and the data-efficiency ratio at that loss."""
    notes = []
    with matplotlib.rc_context(STYLE):
        fig, (ax,) = panels(1)
        families = sorted({c.run.family for c in curves}, key=lambda f: f != efficiency.families[0])
        for family in families:
            runs = sorted((c for c in curves if c.run.family == family), key=lambda c: c.run.n)
            legend = f"{label(family)} (N {human(runs[0].run.n)} to {human(runs[-1].run.n)})"
            for curve, tint in zip(runs, _tints(family, len(runs)), strict=True):
                shown = legend if curve is runs[0] else None  # one legend entry per family
                ax.plot(curve.tokens, curve.loss, color=tint, lw=0.9, label=shown)
                reached = efficiency.reached.get(curve.run.trial)
                if reached is not None:
                    ax.plot([reached], [efficiency.target], "o", ms=3, color=color(family))
        ax.axhline(efficiency.target, color="black", lw=0.7, ls="--")
        a, b = (label(f) for f in efficiency.families)
        if efficiency.ratio_geomean is not None:
            title = (
                f"{b} needs {efficiency.ratio_geomean:.2g}x the tokens of {a} to reach a loss "
                f"of {efficiency.target:.3f}\n(geometric mean over {len(efficiency.n)} sizes "
                "at equal N)"
            )
        else:
            title = f"Tokens to reach {efficiency.target:.3f}"
            notes.append(f"Data efficiency: {efficiency.error}.")
        ax.set_title(title)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: human(x)))
        ax.set_xlabel("training tokens")
        ax.set_ylabel(f"validation loss ({unit})")
        ax.legend(loc="upper right", frameon=False)
        not_reached = sorted(t for t, v in efficiency.reached.items() if v is None)
        if not_reached:
            shown = ", ".join(not_reached[:6]) + (", ..." if len(not_reached) > 6 else "")
            notes.append(
                f"{len(not_reached)} run(s) never reach the target, or reach it before their "
                f"first evaluation ({shown}); fits.md lists each size left out."
            )
        add_notes(fig, notes, NOTE_WIDTH + 30)
    return fig


def learning_rate_figure(choices, unit: str):
    """Final loss against learning rate, one line per size, one panel per family; the rate
    chosen for each size is a star (hollow where the best lies at the edge of the grid)."""
    notes = []
    families = sorted({c.family for c in choices})
    with matplotlib.rc_context(STYLE):
        fig, axes = panels(len(families))
        for ax, family in zip(axes, families, strict=True):
            mine = sorted((c for c in choices if c.family == family), key=lambda c: c.n)
            for choice, tint in zip(mine, _tints(family, len(mine)), strict=True):
                name = f"N = {human(choice.n)}"
                ax.plot(
                    choice.learning_rates, choice.loss, "-o", color=tint, ms=3, lw=0.9, label=name
                )
                best = np.interp(
                    np.log10(choice.best), np.log10(choice.learning_rates), choice.loss
                )
                face = tint if choice.bracketed else "white"  # hollow: at the edge of the grid
                ax.plot([choice.best], [best], "*", color=face, **STAR)
                if not choice.bracketed:
                    notes.append(
                        f"{label(family)}, N = {human(choice.n)}: the best rate is at the edge "
                        f"of the grid ({choice.grid_best:g}); extend the grid there."
                    )
            ax.set_xscale("log")
            ax.set_xlabel("peak learning rate")
            ax.set_ylabel(f"final validation loss ({unit})")
            ax.set_title(f"{label(family)}: loss against learning rate (* = chosen)")
            ax.legend(loc="upper center", frameon=False, fontsize=6.5, ncols=2)
        add_notes(fig, notes, NOTE_WIDTH + 30)
    return fig


def _tints(family: str, k: int) -> list[tuple]:
    """``k`` shades of the family's colour, from pale (mixed with white) to the colour itself."""
    rgb = np.array(matplotlib.colors.to_rgb(color(family)))
    shades = np.linspace(0.35, 1.0, k) if k > 1 else np.ones(1)
    return [tuple(1 - shade * (1 - rgb)) for shade in shades]


def _spread(runs):
    """Per distinct N: the mean loss and the lowest and highest (the seeds' spread)."""
    n = np.array(sorted({run.n for run in runs}))
    losses = [[run.loss for run in runs if run.n == size] for size in n]
    mean, lo, hi = (np.array([f(v) for v in losses]) for f in (np.mean, np.min, np.max))
    return n, mean, lo, hi
