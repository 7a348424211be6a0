"""Figures of the compute-optimal analyses, in the style of Figures 3-5 (``figures``)."""

from __future__ import annotations

import textwrap

import matplotlib
import numpy as np

from lmuscale.analysis.figures import (
    MARKERS,
    NOTE_WIDTH,
    STYLE,
    add_notes,
    color,
    human,
    interval,
    log_axis,
    panels,
    sci,
    side_legend,
)
from lmuscale.analysis.results import MIN_SIZES, label

STAR = {"ms": 9, "mec": "black", "mew": 0.5, "zorder": 5}  # a chosen optimum


def isoflop_figure(frontiers, unit: str, ci: float = 0.95):
    """Loss against N at each budget, one panel per family: the runs (the spread of seeds
    as a bar), the fitted parabola, and its minimum N_opt with its ``ci`` interval."""
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
                    label=f"{label(fit.family)}, C = {sci(fit.budget)} FLOPs",
                )
                _hollow(ax, fit.runs, MARKERS.get(fit.family, "o"), tint)
                if fit.n_opt is not None:
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
                    notes.append(f"{label(fit.family)}, C = {fit.budget:.3g}: {fit.error}.")
            ax.set_title(f"{label(frontier.family)}: IsoFLOP curves (* = N_opt, {ci:.0%} CI)")
            if any(r.branch_from for fit in frontier.fits for r in fit.runs):
                notes.append(f"{label(frontier.family)}: hollow points are cooldown branches.")
            log_axis(ax, "x")
            ax.set_xlabel("non-embedding parameters N")
            ax.set_ylabel(f"validation loss ({unit})")
        side_legend(fig)
        add_notes(fig, notes, NOTE_WIDTH + 30)
    return fig


def optimal_figure(frontiers, envelopes=()):
    """N_opt(C) and, where there are IsoFLOP minima, D_opt(C) of every family: the minima with
    their CIs, the fitted power laws (exponent and CI in the legend; drawn only over the
    budgets when fitted on fewer than 3) and, where given, the N along the lower envelope of the
    evaluation curves (Chinchilla's approach 1) with its power law."""
    notes = []
    minima = [[f for f in fr.fits if f.n_opt is not None] for fr in frontiers]
    with matplotlib.rc_context(STYLE):
        fig, axes = panels(2 if any(minima) else 1)
        for frontier, fits in zip(frontiers, minima, strict=True):
            c = color(frontier.family)
            if frontier.error:
                notes.append(f"{label(frontier.family)}: {frontier.error}.")
            n_panel = ("n_opt", frontier.n_line, "a", frontier.a)
            d_panel = ("d_opt", frontier.d_line, "b", frontier.b)
            for ax, (which, line, symbol, exponent) in zip(axes, (n_panel, d_panel), strict=False):
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
                    zorder=3,
                    label=f"{label(frontier.family)}, IsoFLOP minima",
                )
                if line is None or exponent is None:
                    continue
                text = f"{label(frontier.family)} fit: {symbol} = {_interval(exponent)}"
                few = len(fits) < 3
                if few:
                    text += f", {len(fits)} budgets, not extrapolated"
                grid = _span(budget, 1.0 if few else 1.25)
                ax.plot(
                    grid, _power(line, grid), color=c, lw=1.2, ls="--" if few else "-", label=text
                )
        for envelope in envelopes:
            if envelope.error or len(envelope.flops) == 0:
                if envelope.error:
                    notes.append(f"{label(envelope.family)} envelope: {envelope.error}.")
                continue
            # the points the exponent was fitted to: not those reached by the smallest or the
            # largest size, where the optimum may lie beyond the sizes tried
            used = np.asarray(envelope.used, bool)
            c, name = color(envelope.family), label(envelope.family)
            flops = envelope.flops[used]
            axes[0].plot(
                flops,
                envelope.n[used],
                ".",
                color=c,
                ms=3,
                alpha=0.35,
                zorder=1,
                label=f"{name}, lower envelope",
            )
            if envelope.a is not None and envelope.line is not None:
                grid = _span(flops, 1.0)
                text = f"{name} envelope fit: a = {_interval(envelope.a)}"
                sizes = len(np.unique(envelope.n[used]))
                if sizes < MIN_SIZES:
                    text += f", {sizes} sizes"
                    notes.append(
                        f"{name} envelope fit: its points lie at {sizes} distinct sizes, too few "
                        f"(under {MIN_SIZES}) for its exponent to be more than a line between them."
                    )
                axes[0].plot(
                    grid,
                    _power(envelope.line, grid),
                    color=c,
                    lw=1,
                    ls=":",
                    alpha=0.5 if sizes < MIN_SIZES else 1.0,
                    zorder=2,
                    label=text,
                )
        for ax, what in zip(
            axes, ("N_opt (non-embedding parameters)", "D_opt (tokens)"), strict=False
        ):
            log_axis(ax, "x", sci)
            log_axis(ax, "y")
            ax.set_xlabel("compute C (training FLOPs)")
            ax.set_ylabel(what)
        axes[0].set_title("Compute-optimal model size")
        if len(axes) > 1:
            axes[1].set_title("Compute-optimal training tokens")
        else:
            notes.append("No IsoFLOP minima: the compute-optimal tokens D_opt are not drawn.")
        names = list(dict.fromkeys(label(x.family) for x in (*frontiers, *envelopes)))
        # each family's entries together, its minima first
        side_legend(fig, lambda t: (names.index(t.split(",")[0].split()[0]), "minima" not in t))
        add_notes(fig, notes, NOTE_WIDTH + 30)
    return fig


def tokens_figure(curves, efficiency, unit: str):
    """Validation loss against training tokens, one panel per family and one tint per size
    (darker = larger N; a size's runs at several budgets share it), the target loss, where each
    run reaches it, and the data-efficiency ratio at that loss."""
    notes = []
    families = sorted({c.run.family for c in curves}, key=lambda f: f != efficiency.families[0])
    with matplotlib.rc_context(STYLE):
        fig, axes = panels(len(families))
        for ax, family in zip(axes, families, strict=True):
            if ax is not axes[0]:  # the same scales, so the panels compare at a glance
                ax.sharex(axes[0])
                ax.sharey(axes[0])
            mine = [c for c in curves if c.run.family == family]
            sizes = sorted({c.run.n for c in mine})
            for n, tint in zip(sizes, _tints(family, len(sizes)), strict=True):
                for curve in (c for c in mine if c.run.n == n):
                    text = f"{label(family)}, N = {human(n)}"  # one legend entry per size
                    ax.plot(curve.tokens, curve.loss, color=tint, lw=0.9, label=text)
                    _branch_point(ax, curve, tint)
            reached = [efficiency.reached.get(c.run.trial) for c in mine]
            reached = [r for r in reached if r is not None]
            last = ax is axes[-1]  # the legend's shared entries after every size
            ax.plot(
                reached,
                [efficiency.target] * len(reached),
                "o",
                ms=3,
                color=color(family),
                zorder=3,
                label="reaches the target loss" if last else None,
            )
            ax.axhline(
                efficiency.target,
                color="black",
                lw=0.7,
                ls="--",
                label="target loss" if last else None,
            )
            ax.set_title(label(family))
            log_axis(ax, "x")
            ax.set_xlabel("training tokens")
            ax.set_ylabel(f"validation loss ({unit})")
        a, b = (label(f) for f in efficiency.families)
        if efficiency.ratio_geomean is not None:
            title = (
                f"{b} needs {efficiency.ratio_geomean:.3g}x the tokens of {a} to reach a loss "
                f"of {efficiency.target:.3f} (geometric mean over {len(efficiency.n)} sizes "
                "at equal N)"
            )
        else:
            title = f"Tokens to reach {efficiency.target:.3f}"
            notes.append(f"Data efficiency: {efficiency.error}.")
        inches = side_legend(fig)
        width = fig.get_size_inches()[0] - inches  # centred over the axes, clear of the legend
        text = "\n".join(textwrap.wrap(title, int(width * 12)))
        fig.suptitle(text, x=width / 2 / (width + inches), fontsize=STYLE["axes.titlesize"])
        if any(c.run.branch_from for c in curves):
            notes.append(
                "x: where a cooldown branch leaves its stable run (the curve before it is the "
                "stable run's)."
            )
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
                name = f"{label(family)}, N = {human(choice.n)}"
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
            log_axis(ax, "x", sci)
            ax.set_xlabel("peak learning rate")
            ax.set_ylabel(f"final validation loss ({unit})")
            ax.set_title(f"{label(family)}: loss against learning rate (* = chosen)")
        side_legend(fig)
        add_notes(fig, notes, NOTE_WIDTH + 30)
    return fig


def _tints(family: str, k: int) -> list[tuple]:
    """``k`` shades of the family's colour, from pale (mixed with white) to the colour itself."""
    rgb = np.array(matplotlib.colors.to_rgb(color(family)))
    shades = np.linspace(0.35, 1.0, k) if k > 1 else np.ones(1)
    return [tuple(1 - shade * (1 - rgb)) for shade in shades]


def _hollow(ax, runs, marker: str, tint) -> None:
    """Draw the sizes whose runs are all cooldown branches hollow, over their points."""
    n, mean, _, _ = _spread(runs)
    branch = [all(r.branch_from for r in runs if r.n == size) for size in n]
    if any(branch):
        mask = np.array(branch)
        ax.plot(n[mask], mean[mask], marker, ms=4, mfc="white", mec=tint, ls="none", zorder=4)


def _branch_point(ax, curve, tint) -> None:
    """An x on a branch's curve at the last evaluation before it left its stable run."""
    run = curve.run
    if run.branch_from and run.branch_step:
        at = run.branch_step * run.batch_tokens
        before = np.flatnonzero(curve.tokens <= at)
        if before.size:
            i = before[-1]
            ax.plot(curve.tokens[i], curve.loss[i], "x", ms=5, color=tint, zorder=4)


def _spread(runs):
    """Per distinct N: the mean loss and the lowest and highest (the seeds' spread)."""
    n = np.array(sorted({run.n for run in runs}))
    losses = [[run.loss for run in runs if run.n == size] for size in n]
    mean, lo, hi = (np.array([f(v) for v in losses]) for f in (np.mean, np.min, np.max))
    return n, mean, lo, hi


def _interval(value) -> str:
    return interval(value.estimate, value.lo, value.hi)


def _span(x, factor: float) -> np.ndarray:
    return np.geomspace(np.min(x) / factor, np.max(x) * factor, 50)


def _power(line, x):
    return 10 ** (line[0] * np.log10(x) + line[1])
