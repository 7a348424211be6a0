"""``python -m lmuscale.analysis`` on a compute-optimal sweep: it picks the analyses the table
supports, draws their figures and adds their estimates to fits.md and fits.csv."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from figure_checks import legend_covers_data, text_overlaps, tick_problems

from lmuscale.analysis import analyse, load_results
from lmuscale.analysis import optimal_figures as figures
from lmuscale.analysis.curves import Curve
from lmuscale.analysis.efficiency import data_efficiency
from lmuscale.analysis.figures import human
from lmuscale.analysis.isoflop import Envelope, Interval, fit_frontier
from lmuscale.analysis.learning_rate import read_learning_rates
from lmuscale.analysis.optimal import compute_optimal
from lmuscale.analysis.results import Run, label

# A known L(N, D) per family; the transformer's data term is 4x weaker per token (it needs
# about 4^(1/beta) ... more tokens for the same data term).
LAW = {
    "lmu": dict(E=1.7, A=60.0, alpha=0.34, B=400.0, beta=0.30),
    "transformer": dict(E=1.7, A=60.0, alpha=0.34, B=600.0, beta=0.30),
}
BATCH_TOKENS = 1024


def loss(family, n, d):
    p = LAW[family]
    return p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d ** p["beta"]


def n_opt(family, c):
    """The analytic minimiser of loss(N, C / 6N) over N."""
    grid = np.geomspace(1e2, 1e9, 20001)
    return grid[np.argmin(loss(family, grid, c / (6 * grid)))]


def sweep(root: Path, budgets=(1e14, 1e15, 1e16), seeds=(0,), rates=None, branches=None) -> Path:
    """A results table and trial folders (eval.jsonl) of an IsoFLOP grid drawn from LAW, f = 6N,
    with 0.2% multiplicative noise on the final losses; ``branches``: (family, budget) whose
    runs the table calls cooldown branches (of a stable run, at 80% of their steps)."""
    rng = np.random.default_rng(0)
    rows = []
    for family in LAW:
        for c in budgets:
            centre = n_opt(family, c)
            for n in centre * np.geomspace(0.25, 4, 7):
                n = round(n)
                steps = max(20, round(c / (6 * n) / BATCH_TOKENS))
                for seed in seeds:
                    trial = f"{family}-{n}-{c:.0e}-s{seed}"
                    folder = root / "trials" / trial
                    folder.mkdir(parents=True)
                    evals = np.unique(np.geomspace(steps / 20, steps, 12).round().astype(int))
                    lines = [
                        json.dumps({"step": int(s), "val_loss": loss(family, n, s * BATCH_TOKENS)})
                        for s in evals
                    ]
                    (folder / "eval.jsonl").write_text("\n".join(lines) + "\n")
                    final = loss(family, n, steps * BATCH_TOKENS) * math.exp(rng.normal(0, 0.002))
                    rows.append(
                        dict(
                            trial=trial, family=family, N=n, steps=steps,
                            tokens=steps * BATCH_TOKENS, flops_per_token=6.0 * n,
                            val_loss=final, test_loss=final, status="finished",
                            folder=trial, seed=seed, learning_rate=1e-3,  # as a sweep: in trials/
                        )
                    )  # fmt: skip
                    if (family, c) == branches:
                        rows[-1].update(
                            branch_from=f"{family}-{n}-stable", branch_step=steps * 4 // 5
                        )
    for family, n, lr, extra in rates or ():
        trial = f"{family}-{n}-lr{lr:g}"
        rows.append(
            dict(
                trial=trial, family=family, N=n, steps=100, tokens=100 * BATCH_TOKENS,
                flops_per_token=6.0 * n, val_loss=3.0 + extra, test_loss=3.0 + extra,
                status="finished", learning_rate=lr, seed=0,
            )
        )  # fmt: skip
    table = root / "results.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return table


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    root = tmp_path_factory.mktemp("isoflop")
    rates = [
        ("lmu", 5000, lr, 0.2 * (math.log10(lr) - math.log10(3e-3)) ** 2)
        for lr in (1e-3, 3e-3, 1e-2)
    ]
    # the transformer's largest budget as cooldown branches: the same numbers, marked
    table = sweep(root, rates=rates, branches=("transformer", 1e16))
    report = analyse(table, root / "analysis", split="val", n_boot=100)
    return root, report


def test_fits_and_figures_mark_the_cooldown_branches(analysed):
    root, report = analysed
    text = (root / "analysis" / "fits.md").read_text()
    assert "- Cooldown branches: 7 runs are warmup-stable-decay cooldowns" in text
    assert "  - Transformer, IsoFLOP: rests on 7 branch(es) of its 21 runs" in text
    assert "LMU, IsoFLOP: rests on" not in text
    assert "Transformer / LMU tokens: rests on" in text  # its curves include the 7
    iso = figures.isoflop_figure(report.optimal.frontiers, "nats")
    hollow = [
        line
        for ax in iso.axes
        for line in ax.get_lines()
        if line.get_markerfacecolor() in ("white", (1.0, 1.0, 1.0, 1.0))
    ]
    assert len(hollow) == 1 and len(hollow[0].get_xdata()) == 7
    notes = " ".join(t.get_text() for ax in iso.axes for t in ax.texts)
    assert "Transformer: hollow points are cooldown branches." in notes
    curves = list(report.optimal.curves.values())
    tokens = figures.tokens_figure(curves, report.optimal.efficiency[0], "nats")
    marks = [line for ax in tokens.axes for line in ax.get_lines() if line.get_marker() == "x"]
    assert len(marks) == 7
    for fig in (iso, tokens):
        plt.close(fig)


def test_every_figure_and_table_is_written(analysed):
    root, report = analysed
    out = root / "analysis"
    for name in ("isoflop", "optimal", "tokens_lmu_transformer", "learning_rate"):
        for suffix in (".png", ".pdf"):
            assert (out / f"{name}{suffix}") in report.files
            assert (out / f"{name}{suffix}").stat().st_size > 10_000
    assert read_learning_rates(out / "learning_rates.json").lookup("lmu", 5000) == pytest.approx(
        3e-3, rel=1e-6
    )
    text = (out / "fits.md").read_text()
    for section in ("IsoFLOP minima", "Lower envelope", "Data efficiency", "Learning rates"):
        assert section in text
    forms = {row["form"] for row in csv.DictReader((out / "fits.csv").open())}
    assert {"isoflop", "frontier", "envelope", "data_efficiency", "lr"} <= forms


def test_the_frontier_exponent_is_the_laws(analysed):
    _, report = analysed
    for frontier in report.optimal.frontiers:
        # the learning-rate runs (one size at 3 rates, one budget) are no IsoFLOP curve
        assert [len({r.n for r in fit.runs}) for fit in frontier.fits] == [7, 7, 7]
        p = LAW[frontier.family]
        a = p["beta"] / (p["alpha"] + p["beta"])
        assert frontier.a is not None, frontier.error
        # CI coverage is tested in test_isoflop.py over 5 budgets; with these 3 the estimate
        # lands within 0.005 of the law's exponent, and its CI spans it within that
        assert frontier.a.lo <= frontier.a.estimate <= frontier.a.hi
        assert abs(frontier.a.estimate - a) < 0.02, (frontier.family, frontier.a, a)
        assert frontier.a.lo - 0.02 <= a <= frontier.a.hi + 0.02
    (eff,) = report.optimal.efficiency
    assert eff.families == ("lmu", "transformer")
    # equal N, equal A / N^alpha: the data terms must match, B_t / D_t^beta = B_l / D_l^beta
    expected = (LAW["transformer"]["B"] / LAW["lmu"]["B"]) ** (1 / LAW["lmu"]["beta"])
    assert eff.ratio_geomean == pytest.approx(expected, rel=0.05)


def test_a_table_without_a_grid_says_what_it_left_out(tmp_path):
    rows = [
        dict(trial=f"lmu-{n}", family="lmu", N=n, steps=100, tokens=102_400, val_loss=3 - n / 1e5)
        for n in (1000, 2000, 4000)
    ]
    table = tmp_path / "results.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = compute_optimal(load_results(table, "val"), n_boot=10, ci=0.95, seed=0)
    assert not report.frontiers and not report.envelopes and not report.rates
    text = " | ".join(report.left_out)
    assert "IsoFLOP and envelope: the table has no flops_per_token" in text
    assert "evaluation curves: lmu-1000: the results table names no folder" in text
    assert "data efficiency: needs evaluation curves of two families" in text
    assert "learning rates: no family and size was run at 2 or more learning rates" in text


def test_the_new_figures_have_no_overlapping_text(analysed):
    _, report = analysed
    best = report.optimal
    unit = report.results.unit
    (eff,) = best.efficiency
    curves = [c for c in best.curves.values() if c.run.family in eff.families]
    for fig in (
        figures.isoflop_figure(best.frontiers, unit),
        figures.optimal_figure(best.frontiers, best.envelopes),
        figures.optimal_figure([], best.envelopes),
        figures.optimal_figure(best.frontiers),
        figures.tokens_figure(curves, eff, unit),
        figures.learning_rate_figure(best.rates, unit),
    ):
        assert text_overlaps(fig) == []
        assert legend_covers_data(fig) == []
        assert tick_problems(fig) == []


def data_axes(fig) -> list:
    return [ax for ax in fig.axes if ax.axison]


def legend_labels(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_the_optimal_figure_draws_no_empty_panel(analysed):
    _, report = analysed
    best = report.optimal
    fig = figures.optimal_figure([], best.envelopes)  # no IsoFLOP minima: no D_opt panel
    (ax,) = data_axes(fig)
    assert ax.get_ylabel().startswith("N_opt") and ax.lines
    assert "D_opt are not drawn" in " ".join(t.get_text() for a in fig.axes for t in a.texts)
    for fig in (figures.optimal_figure(best.frontiers, best.envelopes),):
        assert [a.get_ylabel()[:5] for a in data_axes(fig)] == ["N_opt", "D_opt"]
        assert all(a.lines for a in data_axes(fig))


def test_a_frontier_on_2_budgets_is_drawn_over_them_only(tmp_path, analysed):
    results = load_results(sweep(tmp_path, budgets=(1e14, 1e15)), "val")
    two = fit_frontier("lmu", results.runs, n_boot=50, ci=0.95, seed=0)
    _, report = analysed
    (three,) = [f for f in report.optimal.frontiers if f.family == "lmu"]
    for frontier, budgets in ((two, (1e14, 1e15)), (three, (1e14, 1e16))):
        assert frontier.n_line is not None, frontier.error
        fig = figures.optimal_figure([frontier])
        assert text_overlaps(fig) == [] and tick_problems(fig) == []
        assert legend_covers_data(fig) == []
        for ax, symbol in zip(data_axes(fig), "ab", strict=True):
            (line,) = [x for x in ax.lines if f"fit: {symbol} = " in x.get_label()]
            lo, hi = (min(f.budget for f in frontier.fits), max(f.budget for f in frontier.fits))
            assert (lo, hi) == pytest.approx(budgets, rel=0.05)
            x = line.get_xdata()
            if frontier is two:
                assert (x.min(), x.max()) == pytest.approx((lo, hi), rel=1e-9)
                assert line.get_linestyle() == "--"
                assert line.get_label().endswith(", 2 budgets, not extrapolated")
            else:
                assert x.min() < lo and x.max() > hi and hi / lo * 1.6 > x.max() / x.min()
                assert line.get_linestyle() == "-" and "extrapolated" not in line.get_label()


def test_isoflop_titles_give_the_interval_level(analysed):
    _, report = analysed
    for ci in (0.95, 0.8):
        fig = figures.isoflop_figure(report.optimal.frontiers, "nats", ci=ci)
        titles = [a.get_title() for a in data_axes(fig)]
        assert len(titles) == 2 and all(t.endswith(f"{ci:.0%} CI)") for t in titles)
    fig = figures.isoflop_figure(report.optimal.frontiers, "nats")
    assert all(a.get_title().endswith("95% CI)") for a in data_axes(fig))


def test_degenerate_intervals_are_not_printed_as_intervals():
    flops = np.geomspace(1e10, 1e11, 8)
    n = np.repeat([1e4, 2e4], 4)
    flat = Envelope("lmu", flops, np.ones(8), n, Interval(0.65, 0.65, 0.65), None,
                    np.ones(8, bool), (0.65, -2.5))  # fmt: skip
    fine = Envelope("transformer", flops, np.ones(8), n, Interval(0.5, 0.4, 0.6), None,
                    np.ones(8, bool), (0.5, -1.0))  # fmt: skip
    labels = legend_labels(figures.optimal_figure([], [flat, fine]))
    # (each envelope here lies at 2 sizes, which the label marks)
    assert "LMU envelope fit: a = 0.65 (no interval), 2 sizes" in labels
    assert "Transformer envelope fit: a = 0.50 [0.40, 0.60], 2 sizes" in labels


def test_tokens_figure_names_every_size_in_one_tint(tmp_path):
    """A size trained at two budgets is one legend entry and one tint; each family a panel."""

    def curve(family, n, tokens, trial):
        run = Run(trial, family, n, tokens / 100, tokens, 3.0, 0)
        grid = np.geomspace(tokens / 20, tokens, 10)
        return Curve(run, grid, 2.0 + 300 / n**0.3 + 40 / grid**0.3)

    sizes = {"lmu": (1e3, 4e3, 16e3), "transformer": (2e3, 8e3)}
    curves = [
        curve(family, n, tokens, f"{family}-{n:g}-{tokens:g}")
        for family, ns in sizes.items()
        for n in ns
        for tokens in ((1e6, 4e6) if n == 4e3 else (2e6,))
    ]
    eff = data_efficiency(curves, "lmu", "transformer")
    fig = figures.tokens_figure(curves, eff, "nats per token")
    axes = data_axes(fig)
    assert [a.get_title() for a in axes] == ["LMU", "Transformer"]
    named = [f"{label(f)}, N = {human(n)}" for f, ns in sizes.items() for n in ns]
    assert legend_labels(fig) == [*named, "reaches the target loss", "target loss"]
    for ax in axes:
        tint = {}
        for line in ax.lines:
            if line.get_label().startswith(("LMU", "Transformer")):
                tint.setdefault(line.get_label(), set()).add(line.get_color())
        assert all(len(t) == 1 for t in tint.values())  # the 4k LMU's two runs share a tint
        assert len({c for t in tint.values() for c in t}) == len(tint)
    assert sum(len(ax.lines) for ax in axes) == len(curves) + 4  # + reached, target per panel
    assert text_overlaps(fig) == [] and legend_covers_data(fig) == [] and tick_problems(fig) == []


def test_curves_that_cannot_be_read_are_named(tmp_path):
    from lmuscale.analysis.curves import load_curves

    rows = []
    for name, content in (
        ("whole", '{"step": 10, "val_loss": 3.0}\n{"step": 20, "val_loss": 2.5}\n'),
        ("torn", '{"step": 10, "val_loss": 3.0}\n{"step": 20, "val_loss": 2.5}\n{"st'),
        ("one", '{"step": 10, "val_loss": 3.0}\n'),
        ("absent", None),
    ):
        folder = tmp_path / "trials" / name
        folder.mkdir(parents=True)
        if content is not None:
            (folder / "eval.jsonl").write_text(content)
        rows.append(dict(trial=name, family="lmu", N=1000, steps=20, tokens=20 * 64,
                         val_loss=2.5, folder=name))  # fmt: skip
    table = tmp_path / "results.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves, notes = load_curves(load_results(table, "val"))
    assert sorted(curves) == ["torn", "whole"]
    np.testing.assert_array_equal(curves["torn"].tokens, [640, 1280])
    np.testing.assert_array_equal(curves["whole"].loss, [3.0, 2.5])
    trials = tmp_path / "trials"
    assert notes == [
        f"torn: {trials}/torn/eval.jsonl:3 is not an evaluation; left out",
        f"one: {trials}/one/eval.jsonl has 1 finite evaluation(s)",
        f"absent: no {trials}/absent/eval.jsonl",
    ]
