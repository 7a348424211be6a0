"""The sweep folder (``lmuscale.sweepdir``): a results row takes the model's counts from the
trial's summary.json, and the runner's table costs one row per trial when first seen plus one
per trial that ends, across the stages of a staged sweep (in-process, with an executor that
writes each trial's summary instead of training)."""

from __future__ import annotations

import json

from ml_collections import ConfigDict
from sweep_files import SMALL, write_sweep

from lmuscale import sweepdir
from lmuscale.outcomes import Exit
from lmuscale.sweep import load_sweep, spec
from lmuscale.sweep.runner import run_sweep
from lmuscale.workdir import status

STAGED = f"""
from lmuscale.sweep import Trial
from lmuscale.sweep.grids import chosen_learning_rates

RATES = (0.01, 0.03, 0.1)


def get_trials(done):
    grid = [Trial(f"lr{{r}}", {SMALL!r}, {{"optim.learning_rate": r}}, role="learning_rate")
            for r in RATES]
    if chosen_learning_rates(done, grid) is None:
        return grid + [Trial(f"later{{s}}", {SMALL!r}, waits="the rates") for s in (1, 2)]
    return grid + [Trial(f"later{{s}}", {SMALL!r}, {{"train.seed": s}}) for s in (1, 2)]
"""


def _summary(config: dict, outcome: str, sizes=spec.sizes) -> dict:
    """What train.loop writes at a run's end; its total_params is one more than the config's,
    so that a row shows where its counts came from."""
    counts = sizes(ConfigDict(config))
    record = {
        "family": counts["family"],
        "params": {"non_embedding": counts["N"], "embedding": 1, "total": counts["N"] + 1},
        "flops_per_token": {"forward": 1.0, "train": counts["flops_per_token"]},
        "status": outcome,
    }
    if outcome == "diverged":
        return record | {"error": "training diverged at step 3", "step": 3}
    loss = config["optim"]["learning_rate"] + config["train"]["seed"]
    return record | {"val_loss": loss, "test_loss": loss, "wall_seconds": 1.0}


def test_a_row_takes_the_counts_of_the_summary_else_of_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(tmp_path))
    (trial,) = load_sweep(write_sweep(tmp_path, {"a": {}})).trials
    folder = tmp_path / trial.folder_name
    folder.mkdir()
    pending = trial.result_row(folder)
    counts = spec.sizes(trial.config)
    assert (pending["N"], pending["total_params"]) == (counts["N"], counts["total_params"])
    assert pending["status"] == "pending" and pending["val_loss"] is None
    (folder / "summary.json").write_text(json.dumps(_summary(trial.config.to_dict(), "finished")))
    monkeypatch.setattr(spec, "sizes", None)  # a finished trial's row builds no model
    row = trial.result_row(folder)
    assert (row["N"], row["total_params"], row["status"]) == (
        counts["N"],
        counts["N"] + 1,
        "finished",
    )
    assert row["total_flops"] == counts["flops_per_token"] * row["tokens"]
    assert list(row) == list(sweepdir.RESULT_FIELDS)


def test_the_runner_builds_a_row_per_trial_at_its_start_and_per_ended_trial(tmp_path, monkeypatch):
    from lmuscale.sweep import local

    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(tmp_path))
    built, counted, ended = [], [], []
    result_row, sizes = spec.ResolvedTrial.result_row, spec.sizes

    def counting_row(trial, folder):
        built.append(trial.name)
        return result_row(trial, folder)

    def counting_sizes(config):
        counted.append(config.name)
        return sizes(config)

    def train(folders, parallel, on_update, on_end):  # the largest rate diverges
        for folder in folders:
            config = json.loads((folder / "trial.json").read_text())["config"]
            outcome = "diverged" if config["name"] == "lr0.1" else "finished"
            (folder / "summary.json").write_text(json.dumps(_summary(config, outcome, sizes)))
            ended.append(config["name"])
            on_end(folder, status(folder))

    monkeypatch.setattr(spec.ResolvedTrial, "result_row", counting_row)
    monkeypatch.setattr(spec, "sizes", counting_sizes)
    monkeypatch.setattr(local, "run_local", train)
    path, work = tmp_path / "staged.py", tmp_path / "work"
    path.write_text(STAGED)
    sweep = load_sweep(path, work)  # the first stage's rows are built here, and kept
    assert run_sweep(sweep, work, show=False) == Exit.UNFINISHED  # lr0.1 diverged
    names = ["lr0.01", "lr0.03", "lr0.1", "later1", "later2"]
    assert ended == names  # every trial ran, the later ones once the rates had ended
    # one row per trial at its start, one per ended trial; only the first from the config
    assert sorted(built) == sorted(names + ended) and sorted(counted) == sorted(names)
    # the rows kept are those the folders give now
    table = (work / sweepdir.RESULTS).read_text(), (work / sweepdir.RESULTS_CSV).read_text()
    sweepdir.Table(work).write(load_sweep(path, work).trials)
    assert table == (
        (work / sweepdir.RESULTS).read_text(),
        (work / sweepdir.RESULTS_CSV).read_text(),
    )
    rows = [json.loads(line) for line in table[0].splitlines()]
    assert [r["trial"] for r in rows] == names
    assert [r["status"] for r in rows] == ["finished", "finished", "diverged"] + ["finished"] * 2


def test_a_full_disk_at_the_results_or_a_crashed_trials_error_json_is_one_line_and_8(
    tmp_path, monkeypatch, capsys
):
    """Each was a traceback and status 1: the results table at the sweep's start, and the
    error.json the runner writes for a worker that died (a real one, killed by SIGKILL)."""
    import subprocess

    from full_disk import NO_SPACE, fsync_fails
    from sweep_files import write_sweep

    from lmuscale.sweep import local
    from lmuscale.sweep.__main__ import main

    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(tmp_path))
    sweep, work = write_sweep(tmp_path, {"a": {}}), tmp_path / "work"
    argv = [str(sweep), "--workdir", str(work), "--quiet"]
    with monkeypatch.context() as full:
        fsync_fails(full, "results.jsonl")
        assert main(argv) == Exit.IO
    err = capsys.readouterr().err
    assert err == f"error: {work / 'results.jsonl'}: cannot be written ({NO_SPACE})\n", err

    def killed(folder, started, env, **popen):  # a worker the kernel killed at once
        return subprocess.Popen(["sh", "-c", "kill -9 $$"])

    monkeypatch.setattr(local, "start", killed)
    (trial,) = load_sweep(sweep, work).trials
    with monkeypatch.context() as full:
        fsync_fails(full, "error.json")
        assert main(argv) == Exit.IO
    error = work / "trials" / trial.folder_name / "error.json"
    assert capsys.readouterr().err == f"error: {error}: cannot be written ({NO_SPACE})\n"
    assert main(argv) == Exit.UNFINISHED  # room again: the crash is recorded
    assert "worker ended with signal SIGKILL" in error.read_text()


def test_an_attempt_killed_after_its_summary_gets_its_end_record(tmp_path, monkeypatch):
    """A worker killed between summary.json and its end record left attempts.jsonl without
    one for good (the trial is done: no worker runs it again). The next runner writes it, at
    the summary's time, which the dry run's overhead reads."""
    from sweep_files import write_sweep

    from lmuscale.sweep import local
    from lmuscale.sweep.plan import measured_overhead

    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(tmp_path))

    def killed_after_summary(folders, parallel, on_update, on_end):
        for folder in folders:
            start = {"event": "start", "time": 100.0, "spawned": 99.0, "pid": 1}
            (folder / "attempts.jsonl").write_text(json.dumps(start) + "\n")
            config = json.loads((folder / "trial.json").read_text())["config"]
            (folder / "summary.json").write_text(json.dumps(_summary(config, "finished")))
            (folder / "metrics.jsonl").write_text('{"step": 1, "tokens_per_second": 1e9}\n')
            on_end(folder, status(folder))  # and then the kill: no end record

    monkeypatch.setattr(local, "run_local", killed_after_summary)
    sweep, work = write_sweep(tmp_path, {"a": {}}), tmp_path / "work"
    assert run_sweep(load_sweep(sweep, work), work, show=False) == Exit.FINISHED
    (trial,) = load_sweep(sweep, work).trials
    folder = work / "trials" / trial.folder_name
    assert len((folder / "attempts.jsonl").read_text().splitlines()) == 1

    assert run_sweep(load_sweep(sweep, work), work, show=False) == Exit.FINISHED
    events = [json.loads(line) for line in (folder / "attempts.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "end"]
    assert events[1]["outcome"] == "finished"
    assert events[1]["time"] == (folder / "summary.json").stat().st_mtime
    assert "the worker ended before recording it" in events[1]["note"]
    assert measured_overhead(folder, 0, [1e9]) == events[1]["time"] - 99.0
    assert run_sweep(load_sweep(sweep, work), work, show=False) == Exit.FINISHED
    assert len((folder / "attempts.jsonl").read_text().splitlines()) == 2  # once
