"""``lmuscale.analysis.efficiency``: tokens to a target loss, and one family's against another's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmuscale.analysis.curves import Curve
from lmuscale.analysis.efficiency import data_efficiency, tokens_to_target
from lmuscale.analysis.results import Run

# L(N, D) = 1 + C N^-X (D / k)^-Y: a family with k = 4 needs 4x the tokens of k = 1 at every N
C, X, Y = 50.0, 0.1, 0.3
GRID = 1e6 * 2.0 ** (np.arange(21) / 2)  # evaluations: 1e6 to 1.024e9 tokens, 2 per octave


def make_curve(trial, family, n, tokens, loss, seed=None, budget=None) -> Curve:
    """A run trained on ``budget`` tokens (default: its last evaluation's)."""
    tokens, loss = np.asarray(tokens, float), np.asarray(loss, float)
    budget = tokens[-1] if budget is None else budget
    run = Run(trial, family, n, steps=100, tokens=budget, loss=loss[-1], line=1, seed=seed)
    return Curve(run, tokens, loss)


def power_law(n, tokens, k):
    return 1 + C * n**-X * (tokens / k) ** -Y


def family(name, sizes, k, stretch=1.0, seed=None):
    """Curves of ``name`` at ``sizes``, evaluated at k * stretch * GRID. The losses there are
    those of k = 1 at GRID, so each curve is a k = 1 curve with its tokens scaled by
    k * stretch, exactly, whatever the interpolation between evaluations."""
    return [
        make_curve(
            f"{name}-{i}-{seed}",
            name,
            n,
            k * stretch * GRID,
            power_law(n, GRID, 1),
            seed=seed,
            budget=k * GRID[-1],  # seeds share their budget
        )
        for i, n in enumerate(sizes)
    ]


def test_tokens_to_target_by_hand():
    c = make_curve("t", "lmu", 1e6, [1e6, 2e6, 4e6], [3.0, 2.5, 2.0])
    # 2.2 lies between 2.5 (at 2e6) and 2.0 (at 4e6): the fraction f = (2.5 - 2.2) / (2.5 - 2.0)
    # = 0.6 of the way in log10 tokens, so log10 t = log10 2e6 + 0.6 log10 2, t = 2e6 * 2^0.6
    # = 3.0314e6 (linear in tokens would give 3.2e6)
    assert tokens_to_target(c, 2.2) == pytest.approx(2e6 * 2**0.6, rel=1e-12)
    assert tokens_to_target(c, 2.2) == pytest.approx(3.0314331e6, rel=1e-7)
    assert tokens_to_target(c, 2.5) == pytest.approx(2e6, rel=1e-12)  # at an evaluation
    assert tokens_to_target(c, 2.0) == pytest.approx(4e6, rel=1e-12)  # reached at the last one


def test_tokens_to_target_first_crossing_and_unmeasurable():
    c = make_curve("t", "lmu", 1e6, [1e6, 2e6, 4e6, 8e6], [3.0, 2.0, 2.6, 1.5])
    # the first crossing counts (2e6), not the later one after the bump
    assert tokens_to_target(c, 2.4) == pytest.approx(10 ** (6 + 0.6 * math.log10(2)), rel=1e-12)
    assert tokens_to_target(c, 1.4) is None  # never reached
    assert tokens_to_target(c, 3.0) is None  # reached at the first evaluation: not measurable
    assert tokens_to_target(c, 3.5) is None  # below it before the first evaluation


def test_four_times_the_tokens_at_equal_sizes():
    sizes = 1e6 * 4.0 ** np.arange(4)
    a = family("lmu", sizes, k=1)
    # two seeds of b, one 10% slower and one 10% faster: their geometric mean is exactly 4x
    b = family("transformer", sizes, k=4, stretch=1.1, seed=0)
    b += family("transformer", sizes, k=4, stretch=1 / 1.1, seed=1)
    result = data_efficiency(a + b, "lmu", "transformer")
    assert result.error is None
    assert result.families == ("lmu", "transformer")
    np.testing.assert_array_equal(result.n, sizes)
    np.testing.assert_allclose(result.ratio, 4.0, rtol=1e-9)
    np.testing.assert_allclose(result.tokens_b / result.tokens_a, result.ratio, rtol=1e-12)
    assert result.ratio_geomean == pytest.approx(4.0, rel=1e-9)
    assert result.left_out == ()
    # the default target: the largest of the per-run lowest losses, here the smallest size at
    # its last evaluation (it reaches the target exactly there)
    assert result.target == max(c.loss.min() for c in a + b)
    assert result.target == power_law(sizes[0], GRID[-1], 1)
    assert result.reached["lmu-0-None"] == pytest.approx(GRID[-1], rel=1e-12)
    assert set(result.reached) == {c.run.trial for c in a + b}
    # swapping the families inverts the ratio
    swapped = data_efficiency(a + b, "transformer", "lmu")
    np.testing.assert_allclose(swapped.ratio, 0.25, rtol=1e-9)


def test_four_times_the_tokens_with_interpolated_sizes():
    # b measured at every third octave of a's sizes; a also has a size past b's largest.
    # log D to target is linear in log N for this law, so interpolating b between sizes is
    # exact; what remains is a's error from interpolating between evaluations at sizes where
    # the target falls between them (measured: at most 0.41% of the ratio)
    a = family("lmu", 1e6 * 2.0 ** np.arange(9), k=1)
    b = family("transformer", 1e6 * 8.0 ** np.arange(3), k=4)
    result = data_efficiency(a + b, "lmu", "transformer")
    assert result.error is None
    np.testing.assert_array_equal(result.n, 1e6 * 2.0 ** np.arange(7))  # 1.28e8 is outside
    np.testing.assert_allclose(result.ratio, 4.0, rtol=1e-2)
    np.testing.assert_allclose(result.ratio[::3], 4.0, rtol=1e-9)  # at b's own sizes
    # against the law itself: D = k ((L - 1) / (C N^-X))^(-1/Y)
    truth = ((result.target - 1) / (C * result.n**-X)) ** (-1 / Y)
    np.testing.assert_allclose(result.tokens_a, truth, rtol=1e-2)
    np.testing.assert_allclose(result.tokens_b, 4 * truth, rtol=1e-9)


def test_an_explicit_target():
    sizes = 1e6 * 4.0 ** np.arange(3)
    curves = family("lmu", sizes, k=1) + family("transformer", sizes, k=4)
    target = 1.1
    result = data_efficiency(curves, "lmu", "transformer", target)
    assert result.target == target
    np.testing.assert_allclose(result.ratio, 4.0, rtol=1e-9)
    truth = ((target - 1) / (C * sizes**-X)) ** (-1 / Y)  # grid interpolation: under 1%
    np.testing.assert_allclose(result.tokens_a, truth, rtol=1e-2)


def test_sizes_that_do_not_reach_the_target_are_left_out_and_named():
    sizes = 1e6 * 4.0 ** np.arange(3)
    a = family("lmu", sizes, k=1)
    b = family("transformer", sizes, k=4)
    target = 1.1
    # the largest b size is short: its curve stops above the target
    stop = power_law(sizes[2], GRID, 1) > target
    b[2] = make_curve(
        "short", "transformer", sizes[2], 4 * GRID[stop], power_law(sizes[2], GRID, 1)[stop]
    )
    # the largest a size starts below it
    start = power_law(sizes[2], GRID, 1) <= target
    a[2] = make_curve("late", "lmu", sizes[2], GRID[start], power_law(sizes[2], GRID, 1)[start])
    result = data_efficiency(a + b, "lmu", "transformer", target)
    assert result.reached["short"] is None and result.reached["late"] is None
    assert result.error is None
    np.testing.assert_array_equal(result.n, sizes[:2])
    np.testing.assert_allclose(result.ratio, 4.0, rtol=1e-9)
    text = "\n".join(result.left_out)
    assert "short never reaches 1.1" in text
    assert "late is already at or below 1.1 at its first evaluation" in text


def test_a_size_trained_at_several_budgets_takes_its_fewest_tokens():
    """An IsoFLOP grid trains one N at several budgets: a budget too short to reach the target
    does not drop the size, and of those that reach it the fewest tokens count."""
    n, target = 1e6, 1.1
    law = power_law(n, GRID, 1)
    a = [
        make_curve("a-short", "lmu", n, GRID[law > target], law[law > target]),  # never reaches
        make_curve("a-slow", "lmu", n, 2 * GRID, law),  # reaches at 2x the tokens of a-fast
        make_curve("a-fast", "lmu", n, GRID[:-1], law[:-1]),
    ]
    b = [make_curve("b", "transformer", n, 8 * GRID, law)]
    result = data_efficiency(a + b, "lmu", "transformer", target)
    assert result.error is None and result.left_out == ()
    assert result.reached["a-short"] is None
    assert result.reached["a-slow"] == pytest.approx(2 * result.reached["a-fast"], rel=1e-12)
    np.testing.assert_allclose(result.tokens_a, [result.reached["a-fast"]], rtol=1e-12)
    np.testing.assert_allclose(result.ratio, [8.0], rtol=1e-9)


def test_nothing_reached_or_measurable_is_an_error():
    sizes = 1e6 * 4.0 ** np.arange(3)
    curves = family("lmu", sizes, k=1) + family("transformer", sizes, k=4)
    for target in (0.5, 100.0):
        result = data_efficiency(curves, "lmu", "transformer", target)
        assert (
            result.error
            == f"no Transformer size reaches loss {target:.4g} after its first evaluation"
        )
        assert result.n.size == result.ratio.size == 0 and result.ratio_geomean is None
        assert all(v is None for v in result.reached.values())
        assert len(result.left_out) == 6


def test_no_overlap_is_an_error():
    a = family("lmu", [1e6, 1e7], k=1)
    b = family("transformer", [1e8, 1e9], k=4)
    result = data_efficiency(a + b, "lmu", "transformer")
    assert result.error.startswith("no LMU size lies inside the Transformer's measured sizes")
    assert "N 1e+08 to 1e+09" in result.error
    assert result.n.size == result.tokens_a.size == result.tokens_b.size == result.ratio.size == 0
    assert result.ratio_geomean is None


def test_a_missing_family_and_bad_arguments():
    curves = family("lmu", [1e6, 1e7], k=1)
    result = data_efficiency(curves, "lmu", "transformer")
    assert result.error == "no Transformer curves (the curves given are of lmu)"
    assert result.ratio_geomean is None
    with pytest.raises(ValueError, match="two different families"):
        data_efficiency(curves, "lmu", "lmu")
    with pytest.raises(ValueError, match="positive loss"):
        data_efficiency(curves, "lmu", "transformer", -1.0)
    with pytest.raises(ValueError, match="two curves for trial"):
        data_efficiency(curves + curves, "lmu", "transformer")
