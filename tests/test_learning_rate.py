"""``lmuscale.analysis.learning_rate``: choosing a rate per size, and the file sweeps read."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lmuscale.analysis.learning_rate import (
    FORMAT,
    read_learning_rates,
    select_learning_rates,
    write_learning_rates,
)
from lmuscale.analysis.results import Run
from lmuscale.outcomes import DataError

OPTIMUM = 3e-3
QUARTER = 10 ** np.arange(-3, -2 + 1e-9, 0.25)  # 1e-3, 1.78e-3, 3.16e-3, 5.62e-3, 1e-2
HALF = 10 ** np.arange(-3, -2 + 1e-9, 0.5)  # 1e-3, 3.16e-3, 1e-2


def bowl(lr, optimum=OPTIMUM):
    """Final loss (nats) against the rate: a parabola in log10(lr) with its vertex at optimum."""
    return 3 + 0.2 * (math.log10(lr) - math.log10(optimum)) ** 2


def make_run(trial, lr, loss, family="lmu", n=1e6, tokens=1e8, seed=0):
    return Run(trial, family, n, 100, tokens, loss, 1, learning_rate=lr, seed=seed)


def sweep(grid, family="lmu", n=1e6, tokens=1e8, seeds=(0,), optimum=OPTIMUM, noise=None):
    """One run per (seed, rate); ``noise(seed, i)`` is added to the loss."""
    return [
        make_run(
            f"{family}-{n:g}-{tokens:g}-lr{i}-s{seed}",
            float(lr),
            bowl(lr, optimum) + (noise(seed, i) if noise else 0.0),
            family,
            n,
            tokens,
            seed,
        )
        for seed in seeds
        for i, lr in enumerate(grid)
    ]


@pytest.mark.parametrize("grid", [QUARTER, HALF], ids=["quarter-decade", "half-decade"])
def test_the_parabola_recovers_the_optimum(grid):
    choices, left_out = select_learning_rates(sweep(grid))
    assert left_out == []
    [choice] = choices
    # the loss is exactly a parabola in log10(lr), so the vertex through three points is exact
    assert choice.best == pytest.approx(OPTIMUM, rel=1e-9)
    assert choice.grid_best == pytest.approx(10**-2.5, rel=1e-12)  # the grid point nearest 3e-3
    assert choice.bracketed and choice.note == ""
    np.testing.assert_allclose(choice.learning_rates, grid)
    np.testing.assert_allclose(choice.loss, [bowl(lr) for lr in grid])
    assert (choice.family, choice.n, choice.tokens) == ("lmu", 1e6, 1e8)
    assert len(choice.trials) == len(grid)


def test_the_parabola_with_noise():
    # loss noise with SD 0.002 nats, 3 seeds, on the quarter-decade grid. Over 2,000 noise
    # draws the error in log10(best) had median 0.006, 99th percentile 0.023, max 0.042 decades
    rng = np.random.default_rng(0)
    draws = rng.normal(0, 0.002, size=(3, len(QUARTER)))
    choices, _ = select_learning_rates(
        sweep(QUARTER, seeds=(0, 1, 2), noise=lambda s, i: draws[s, i])
    )
    [choice] = choices
    assert abs(math.log10(choice.best / OPTIMUM)) < 0.05
    assert choice.bracketed
    np.testing.assert_allclose(choice.loss, [bowl(lr) for lr in QUARTER] + draws.mean(axis=0))


def test_seeds_are_averaged():
    # seed 0 is pushed up at small rates and seed 1 down by as much: their mean is the bowl,
    # while seed 0 alone would put the vertex elsewhere
    def push(seed, i):
        return (1 if seed == 0 else -1) * 0.01 * (len(QUARTER) - i)

    choices, _ = select_learning_rates(sweep(QUARTER, seeds=(0, 1), noise=push))
    [choice] = choices
    assert choice.best == pytest.approx(OPTIMUM, rel=1e-9)
    np.testing.assert_allclose(choice.loss, [bowl(lr) for lr in QUARTER], rtol=1e-12)
    [alone], _ = select_learning_rates(sweep(QUARTER, seeds=(0,), noise=push))
    assert abs(math.log10(alone.best / OPTIMUM)) > 0.02


@pytest.mark.parametrize(("optimum", "edge", "way"), [(3e-2, -1, "above"), (2e-4, 0, "below")])
def test_an_optimum_off_the_grid_is_not_bracketed(optimum, edge, way):
    [choice], _ = select_learning_rates(sweep(QUARTER, optimum=optimum))
    assert not choice.bracketed
    assert choice.best == choice.grid_best == QUARTER[edge]
    assert f"extend the grid {way} it" in choice.note


def test_groups_and_what_is_left_out():
    runs = [
        *sweep(QUARTER, n=1e6),
        # a size 3% larger is the same size; its rates join the grid
        make_run("near", 1.5e-3, bowl(1.5e-3), n=1.03e6),
        # another budget of that size is its own group
        *sweep(HALF, n=1e6, tokens=1e9, optimum=5e-3),
        # a size with one rate only
        make_run("lonely", 1e-3, 3.0, n=1e8),
        # a run without a learning rate
        Run("no-lr", "transformer", 1e6, 100, 1e8, 3.0, 1),
        *sweep(HALF, family="transformer", n=1e7, optimum=1e-3),
    ]
    choices, left_out = select_learning_rates(runs)
    keys = [(c.family, c.n, c.tokens) for c in choices]
    assert keys == [
        ("lmu", 1e6, 1e8),  # the median of 5 runs at 1e6 and one at 1.03e6
        ("lmu", 1e6, 1e9),
        ("transformer", 1e7, 1e8),
    ]
    assert len(choices[0].learning_rates) == 6 and 1.5e-3 in choices[0].learning_rates
    assert choices[0].best == pytest.approx(OPTIMUM, rel=1e-9)
    assert choices[1].best == pytest.approx(5e-3, rel=1e-9)
    assert not choices[2].bracketed
    assert left_out == [
        "Transformer: no learning_rate in 1 run(s): no-lr",
        "LMU N=1e+08, 1e+08 tokens: only one learning rate (0.001) in lonely",
    ]


def test_write_and_read_back(tmp_path):
    runs = (
        sweep(QUARTER, n=1e6, optimum=4e-3)
        + sweep(QUARTER, n=1e7, optimum=2e-3)
        + sweep(HALF, family="transformer", n=1e7, optimum=2.5e-3)
    )
    choices, _ = select_learning_rates(runs)
    path = tmp_path / "learning_rates.json"
    write_learning_rates(path, choices)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["version"] == 1
    row = data["rates"][0]
    assert set(row) == {"family", "N", "tokens", "learning_rate", "bracketed", "grid", "loss"}
    assert row["grid"] == pytest.approx(list(QUARTER)) and row["bracketed"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["learning_rates.json"]  # no temporary left

    rates = read_learning_rates(path)
    assert rates.families == ("lmu", "transformer")
    for choice in choices:
        assert rates.lookup(choice.family, choice.n) == choice.best
    assert rates.lookup("lmu", 1e6) == pytest.approx(4e-3, rel=1e-9)
    assert rates.lookup("lmu", 1.08e6) == pytest.approx(4e-3, rel=1e-9)  # nearest size
    assert rates.lookup("lmu", 9.3e6) == pytest.approx(2e-3, rel=1e-9)
    assert rates.lookup("transformer", 1e7) == pytest.approx(2.5e-3, rel=1e-9)
    np.testing.assert_array_equal(rates.sizes("lmu"), [1e6, 1e7])


def write(path, rows, **top):
    path.write_text(json.dumps({"format": FORMAT, "version": 1, "rates": rows, **top}))
    return path


def test_lookup_too_far_and_unknown_family(tmp_path):
    path = write(
        tmp_path / "lr.json",
        [
            {"family": "lmu", "N": 1e6, "learning_rate": 4e-3},
            {"family": "lmu", "N": 1e7, "learning_rate": 2e-3},
        ],
    )
    rates = read_learning_rates(path)
    with pytest.raises(DataError) as e:
        rates.lookup("lmu", 3e6)
    message = str(e.value)
    assert str(path) in message and "lmu" in message and "N=3e+06" in message
    assert "the file has lmu at N = 1e+06, 1e+07" in message
    assert rates.lookup("lmu", 3e6, rtol=3) == 4e-3  # nearest in log: 3e6 is nearer 1e6
    with pytest.raises(DataError) as e:
        rates.lookup("transformer", 1e6)
    assert str(e.value) == f"{path}: no learning rate for family 'transformer'; the file has lmu"
    with pytest.raises(ValueError, match="positive number of parameters"):
        rates.lookup("lmu", 0)


def test_the_largest_budget_counts(tmp_path):
    path = write(
        tmp_path / "lr.json",
        [
            {"family": "lmu", "N": 1e6, "tokens": 1e9, "learning_rate": 2e-3},
            {"family": "lmu", "N": 1.01e6, "tokens": 1e10, "learning_rate": 1e-3},
            {"family": "lmu", "N": 1e6, "tokens": 1e8, "learning_rate": 4e-3},
        ],
    )
    assert read_learning_rates(path).lookup("lmu", 1e6) == 1e-3
    ambiguous = write(
        tmp_path / "two.json",
        [
            {"family": "lmu", "N": 1e6, "tokens": 1e9, "learning_rate": 2e-3},
            {"family": "lmu", "N": 1e6, "tokens": 1e9, "learning_rate": 3e-3},
        ],
    )
    with pytest.raises(
        DataError, match=r"two\.json: rates\[0\] and rates\[1\] give lmu at N=1e\+06 with the same "
    ):
        read_learning_rates(ambiguous)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such learning-rate file"),
        ("{not json", ":1: not JSON"),
        (json.dumps({"format": "something else", "rates": []}), "format is 'something else'"),
        (json.dumps([1, 2]), "format is 'a JSON list'"),
        (json.dumps({"format": FORMAT, "version": 2, "rates": []}), "version 2"),
        (json.dumps({"format": FORMAT, "version": 1, "rates": {}}), "'rates' must be a list"),
        (
            json.dumps({"format": FORMAT, "version": 1, "rates": [{"family": "lmu", "N": 1e6}]}),
            "rates[0] has no learning_rate",
        ),
        (
            json.dumps(
                {
                    "format": FORMAT,
                    "version": 1,
                    "rates": [
                        {"family": "lmu", "N": 1e6, "learning_rate": 1e-3},
                        {"N": 1e7, "learning_rate": 1e-3},
                    ],
                }
            ),
            "rates[1] has no family",
        ),
        (
            json.dumps(
                {
                    "format": FORMAT,
                    "version": 1,
                    "rates": [{"family": "lmu", "N": 1e6, "learning_rate": -1e-3}],
                }
            ),
            "rates[0]: learning_rate must be a positive number, got -0.001",
        ),
        (
            json.dumps(
                {
                    "format": FORMAT,
                    "version": 1,
                    "rates": [{"family": "lmu", "N": "big", "learning_rate": 1e-3}],
                }
            ),
            "rates[0]: N is 'big', not a number",
        ),
    ],
    ids=[
        "missing",
        "not-json",
        "wrong-format",
        "not-an-object",
        "version",
        "rates-not-list",
        "no-rate",
        "no-family",
        "negative-rate",
        "bad-n",
    ],
)
def test_malformed_files_are_named(tmp_path, content, expected):
    path = tmp_path / "lr.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError) as e:
        read_learning_rates(path)
    assert str(e.value).startswith(str(path))
    assert expected in str(e.value)


def test_interpolate_between_and_beyond_the_sizes_swept(tmp_path):
    path = write(
        tmp_path / "lr.json",
        [
            {"family": "lmu", "N": 1e7, "learning_rate": 1e-3},  # rows in any order
            {"family": "lmu", "N": 1e5, "learning_rate": 1e-2},
        ],
    )
    rates = read_learning_rates(path)
    # halfway in log N is halfway in log rate: 1e6 -> sqrt(1e-2 * 1e-3)
    assert rates.interpolate("lmu", 1e6) == pytest.approx(math.sqrt(1e-5), rel=1e-12)
    assert rates.interpolate("lmu", 1e5) == pytest.approx(1e-2, rel=1e-12)
    assert rates.interpolate("lmu", 1e3) == pytest.approx(1e-2, rel=1e-12)  # held beyond
    assert rates.interpolate("lmu", 1e9) == pytest.approx(1e-3, rel=1e-12)
    with pytest.raises(DataError, match="no learning rate for family 'lmu_g'"):
        rates.interpolate("lmu_g", 1e6)
