"""Run roles: a results table that mixes a paper grid, IsoFLOP budgets, a learning-rate grid and
seed replicates gives each analysis exactly the runs of its role, whether the table names the
roles or they are inferred."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.collections import PathCollection

from lmuscale.analysis import analyse, figures, load_results, optimal
from lmuscale.analysis.__main__ import main
from lmuscale.analysis.results import Results, Run, infer_roles
from lmuscale.outcomes import Exit
from lmuscale.sweep import Trial, load_sweep
from lmuscale.sweep.grids import seed_replicates

LAW = dict(E=1.7, A=60.0, alpha=0.34, B=400.0, beta=0.30)  # L(N, D), both families
BATCH = 1024
GRID_TOKENS = 2_000 * BATCH


def law(n, d):
    return LAW["E"] + LAW["A"] / n ** LAW["alpha"] + LAW["B"] / d ** LAW["beta"]


def mixed(root, with_roles=True):
    """Per family: 5 grid sizes at one budget (one size again at two more seeds), 3 IsoFLOP
    budgets of 5 sizes each (f = 6N), and 2 sizes at 3 learning rates for 100 steps; every
    run with an eval.jsonl. Returns (table path, {role: set of trials})."""
    rng = np.random.default_rng(0)
    rows, roles = [], {"grid": set(), "isoflop": set(), "learning_rate": set(), "seed": set()}

    def add(role, trial, family, n, steps, lr=3e-3, seed=0, extra=0.0):
        tokens = steps * BATCH
        folder = root / "trials" / trial
        folder.mkdir(parents=True)
        evals = np.unique(np.geomspace(steps / 10, steps, 6).round().astype(int))
        lines = [json.dumps({"step": int(s), "val_loss": law(n, s * BATCH) + extra}) for s in evals]
        (folder / "eval.jsonl").write_text("\n".join(lines) + "\n")
        loss = (law(n, tokens) + extra) * math.exp(rng.normal(0, 0.003))
        row = dict(trial=trial, family=family, N=n, steps=steps, tokens=tokens, val_loss=loss)
        row.update(test_loss=loss, flops_per_token=6.0 * n, learning_rate=lr, seed=seed)
        row.update(status="finished", folder=trial, role=role)
        if not with_roles:
            del row["role"]
        rows.append(row)
        roles[role].add(trial)

    for family in ("lmu", "transformer"):
        for n in (2_000, 5_000, 12_000, 30_000, 80_000):
            add("grid", f"{family}-{n}", family, n, 2_000)
        for seed in (1, 2):
            add("seed", f"{family}-12000-s{seed}", family, 12_000, 2_000, seed=seed)
        for c in (1e13, 4e13, 1.6e14):
            for n in np.geomspace(3e3, 5e4, 5).round().astype(int):
                steps = round(c / (6 * n) / BATCH)
                add("isoflop", f"{family}-{n}-{c:.0e}", family, int(n), steps)
        for n in (4_000, 16_000):
            for lr in (1e-3, 3e-3, 1e-2):
                extra = 2.0 * (math.log10(lr) - math.log10(3e-3)) ** 2
                add("learning_rate", f"{family}-{n}-lr{lr:g}", family, n, 100, lr, extra=extra)
    table = root / "results.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return table, roles


def plotted_points(fig) -> set[tuple[float, float]]:
    """(N, loss) of every scatter point on the figure's axes."""
    points = set()
    for ax in fig.axes:
        for c in ax.collections:
            if isinstance(c, PathCollection):
                points |= {(round(x), round(y, 9)) for x, y in c.get_offsets()}
    return points


def drawn_not_written(fig, path_without_suffix):
    """``figures.save`` for these tests: the figure is drawn (so a figure that cannot be drawn
    still fails), but no PNG or PDF is encoded and written. Which runs each figure and table
    takes is what these tests check; the files are test_analysis.py's and test_optimal.py's.
    Encoding and writing both formats of every figure took about 11 of the fixture's 23 s."""
    del path_without_suffix
    fig.canvas.draw()
    return []


@pytest.fixture(scope="module", params=[True, False], ids=["role column", "inferred"])
def analysed(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("roles")
    table, roles = mixed(root, with_roles=request.param)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(figures, "save", drawn_not_written)
        patch.setattr(optimal, "save", drawn_not_written)
        report = analyse(table, root / "analysis", split="val", n_boot=40)
    return report, roles


def test_the_table_gives_each_run_its_role(analysed):
    report, roles = analysed
    assert {role: {r.trial for r in report.results.runs if r.role == role} for role in roles} == (
        roles
    )


def test_figures_and_fits_in_n_take_exactly_the_paper_grid(analysed):
    report, roles = analysed
    grid = [r for r in report.results.runs if r.trial in roles["grid"]]
    for g in report.fits:
        if g.form in ("power_law", "saturating"):
            assert set(g.trials) == {r.trial for r in grid if r.family == g.family}
    assert {(g.form, g.family) for g in report.fits if g.form != "chinchilla"} == {
        (form, family) for form in ("power_law", "saturating") for family in ("lmu", "transformer")
    }
    fig3 = figures.figure3(report.results.grid(), report.fits)
    assert plotted_points(fig3) == {(round(r.n), round(r.loss, 9)) for r in grid}


def test_isoflop_fits_take_exactly_the_isoflop_runs(analysed):
    report, roles = analysed
    for frontier in report.optimal.frontiers:
        used = {r.trial for fit in frontier.fits for r in fit.runs}
        assert used == {t for t in roles["isoflop"] if t.startswith(frontier.family + "-")}
    assert len(report.optimal.frontiers) == 2
    (chinchilla,) = [g for g in report.fits if g.form == "chinchilla" and g.family == "lmu"]
    assert chinchilla.role == "isoflop"
    assert set(chinchilla.trials) == {t for t in roles["isoflop"] if t.startswith("lmu-")}
    for env in report.optimal.envelopes:
        assert set(env.trials) == {t for t in roles["isoflop"] if t.startswith(env.family + "-")}


def test_learning_rates_take_exactly_the_learning_rate_runs(analysed):
    report, roles = analysed
    chosen = {t for choice in report.optimal.rates for t in choice.trials}
    assert chosen == roles["learning_rate"]
    assert len(report.optimal.rates) == 4  # 2 families x 2 sizes
    for choice in report.optimal.rates:  # the law's best rate, within the noise
        assert choice.bracketed and 2e-3 < choice.best < 4.5e-3


def test_data_efficiency_takes_the_grid_and_seed_replicates_are_reported(analysed):
    report, roles = analysed
    (eff,) = report.optimal.efficiency
    assert set(eff.reached) == roles["grid"]
    text = (report.files[-1]).read_text()
    assert "## Seed replicates" in text
    assert "| LMU | 12,000 | 2,048,000 | 3 |" in text  # the grid run and its two replicas


def test_fits_md_leads_with_the_summary_and_ends_with_refusals_and_claims(analysed):
    report, _ = analysed
    text = report.files[-1].read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Summary"
    assert headings[-2:] == [
        "## Not fitted or not drawn",
        "## The paper's claims, read from these runs",
    ]
    assert "## Runs behind each fit" in headings
    # the grid's fits list their five runs
    assert "- LMU, 2,000 steps x 1,024 tokens, power law: lmu-2000, lmu-5000" in text


def test_selection_by_role_family_budget_and_pattern(tmp_path):
    table, roles = mixed(tmp_path)
    results = load_results(table, "val")
    assert {r.trial for r in results.select(roles=["isoflop"]).runs} == roles["isoflop"]
    lmu = results.select(families=["lmu"], roles=["learning_rate"]).runs
    assert {r.trial for r in lmu} == {t for t in roles["learning_rate"] if t.startswith("lmu-")}
    at = results.select(budgets=[4e13]).runs  # FLOPs within 5%
    assert {r.trial for r in at} == {t for t in roles["isoflop"] if t.endswith("-4e+13")}
    at = results.select(budgets=[GRID_TOKENS]).runs  # or tokens
    assert {r.trial for r in at} == roles["grid"] | roles["seed"]
    assert {r.trial for r in results.select(trials=["*-lr0.01"]).runs} == {
        "lmu-4000-lr0.01",
        "lmu-16000-lr0.01",
        "transformer-4000-lr0.01",
        "transformer-16000-lr0.01",
    }
    out = tmp_path / "out"
    args = [str(table), "--out", str(out), "--split", "val", "--quiet", "--role", "learning_rate"]
    assert main([*args, "--family", "lstm"]) == Exit.DATA
    assert main([*args, "--family", "lmu,transformer"]) == Exit.FINISHED
    text = (out / "fits.md").read_text()
    assert "- Selected: --role learning_rate --family lmu,transformer." in text
    assert "12 runs (12 learning-rate grid;" in text
    assert "Figures 3-5: not drawn: the table has no paper-grid runs" in text


def test_inferred_roles_of_a_plain_grid_and_of_seeds():
    """A grid with repeats at other seeds: the lowest seed's run is the grid's, the rest are
    replicates; one size at two rates on the same tokens is a learning-rate grid."""
    from lmuscale.analysis.results import Run

    def run(trial, n, seed=0, lr=1e-3, tokens=1e6):
        return Run(trial, "lmu", n, 100, tokens, 3.0, line=len(trial), seed=seed, learning_rate=lr)

    runs = [run("a", 1e3), run("a-s1", 1e3, seed=1), run("b", 2e3), run("c", 4e3, lr=1e-2)]
    runs += [run("c-lr", 4e3, lr=3e-3)]
    assert [r.role for r in infer_roles(runs)] == ["grid", "seed", "grid"] + ["learning_rate"] * 2


def test_a_sweep_names_the_role_of_each_trial(tmp_path):
    """isoflop_grid and learning_rate_grid mark their trials; seed_replicates makes replicas;
    a role outside the four is refused with the file and line."""
    from lmuscale.outcomes import ConfigError

    base = Trial("a", "x.py:y")
    (replica,) = seed_replicates([base], [7])
    assert (replica.name, replica.role, replica.overrides) == ("a-s7", "seed", {"train.seed": 7})
    sweep = tmp_path / "bad.py"
    sweep.write_text(
        "from lmuscale.sweep import Trial\n"
        "from lmuscale.train import base_config\n"
        "from lmuscale.models import TransformerConfig\n"
        "def get_trials():\n"
        "    return [Trial('a', base_config(TransformerConfig(d=16, n_heads=1, vocab_size=256)),\n"
        "                  role='paper')]\n"
    )
    with pytest.raises(ConfigError, match=r"bad.py:[56] \(trial 'a'\): role is 'paper'"):
        load_sweep(sweep)


def test_the_grid_takes_one_learning_rate_per_budget_and_says_which_it_left_out():
    from lmuscale.analysis.results import Results, Run

    def run(trial, n, lr):
        return Run(trial, "lmu", n, 100, 1e6, 3.0, line=1, learning_rate=lr, role="grid")

    runs = [run("a", 1e3, 1e-3), run("b", 2e3, 1e-3), run("c", 4e3, 1e-3), run("d", 8e3, 3e-3)]
    grid = Results("r.jsonl", "val", runs).grid()
    assert [r.trial for r in grid.runs] == ["a", "b", "c"]
    assert grid.skipped == [
        "d: learning rate 0.003, not the 0.001 of the other LMU grid runs at 1,000,000 tokens"
    ]
    runs[:3] = [run(t, n, None) for t, n in (("a", 1e3), ("b", 2e3), ("c", 4e3))]  # no column
    assert [r.trial for r in Results("r.jsonl", "val", runs).grid().runs] == ["a", "b", "c"]


def test_fits_md_lists_each_size_the_data_efficiency_left_out():
    """The tokens figure's note points to fits.md for the sizes left out: they are there."""
    from lmuscale.analysis.efficiency import DataEfficiency
    from lmuscale.analysis.optimal import OptimalReport

    one = np.ones(1)
    why = "LMU N=2.9e+04: lmu-d48 is already at or below 3.003 at its first evaluation (2.91)"
    eff = DataEfficiency(3.003, ("lmu", "transformer"), {}, one, one, one, one, 1.0, None, (why,))
    assert f"- Size left out: {why}" in OptimalReport(efficiency=[eff]).markdown(0.95)


def test_a_geometric_grid_at_two_token_budgets_is_all_grid():
    # Sizes doubling and a second budget of twice the tokens: (2N, T) and (N, 2T) have the
    # same FLOPs, so each compute budget holds two sizes on two token counts. IsoFLOP needs 3
    # sizes at one budget; none of these runs is one.
    runs = [
        Run(f"{family}-{n}-{k}x", family, n, 1_000 * k, 1_024_000 * k, 3.0, line)
        for line, (family, n, k) in enumerate(
            (family, 1_000 * 2**i, k)
            for family in ("lmu", "transformer")
            for i in range(5)
            for k in (1, 2)
        )
    ]
    runs = [dataclasses.replace(r, flops_per_token=6.0 * r.n, learning_rate=1e-3) for r in runs]
    assert {r.role for r in infer_roles(runs)} == {"grid"}


def test_a_learning_rate_tie_in_the_grid_keeps_the_lower_rate_and_names_the_other():
    runs = [
        Run("lmu-fast", "lmu", 5_000, 100, 102_400, 3.0, 1, learning_rate=3e-3),
        Run("lmu-slow", "lmu", 5_000, 100, 102_400, 3.1, 2, learning_rate=1e-3),
    ]
    grid = Results(Path("results.jsonl"), "val", runs).grid()
    assert [r.trial for r in grid.runs] == ["lmu-slow"]
    assert len(grid.skipped) == 1 and grid.skipped[0].startswith("lmu-fast: learning rate")
    assert "0.001" in grid.skipped[0]
