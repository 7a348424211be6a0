"""Sweeps in stages: trials that wait for others' results (``Trial(waits=...)`` and
``get_trials(done)``), the runner asking the sweep file again once they have ended, and the
learning rates a staged sweep takes from its own learning-rate grid."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from compile_cache import env as cache_env
from compile_cache import in_process
from small_config import small
from sweep_files import SMALL, run_sweep

from lmuscale.outcomes import Exit
from lmuscale.sweep import Trial, load_sweep
from lmuscale.sweep.grids import chosen_learning_rates
from lmuscale.train import run

STAGED = f"""
import json
from pathlib import Path

from lmuscale.sweep import Trial


def get_trials(done):
    yield Trial("first", {SMALL!r})
    first = done.get("first")
    if first is None:
        yield Trial("second", {SMALL!r}, waits="the first trial's loss")
    else:  # a config made from the first trial's result
        yield Trial("second", {SMALL!r}, {{"train.seed": 1 + int(first["val_loss"] > 0)}})


def after(workdir):
    rows = [json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines()]
    with open(Path(__file__).parent / "after.jsonl", "a") as f:
        f.write(json.dumps({{r["trial"]: r["status"] for r in rows}}) + "\\n")
"""


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory, byte_corpus) -> Path:
    """The small config's train step compiled once, for both trials' workers (seeds are data)."""
    folder = tmp_path_factory.mktemp("xla-cache")
    with in_process(folder):
        run(small(str(byte_corpus)), tmp_path_factory.mktemp("warm-up"), progress=False)
    return folder


def test_a_staged_sweep_runs_its_later_stage_in_the_same_command(
    tmp_path, byte_corpus, xla_cache, monkeypatch
):
    sweep = tmp_path / "staged.py"
    sweep.write_text(STAGED)
    work = tmp_path / "work"
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))

    before = load_sweep(sweep, work)
    assert [t.name for t in before.waiting] == ["second"]
    assert before.waiting[0].waits == "the first trial's loss"

    out = run_sweep(sweep, work, byte_corpus, extra_env=cache_env(xla_cache))
    assert out.returncode == Exit.FINISHED, out.stdout + out.stderr
    assert "2 trials, 0 already done, 1 to run (local), 1 waiting for others" in out.stdout
    assert re.search(r"^sweep: 0/1 trials done, .*; 1 more wait for these$", out.stdout, re.M)
    rows = {
        r["trial"]: r for r in map(json.loads, (work / "results.jsonl").read_text().splitlines())
    }
    assert {name: row["status"] for name, row in rows.items()} == {
        "first": "finished",
        "second": "finished",
    }
    second = json.loads((work / "trials" / rows["second"]["folder"] / "config.json").read_text())
    assert second["train"]["seed"] == 2  # made from the first trial's (positive) loss
    index = json.loads((work / "sweep.json").read_text())["trials"]
    assert index == {name: f"trials/{row['folder']}" for name, row in rows.items()}
    # `after` ran once, when both stages had finished, not after the first
    calls = (tmp_path / "after.jsonl").read_text().splitlines()
    assert [json.loads(c) for c in calls] == [{"first": "finished", "second": "finished"}]

    after = load_sweep(sweep, work)
    assert not after.waiting and rows["second"]["folder"] == after.trials[1].folder_name
    again = run_sweep(sweep, work, byte_corpus, extra_env=cache_env(xla_cache))
    assert again.returncode == Exit.FINISHED and "2 already done, 0 to run" in again.stdout
    # `after` does not run again on the same results (it did on every invocation), unless asked
    assert f"after(): already run on these results ({work / 'after.json'})" in again.stdout
    assert len((tmp_path / "after.jsonl").read_text().splitlines()) == 1
    asked = run_sweep(sweep, work, byte_corpus, "--after", extra_env=cache_env(xla_cache))
    assert asked.returncode == Exit.FINISHED and "already run" not in asked.stdout
    assert len((tmp_path / "after.jsonl").read_text().splitlines()) == 2


# A learning-rate grid of the small config whose largest rate diverges at step 2 (warmup step
# 0 has rate 0, step 1 2.5e37: test_train's diverging run), then a trial at the rate it chose.
DIVERGING = f"""
import json
from pathlib import Path

from lmuscale.models import count_params
from lmuscale.sweep import Trial
from lmuscale.sweep.grids import chosen_learning_rates
from lmuscale.train import load, model_config

RATES = {{"lr0.01": {{}}, "lr0.03": {{"optim.learning_rate": 0.03}}}}
RATES["lr1e38"] = {{"optim.learning_rate": 1e38, "optim.warmup_steps": 4}}


def get_trials(done):
    grid = [Trial(name, {SMALL!r}, o, role="learning_rate") for name, o in RATES.items()]
    chosen = chosen_learning_rates(done, grid)
    if chosen is None:
        return grid + [Trial("later", {SMALL!r}, waits="the grid's learning rate")]
    n = count_params(model_config(load({SMALL!r}).model)).non_embedding
    rate = float(f"{{chosen[0].interpolate('lmu', n):.6g}}")  # the grid's own: its step cached
    return grid + [Trial("later", {SMALL!r}, {{"optim.learning_rate": rate, "train.seed": 1}})]


def after(workdir):
    (Path(__file__).parent / "after.txt").write_text("ran")
"""


def test_a_diverged_learning_rate_trial_still_lets_the_later_stage_run(
    tmp_path, byte_corpus, xla_cache
):
    sweep = tmp_path / "diverging.py"
    sweep.write_text(DIVERGING)
    work = tmp_path / "work"
    out = run_sweep(sweep, work, byte_corpus, "--parallel", "2", extra_env=cache_env(xla_cache))
    # unfinished, for the diverged trial; but every trial has ended and none waits
    assert out.returncode == Exit.UNFINISHED, out.stdout + out.stderr
    rows = {
        r["trial"]: r for r in map(json.loads, (work / "results.jsonl").read_text().splitlines())
    }
    assert {name: row["status"] for name, row in rows.items()} == {
        "lr0.01": "finished",
        "lr0.03": "finished",
        "lr1e38": "diverged",
        "later": "finished",
    }
    assert rows["lr1e38"]["step"] == 2 and "diverged at step 2" in rows["lr1e38"]["error"]
    # the diverged rate is left out: the grid's edge, the better of the other two
    best = min(("lr0.01", "lr0.03"), key=lambda name: rows[name]["val_loss"])
    assert rows["later"]["learning_rate"] == rows[best]["learning_rate"]  # to 6 digits
    assert "not run" not in out.stdout and (tmp_path / "after.txt").read_text() == "ran"
    assert not load_sweep(sweep, work).waiting


def test_a_trial_left_waiting_is_named_and_the_sweep_is_unfinished(tmp_path, monkeypatch):
    sweep = tmp_path / "waits.py"
    sweep.write_text(
        "from lmuscale.sweep import Trial\n\n\ndef get_trials():\n"
        f"    yield Trial('later', {SMALL!r}, waits='run sweeps/other.py first')\n"
        "\n\ndef after(workdir):\n    raise SystemExit('after must not run')\n"
    )
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(tmp_path))
    work = tmp_path / "work"
    out = run_sweep(sweep, work, tmp_path)
    assert out.returncode == Exit.UNFINISHED, out.stdout + out.stderr
    assert "1 trial(s) not run: run sweeps/other.py first" in out.stdout
    assert "after must not run" not in out.stdout + out.stderr
    assert json.loads((work / "sweep.json").read_text())["trials"] == {}
    assert not (work / "trials").exists() or not any((work / "trials").iterdir())
    assert (work / "results.jsonl").read_text() == ""


def test_waits_and_note_must_be_text(tmp_path, monkeypatch):
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(tmp_path))
    sweep = tmp_path / "bad.py"
    sweep.write_text(
        f"from lmuscale.sweep import Trial\n\n\ndef get_trials():\n"
        f"    yield Trial('x', {SMALL!r}, waits=True)\n"
    )
    with pytest.raises(Exception, match=r"bad.py:5 \(trial 'x'\): waits is True; expected text"):
        load_sweep(sweep)


def _row(name, family, n, lr, loss, tokens=1000):
    return {
        "trial": name,
        "family": family,
        "N": n,
        "steps": 10,
        "tokens": tokens,
        "learning_rate": lr,
        "val_loss": loss,
    }


def test_chosen_learning_rates_wait_for_every_trial_and_choose_as_the_analysis_does():
    grid = [Trial(f"a-lr{lr:g}", "x.py:y") for lr in (1e-3, 1e-2, 1e-1)]
    grid += [Trial(f"b-lr{lr:g}", "x.py:y") for lr in (1e-3, 1e-2, 1e-1)]
    losses_a = {1e-3: 3.0, 1e-2: 2.0, 1e-1: 2.5}
    losses_b = {1e-3: 2.9, 1e-2: 2.2, 1e-1: None}  # diverged at 0.1: left out
    done = {f"a-lr{lr:g}": _row(f"a-lr{lr:g}", "lmu", 1000, lr, v) for lr, v in losses_a.items()}
    done |= {f"b-lr{lr:g}": _row(f"b-lr{lr:g}", "lmu", 8000, lr, v) for lr, v in losses_b.items()}

    for missing in done:  # any trial not ended: no choice yet
        assert chosen_learning_rates({k: v for k, v in done.items() if k != missing}, grid) is None
    rates, choices = chosen_learning_rates(done, grid)
    # a parabola in log10(rate) through (-3, 3.0), (-2, 2.0), (-1, 2.5): vertex at -2 + 0.5/3
    small_n, large_n = sorted(choices, key=lambda c: c.n)
    assert small_n.bracketed and math.isclose(math.log10(small_n.best), -2 + 1 / 6, rel_tol=1e-12)
    assert not large_n.bracketed and large_n.best == 1e-2  # the grid's edge, once 0.1 is out
    assert math.isclose(rates.interpolate("lmu", 1000), small_n.best, rel_tol=1e-12)
    assert math.isclose(rates.interpolate("lmu", 8000), 1e-2, rel_tol=1e-12)
    middle = math.exp((math.log(small_n.best) + math.log(1e-2)) / 2)
    assert math.isclose(rates.interpolate("lmu", math.sqrt(8000 * 1000)), middle, rel_tol=1e-9)


def test_the_dry_run_shows_waiting_trials_and_notes(tmp_path, monkeypatch):
    from lmuscale.sweep.plan import plan, table

    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(tmp_path))
    sweep = tmp_path / "noted.py"
    sweep.write_text(
        "from lmuscale.sweep import Trial\n\n\ndef get_trials():\n"
        f"    yield Trial('now', {SMALL!r}, note='rate from a file')\n"
        f"    yield Trial('later', {SMALL!r}, waits='the rate file')\n"
        f"    yield Trial('later2', {SMALL!r}, {{'train.seed': 3}}, waits='the rate file')\n"
    )
    loaded = load_sweep(sweep, tmp_path / "work")
    text = table(plan(loaded.trials, tmp_path / "work", loaded.throughput))
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()}
    assert lines["now"].endswith("| pending | rate from a file |")
    assert lines["later"].endswith("| waits | - |") and "| - |" in lines["later"]
    assert "| 0.01 |" in lines["now"] and "| 0.01 |" not in lines["later"]
    assert "2 trial(s) wait for the rate file;" in text
