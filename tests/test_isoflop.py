"""``lmuscale.analysis.isoflop``: Chinchilla approaches 1 and 2 on runs drawn from a known law.

The law is L(N, D) = E + A / N^alpha + B / D^beta with f(N) = 6N FLOPs per token. At compute
C = 6ND its optimum is N_opt = G (C / 6)^a with a = beta / (alpha + beta),
G = (alpha A / (beta B))^(1 / (alpha + beta)), and D_opt = C / (6 N_opt), which grows as C^b
with b = alpha / (alpha + beta).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from lmuscale.analysis import isoflop
from lmuscale.analysis.curves import Curve
from lmuscale.analysis.isoflop import budgets, envelope, fit_frontier, fit_isoflop
from lmuscale.analysis.results import Run

# Hoffmann et al.'s (2022) fitted constants: the optimum is well inside a +-1 decade grid.
E, A, ALPHA, B, BETA = 1.69, 406.4, 0.34, 410.7, 0.28
A_TRUE = BETA / (ALPHA + BETA)
B_TRUE = ALPHA / (ALPHA + BETA)
G = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
BUDGETS = 10 ** np.linspace(17, 20, 5)  # FLOPs: 5 budgets over 3 decades
OFFSETS = np.linspace(-1, 1, 7)  # log10 N - log10 N_opt(C): 7 sizes per budget


def law(n, d):
    return E + A / np.asarray(n) ** ALPHA + B / np.asarray(d) ** BETA


def n_opt(c):
    return G * (np.asarray(c) / 6) ** A_TRUE


def loss_opt(c):
    n = n_opt(c)
    return law(n, c / (6 * n))


def run(trial, n, tokens, loss, family="lmu", seed=None, f=None) -> Run:
    return Run(
        trial=trial,
        family=family,
        n=float(n),
        steps=100.0,
        tokens=float(tokens),
        loss=float(loss),
        line=0,
        flops_per_token=6 * n if f is None else f,
        seed=seed,
    )


def isoflop_runs(budgets_C, offsets, *, noise=0.005, seed=0, seeds=1) -> list[Run]:
    """Runs at each budget, at sizes N_opt(C) x 10^offset, with multiplicative noise."""
    rng = np.random.default_rng(seed)
    runs = []
    for c in budgets_C:
        for off in offsets:
            n = n_opt(c) * 10**off
            d = c / (6 * n)
            for s in range(seeds):
                loss = law(n, d) * math.exp(noise * rng.standard_normal())
                runs.append(run(f"C{c:.3g}-N{n:.3g}-s{s}", n, d, loss, seed=s))
    return runs


def test_budgets_group_within_rtol_at_the_geometric_mean():
    runs = [
        run("a", 1e6, 1e12 / 6e6, 3.0),
        run("b", 2e6, 1.035e12 / 12e6, 3.0),
        run("c", 4e6, 0.99e12 / 24e6, 3.0),
        run("d", 1e6, 3e12 / 6e6, 3.0),
        run("e", 2e6, 3.1e12 / 12e6, 3.0),
    ]
    groups = budgets(runs[::-1])
    assert [[r.trial for r in g] for _, g in groups] == [["a", "b", "c"], ["d", "e"]]
    assert groups[0][0] == pytest.approx((0.99e12 * 1e12 * 1.035e12) ** (1 / 3), rel=1e-12)
    assert groups[1][0] == pytest.approx((3e12 * 3.1e12) ** 0.5, rel=1e-12)
    # within rtol of each other, not of a neighbour: 1.035 / 0.99 - 1 > 0.045
    assert len(budgets(runs[:3], rtol=0.045)) == 2
    assert len(budgets(runs, rtol=0)) == 5
    no_flops = Run("x", "lmu", 1e6, 100, 1e6, 3.0, 0)
    with pytest.raises(ValueError, match=r"^x: .*flops_per_token"):
        budgets([*runs, no_flops])
    with pytest.raises(ValueError, match="one family"):
        budgets([*runs, run("t", 1e6, 1e6, 3.0, family="transformer")])


def test_approach_2_recovers_the_exponents():
    runs = isoflop_runs(BUDGETS, OFFSETS, noise=0.005, seed=0)
    frontier = fit_frontier("lmu", runs, n_boot=200)
    assert frontier.error is None
    assert [f.budget for f in frontier.fits] == pytest.approx(BUDGETS, rel=1e-9)
    assert all(f.error is None and len(f.runs) == 7 for f in frontier.fits)
    assert all(f.kept >= 190 for f in frontier.fits)
    # measured: a = 0.4519 (true 0.4516), CI [0.433, 0.463]; over 300 noise draws the
    # estimate's SD is 0.0054 and the CI covered the truth 98% of the time
    assert A_TRUE in frontier.a
    assert frontier.a.estimate == pytest.approx(A_TRUE, abs=0.01)
    assert B_TRUE in frontier.b
    assert frontier.b.estimate == pytest.approx(B_TRUE, abs=0.01)
    assert frontier.n_line[0] == frontier.a.estimate
    # D_opt = C / 6 N_opt, so the two lines are tied exactly
    assert frontier.a.estimate + frontier.b.estimate == pytest.approx(1, abs=1e-9)
    for fit in frontier.fits:
        # the parabola's vertex sits 0.018 decades above the optimum of the true (asymmetric)
        # valley at every budget, so the level is close and the slope is unbiased
        assert math.log10(fit.n_opt.estimate / n_opt(fit.budget)) == pytest.approx(0.018, abs=0.05)
        assert fit.n_opt.lo <= fit.n_opt.estimate <= fit.n_opt.hi
        assert fit.d_opt.estimate == pytest.approx(fit.budget / (6 * fit.n_opt.estimate))
        assert fit.loss_opt == pytest.approx(loss_opt(fit.budget), rel=0.01)


def test_d_opt_interpolates_flops_per_token_in_log_log():
    # f = 6N (1 + 1e8 / N) is not a power law: D_opt uses f between the two nearest sizes
    sizes = np.array([1e7, 1e8, 1e9, 1e10])
    losses = [3.0, 2.5, 2.6, 3.1]
    f = 6 * sizes * (1 + 1e8 / sizes)
    runs = [
        run(f"n{i}", n, 1e20 / fi, loss, f=fi)
        for i, (n, fi, loss) in enumerate(zip(sizes, f, losses, strict=True))
    ]
    fit = fit_isoflop("lmu", 1e20, runs, n_boot=50)
    x = math.log10(fit.n_opt.estimate)
    assert 8 < x < 9
    f_opt = 10 ** np.interp(x, np.log10(sizes), np.log10(f))
    assert fit.d_opt.estimate == pytest.approx(1e20 / f_opt, rel=1e-12)
    assert fit.coef == pytest.approx(tuple(np.polyfit(np.log10(sizes), losses, 2)), rel=1e-12)


def test_unbracketed_and_too_small_budgets_are_refused_with_why():
    below = isoflop_runs(BUDGETS[:1], np.linspace(-2, -0.6, 5), noise=0.0)
    fit = fit_isoflop("lmu", BUDGETS[0], below, n_boot=50)
    assert fit.error.startswith("not bracketed")
    assert fit.error == (
        f"not bracketed: the lowest loss is at the largest size tried (N={below[-1].n:.3g})"
    )
    assert fit.n_opt is None and fit.d_opt is None and fit.loss_opt is None
    assert fit.kept == 0 and len(fit.n_opt_samples) == 0
    above = isoflop_runs(BUDGETS[:1], np.linspace(0.6, 2, 5), noise=0.0)
    fit = fit_isoflop("lmu", BUDGETS[0], above, n_boot=50)
    assert fit.error.startswith("not bracketed: the lowest loss is at the smallest size tried")
    assert fit.n_opt is None
    # the parabola's vertex is inside the sizes, but the data still fall at the largest one
    edge = [
        run(f"e{i}", 10.0 ** (7 + i), 1e9, loss) for i, loss in enumerate([3, 2, 2.05, 2.1, 1.99])
    ]
    fit = fit_isoflop("lmu", 6e16, edge, n_boot=50)
    assert 7 < -fit.coef[1] / (2 * fit.coef[0]) < 11
    assert fit.error == "not bracketed: the lowest loss is at the largest size tried (N=1e+11)"
    # near an edge some replicates' vertices fall outside the sizes: they are dropped
    near = isoflop_runs(BUDGETS[:1], np.linspace(-0.3, 1.5, 7), noise=0.02, seed=2)
    fit = fit_isoflop("lmu", BUDGETS[0], near, n_boot=200)
    x_P = np.log10([r.n for r in near])
    assert fit.error is None and 150 < fit.kept < 190  # measured: 170 of 200
    assert len(fit.n_opt_samples) == len(fit.d_opt_samples) == fit.kept
    assert np.all((fit.n_opt_samples >= x_P.min()) & (fit.n_opt_samples <= x_P.max()))

    one = isoflop_runs(BUDGETS[:1], [0.0], seeds=3)
    fit = fit_isoflop("lmu", BUDGETS[0], one, n_boot=50)
    assert fit.error == "needs 3 sizes, has 1"
    assert fit.coef is None and fit.n_opt is None

    # the lowest loss inside, but the best parabola curves down
    hump = [
        run(f"h{i}", 10.0 ** (7 + i), 1e9, loss) for i, loss in enumerate([2.5, 2.1, 3.3, 3.4, 2.6])
    ]
    fit = fit_isoflop("lmu", 6e16, hump, n_boot=50)
    assert fit.error.startswith("not convex") and fit.coef[0] < 0 and fit.n_opt is None

    # one bracketed budget among unbracketed ones (all sizes below): no frontier, and why
    runs = isoflop_runs(BUDGETS[:1], OFFSETS) + isoflop_runs(BUDGETS[1:3], [-2, -1.5, -1, -0.6])
    frontier = fit_frontier("lmu", runs, n_boot=50)
    assert frontier.error.startswith("needs 2 bracketed budgets, has 1 (")
    assert frontier.error.count("not bracketed") == 2
    assert frontier.a is None and frontier.b is None and frontier.n_line is None
    assert [f.n_opt is not None for f in frontier.fits] == [True, False, False]

    one_size = isoflop_runs(BUDGETS, [0.0])
    frontier = fit_frontier("lmu", one_size, n_boot=50)
    assert frontier.error.startswith("needs 2 bracketed budgets, has 0")
    assert "needs 3 sizes, has 1" in frontier.error
    assert fit_frontier("sru", runs).error == "no runs of family sru"


def seeded_runs(spread: float) -> list[Run]:
    """7 sizes x 3 seeds whose mean at each size lies exactly on a parabola with its vertex at
    log10 N = 8.1; the seeds differ from it by (+spread, 0, -spread)."""
    runs = []
    for i, x in enumerate(np.linspace(7, 9, 7)):
        mean = 3.0 + 0.1 * (x - 8.1) ** 2
        for s, dev in enumerate((spread, 0.0, -spread)[i % 3 :] + (spread, 0.0, -spread)[: i % 3]):
            runs.append(run(f"x{x:.2f}-s{s}", 10**x, 1e19 / (6 * 10**x), mean + dev, seed=s))
    return runs


def test_bootstrap_resamples_seeds_as_well_as_sizes():
    narrow = fit_isoflop("lmu", 1e19, seeded_runs(0.01), n_boot=200)
    wide = fit_isoflop("lmu", 1e19, seeded_runs(0.02), n_boot=200)
    # every run is in the fit; the seeds cancel at each size, so the vertex is exact
    assert len(narrow.runs) == 21
    x_P = np.log10([r.n for r in narrow.runs])
    loss_P = [r.loss for r in narrow.runs]
    assert narrow.coef == pytest.approx(tuple(np.polyfit(x_P, loss_P, 2)), rel=1e-12)
    assert math.log10(narrow.n_opt.estimate) == pytest.approx(8.1, abs=1e-9)
    # resampling the sizes alone would give every replicate that same exact vertex: the
    # spread of the replicates is the seeds', and grows with it
    width = {}
    for name, fit in (("narrow", narrow), ("wide", wide)):
        assert len(np.unique(fit.n_opt_samples.round(12))) > 150
        width[name] = math.log10(fit.n_opt.hi / fit.n_opt.lo)
    assert width["narrow"] > 0.02
    assert width["wide"] > 1.6 * width["narrow"]


def test_same_seed_same_intervals():
    runs = isoflop_runs(BUDGETS, OFFSETS, noise=0.005, seed=3, seeds=2)
    first = fit_frontier("lmu", runs, n_boot=200, seed=7)
    again = fit_frontier("lmu", runs, n_boot=200, seed=7)
    other = fit_frontier("lmu", runs, n_boot=200, seed=8)
    assert (first.a, first.b) == (again.a, again.b)
    for f, g in zip(first.fits, again.fits, strict=True):
        assert f.n_opt == g.n_opt and f.d_opt == g.d_opt
        assert np.array_equal(f.n_opt_samples, g.n_opt_samples)
    assert first.a.estimate == other.a.estimate and first.a.lo != other.a.lo
    # budgets draw independent bootstraps
    assert not np.array_equal(first.fits[0].n_opt_samples, first.fits[1].n_opt_samples)
    curves = training_curves(noise=0.002, seed=0)
    e1, e2 = (
        envelope("lmu", curves, n_boot=200, seed=7),
        envelope("lmu", curves, n_boot=200, seed=7),
    )
    assert e1.a == e2.a and np.array_equal(e1.loss, e2.loss)
    assert envelope("lmu", curves, n_boot=200, seed=8).a.lo != e1.a.lo


SIZES = 10 ** np.arange(7, 10.01, 0.25)  # 13 sizes over 3 decades


def training_curves(noise: float, seed: int, sizes=SIZES) -> list[Curve]:
    """One run per size, evaluated 20 times (linearly in steps) up to 4x the tokens that make
    it compute-optimal, with multiplicative noise on every evaluation."""
    rng = np.random.default_rng(seed)
    curves = []
    for n in sizes:
        c_opt = 6 * (n / G) ** (1 / A_TRUE)  # the compute at which n is optimal
        tokens = 4 * c_opt / (6 * n) * np.arange(1, 21) / 20
        loss = law(n, tokens) * np.exp(noise * rng.standard_normal(20))
        curves.append(Curve(run(f"N{n:.3g}", n, tokens[-1], loss[-1]), tokens, loss))
    return curves


def test_approach_1_envelope_follows_the_frontier():
    exact = envelope("lmu", training_curves(noise=0.0, seed=0), n_boot=50)
    # each curve is convex in log C, so its chords lie above the law: never below the optimum
    assert np.all(exact.loss >= loss_opt(exact.flops) * (1 - 1e-12))
    env = envelope("lmu", training_curves(noise=0.002, seed=0), n_boot=200)
    assert env.error is None
    first = 4 / 20 * 6 * (SIZES[0] / G) ** (1 / A_TRUE)  # the smallest run's first evaluation
    assert env.flops[0] == pytest.approx(first, rel=1e-12) and len(env.flops) == 60
    assert np.all(np.isfinite(env.loss)) and set(env.n) <= set(SIZES)
    interior = (n_opt(env.flops) > SIZES[1]) & (n_opt(env.flops) < SIZES[-2])
    assert interior.sum() > 30
    # measured: within 0.38% of the optimum (0.17% without noise, from the sizes' spacing)
    assert env.loss[interior] == pytest.approx(loss_opt(env.flops[interior]), rel=0.005)
    # measured: a = 0.4498 (true 0.4516); fitting every point, the smallest and largest
    # sizes' stretches included, gives 0.432: those points are left out (``used``)
    assert env.a.estimate == pytest.approx(A_TRUE, abs=0.01)
    assert A_TRUE in env.a
    assert env.used.sum() < np.isfinite(env.n).sum()
    assert not np.isin(env.n[env.used], [SIZES[0], SIZES[-1]]).any()
    assert env.kept == 200


def test_envelope_uses_each_curve_only_inside_its_range():
    def curve(trial, n, flops, loss):
        flops = np.array(flops, float)
        return Curve(run(trial, n, flops[-1] / (6 * n), loss[-1]), flops / (6 * n), np.array(loss))

    small = curve("small", 1e7, [6e16, 6e17], [3.2, 3.0])
    big = curve("big", 1e9, [6e16, 6e18], [3.6, 2.5])
    env = envelope("lmu", [small, big], points=200, n_boot=20)
    # just past the small run's last evaluation the big one is worse than the small one was
    # (3.0); holding the small run's loss flat beyond its range would wrongly pick it there
    past = env.flops > 6e17
    assert env.n[past] == pytest.approx(1e9)
    big_loss = np.interp(np.log10(env.flops[past]), np.log10([6e16, 6e18]), [3.6, 2.5])
    assert env.loss[past] == pytest.approx(big_loss, rel=1e-12)
    assert env.loss[past][0] > 3.0 and env.n[~past][-1] == 1e7
    assert env.a is None and env.error.startswith("needs the envelope reached by 2 sizes")

    far = curve("far", 1e9, [6e18, 6e19], [2.4, 2.2])
    gap = envelope("lmu", [small, far], points=50, n_boot=20)
    missing = (gap.flops > 6e17 * 1.0001) & (gap.flops < 6e18 / 1.0001)
    assert missing.any() and np.isnan(gap.loss[missing]).all() and np.isnan(gap.n[missing]).all()
    assert np.isfinite(gap.loss[~missing]).all()

    one = envelope("lmu", [small, curve("small-2", 1e7, [1e17, 1e18], [3.1, 2.9])], n_boot=20)
    assert one.error == "needs 2 sizes, has 1 (N=1e+07)" and one.a is None
    with pytest.raises(ValueError, match=r"^small: .*flops_per_token"):
        no_flops = Run("small", "lmu", 1e7, 100, 1e10, 3.0, 0)
        envelope("lmu", [Curve(no_flops, np.array([1e9, 1e10]), np.array([3.2, 3.0]))])


# ---------------------------------------------------------------- the reported intervals

CIS = (0.5, 0.8, 0.9, 0.95)


def central(samples, ci) -> tuple[float, float]:
    """The central ``ci`` interval of ``samples``: percentiles (1 - ci) / 2 and (1 + ci) / 2."""
    low, high = np.percentile(samples, [100 * (1 - ci) / 2, 100 * (1 + ci) / 2])
    return float(low), float(high)


def test_isoflop_intervals_are_the_percentiles_of_their_replicates_at_every_ci():
    runs = isoflop_runs(BUDGETS[:1], OFFSETS, noise=0.01, seed=5, seeds=2)
    for ci in CIS:
        fit = fit_isoflop("lmu", BUDGETS[0], runs, n_boot=300, ci=ci, seed=4)
        assert fit.kept > 250
        for interval, samples in ((fit.n_opt, fit.n_opt_samples), (fit.d_opt, fit.d_opt_samples)):
            low, high = central(samples, ci)  # the replicates are log10 N_opt, log10 D_opt
            assert math.log10(interval.lo) == pytest.approx(low, rel=1e-12)
            assert math.log10(interval.hi) == pytest.approx(high, rel=1e-12)


def frontier_replicates(frontier, n_boot, seed):
    """The frontier's bootstrap slopes rebuilt from its budgets' replicates, as ``fit_frontier``
    documents the pairing: replicate i of every budget when all kept as many, else ``n_boot``
    draws from each budget's with the seed's last spawned generator. The slopes by polyfit."""
    kept = [f.kept for f in frontier.fits]
    if len(set(kept)) == 1:
        pick = [np.arange(kept[0])] * len(kept)
    else:
        rng = np.random.default_rng(seed).spawn(len(kept) + 1)[-1]
        pick = [rng.integers(0, k, n_boot) for k in kept]
    log_c = np.log10([f.budget for f in frontier.fits])
    slopes = {}
    for name in ("n_opt_samples", "d_opt_samples"):
        rows = np.stack([getattr(f, name)[i] for f, i in zip(frontier.fits, pick, strict=True)], 1)
        slopes[name] = [np.polyfit(log_c, row, 1)[0] for row in rows]
    return slopes["n_opt_samples"], slopes["d_opt_samples"]


@pytest.mark.parametrize(("seed", "same_kept"), [(2, True), (0, False)], ids=["paired", "redrawn"])
def test_frontier_intervals_are_the_percentiles_of_their_slopes_at_every_ci(seed, same_kept):
    # a replicate drawing under 3 distinct sizes is dropped; with seed 2 no budget drops any
    runs = isoflop_runs(BUDGETS[:3], OFFSETS, noise=0.01, seed=6)
    for ci in CIS:
        frontier = fit_frontier("lmu", runs, n_boot=120, ci=ci, seed=seed)
        assert frontier.error is None
        assert (len({f.kept for f in frontier.fits}) == 1) == same_kept
        a_slopes, b_slopes = frontier_replicates(frontier, 120, seed)
        for interval, slopes in ((frontier.a, a_slopes), (frontier.b, b_slopes)):
            low, high = central(slopes, ci)
            assert (interval.lo, interval.hi) == pytest.approx((low, high), rel=1e-9)


def test_envelope_interval_is_the_percentiles_of_its_replicates_at_every_ci():
    """Every curve spans the same FLOPs, so a replicate (the curves a draw picked) has the same
    grid as the full set, and its slope is that of ``envelope`` on those curves alone. The
    draws are rebuilt from the seed as ``envelope`` makes them, ``_CHUNK`` at a time."""
    flops = np.geomspace(1e17, 1e21, 20)
    rng = np.random.default_rng(3)
    curves = []
    for n in 10 ** np.arange(7, 10.01, 0.25):
        loss = law(n, flops / (6 * n)) * np.exp(0.003 * rng.standard_normal(20))
        curves.append(Curve(run(f"N{n:.3g}", n, flops[-1], loss[-1], f=1.0), flops, loss))
    n_boot, seed = 150, 4
    draws = np.random.default_rng(seed)
    picked = [
        row
        for start in range(0, n_boot, isoflop._CHUNK)
        for row in draws.integers(0, len(curves), (min(isoflop._CHUNK, n_boot - start), 13))
    ]
    slopes = []
    for row in picked:
        alone = envelope("lmu", [curves[k] for k in np.unique(row)], n_boot=0)
        if alone.error is None:
            slopes.append(alone.line[0])
    for ci in CIS:
        env = envelope("lmu", curves, n_boot=n_boot, ci=ci, seed=seed)
        assert env.kept == len(slopes) > 100
        assert (env.a.lo, env.a.hi) == pytest.approx(central(slopes, ci), rel=1e-9)


def test_isoflop_fits_on_degenerate_data_emit_no_numpy_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flat = [run(f"f{i}", 10 ** (7 + i / 2), 1e9, 3.0 - 0.1 * (i in (1, 2))) for i in range(5)]
        fit_isoflop("lmu", 1e18, flat, n_boot=200)
        fit_frontier("lmu", isoflop_runs(BUDGETS, [-0.3, 0, 0.3], noise=0.05), n_boot=200)
        # an evaluation at 0 tokens: log10 of it was a divide-by-zero warning, then NaNs
        curves = training_curves(noise=0.0, seed=0)
        zero = [Curve(c.run, np.r_[0.0, c.tokens], np.r_[10.8, c.loss]) for c in curves]
        with pytest.raises(ValueError, match=r"^N1e\+07: .* at positive tokens in increasing"):
            envelope("lmu", zero, n_boot=20)


def test_an_envelope_fit_through_two_sizes_is_marked_in_the_figure_and_the_summary():
    # Four sizes: the envelope's exponent leaves out the stretches of the smallest and the
    # largest, so it rests on two distinct N, a line between them. The figure's legend and
    # notes and fits.md's Summary say so; with many sizes they do not.
    from matplotlib.text import Text

    from lmuscale.analysis import tables
    from lmuscale.analysis.optimal import OptimalReport
    from lmuscale.analysis.optimal_figures import optimal_figure

    def marks(env):
        fig = optimal_figure([], [env])
        legend = " ".join(t.get_text() for t in fig.legends[0].get_texts())
        texts = fig.findobj(lambda artist: isinstance(artist, Text))
        notes = " ".join(" ".join(t.get_text().split()) for t in texts)  # wrapped lines
        (row,) = tables.summary_rows([], OptimalReport(envelopes=[env]))
        return ", 2 sizes" in legend, "2 distinct sizes, too few" in notes, row[-1]

    few = envelope("lmu", training_curves(noise=0.002, seed=0, sizes=SIZES[3:7]), n_boot=20)
    assert few.a is not None and len(np.unique(few.n[few.used])) == 2
    legend, note, check = marks(few)
    assert legend and note and f"{tables.FLAG} through 2 distinct sizes only" in check
    many = envelope("lmu", training_curves(noise=0.002, seed=0), n_boot=20)
    assert marks(many) == (False, False, "no hold-out test")
