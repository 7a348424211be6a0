"""Compute-optimal grids: every trial spends its budget, its schedule scales with its steps,
and the shipped sweep files resolve."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from lmuscale.models import LMUConfig, TransformerConfig, count_params, flops_per_token, sizes
from lmuscale.models.lmu import lmu_config
from lmuscale.sweep.grids import (
    isoflop_grid,
    isoflop_points,
    learning_rate_grid,
    short,
    wsd_grid,
)
from lmuscale.sweep.spec import load_sweep
from lmuscale.train import base_config, model_config, optim

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"
WIDTHS = (8, 12, 16, 24, 32, 48, 64, 96)


def lmu(d):
    return LMUConfig(
        d=d, q=8, q_prime=2, theta=32.0, n_layers=2, pre_ffn_dim=d, post_ffn_dim=2 * d,
        vocab_size=256, batch_chunk=0,
    )  # fmt: skip


def transformer(d):
    return TransformerConfig(d=d, n_heads=max(1, d // 16), n_layers=2, max_len=64, vocab_size=256)


def make_config(model):
    c = base_config(model)
    c.data.update(path="/data", tokenizer="bytes", seq_len=64)
    c.train.update(steps=1000, global_batch=8)
    c.optim.update(learning_rate=3e-3, warmup_steps=50)  # 5% warmup
    c.log.every = 10
    return c


MODELS = {"lmu": [lmu(d) for d in WIDTHS], "transformer": [transformer(d) for d in WIDTHS]}
BUDGETS = (2e10, 6e10, 2e11)


def cost(config) -> float:
    model = model_config(config.model)
    f = flops_per_token(model, config.data.seq_len).train
    return f * config.train.steps * config.train.global_batch * config.data.seq_len


def test_every_trial_spends_its_budget_within_2_percent():
    trials = isoflop_grid(MODELS, BUDGETS, make_config, per_budget=4, min_steps=30)
    assert len(trials) == len(BUDGETS) * 2 * 4
    for trial in trials:
        budget = float(trial.name.rsplit("-", 1)[1])
        assert abs(cost(trial.config) / budget - 1) < 0.02, trial.name
        assert trial.role == "isoflop"
        n = count_params(model_config(trial.config.model)).non_embedding
        assert trial.name.startswith(f"{trial.config.model.family}-{short(n)}-")


def test_a_budget_takes_consecutive_sizes_around_the_tokens_per_parameter_target():
    points = isoflop_points(MODELS, BUDGETS, batch=8, seq_len=64, per_budget=4, min_steps=30)
    for family, candidates in MODELS.items():
        every_n = sorted(count_params(m).non_embedding for m in candidates)
        medians = []
        for budget in BUDGETS:
            ns = [p.n for p in points if p.family == family and p.budget == budget]
            first = every_n.index(ns[0])
            assert ns == every_n[first : first + 4]  # a run of neighbours
            ratio = [p.tokens / p.n for p in points if p.family == family and p.budget == budget]
            assert min(ratio) <= 20 <= max(ratio) or first in (0, len(every_n) - 4)
            medians.append(np.median(ns))
        assert medians == sorted(medians) and medians[0] < medians[-1]  # slides with C
        for p in points:
            assert p.tokens == p.steps * 8 * 64 and p.steps >= 30
            assert p.flops == pytest.approx(flops_per_token(p.model, 64).train * p.tokens)


def test_schedules_scale_with_each_runs_steps():
    trials = isoflop_grid(MODELS, BUDGETS, make_config, per_budget=4, min_steps=30, evals=8)
    steps = sorted({t.config.train.steps for t in trials})
    assert steps[0] < steps[-1] / 5  # the grid spans short and long runs
    for trial in trials:
        c = trial.config
        assert c.optim.warmup_steps == max(1, round(0.05 * c.train.steps))
        assert c.eval.every == c.checkpoint.every == max(1, c.train.steps // 8)
        assert c.log.every <= c.eval.every
        lr = optim.cosine(c.optim.learning_rate, c.optim.warmup_steps, c.train.steps)
        assert float(lr(c.optim.warmup_steps)) == pytest.approx(3e-3)
        assert float(lr(c.train.steps)) == pytest.approx(0.0, abs=1e-12)  # decays at its end
        assert float(lr(c.train.steps // 2 + c.optim.warmup_steps // 2)) == pytest.approx(
            1.5e-3, rel=0.05
        )


def test_too_few_affordable_sizes_is_named():
    with pytest.raises(ValueError, match=r"transformer at C = 1e\+09 FLOPs: only \d of its 8"):
        isoflop_grid(
            {"transformer": MODELS["transformer"]}, [1e9], make_config, per_budget=5, min_steps=30
        )


def test_seeds_and_tuned_learning_rates():
    rates = {}

    def rate(family, n):
        rates[family, n] = 1e-3 if family == "lmu" else 2e-3
        return rates[family, n]

    trials = isoflop_grid(
        MODELS, BUDGETS[:1], make_config, per_budget=4, min_steps=30, seeds=(0, 1, 2),
        learning_rate=rate,
    )  # fmt: skip
    assert len(trials) == 2 * 4 * 3
    for trial in trials:
        seed = int(trial.name.rsplit("-s", 1)[1])
        assert trial.config.train.seed == seed
        family = trial.config.model.family
        assert trial.config.optim.learning_rate == (1e-3 if family == "lmu" else 2e-3)
    assert len(rates) == 8


def test_learning_rate_grid_is_every_size_at_every_rate():
    rates = (1e-3, 3e-3, 1e-2)
    trials = learning_rate_grid(MODELS, rates, make_config, steps=200, evals=4)
    assert len(trials) == 2 * len(WIDTHS) * 3
    for trial in trials:
        lr = float(trial.name.rsplit("-lr", 1)[1])
        assert trial.config.optim.learning_rate == lr and lr in rates
        assert trial.config.train.steps == 200 and trial.config.optim.warmup_steps == 10
        assert trial.config.eval.every == 50
        assert trial.role == "learning_rate"


def test_any_n_gets_a_grid_point_and_table_rows_are_unchanged():
    for row in sizes.TABLE3:
        assert sizes.row(row.n) == row == sizes.row(row.size)
    for n in (20_000, 150_000, 3_000_000, 40_000_000):
        point = sizes.row(n)
        assert point.d == round(math.sqrt(n / 24))
        assert 0.9 < point.q / point.d < 1.1 and 1 <= point.q_prime <= point.q
        assert abs(count_params(lmu_config(n)).non_embedding / n - 1) < 0.01
    for bad in (999, 1.5e5, True, "150k"):
        with pytest.raises(ValueError):
            sizes.row(bad)


@pytest.mark.parametrize(
    ("sweep", "count", "budgets"),
    [
        ("isoflop_demo.py", 42, (4.5e10, 9e10, 1.8e11)),
        ("isoflop.py", 105, tuple(10 ** (15 + 0.75 * k) for k in range(5))),
    ],
)
def test_the_shipped_isoflop_sweeps_resolve_and_spend_their_budgets(sweep, count, budgets):
    loaded = load_sweep(SWEEPS / sweep)
    assert len(loaded.trials) == count
    grid = [t for t in loaded.trials if "-lr" not in t.name]  # the demo adds a small LR sweep
    assert len(grid) == 30 if sweep == "isoflop_demo.py" else count
    if sweep == "isoflop_demo.py":  # its learning-rate stage has not run: the grid waits for it
        assert [t.name for t in loaded.waiting] == [t.name for t in grid]
    for trial in grid:
        spent = cost(trial.config)
        assert min(abs(spent / b - 1) for b in budgets) < 0.02, trial.name


def test_each_family_may_centre_its_window_on_its_own_ratio():
    common = isoflop_points(MODELS, BUDGETS, batch=8, seq_len=64, per_budget=4, min_steps=30)
    apart = isoflop_points(
        MODELS, BUDGETS, batch=8, seq_len=64, per_budget=4, min_steps=30,
        tokens_per_param={"lmu": 20.0, "transformer": 2000.0},
    )  # fmt: skip
    for family, lower in (("lmu", False), ("transformer", True)):
        before = sorted(p.n for p in common if p.family == family)
        after = sorted(p.n for p in apart if p.family == family)
        assert (after < before) if lower else (after == before)


def test_wsd_grid_branches_every_budget_from_one_stable_run_per_size():
    models = {"lmu": [lmu(16), lmu(8)]}
    trials = wsd_grid(models, [6e10, 2e10, 4e10], make_config, decay=0.25, min_steps=30)
    assert [t.role for t in trials] == ["stable", "isoflop", "isoflop", "isoflop"] * 2
    for stable, *branches in (trials[:4], trials[4:]):
        n = count_params(model_config(stable.config.model)).non_embedding
        assert stable.name == f"lmu-{short(n)}-stable" and stable.branch_from is None
        steps = [b.config.train.steps for b in branches]
        assert steps == sorted(steps)  # budgets in ascending order
        for branch, budget in zip(branches, (2e10, 4e10, 6e10), strict=True):
            assert branch.name == f"lmu-{short(n)}-{short(budget)}"
            assert abs(cost(branch.config) / budget - 1) < 0.02
            start = branch.config.train.steps - round(0.25 * branch.config.train.steps)
            assert branch.branch_from == (stable.name, start)
            # the same warmup (5% of the smallest budget's steps) and peak in every run
            assert branch.config.optim.warmup_steps == round(0.05 * steps[0])
            assert branch.config.optim.decay_fraction == 0.25
            rate = optim.schedule(branch.config.optim, branch.config.train.steps)
            parent = optim.schedule(stable.config.optim, stable.config.train.steps)
            before = np.arange(start)
            np.testing.assert_array_equal(rate(before), parent(before))
            assert float(rate(branch.config.train.steps)) == 0.0  # decayed to the floor
        # the stable run reaches the largest budget's branch point, at the peak rate
        assert stable.config.train.steps == branches[-1].branch_from[1]
        assert stable.config.optim.decay_fraction == 0.0
        # evaluated at the smallest budget's pace, whatever its own length
        assert stable.config.eval.every == steps[0] // 10
    with pytest.raises(ValueError, match="at least 500 are needed"):
        wsd_grid(models, [2e10], make_config, min_steps=500)


def test_the_wsd_demo_pairs_each_cooldown_with_a_cosine_run_and_spends_under_60_percent(
    tmp_path,
):
    from lmuscale.sweep.plan import plan, table

    sweep = load_sweep(SWEEPS / "wsd_demo.py")
    by_name = {t.name: t for t in sweep.trials}
    branches = [t for t in sweep.trials if t.branch_from]
    assert len(branches) == 18
    for family in ("lmu", "transformer"):  # 3 sizes x 3 budgets each
        sizes = {t.config.model.d for t in branches if t.config.model.family == family}
        assert len(sizes) == 3, family
    for branch in branches:
        cosine = by_name[f"cosine-{branch.name}"].config
        assert cosine.optim.schedule == "cosine" and branch.config.optim.schedule == "wsd"
        for key in ("train.steps", "optim.warmup_steps", "optim.learning_rate", "eval.every"):
            section, leaf = key.split(".")
            assert cosine[section][leaf] == branch.config[section][leaf], key
    text = table(plan(sweep.trials, tmp_path, sweep.throughput))
    spent = {
        design: sum(
            cost(t.config) * (1 - t.branch_from[1] / t.config.train.steps if t.branch_from else 1)
            for t in sweep.trials
            if t.name.startswith("cosine-") == (design == "cosine")
        )
        for design in ("wsd", "cosine")
    }
    assert spent["wsd"] / spent["cosine"] <= 0.6
    assert f"({spent['wsd'] / spent['cosine']:.0%} of it)" in text, text
