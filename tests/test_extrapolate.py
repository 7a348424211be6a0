"""Fits tested by extrapolation (``lmuscale.scaling.extrapolate``, ``analysis.extrapolation``):
prediction intervals that cover held-out runs at their level over many synthetic draws, the
power law's equal to the textbook OLS one, refusals, fits.json and ``scaling predict``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from figure_checks import legend_covers_data, text_overlaps, tick_problems
from scipy import stats
from test_isoflop import isoflop_runs, n_opt

from lmuscale.analysis.extrapolation import extrapolate, figure, frontier_lines, write_fits_json
from lmuscale.analysis.fitting import GroupFit
from lmuscale.analysis.isoflop import fit_frontier
from lmuscale.analysis.results import Run
from lmuscale.outcomes import Exit
from lmuscale.scaling import fits
from lmuscale.scaling.__main__ import main
from lmuscale.scaling.extrapolate import Line, holdout, law, line_holdout, load_fits

SIZES = np.geomspace(55e3, 1e6, 6)
E, A, ALPHA = 1.7, 400.0, 0.5


def saturating(n):
    return E + A * np.asarray(n) ** -ALPHA


def test_saturating_interval_for_the_held_out_largest_size_covers_90_percent():
    """The issue's Done-when: 6 sizes from a known saturating law with 0.5% (log-normal)
    noise; over 200 draws the 90% interval for the held-out largest size's measured loss
    covers it in 85-95% of draws."""
    rng = np.random.default_rng(34)
    covered = 0
    for _ in range(200):
        loss = saturating(SIZES) * np.exp(rng.normal(0, 0.005, len(SIZES)))
        (record,) = holdout("saturating", SIZES, loss, ci=0.9, held_out=(1,)).records
        assert record.x == SIZES[-1] and record.n_points == 5
        covered += record.covered
    assert 170 <= covered <= 190


def test_power_law_interval_is_the_textbook_ols_prediction_interval():
    rng = np.random.default_rng(1)
    n = np.geomspace(1e5, 1e7, 7)
    loss = (1e13 / n) ** 0.07 * np.exp(rng.normal(0, 0.01, len(n)))
    fitted = law(fits.fit_power_law(n, loss, n_boot=0))
    x, y = np.log(n), np.log(loss)
    slope, intercept = np.polyfit(x, y, 1)
    s = np.sqrt(np.sum((y - intercept - slope * x) ** 2) / (len(n) - 2))
    for new, ci in ((3e7, 0.9), (1e8, 0.95), (2e5, 0.5)):
        centre = intercept + slope * math.log(new)
        se = s * math.sqrt(
            1 + 1 / len(n) + (math.log(new) - x.mean()) ** 2 / np.sum((x - x.mean()) ** 2)
        )
        half = stats.t.ppf(0.5 + ci / 2, len(n) - 2) * se
        got = fitted.interval(new, ci=ci)
        np.testing.assert_allclose(got, np.exp([centre, centre - half, centre + half]), rtol=1e-9)


def test_holdout_records_every_held_out_run_and_refuses_too_few_sizes():
    rng = np.random.default_rng(2)
    n = np.repeat(SIZES[1:], 2)  # 5 sizes, 2 seeds each
    loss = saturating(n) * np.exp(rng.normal(0, 0.005, len(n)))
    trials = [f"t{i}" for i in range(len(n))]
    result = holdout("saturating", n, loss, trials=trials, family="lmu", ci=0.9)
    # one size out: 4 sizes for 3 parameters; two out: 3 sizes leave no residual
    assert [r.trial for r in result.records] == ["t8", "t9"]
    for r in result.records:
        assert r.held_out == 1 and r.n_points == 8
        assert r.error == r.predicted - r.measured and r.lo < r.predicted < r.hi
    (refusal,) = result.refusals
    assert refusal.held_out == 2 and "3 sizes left for 3 parameters" in refusal.why
    power = holdout("power_law", SIZES[:4], saturating(SIZES[:4]), ci=0.9)
    assert [r.held_out for r in power.records] == [1] and len(power.refusals) == 1
    assert "needs 3" in power.refusals[0].why
    assert not holdout("power_law", SIZES[:3], saturating(SIZES[:3])).records


def test_frontier_holdout_covers_the_held_out_budgets_n_opt_at_its_level():
    """6 budgets of synthetic IsoFLOP runs with N_opt ∝ C^a; the 90% interval of the line
    without the largest budget holds that budget's measured N_opt in 85-97% of 200 draws."""
    budgets = 10 ** np.linspace(17, 20, 6)
    covered = truth = 0
    for draw in range(200):
        runs = isoflop_runs(budgets, np.linspace(-1, 1, 7), noise=0.01, seed=draw)
        frontier = fit_frontier("lmu", runs, n_boot=20, seed=draw)
        (record,) = line_holdout(frontier_lines(frontier)["n_opt"], ci=0.9).records
        assert record.x == pytest.approx(budgets[-1], rel=0.05) and record.n_points == 5
        covered += record.covered
        truth += record.lo <= n_opt(record.x) <= record.hi
    assert 170 <= covered <= 194
    assert truth >= 170


def test_frontier_holdout_refuses_fewer_than_three_budgets():
    line = Line(np.array([17.0, 18.0]), np.array([5.0, 5.5]), np.array([1e-4, 1e-4]))
    result = line_holdout(line, family="lmu")
    assert not result.records and "2 bracketed budgets" in result.refusals[0].why


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A power-law, saturating and Chinchilla GroupFit and an IsoFLOP frontier, written to
    fits.json: (path, group fits, frontier)."""
    tmp_path = tmp_path_factory.mktemp("fits")
    rng = np.random.default_rng(3)
    loss = saturating(SIZES) * np.exp(rng.normal(0, 0.005, len(SIZES)))
    trials = tuple(f"grid-{i}" for i in range(len(SIZES)))
    runs = [
        Run(t, "lmu", n, 1000, 1e8, lo, 0, flops_per_token=6 * n, learning_rate=3e-3)
        for t, n, lo in zip(trials, SIZES, loss, strict=True)
    ]
    iso = isoflop_runs(10 ** np.linspace(17, 20, 5), np.linspace(-1, 1, 7), noise=0.005)
    frontier = fit_frontier("lmu", iso, n_boot=50)
    chin = fits.fit_chinchilla(
        [r.n for r in iso], [r.tokens for r in iso], [r.loss for r in iso], n_boot=0
    )
    groups = [
        GroupFit("lmu", 1e8, 1000.0, form, trials, fitter(SIZES, loss, n_boot=0))
        for form, fitter in (("power_law", fits.fit_power_law), ("saturating", fits.fit_saturating))
    ]
    groups.append(GroupFit("lmu", None, None, "chinchilla", tuple(r.trial for r in iso), chin))
    groups.append(GroupFit("lmu", 2e8, 2000.0, "saturating", (), None, "too few"))
    path = tmp_path / "fits.json"
    write_fits_json(path, groups, [frontier], runs + iso)
    return path, groups, frontier


def test_fits_json_round_trip(fitted):
    path, groups, frontier = fitted
    stored = load_fits(path)
    assert [w.form for w in stored.laws] == ["power_law", "saturating", "chinchilla"]
    for w, g in zip(stored.laws, groups, strict=False):
        mine = law(g.fit)
        assert (w.family, w.name, w.tokens, w.trials) == ("lmu", g.name, g.tokens, g.trials)
        np.testing.assert_array_equal(w.estimate, mine.estimate)
        np.testing.assert_array_equal(w.cov, mine.cov)
        tokens = None if w.form != "chinchilla" else 1e9
        np.testing.assert_array_equal(w.interval(3e6, tokens), mine.interval(3e6, tokens))
    assert stored.laws[0].learning_rate == 3e-3 and stored.laws[2].learning_rate is None
    mine = frontier_lines(frontier)
    for key in ("n_opt", "d_opt"):
        np.testing.assert_array_equal(stored.frontiers["lmu"][key].interval(1e21),
                                      mine[key].interval(1e21))  # fmt: skip
    # f = 6 N for every run: the log-log line is exact
    assert stored.flops_per_token("lmu", 1234.5) == pytest.approx(6 * 1234.5, rel=1e-9)
    assert stored.flops_per_token("transformer", 1e6) is None


def test_n_for_loss_inverts_the_law_and_its_interval():
    loss = saturating(SIZES) * np.exp(np.random.default_rng(4).normal(0, 0.005, len(SIZES)))
    w = law(fits.fit_saturating(SIZES, loss, n_boot=0))
    n, lo, hi = w.n_for_loss(2.05, ci=0.9)
    assert lo < n < hi < math.inf
    assert float(w.predict(n)) == pytest.approx(2.05, rel=1e-12)
    assert float(w.interval(lo, ci=0.9)[1]) == pytest.approx(2.05, rel=1e-9)  # low bound
    assert float(w.interval(hi, ci=0.9)[2]) == pytest.approx(2.05, rel=1e-9)  # high bound
    with pytest.raises(fits.FitError, match="at or below this fit's E"):
        w.n_for_loss(w.params["E"] * 0.99)


def _table(out: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("| ") and not line.startswith("| fit") and "---" not in line
    ]


def test_predict_prints_the_librarys_numbers(fitted, capsys):
    path, groups, _ = fitted
    stored = load_fits(path)
    assert main(["predict", str(path), "--n", "2M", "--ci", "0.8"]) == Exit.FINISHED
    rows = _table(capsys.readouterr().out)
    assert len(rows) == 2
    for row, w in zip(rows, stored.laws[:2], strict=True):
        loss, lo, hi = w.interval(2e6, ci=0.8)
        assert row[2:] == [f"{loss:.4f}", f"[{lo:.4f}, {hi:.4f}]"]

    assert main(["predict", str(path), "--flops", "1e21", "--family", "lmu"]) == Exit.FINISHED
    out = capsys.readouterr().out
    (row,) = [r for r in _table(out) if r[0] == "lmu"]
    n, _, _ = stored.frontiers["lmu"]["n_opt"].interval(1e21, ci=0.9)
    d, _, _ = stored.frontiers["lmu"]["d_opt"].interval(1e21, ci=0.9)
    loss, lo, hi = stored.laws[2].interval(n, d, ci=0.9)
    assert row[1].startswith(f"{n / 1e6:.3g}M" if n < 1e9 else f"{n / 1e9:.3g}B")
    assert row[3] == f"{loss:.4f} [{lo:.4f}, {hi:.4f}]"

    assert main(["predict", str(path), "--target-loss", "2.05"]) == Exit.FINISHED
    out = capsys.readouterr().out
    (row,) = _table(out)
    n, lo, hi = stored.laws[1].n_for_loss(2.05, ci=0.9)
    assert row[0] == f"{groups[1].name}, saturating" and "L = E + A / N^alpha solved" in out
    assert row[3] == f"{6 * n * 1e8:.3g} [{6 * lo * 1e8:.3g}, {6 * hi * 1e8:.3g}]"
    assert "unbounded" not in row[1] and 1 < lo < hi < math.inf
    # A target just above the fit's floor: no size is too large for the interval to hold it,
    # and the row says why the interval has no upper end.
    target = stored.laws[1].params["E"] * 1.0001
    assert main(["predict", str(path), "--target-loss", f"{target!r}"]) == Exit.FINISHED
    (row,) = _table(capsys.readouterr().out)
    assert row[1].endswith(
        ", inf] (unbounded above: the interval still holds the target at "
        "N = 1e18, as the floor E may be at or above it within the fit's "
        "uncertainty)"
    ), row[1]


def test_predict_errors_name_the_problem(fitted, tmp_path, capsys):
    path, _, _ = fitted
    cases = [
        ([str(tmp_path / "nope.json"), "--n", "1M"], "nope.json: no such fits file"),
        ([str(tmp_path / "bad.json"), "--n", "1M"], "not a fits file"),
        ([str(tmp_path / "broken.json"), "--n", "1M"], "has no 'cov'"),
        ([str(path), "--n", "1M", "--family", "lstm"], "no family 'lstm'; it has lmu"),
        ([str(path), "--target-loss", "1.0"], "at or below this fit's E"),
    ]
    (tmp_path / "bad.json").write_text(json.dumps({"fits": []}))
    broken = json.loads(path.read_text())
    del broken["fits"][1]["cov"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    for argv, message in cases:
        assert main(["predict", *argv]) == Exit.DATA
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["predict", str(path), "--n", "1M", "--ci", "1.5"])
    assert exit_.value.code == Exit.ARGUMENTS
    assert main([]) == Exit.FINISHED  # no subcommand: the reference table, as before
    assert "| N | transformer_25k_steps" in capsys.readouterr().out


def _edited(path, target, edit):
    saved = json.loads(path.read_text())
    edit(saved)
    target.write_text(json.dumps(saved))
    return target


def test_predict_refuses_a_fits_file_whose_numbers_cannot_be_a_fit(fitted, tmp_path, capsys):
    """Each was used: a negative sigma printed [0.09, 31.7] for [1.43, 2.03], NaN parameters a
    table of nan, a loss list cut to 2 of its points a prediction; an empty file named no
    family ("no ... fit for  (")."""
    path, groups, _ = fitted
    name = groups[1].name

    def fit(i, key, value):
        return lambda saved: saved["fits"][i].__setitem__(key, value)

    def parameter(i, key, value):
        return lambda saved: saved["fits"][i]["parameters"].__setitem__(key, value)

    loss = json.loads(path.read_text())["fits"][1]["loss"]
    cases = {
        "sigma": (fit(1, "sigma", -0.05), "sigma is -0.05, not a standard deviation (>= 0)"),
        "nan": (parameter(1, "alpha", None), "parameter alpha is nan, not a finite number"),
        "scale": (parameter(1, "A", -2.0), "parameter A is -2.0, not a positive number"),
        "cut": (
            fit(1, "loss", loss[:2]),
            f"the point lists differ in length: n {len(SIZES)}, loss 2",
        ),
        "dof": (
            fit(1, "dof", 7),
            f"dof is 7, but {len(SIZES)} points and 3 parameters leave {len(SIZES) - 3}",
        ),
        "cov": (
            lambda saved: saved["fits"][1]["cov"][0].__setitem__(1, 123.0),
            "its covariance is not symmetric",
        ),
        "frontier": (
            lambda saved: saved["frontiers"]["lmu"]["n_opt"]["var"].pop(),
            "frontiers.lmu.n_opt: log10_C, log10_y and var have shapes (5,), (5,), (4,)",
        ),
        "empty": (
            lambda saved: saved.update(fits=[], frontiers={}),
            "holds no fits and no frontiers: nothing to predict from",
        ),
    }
    for case, (edit, message) in cases.items():
        broken = _edited(path, tmp_path / f"{case}.json", edit)
        assert main(["predict", str(broken), "--n", "2M"]) == Exit.DATA, case
        out, err = capsys.readouterr()
        where = "" if case in ("frontier", "empty") else f"fits[1] ({name}): "
        assert out == "" and err == f"error: {broken}: {where}{message}\n", (case, err)

    # What an analysis writes passes: a budget's var is null where its parabola had 3 sizes,
    # and a covariance is symmetric only to an inverse's rounding.
    def written(saved):
        saved["frontiers"]["lmu"]["n_opt"]["var"][0] = None
        cov = saved["fits"][1]["cov"]
        cov[0][1] = cov[1][0] * (1 + 1e-9)

    fine = _edited(path, tmp_path / "fine.json", written)
    assert main(["predict", str(fine), "--n", "2M"]) == Exit.FINISHED
    assert main(["predict", str(fine), "--flops", "1e21"]) == Exit.FINISHED
    capsys.readouterr()


def test_extrapolate_tests_every_fit_and_its_figure_has_no_overlapping_text(fitted):
    _, groups, frontier = fitted
    result = extrapolate(groups, [frontier], ci=0.9)
    forms = {(r.form, r.held_out) for r in result.records}
    assert forms == {
        ("power_law", 1),
        ("power_law", 2),
        ("saturating", 1),
        ("saturating", 2),
        ("chinchilla", 1),
        ("chinchilla", 2),
        ("n_opt", 1),
        ("d_opt", 1),
    }
    largest = max(r.n for r in frontier.fits[-1].runs)
    assert [r.x for r in result.records if r.form == "chinchilla" and r.held_out == 1] == [largest]
    assert len(result.csv_rows()) == 2 * len(result.records) + len(result.refusals)
    fig = figure(result)
    assert len(fig.axes) == 3  # two panels and the notes
    assert text_overlaps(fig) == []
    assert legend_covers_data(fig) == []
    assert tick_problems(fig) == []


def test_a_line_with_negligible_budget_variance_gives_the_textbook_prediction_interval():
    # Budgets measured with (next to) no bootstrap variance: the interval is the ordinary
    # least-squares prediction interval for a new observation, y0 +- t s sqrt(1 + 1/J +
    # (x0 - mean x)^2 / Sxx), computed here from its textbook formula, not from Line's code.
    x = np.log10([1e15, 3e15, 1e16, 3e16, 1e17])
    y = 0.5 * x - 1.0 + np.array([0.02, -0.015, 0.01, -0.025, 0.012])
    line = Line(x, y, np.full(5, 1e-30))
    budget = 1e18
    predicted, low, high = line.interval(budget, ci=0.9)

    slope, intercept = np.polyfit(x, y, 1)
    x0 = np.log10(budget)
    s = np.sqrt(np.sum((y - slope * x - intercept) ** 2) / (len(x) - 2))
    sxx = np.sum((x - x.mean()) ** 2)
    half = stats.t.ppf(0.95, len(x) - 2) * s * np.sqrt(1 + 1 / len(x) + (x0 - x.mean()) ** 2 / sxx)
    centre = slope * x0 + intercept
    np.testing.assert_allclose(
        [predicted, low, high], 10 ** np.array([centre, centre - half, centre + half]), rtol=1e-12
    )
