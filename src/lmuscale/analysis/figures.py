"""Figures 3, 4 and 5 of the LMU paper from a results table, as matplotlib figures.

Every figure keeps its notes (what is missing, what was left out and why) in a text panel
under the axes, so nothing is silently absent and no text sits on top of the data.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib import ticker
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lmuscale.analysis.fitting import find
from lmuscale.analysis.results import LMU_FAMILIES, Results, label
from lmuscale.files import atomic_write_bytes
from lmuscale.scaling import (
    LMU_G_PAPER,
    LMU_PAPER,
    LSTM,
    PAPER_STEPS,
    transformer_loss,
)
from lmuscale.scaling.fits import human

COLORS = {
    "lmu": "#1f77b4",
    "lmu_g": "#2ca02c",
    "transformer": "#d62728",
    "sru": "#b8860b",  # not in color()'s palette for unknown families
    "sru_pp": "#008080",
    "lstm": "#9467bd",
}
MARKERS = {"lmu": "o", "lmu_g": "s", "transformer": "^", "sru": "v", "sru_pp": "P", "lstm": "D"}
REFERENCE_COLOR = "#555555"
PAPER_SIZES = (55_000, 1_000_000)  # the range of the paper's Figure 3
STYLE = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "legend.fontsize": 7.5,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.grid": True,
    "grid.alpha": 0.3,
}
DPI = 200
SMOOTH = 1.2  # Figure 4's smoothing window: positions within this factor either side
NOTE_WIDTH = 90  # characters per line of the notes under the axes
PANEL = 4.6  # inches of figure width per axes


def color(family: str) -> str:
    extra = ("#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
    return COLORS.get(family, extra[sum(map(ord, family)) % len(extra)])


def sci(x: float) -> str:
    """2e14 -> "2 x 10^14" (in mathtext), 1e14 -> "10^14": FLOP counts in axis ticks and labels."""
    if not x > 0:
        return f"{x:g}"
    exponent = int(np.floor(np.log10(x)))
    mantissa = f"{x / 10.0**exponent:.2g}"
    if mantissa == "10":  # rounding carried into the next power
        mantissa, exponent = "1", exponent + 1
    power = f"10^{{{exponent}}}"
    return f"${power}$" if mantissa == "1" else f"${mantissa}{{\\times}}{power}$"


def interval(estimate: float, lo: float, hi: float, fmt: str = ".2f", ci=None) -> str:
    """ "0.65 [0.61, 0.70]" ("0.65, 95% CI [...]" with ``ci``), or "0.65 (no interval)" where the
    interval is unresolved: an end that is not finite, or no width."""
    text = f"{estimate:{fmt}}"
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        return f"{text} (no interval)"
    level = "" if ci is None else f", {ci:.0%} CI"
    return f"{text}{level} [{lo:{fmt}}, {hi:{fmt}}]"


class CountLocator(ticker.Locator):
    """Major ticks of a log axis at 10^k where 3 are in view, else at the sparsest of 1, 2, 5 x
    10^k, 1, 2, 3, 5 x 10^k and every multiple of 10^k with 2 in view (else linear steps); at
    most 8."""

    def __call__(self):
        return self.tick_values(*self.axis.get_view_interval())

    def tick_values(self, vmin, vmax):
        lo, hi = sorted((vmin, vmax))
        if not (lo > 0 and np.isfinite(hi)):
            return []
        k = np.arange(np.floor(np.log10(lo)), np.ceil(np.log10(hi)) + 1)
        for subs, least in (
            ((1,), 3),
            ((1, 2, 5), 2),
            ((1, 2, 3, 5), 2),
            (range(1, 10), 2),
            (None, 0),
        ):
            ticks = (
                np.outer(10.0**k, subs).ravel()
                if subs
                else ticker.MaxNLocator(3).tick_values(lo, hi)
            )
            ticks = ticks[(ticks >= lo * (1 - 1e-9)) & (ticks <= hi * (1 + 1e-9))]
            if len(ticks) >= least:
                return ticks[:: -(-len(ticks) // 8)]


def log_axis(ax, which: str, text=human) -> None:
    """A log ``which`` ("x" or "y") axis of counts: major ticks labelled by ``text`` (``human``,
    or ``sci`` for FLOPs), minor ticks unlabelled."""
    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_locator(CountLocator())
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: text(v)))
    axis.set_minor_formatter(ticker.NullFormatter())


def figure3(results: Results, fits):
    """Loss against non-embedding parameters at the base budget, log-log: measured points,
    power-law fits with bootstrap CI bands, and (for GPT-2 tokens) the reference curves. Like
    Figures 4 and 5, of the paper-grid runs (``Results.grid``) alone."""
    results = results.grid()
    base = results.base_tokens
    notes = []
    with matplotlib.rc_context(STYLE):
        fig, (ax,) = panels(1)
        sizes = []
        for family in results.families:
            runs = results.group(family, base)
            if not runs:
                budgets = ", ".join(human(t) for t in results.budgets(family))
                notes.append(
                    f"{label(family)} has no run at {human(base)} tokens (only {budgets})."
                )
                continue
            sizes += _measured(ax, runs, fits, f"{label(family)} (measured)", notes)
        lo, hi = min(sizes), max(sizes)
        if results.gpt2_tokens:
            lo, hi = min(lo, PAPER_SIZES[0]), max(hi, PAPER_SIZES[1])
            grid = np.geomspace(lo / 1.25, hi * 1.25, 200)
            ax.plot(
                grid,
                transformer_loss(grid, PAPER_STEPS),
                color=REFERENCE_COLOR,
                lw=1.3,
                label="Transformer, 25k steps (Kaplan eq. 1.6)",
            )
            ax.plot(grid, LSTM(grid), color=REFERENCE_COLOR, ls="--", lw=1.3, label=LSTM.label)
            for curve, family in ((LMU_PAPER, "lmu"), (LMU_G_PAPER, "lmu_g")):
                ax.plot(grid, curve(grid), color=color(family), ls=":", lw=1.5, label=curve.label)
        else:
            notes.append(
                "Reference curves (Kaplan's transformer, the LSTM, the paper's LMU fits) are "
                f"in nats per GPT-2 token; these losses are {results.unit}, so the curves are "
                "left out."
            )
        notes += _skipped(results)
        steps = _steps_at(results, base)
        ax.set_title(f"{_split(results)} loss after {human(base)} tokens ({steps:,.0f} steps)")
        _axes(ax, results, lo, hi)
        side_legend(fig)
        add_notes(fig, notes)
    return fig


def figure4(results: Results, size: float | None = None):
    """Per-position loss against token position (log x) for each family at the run nearest in
    log N to ``size`` (default: the largest LMU)."""
    results = results.grid()
    base = results.base_tokens
    notes = []
    if size is None:
        lmus = [r for r in results.runs if r.family in LMU_FAMILIES and r.tokens == base]
        size = max(r.n for r in (lmus or [r for r in results.runs if r.tokens == base]))
    with matplotlib.rc_context(STYLE):
        fig, (ax,) = panels(1)
        drawn = 0
        for family in results.families:
            runs = results.group(family, base)
            if not runs:
                continue
            run = min(runs, key=lambda r: abs(np.log(r.n / size)))
            if not run.per_position:
                notes.append(
                    f"{label(family)}: {run.trial} has no {results.split}_per_position "
                    "in the results."
                )
                continue
            loss = np.asarray(run.per_position, dtype=float)
            position = np.arange(1, len(loss) + 1)
            ax.plot(position, loss, color=color(family), lw=0.6, alpha=0.3)
            text = f"{label(family)} (N = {human(run.n)}, {run.trial})"
            ax.plot(position, smooth_log(loss), color=color(family), lw=1.6, label=text)
            drawn += 1
        for family in ("lmu", "lmu_g", "transformer"):
            if not results.group(family, base):
                notes.append(f"No {label(family)} run at {human(base)} tokens in the results.")
        if drawn:
            notes.append(
                f"Thin: each position's loss. Thick: the mean over positions within a factor "
                f"{SMOOTH:g} either side (a window that is constant in log position)."
            )
        else:
            notes.append("Nothing to draw: no run has per-position losses.")
            ax.text(0.5, 0.5, "no per-position losses", ha="center", transform=ax.transAxes)
        notes += _skipped(results)
        log_axis(ax, "x")
        ax.set_xlabel("Position in the context (tokens)")
        ax.set_ylabel(f"{_split(results)} loss at that position ({results.unit})")
        ax.set_title(f"Per-position {results.split} loss at N ≈ {human(size)}")
        if drawn:
            side_legend(fig)
        add_notes(fig, notes)
    return fig


def figure5(results: Results, fits):
    """The LMU families at their budget against the transformer at more tokens: measured
    transformer runs at the largest budget above the LMU's where the sweep has them, and
    Kaplan's L(N, S) at that budget (10x without such runs) for GPT-2 tokens."""
    results = results.grid()
    base = results.base_tokens
    base_steps = _steps_at(results, base)
    notes = []
    with matplotlib.rc_context(STYLE):
        fig, (ax,) = panels(1)
        sizes = []
        for family in LMU_FAMILIES:
            runs = results.group(family, base)
            if not runs:
                notes.append(f"No {label(family)} run at {human(base)} tokens in the results.")
                continue
            sizes += _measured(ax, runs, fits, f"{label(family)}, {human(base)} tokens", notes)
        longest = max((t for t in results.budgets("transformer") if t > base), default=None)
        more = 10.0 if longest is None else longest / base
        if longest is not None:
            runs = results.group("transformer", longest)
            text = f"Transformer, {human(longest)} tokens (measured)"
            sizes += _measured(ax, runs, fits, text, notes, hollow=True)
        if not sizes:
            sizes = [r.n for r in results.runs]
        if results.gpt2_tokens:
            grid = np.geomspace(min(sizes) / 1.25, max(sizes) * 1.25, 200)
            steps = more * base_steps
            ax.plot(
                grid,
                transformer_loss(grid, steps, base / base_steps),
                color=REFERENCE_COLOR,
                lw=1.3,
                ls="--",
                label=f"Transformer, {steps:,.0f} steps (Kaplan eq. 1.6)",
            )
        elif longest is None:
            runs = results.group("transformer", base)
            more = 1.0
            if not runs:
                notes.append(
                    "No transformer run in the results, and Kaplan's curve is for GPT-2 tokens "
                    f"({results.unit} here): there is nothing to compare against."
                )
            else:
                sizes += [r.n for r in runs]
                ax.scatter(
                    [r.n for r in runs],
                    [r.loss for r in runs],
                    color=REFERENCE_COLOR,
                    marker=MARKERS["transformer"],
                    s=22,
                    zorder=2,
                    label=f"Transformer, {human(base)} tokens (same budget)",
                )
                notes.append(
                    "No transformer run at more than the LMU's budget, and Kaplan's curve is for "
                    f"GPT-2 tokens ({results.unit} here): the transformer shown has the same "
                    "budget."
                )
        notes += _skipped(results)
        ax.set_title(
            f"LMU at {human(base)} tokens vs. transformer at {human(more * base)} "
            f"({more:.3g}x the tokens)"
        )
        _axes(ax, results, min(sizes), max(sizes))
        side_legend(fig)
        add_notes(fig, notes)
    return fig


def smooth_log(values, factor: float = SMOOTH):
    """Mean of ``values`` (position 1, 2, ...) over positions [t / factor, t * factor] for each
    t: noise averages out at long context without blurring the first few tokens."""
    values = np.asarray(values, dtype=float)
    position = np.arange(1, len(values) + 1)
    low = np.clip(np.ceil(position / factor).astype(int), 1, len(values))
    high = np.clip(np.floor(position * factor).astype(int), 1, len(values))
    total = np.concatenate([[0.0], np.cumsum(values)])
    return (total[high] - total[low - 1]) / (high - low + 1)


def save(fig, path_without_suffix: Path) -> list[Path]:
    """Write ``.png`` and ``.pdf`` atomically; returns the paths."""
    paths = []
    for suffix in (".png", ".pdf"):
        buffer = io.BytesIO()
        stamp = {"CreationDate": None} if suffix == ".pdf" else None  # same bytes each time
        fig.savefig(buffer, format=suffix[1:], dpi=DPI, metadata=stamp)
        path = Path(f"{path_without_suffix}{suffix}")
        atomic_write_bytes(path, buffer.getvalue())
        paths.append(path)
    return paths


def panels(k: int):
    """A figure of its own (not pyplot's, so nothing accumulates and any backend works) with
    ``k`` axes side by side, and a second grid row that ``add_notes`` fills."""
    fig = Figure(figsize=(max(9.0, PANEL * k + 0.8), 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    spec = fig.add_gridspec(2, k, height_ratios=[1, 0.001])
    return fig, [fig.add_subplot(spec[0, i]) for i in range(k)]


def side_legend(fig, key=None) -> float:
    """One legend of every axes' labelled artists (once per label, sorted by ``key`` of the
    label if given) to the right of the axes, where it cannot cover a point or a curve, in
    columns of at most 24; the figure widens so each axes keeps ``PANEL`` inches. Returns the
    legend's width in inches."""
    entries = {}
    for ax in fig.axes:
        for handle, text in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(text, handle)
    if key is not None:
        entries = dict(sorted(entries.items(), key=lambda item: key(item[0])))
    if not entries:
        return 0.0
    legend = fig.legend(
        entries.values(),
        entries.keys(),
        loc="outside right upper",
        frameon=False,
        ncols=1 + (len(entries) - 1) // 24,
    )
    inches = legend.get_window_extent(fig.canvas.get_renderer()).width / fig.dpi
    width, height = fig.get_size_inches()
    fig.set_size_inches(max(width, PANEL * len(fig.axes) + 0.8 + inches), height)
    return inches


def add_notes(fig, notes: list[str], width: int = NOTE_WIDTH) -> None:
    """Put the notes in a text panel under the axes (the figure grows to fit them), wrapped at
    ``width`` characters."""
    if not notes:
        return
    lines = [line for note in notes for line in textwrap.wrap(note, width)]
    height = 0.16 * len(lines) + 0.1
    width, old = fig.get_size_inches()
    fig.set_size_inches(width, old + height)
    spec = fig.axes[0].get_subplotspec().get_gridspec()
    spec.set_height_ratios([old, height])
    panel = fig.add_subplot(spec[1, :])
    panel.axis("off")
    panel.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=7.5, transform=panel.transAxes)


def _measured(ax, runs, fits, text: str, notes: list[str], hollow=False) -> list[float]:
    """One group's points (hollow, with a dashed fit, for a second budget of a family) and
    its power-law fit with the CI band; returns the sizes drawn."""
    family, tokens = runs[0].family, runs[0].tokens
    n = np.array([r.n for r in runs])
    fill = {"facecolors": "none", "edgecolors": color(family)} if hollow else {"c": color(family)}
    ax.scatter(
        n,
        [r.loss for r in runs],
        marker=MARKERS.get(family, "o"),
        s=34 if hollow else 28,
        zorder=3,
        label=text,
        **fill,
    )
    _draw_fit(ax, find(fits, family, tokens, "power_law"), n, notes, ls="--" if hollow else "-")
    return list(n)


def _draw_fit(ax, group_fit, n, notes, ls="-") -> None:
    if group_fit is None:
        return
    if group_fit.fit is None:
        notes.append(f"{group_fit.name}: no power-law fit ({group_fit.error}).")
        return
    family, fit = group_fit.family, group_fit.fit
    grid = np.geomspace(min(n) / 1.15, max(n) * 1.15, 100)
    alpha = interval(fit.params["alpha"], fit.ci_low[1], fit.ci_high[1], ".3f", fit.ci)
    text = f"{label(family)} fit: $\\alpha$ = {alpha}"
    ax.plot(grid, fit.predict(grid), color=color(family), ls=ls, lw=1.6, label=text)
    low, high = fit.band(grid)
    if np.all(np.isfinite(low)):
        ax.fill_between(grid, low, high, color=color(family), alpha=0.15, lw=0)
    else:
        notes.append(f"{group_fit.name}: too few usable bootstrap resamples for a CI band.")


def _axes(ax, results: Results, lo, hi) -> None:
    """N from ``lo`` to ``hi`` on x and the loss on y, both log, with readable ticks."""
    log_axis(ax, "x")
    ax.set_xlim(lo / 1.3, hi * 1.3)
    ax.set_xlabel("Non-embedding parameters N")
    ax.set_yscale("log")
    ax.set_ylabel(f"{_split(results)} loss ({results.unit})")
    lo, hi = ax.get_ylim()
    span = hi - lo
    steps = [s for s in (0.02, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0) if span / s <= 8]
    if not steps:  # a range this wide: at 1, 2, 5 x 10^k
        log_axis(ax, "y")
        return
    step = steps[0]
    ticks = np.arange(np.ceil(lo / step) * step, hi + 1e-9, step)
    ax.yaxis.set_major_locator(ticker.FixedLocator(ticks))
    ax.yaxis.set_major_formatter(
        ticker.FuncFormatter(lambda y, _: f"{y:.2f}".rstrip("0").rstrip("."))
    )
    ax.yaxis.set_minor_locator(ticker.NullLocator())


def _split(results: Results) -> str:
    return {"test": "Test", "val": "Validation"}[results.split]


def _steps_at(results: Results, tokens: float) -> float:
    return float(np.median([r.steps for r in results.runs if r.tokens == tokens]))


def _skipped(results: Results) -> list[str]:
    if not results.skipped:
        return []
    return [f"Left out ({len(results.skipped)}): " + "; ".join(results.skipped)]
