"""Cooldown branches (``Trial(..., branch_from=(parent, step))``, ``lmuscale.train.branch``).

The runs: a stable parent (a "wsd" schedule without decay, 16 steps) and a branch of its step
12 that trains to step 20 with a decay over its last 8 steps. The branch's schedule equals
the parent's before step 12, and both evaluate every 4 steps, so the branch must compute
exactly what the same config trained from scratch computes: the comparison that shows it
started from exactly the parent's state (parameters, optimiser and plateau state, and the
data position, which is the step).
"""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
from compile_cache import env as cache_env
from compile_cache import in_process
from small_config import small
from sweep_files import SMALL, environment, run_sweep, sweep_command, wait_for

from lmuscale.outcomes import ConfigError
from lmuscale.sweep import load_sweep
from lmuscale.sweep.plan import plan, table
from lmuscale.sweep.throughput import Throughput
from lmuscale.train import run
from lmuscale.train.branch import Branch
from lmuscale.workdir import is_locked

# Saves every 5 steps, keeping 1: step 12 is saved and kept for the branch alone.
PARENT = {
    "train.steps": 16,
    "optim.schedule": "wsd",
    "optim.decay_fraction": 0.0,
    "checkpoint.every": 5,
    "checkpoint.keep": 1,
}
BRANCH = {**PARENT, "train.steps": 20, "optim.decay_fraction": 0.4}  # decays over 12..20
POINT = 12


def configure(data: Path, overrides: dict, keep_steps: str = ""):
    config = small(str(data))
    for key, value in overrides.items():
        section, leaf = key.split(".")
        config[section][leaf] = value
    config.checkpoint.keep_steps = keep_steps
    return config


def sweep_file(folder: Path, trials: str) -> Path:
    path = folder / "branches.py"
    path.write_text(
        "from lmuscale.sweep import Trial\n\n\ndef get_trials():\n"
        + textwrap.indent(textwrap.dedent(trials), "    ")
    )
    return path


GOOD = f"""\
yield Trial("stable", {SMALL!r}, {PARENT!r}, role="stable")
yield Trial("cool", {SMALL!r}, {BRANCH!r}, branch_from=("stable", {POINT}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, byte_corpus):
    """The parent, its branch and the branch's config from scratch, run in-process."""
    root = tmp_path_factory.mktemp("branch-runs")
    cache = tmp_path_factory.mktemp("xla-cache")
    folders = {name: root / name for name in ("stable", "cool", "scratch")}
    with in_process(cache):
        summaries = {
            "stable": run(configure(byte_corpus, PARENT, "12"), folders["stable"]),
            "cool": run(
                configure(byte_corpus, BRANCH),
                folders["cool"],
                branch=Branch("stable", folders["stable"], POINT),
            ),
            "scratch": run(configure(byte_corpus, BRANCH), folders["scratch"]),
        }
    return folders, summaries, cache


def test_a_branch_starts_from_exactly_its_parents_checkpointed_state(runs):
    folders, summaries, _ = runs
    stable, cool, scratch = (summaries[k] for k in ("stable", "cool", "scratch"))
    # The parent saved its branch point, off its checkpoint.every, and kept it whatever
    # checkpoint.keep (1) says.
    kept = sorted(int(p.name) for p in (folders["stable"] / "checkpoints").iterdir())
    assert kept == [POINT, 16]
    # The branch computed what the same config computes from scratch, bit for bit: the state
    # it started from at step 12 was the parent's, which equals the scratch run's there.
    for key in ("val_loss", "test_loss", "val_per_position", "test_per_position"):
        assert cool[key] == scratch[key], key
    assert cool["val_loss"] != stable["val_loss"]  # and the cooldown changed the result
    assert cool["branch_from"] == {"trial": "stable", "folder": "stable", "step": POINT}
    assert cool["tokens"] == 20 * 8 * 32  # the parent's share included
    # Its log holds the parent's lines up to the branch point, then its own from step 13.
    lines = [json.loads(x) for x in (folders["cool"] / "metrics.jsonl").read_text().splitlines()]
    parent = [json.loads(x) for x in (folders["stable"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 21))
    assert lines[:POINT] == parent[:POINT]
    scratch_lines = (folders["scratch"] / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in scratch_lines] == [r["loss"] for r in lines]


def test_a_branch_refuses_what_would_not_continue_its_parent(tmp_path, byte_corpus, monkeypatch):
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    stable = f'yield Trial("stable", {SMALL!r}, {PARENT!r}, role="stable")\n'

    def refused(branch: str, *needles):
        with pytest.raises(ConfigError) as error:
            load_sweep(sweep_file(tmp_path, stable + branch))
        message = str(error.value)
        assert "branches.py:" in message and "(trial 'cool')" in message, message
        for needle in needles:
            assert needle in message, message
        assert "\n" not in message

    cases = [
        ({**BRANCH}, ("nowhere", 12), ("'nowhere', which is not a trial here",)),
        ({**BRANCH}, ("stable", 17), ("step 17 is past its parent 'stable'", "16 steps")),
        ({**BRANCH}, ("stable", 20), ("step 20 is past",)),
        ({**BRANCH, "train.steps": 12}, ("stable", 12), ("nothing would be left to train",)),
        # a decay longer than the run
        (
            {**BRANCH, "optim.decay_steps": 20, "optim.warmup_steps": 2},
            ("stable", 12),
            ("optim's decay (20 steps) and warmup (2) are longer than the run",),
        ),
        # the decay would start at step 10, before the branch point
        (
            {**BRANCH, "optim.decay_fraction": 0.5},
            ("stable", 12),
            ("its decay starts at step 10, before the branch point (step 12)",),
        ),
        (
            {**BRANCH, "optim.schedule": "cosine"},
            ("stable", 12),
            ("its optim.schedule is 'cosine' where its parent 'stable' has 'wsd'",),
        ),
        ({**BRANCH}, ("stable", 0), ("branch_from step 0; expected a step >= 1",)),
        (
            {**BRANCH, "optim.learning_rate": 0.02},
            ("stable", 12),
            ("optim.learning_rate is 0.02 where its parent 'stable' has 0.01",),
        ),
        ({**BRANCH, "train.seed": 3}, ("stable", 12), ("train.seed is 3",)),
    ]
    for overrides, point, needles in cases:
        refused(f"yield Trial('cool', {SMALL!r}, {overrides!r}, branch_from={point!r})\n", *needles)
    refused(
        f"yield Trial('cool', {SMALL!r}, {BRANCH!r}, branch_from='stable')\n",
        "branch_from is 'stable'; expected (trial name, step)",
    )


def test_the_sweep_keeps_hashes_saves_branch_points_and_counts_both_designs(
    tmp_path, byte_corpus, monkeypatch
):
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    sweep = load_sweep(sweep_file(tmp_path, GOOD))
    stable, cool = sweep.trials
    assert stable.config.checkpoint.keep_steps == "12"  # filled in for the branch
    alone = load_sweep(sweep_file(tmp_path, GOOD.splitlines()[0]))
    assert alone.trials[0].folder_name == stable.folder_name  # keep_steps: not in the hash
    # A longer parent (a larger budget added) keeps the branch's folder; a parent that ends at
    # the branch point (and evaluates there) does not.
    for steps, same in ((24, True), (POINT, False)):
        other = load_sweep(sweep_file(tmp_path, GOOD.replace("16,", f"{steps},", 1)))
        assert other.trials[0].folder_name != stable.folder_name
        assert (other.trials[1].folder_name == cool.folder_name) is same, steps
    assert cool.branch_from == ("stable", POINT) and cool.waits  # until the parent finishes
    rows = plan(sweep.trials, tmp_path / "work", Throughput(1e9, source="test"))
    by = {r["trial"]: r for r in rows}
    per_step = by["cool"]["flops_per_token"] * 8 * 32
    assert by["cool"]["total_flops"] == pytest.approx(20 * per_step)
    assert by["cool"]["spent_flops"] == pytest.approx(8 * per_step)
    text = table(rows)
    assert "| cool |" in text and "0.01 |" in text  # a waiting branch's rate is known
    # both designs: stable 16 + cooldown 8 steps, against the branch's 20 from scratch
    assert "the same 1 budgets as independent runs: " in text and "(120% of it)" in text, text


def test_killing_parent_and_branch_resumes_to_identical_results(tmp_path, byte_corpus, runs):
    _, summaries, cache = runs
    sweep = sweep_file(tmp_path, GOOD)
    work = tmp_path / "work"

    def kill_when(pattern: str, what: str):
        runner = subprocess.Popen(  # its worker dies with it
            sweep_command(sweep, work, "--quiet"),
            env=environment(byte_corpus) | cache_env(cache, write=False),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(lambda: list(work.glob(pattern)), 120, what)
        finally:
            runner.send_signal(signal.SIGKILL)
            runner.wait()
        folder = next(work.glob(pattern.split("/checkpoints")[0]))
        wait_for(lambda: not is_locked(folder), 20, "the worker to die with its runner")
        assert not (folder / "summary.json").exists()

    kill_when("trials/stable-*/checkpoints/5", "the parent's checkpoint 5")
    assert not list(work.glob("trials/stable-*/checkpoints/12"))  # killed before the branch point
    kill_when("trials/cool-*/checkpoints/15", "the branch's checkpoint 15")  # mid-cooldown
    out = run_sweep(sweep, work, byte_corpus, extra_env=cache_env(cache))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {json.loads(x)["trial"]: json.loads(x) for x in (work / "results.jsonl").open()}
    for name, reference in (("stable", "stable"), ("cool", "cool")):
        for key in ("val_loss", "test_loss", "val_per_position", "test_per_position"):
            assert rows[name][key] == summaries[reference][key], (name, key)
    cool = rows["cool"]
    assert (cool["branch_from"], cool["branch_step"], cool["status"]) == ("stable", 12, "finished")
    assert cool["spent_flops"] == pytest.approx(cool["total_flops"] * 8 / 20)
    record = json.loads(next(work.glob("trials/cool-*/trial.json")).read_text())
    assert record["branch_from"]["trial"] == "stable" and record["branch_from"]["step"] == 12
    log = next(work.glob("trials/cool-*/train.log")).read_text()
    assert log.count("branch of stable: starts from its step 12") == 1  # seeded once
    for name, steps in (("stable", 16), ("cool", 20)):
        folder = work / "trials" / rows[name]["folder"]
        logged = [json.loads(x)["step"] for x in (folder / "metrics.jsonl").open()]
        assert logged == list(range(1, steps + 1)), name  # each step once
        attempts = [json.loads(x) for x in (folder / "attempts.jsonl").open()]
        # killed mid-run (a start without an end), then resumed to its end
        assert [a.get("outcome") for a in attempts] == [None, None, "finished"], name


def test_a_branch_whose_parent_diverged_ends_as_parent_diverged(tmp_path, byte_corpus, monkeypatch):
    from lmuscale.sweep import worker
    from lmuscale.sweep.runner import folders
    from lmuscale.sweepdir import Table

    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    path, work = sweep_file(tmp_path, GOOD), tmp_path / "work"
    sweep = load_sweep(path, work)
    paths = folders(sweep, work, [t for t in sweep.trials if not t.waits])
    (paths["stable"] / "summary.json").write_text(
        json.dumps({"status": "diverged", "step": 9, "error": "training diverged at step 9"})
    )
    again = sweep.reload()  # the parent has ended: the branch no longer waits
    assert not again.waiting
    branch = folders(again, work, again.trials)["cool"]
    assert worker.train(branch) == worker.Exit.DIVERGED  # in-process: no training starts
    row = Table(work).row(again.trials[1])
    assert row["status"] == "diverged" and row["branch_from"] == "stable"
    assert row["error"].startswith("parent diverged: stable diverged at step 9"), row["error"]
    assert not (branch / "checkpoints").exists()
    ends = [json.loads(x) for x in (branch / "attempts.jsonl").open()]
    assert [e["event"] for e in ends] == ["start", "end"] and ends[1]["outcome"] == "diverged"
    # A parent that diverged after the branch point left it a good checkpoint: it would train.
    late = Branch("stable", paths["stable"], 8)
    assert worker._parent_diverged_first(late) is False
    assert worker._parent_diverged_first(Branch("stable", paths["stable"], 9)) is True
