"""Sweep files, trial folders and the dry-run table (in-process), and the local runner end to
end (real subprocesses): a failing trial and two runners on one workdir (a runner killed with
SIGKILL and started again: test_sweep_branches, whose parent and branch are both killed).

The end-to-end tests' workers share a persistent compilation cache (``compile_cache``): their
trials are the same small config with a few seeds and step counts, so most of them load the
train step that an earlier run compiled instead of spending ~10 s compiling it again.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from compile_cache import env as cache_env
from compile_cache import in_process
from ml_collections import ConfigDict
from small_config import small
from sweep_files import SMALL, environment, run_sweep, sweep_command, wait_for, write_sweep

from lmuscale import __version__
from lmuscale.data.format import fingerprint
from lmuscale.models import count_params
from lmuscale.outcomes import ConfigError, Exit
from lmuscale.resume import flatten
from lmuscale.sweep import Throughput, Trial, config_hash, load_sweep
from lmuscale.sweep.__main__ import parse as sweep_parse
from lmuscale.sweep.__main__ import slurm_params
from lmuscale.sweep.local import gpu_slots
from lmuscale.sweep.plan import plan, table
from lmuscale.sweep.runner import select
from lmuscale.sweep.spec import _resolve, twins
from lmuscale.sweepdir import RESULT_FIELDS
from lmuscale.train import load, model_config, run
from lmuscale.workdir import Lock as TrialLock
from lmuscale.workdir import is_locked

REPO = Path(__file__).resolve().parent.parent


# -- sweep files -------------------------------------------------------------------------------


def _bad_sweep(tmp_path, body: str) -> str:
    path = tmp_path / "bad.py"
    path.write_text(body)
    # each message starts with the file (and the line, and the trial)
    where = rf"^{re.escape(str(path))}(:\d+)?( \(trial '[^']*'\))?: "
    with pytest.raises(ConfigError, match=where) as error:
        load_sweep(path)
    return str(error.value)


def test_sweep_file_errors_name_file_and_line(tmp_path):
    header = "from lmuscale.sweep import Trial\n\n\ndef get_trials():\n"
    message = _bad_sweep(tmp_path, "x = (\n")
    assert f"{tmp_path / 'bad.py'}:1" in message and "SyntaxError" in message

    message = _bad_sweep(tmp_path, header + "    yield Trial('a', 'x.py:a')\n    1 / 0\n")
    assert f"{tmp_path / 'bad.py'}:6" in message and "ZeroDivisionError" in message

    message = _bad_sweep(
        tmp_path, header + f"    yield Trial('a', {SMALL!r}, {{'train.stepz': 3}})\n"
    )
    assert "bad.py:5" in message and "'a'" in message and "train.stepz" in message
    assert "train.steps" in message  # the close match

    message = _bad_sweep(
        tmp_path, header + f"    yield Trial('a', {SMALL!r}, {{'train.steps': 0}})\n"
    )
    assert "bad.py:5" in message and "train.steps" in message

    body = header + f"    yield Trial('a', {SMALL!r})\n    yield Trial('a', {SMALL!r})\n"
    message = _bad_sweep(tmp_path, body)
    assert "bad.py:6" in message and "already used" in message and "bad.py:5" in message

    message = _bad_sweep(tmp_path, header + f"    yield Trial('a/b', {SMALL!r})\n")
    assert "bad.py:5" in message and "folder" in message

    message = _bad_sweep(tmp_path, header + "    yield Trial('a', 'missing.py:a')\n")
    assert "bad.py:5" in message and "missing.py" in message

    assert "get_trials" in _bad_sweep(tmp_path, "TRIALS = []\n")
    assert "no trials" in _bad_sweep(tmp_path, header + "    return []\n")


def test_trial_configs_resolve_overrides_and_names(tmp_path, byte_corpus, monkeypatch):
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    sweep = load_sweep(write_sweep(tmp_path, {"a": {"train.steps": 7}, "b": {}}))
    a, b = sweep.trials
    assert (a.config.name, a.config.train.steps, b.config.train.steps) == ("a", 7, 12)
    assert a.config.data.path == str(byte_corpus)
    assert a.folder_name == f"a-{config_hash(a.config)}"
    # A ConfigDict trial and an equal file trial resolve to the same config and folder hash.
    config = load(SMALL)
    with config.unlocked():
        config.data.path = str(byte_corpus)
    trial = Trial("a", config, {"train.steps": 7})
    from lmuscale.sweep.spec import _resolve

    assert _resolve(trial, tmp_path, "here").key == a.key


# Folder names of the shipped sweeps, as the code before the WSD schedule and AdamW (0d9dda9)
# named them: the optimiser keys added since leave a trial's hash alone at their defaults.
EARLIER_FOLDERS = {
    "demo.py": "lmu-d16-2c927f82b110 lmu-d24-8f47d18093c8 lmu-d32-2e6108dc17f1 "
    "lmu-d48-ff19e8df6147 transformer-d16-187aa09cfc0f transformer-d24-ea40f0a524a1 "
    "transformer-d32-c2bf142472b2 transformer-d48-cfc0e7748357 lmu_g-d16-c469fbdc6d22 "
    "lmu_g-d32-604fef67c981 transformer-d16-5x-efb7ee3559a2 transformer-d24-5x-fa727a6f6d39",
    "owt2.py": "lmu-55k-dc5b73720135 lmu-100k-b7e6bdb920ee lmu-200k-5feb5014bd63 "
    "lmu-300k-426f2b99b69b lmu-500k-02f444b5d058 lmu-1M-649db39a28c9",
}


def test_earlier_sweeps_keep_their_trial_folders():
    sweeps = Path(__file__).resolve().parent.parent / "sweeps"
    for file, names in EARLIER_FOLDERS.items():
        folders = [t.folder_name for t in load_sweep(sweeps / file).trials]
        assert folders[: len(names.split())] == names.split(), file
    trial = load_sweep(sweeps / "demo.py").trials[0]
    for key, value in (("schedule", "wsd"), ("weight_decay", 0.1), ("final_lr_fraction", 0.1)):
        changed = ConfigDict(trial.config.to_dict())
        changed.optim[key] = value
        assert config_hash(changed) != trial.key, key


def test_config_hash_covers_exactly_what_changes_the_numbers(byte_corpus):
    config = load(SMALL)
    key = config_hash(config)
    same = load(SMALL)
    with same.unlocked():
        same.log.every = 5
        same.data.path = "/elsewhere"
        same.data.verify = False
    assert config_hash(same) == key
    for change in ({"train.steps": 13}, {"train.seed": 1}, {"optim.learning_rate": 0.02}):
        other = load(SMALL)
        (section, leaf), value = next(iter(change)).split("."), next(iter(change.values()))
        with other.unlocked():
            other[section][leaf] = value
        assert config_hash(other) != key, change
    # Stable across processes (str hashing is salted per process; the folder name is not).
    code = (
        "from lmuscale.sweep import config_hash; from lmuscale.train import load; "
        f"print(config_hash(load({SMALL!r})))"
    )
    env = os.environ | {"PYTHONHASHSEED": "123", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == key, out.stderr


def test_dry_run_table_counts_and_throughputs(tmp_path, byte_corpus, monkeypatch):
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    sweep = load_sweep(write_sweep(tmp_path, {"a": {}, "b": {"train.steps": 24}}))
    rows = plan(sweep.trials, tmp_path / "work", Throughput(1e9))
    a, b = rows
    assert a["tokens"] == 12 * 8 * 32 and b["tokens"] == 24 * 8 * 32
    assert a["total_flops"] == a["flops_per_token"] * a["tokens"]
    assert a["seconds"] == pytest.approx(a["total_flops"] / 1e9)
    assert a["source"] == "configured" and a["status"] == "pending"
    # A trial that has logged steps is estimated from its own median speed, and the other trial
    # of its family from that.
    folder = tmp_path / "work" / "trials" / sweep.trials[0].folder_name
    folder.mkdir(parents=True)
    speeds = [1000.0, 3000.0, 2000.0]
    lines = [json.dumps({"step": i + 1, "tokens_per_second": s}) for i, s in enumerate(speeds)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n{torn")
    a, b = plan(sweep.trials, tmp_path / "work", Throughput(1e9))
    assert a["source"] == "measured" and b["source"] == "family"
    assert a["flops_per_second"] == pytest.approx(2000.0 * a["flops_per_token"])
    assert b["seconds"] == pytest.approx(b["total_flops"] / a["flops_per_second"])
    text = table([a, b])
    assert "**total** (2)" in text and "measured" in text and "family" in text
    assert not (tmp_path / "work" / "results.csv").exists()  # the dry run writes nothing


def test_dry_run_overhead_takes_medians_of_skewed_speeds_and_overheads(tmp_path, monkeypatch):
    # Skewed on purpose: the mean of a trial's speeds or of the trials' overheads is not their
    # median, so a mean anywhere gives another overhead.
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(tmp_path))
    sweep = load_sweep(write_sweep(tmp_path, {n: {"train.seed": i} for i, n in enumerate("abc")}))
    tokens = 12 * 8 * 32
    # name: (its steps' tokens/s, when the runner spawned it, when it finished)
    trials = {"a": ([500.0, 2000.0, 2000.0], 100.0, 110.0), "b": ([2000.0], 200.0, 205.0)}
    trials["c"] = ([2000.0], 300.0, 340.0)
    for trial in sweep.trials:
        speeds, spawned, end = trials[trial.name]
        folder = tmp_path / "work" / "trials" / trial.folder_name
        folder.mkdir(parents=True)
        lines = [json.dumps({"step": i + 1, "tokens_per_second": s}) for i, s in enumerate(speeds)]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        events = [
            {"event": "start", "spawned": spawned, "time": spawned + 1},
            {"event": "end", "outcome": "finished", "time": end},
        ]
        (folder / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    # at the median speed, 2,000 tokens/s (the mean, 1,500, would give a 7.95 s overhead)
    overheads = {"a": 10 - tokens / 2000, "b": 5 - tokens / 2000, "c": 40 - tokens / 2000}
    assert overheads["a"] == pytest.approx(8.464)
    rows = plan(sweep.trials, tmp_path / "work", Throughput(1e9, platform="gpu"))
    for row in rows:  # the median of 8.46, 3.46 and 38.46 s (their mean would be 16.80 s)
        assert (row["overhead"], row["overhead_source"]) == (
            pytest.approx(overheads["a"]),
            "measured (3 finished trials)",
        )
        assert row["flops_per_second"] == pytest.approx(2000.0 * row["flops_per_token"])
        assert row["estimate"] == pytest.approx(tokens / 2000 + overheads["a"])
    assert "8 s a trial of start-up" in table(rows)


def test_dry_run_cli_writes_nothing(tmp_path):
    out = subprocess.run(
        sweep_command(REPO / "sweeps" / "owt2.py", tmp_path / "w", "--dry-run"),
        capture_output=True,
        text=True,
        env=os.environ | {"JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 24 + 1  # header, 18 paper runs + 6 transformers at 10x, total
    assert "| lmu-1M | lmu | 1,000,053 |" in out.stdout
    assert "| transformer-1M-10x | transformer | 1,004,496 |" in out.stdout
    assert not (tmp_path / "w").exists()


# -- command-line overrides (--config.KEY=VALUE on every trial) -----------------------------


def test_overrides_apply_to_every_trial_after_its_own(tmp_path, byte_corpus, monkeypatch):
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    trials = {"a": {"train.steps": 7}, "b": {}, "c": {"optim.learning_rate": 0.02}}
    path = write_sweep(tmp_path, trials)
    plain = load_sweep(path)
    command_line = ["train.steps=9", "train.seed=3"]
    changed = load_sweep(path, overrides=command_line)
    for before, after in zip(plain.trials, changed.trials, strict=True):
        old, new = flatten(before.config), flatten(after.config)
        assert (new["train.steps"], new["train.seed"]) == (9, 3), after.name
        assert {k for k in old if old[k] != new[k]} <= {"train.steps", "train.seed"}
        assert after.key != before.key and after.key == config_hash(after.config)
        # the same config and folder as a sweep file whose trial sets these keys itself
        merged = Trial(after.name, SMALL, {**trials[after.name], "train.steps": 9, "train.seed": 3})
        assert _resolve(merged, tmp_path, "here").key == after.key
    assert len({t.folder_name for t in changed.trials}) == 3
    # A learning rate for every trial makes b and c the same run but for the name.
    assert twins(plain.trials) == []
    assert twins(load_sweep(path, overrides=["optim.learning_rate=0.01"]).trials) == [["b", "c"]]


def test_a_bad_override_is_named_with_its_close_match(tmp_path, byte_corpus, monkeypatch):
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    path = write_sweep(tmp_path, {"a": {}, "b": {}})
    cases = {
        "train.stepz=9": "--config.train.stepz: unknown config key 'train.stepz'; did you "
        "mean 'train.steps'?",
        "train.steps=nine": "--config.train.steps: expected an int, got 'nine'",
        "train.steps=1": "command line: optim.warmup_steps (2) must be below train.steps (1)",
    }
    for item, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)) as error:
            load_sweep(path, overrides=[item])
        assert str(error.value) == f"{path}:5 (trial 'a'): {message}", item


def test_sweep_command_line_takes_config_keys_in_either_form():
    args = sweep_parse(["--config.train.steps", "5", "s.py", "--only", "a", "--config.x.y=b"])
    assert (args.sweep, args.only, args.overrides) == ("s.py", "a", ["train.steps=5", "x.y=b"])
    assert sweep_parse(["s.py"]).overrides == []


def test_dry_run_shows_the_overrides_and_refuses_a_bad_key(tmp_path, byte_corpus):
    path = write_sweep(tmp_path, {"a": {}, "b": {"optim.learning_rate": 0.02}})
    argv = ["--dry-run", "--config.train.steps", "30", "--config.optim.learning_rate=0.02"]
    out = subprocess.run(
        sweep_command(path, tmp_path / "w", *argv),
        capture_output=True,
        text=True,
        env=environment(byte_corpus),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "overrides for every trial: train.steps=30 optim.learning_rate=0.02"
    assert [line.split(" | ")[5] for line in lines if line.startswith("| a ")] == ["7.68k"]
    assert "trials a, b differ only in name: they would train the same model" in out.stderr
    assert not (tmp_path / "w").exists()
    out = subprocess.run(
        sweep_command(path, tmp_path / "w", "--dry-run", "--config.optim.learning_rat=0.1"),
        capture_output=True,
        text=True,
        env=environment(byte_corpus),
    )
    assert out.returncode == Exit.CONFIG and out.stdout == ""
    assert out.stderr == (
        f"error: {path}:5 (trial 'a'): --config.optim.learning_rat: unknown config key "
        "'optim.learning_rat'; did you mean 'optim.learning_rate'?\n"
    )


def test_trial_lock_is_exclusive_and_dies_with_its_holder(tmp_path):
    lock = TrialLock(tmp_path)
    assert lock.acquire() and is_locked(tmp_path)
    assert not TrialLock(tmp_path).acquire()
    lock.release()
    assert not is_locked(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from lmuscale.workdir import Lock as TrialLock; "
            f"assert TrialLock({str(tmp_path)!r}).acquire(); print('held', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    assert is_locked(tmp_path)
    holder.kill()
    holder.wait()
    assert not is_locked(tmp_path)


def test_only_selects_by_glob_and_names_the_trials_when_nothing_matches(
    tmp_path, byte_corpus, monkeypatch
):
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    sweep = load_sweep(write_sweep(tmp_path, {"lmu-a": {}, "lmu-b": {}, "tf-a": {}}))
    assert [t.name for t in select(sweep, "lmu-*")] == ["lmu-a", "lmu-b"]
    assert [t.name for t in select(sweep, "*-a,lmu-b")] == ["lmu-a", "lmu-b", "tf-a"]
    with pytest.raises(ConfigError, match=r"matches no trial.*lmu-a, lmu-b, tf-a"):
        select(sweep, "gru-*")


def test_parallel_workers_get_disjoint_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    slots = [s["CUDA_VISIBLE_DEVICES"] for s in gpu_slots(4)]
    assert slots == ["0,1", "2,3", "4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert [s["CUDA_VISIBLE_DEVICES"] for s in gpu_slots(2)] == ["3", "5"]
    with pytest.raises(ConfigError, match="--parallel 3 is more than the 2 GPUs"):
        gpu_slots(3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_slots(2) == [{}, {}]  # no GPU: the workers share the CPU


def test_slurm_parameters_from_the_command_line():
    params = slurm_params(["slurm_partition=gpu", "gpus_per_node=8", "use_srun=false", "x=0.5"])
    assert params == {
        "slurm_partition": "gpu",
        "gpus_per_node": 8,
        "use_srun": False,
        "x": 0.5,
    }


def test_without_a_bar_the_sweep_prints_trials_steps_and_an_eta_every_interval(tmp_path, capsys):
    from types import SimpleNamespace

    from lmuscale.sweep.runner import Progress

    steps = {"a": 10, "b": 10, "c": 20, "d": 10}
    paths = {name: tmp_path / name for name in steps}
    for path in paths.values():
        path.mkdir()
    trials = [
        SimpleNamespace(name=n, config=SimpleNamespace(train=SimpleNamespace(steps=s)))
        for n, s in steps.items()
    ]

    def logged(name, step):
        with open(paths[name] / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step}) + "\n")

    (paths["a"] / "summary.json").write_text('{"status": "finished"}')
    logged("c", 4)
    (paths["d"] / "error.json").write_text("{}")
    now = [100.0]
    progress = Progress(paths, trials, show=False, every=30.0, clock=lambda: now[0])
    progress.update({})
    assert capsys.readouterr().out == (
        "sweep: 1/4 trials done, 0 running, 3 left (1 of them failed); 14/50 steps; "
        "0 s elapsed, ETA unknown\n"
    )
    lock = TrialLock(paths["b"])
    assert lock.acquire()
    logged("b", 6)
    now[0] = 129.0  # before the interval has passed: no line
    progress.update({paths["b"]: "running"})
    assert capsys.readouterr().out == ""
    now[0] = 130.0  # 6 steps in 30 s: the 30 steps left take 150 s
    progress.update({paths["b"]: "running"})
    assert capsys.readouterr().out == (
        "sweep: 1/4 trials done, 1 running, 2 left (1 of them failed); 20/50 steps; "
        "30 s elapsed, ETA 2.5 min\n"
    )
    lock.release()
    (paths["b"] / "summary.json").write_text('{"status": "diverged"}')
    now[0] = 131.0
    progress.close()  # a last line, whatever the interval
    assert capsys.readouterr().out.startswith("sweep: 2/4 trials done, 0 running, 2 left")
    # With a bar, no lines.
    bar = Progress(paths, trials, show=True, clock=lambda: now[0])
    bar.update({})
    bar.close()
    assert capsys.readouterr().out == ""


# -- the runner, end to end ------------------------------------------------------------------


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory, byte_corpus) -> Path:
    """The cache, filled here by a run of the trials' default config (seed 0, 12 steps): the
    first test's two workers then load its train step instead of both compiling it at once."""
    folder = tmp_path_factory.mktemp("xla-cache")
    with in_process(folder):
        run(small(str(byte_corpus)), tmp_path_factory.mktemp("warm-up"), progress=False)
    return folder


def _results(workdir: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines()]
    with open(workdir / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["trial"] for r in table] == [r["trial"] for r in rows]
    assert list(table[0]) == list(RESULT_FIELDS)
    for row, line in zip(rows, table, strict=True):  # the CSV holds the same values
        if row["val_loss"] is not None:
            assert float(line["val_loss"]) == row["val_loss"]
            assert json.loads(line["val_per_position"]) == row["val_per_position"]
    return {r["trial"]: r for r in rows}


def _starts(workdir: Path, row: dict) -> list[dict]:
    path = workdir / "trials" / row["folder"] / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def head_commit() -> str | None:
    """The checkout's commit, as git says it; None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    return subprocess.check_output(["git", "-C", str(root), "rev-parse", "HEAD"], text=True).strip()


def swap_content(folder: Path) -> str:
    """Replace the prepared dataset in ``folder`` by other content of the same token counts
    (each split's tokens in reverse order), with its meta.json as a new prepare would write
    it; returns the new fingerprint."""
    meta = json.loads((folder / "meta.json").read_text())
    for entry in meta["splits"].values():
        path = folder / entry["file"]
        path.write_bytes(np.fromfile(path, meta["dtype"])[::-1].tobytes())
        entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    meta["fingerprint"] = fingerprint(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    return meta["fingerprint"]


def test_failing_trial_is_marked_and_the_others_finish(
    tmp_path, byte_corpus, xla_cache, monkeypatch
):
    data = tmp_path / "data"  # a copy, swapped for other data at the end
    shutil.copytree(byte_corpus, data)
    sweep = write_sweep(
        tmp_path,
        {
            "good": {},
            "broken": {"data.path": str(tmp_path / "no-data")},
            "other": {"train.seed": 1},
        },
    )
    work = tmp_path / "work"
    cache = cache_env(xla_cache)
    out = run_sweep(sweep, work, data, "--parallel", "2", extra_env=cache)  # two at once
    assert out.returncode == Exit.UNFINISHED, out.stdout + out.stderr
    rows = _results(work)
    assert [rows[n]["status"] for n in ("good", "broken", "other")] == [
        "finished",
        "failed",
        "finished",
    ]
    error = rows["broken"]["error"]
    assert "Traceback" in error and "ConfigError" in error and "no-data" in error
    assert rows["broken"]["val_loss"] is None and "broken: failed" in out.stdout
    params = count_params(model_config(load(SMALL).model))
    for name in ("good", "other"):
        row = rows[name]
        assert (row["N"], row["total_params"]) == (params.non_embedding, params.total)
        assert row["tokens"] == 12 * 8 * 32 and row["steps"] == 12
        assert len(row["val_per_position"]) == 32 and row["wall_seconds"] > 0
        summary = json.loads((work / "trials" / row["folder"] / "summary.json").read_text())
        assert row["val_loss"] == summary["val_loss"] and row["test_loss"] == summary["test_loss"]
        # What the run trained on and with: the data's fingerprint, this checkout, the versions.
        assert row["data_fingerprint"] == summary["data"]["fingerprint"]
        assert summary["data"]["path"] == str(data.resolve())
        made = summary["provenance"]
        assert made["versions"]["jax"] == jax.__version__ and made["lmuscale"] == __version__
        assert made["commit"] == head_commit()
    assert rows["good"]["val_loss"] != rows["other"]["val_loss"]  # another seed
    # The worker records when the runner started it, from which the dry run measures the
    # time a trial takes beyond its steps.
    for name in ("good", "other"):
        start, end = _starts(work, rows[name])
        assert start["spawned"] < start["time"] < end["time"]
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(data))
    planned = plan(load_sweep(sweep).trials, work, Throughput(1e9, platform="gpu"))
    assert {(r["overhead_source"], r["overhead"] > 0) for r in planned} == {
        ("measured (2 finished trials)", True)
    }
    # With output to a pipe: the runner's progress line, and each step's loss in the trial's log.
    assert re.search(r"^sweep: \d/3 trials done, \d running, \d left.*, ETA ", out.stdout, re.M)
    log = (work / "trials" / rows["good"]["folder"] / "train.log").read_text()
    metrics = (work / "trials" / rows["good"]["folder"] / "metrics.jsonl").read_text()
    losses = [json.loads(line)["loss"] for line in metrics.splitlines()]
    logged = re.findall(r"^step (\d+)/12: loss (\S+) ", log, re.M)
    assert [int(step) for step, _ in logged] == list(range(1, 13))
    assert [float(loss) for _, loss in logged] == pytest.approx(losses, abs=5e-5)

    # Run again: the finished trials are not run again; the failed one is tried again.
    again = run_sweep(sweep, work, data, extra_env=cache)
    assert again.returncode == Exit.UNFINISHED
    assert "1 to run" in again.stdout
    assert [e["event"] for e in _starts(work, rows["good"])] == ["start", "end"]
    assert [e.get("outcome") for e in _starts(work, rows["broken"])][1::2] == ["failed", "failed"]

    # The data swapped under the same path (as a prepare of other text of the same size would
    # leave it): the finished trials are not done on it. The sweep names both fingerprints and
    # refuses; pinned to the new data, a trial is trained again, in a folder of its own.
    was = rows["good"]["data_fingerprint"]
    assert was == json.loads((data / "meta.json").read_text())["fingerprint"]
    now = swap_content(data)
    refused = run_sweep(sweep, work, data, extra_env=cache)
    assert refused.returncode == Exit.CONFIG, refused.stdout + refused.stderr
    assert f"holds the dataset {now}, but good, other ended on {was}" in refused.stderr
    assert "already done" not in refused.stdout
    pinned = f"--config.data.fingerprint={now}"
    anew = run_sweep(sweep, work, data, "--only", "good", pinned, extra_env=cache)
    assert anew.returncode == Exit.FINISHED, anew.stdout + anew.stderr
    good = _results(work)["good"]
    assert good["folder"] != rows["good"]["folder"] and good["data_fingerprint"] == now
    assert good["status"] == "finished" and good["val_loss"] != rows["good"]["val_loss"]


def test_sigterm_twice_stops_the_runner_and_its_worker_with_the_stop_status(
    tmp_path, byte_corpus, xla_cache
):
    """The second SIGTERM, while the runner waited for its workers' checkpoints, killed it
    (status 143, outside the table). Now the runner ignores it while it stops them: one line,
    the stop status (4), and no worker left."""
    sweep = write_sweep(tmp_path, {"first": {"train.steps": 40}})
    work = tmp_path / "work"
    runner = subprocess.Popen(
        sweep_command(sweep, work, "--quiet"),
        env=environment(byte_corpus) | cache_env(xla_cache, write=False),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: list(work.glob("trials/first-*/attempts.jsonl")), 120, "the worker")
        runner.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        runner.send_signal(signal.SIGTERM)
        err = runner.communicate(timeout=180)[1]
    finally:
        runner.kill()
    assert runner.returncode == Exit.STOPPED, err
    assert err == "stopped: SIGTERM received: interrupted; run the same command again to resume\n"
    folder = next((work / "trials").glob("first-*"))
    assert not is_locked(folder)  # its worker has ended
    events = [json.loads(line) for line in (folder / "attempts.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "end" and events[-1]["outcome"] == "interrupted", events


def test_two_runners_on_one_workdir_never_run_a_trial_twice(tmp_path, byte_corpus, xla_cache):
    # a needs no more steps than the others to be still running when the second runner comes:
    # its worker is paused until then (below).
    trials = {"a": {}, "b": {"train.seed": 1}, "c": {"train.seed": 2}}
    sweep = write_sweep(tmp_path, trials)
    work = tmp_path / "work"

    def start():
        return subprocess.Popen(
            sweep_command(sweep, work, "--quiet"),
            env=environment(byte_corpus) | cache_env(xla_cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def started(name: str) -> list[dict]:
        return [
            json.loads(line)
            for path in work.glob(f"trials/{name}-*/attempts.jsonl")
            for line in path.read_text().splitlines()
        ]

    runners, paused = [start()], None
    try:
        # The second runner starts while the first one's worker holds trial a: that worker is
        # paused (SIGSTOP, its lock held) until the second runner has started a trial of its
        # own, so a cannot end first however fast it trains.
        paused = wait_for(lambda: started("a"), 120, "a to start")[0]["pid"]
        os.kill(paused, signal.SIGSTOP)
        runners.append(start())
        wait_for(lambda: started("b") or started("c"), 120, "the second runner to start a trial")
        os.kill(paused, signal.SIGCONT)
        outputs = [r.communicate(timeout=600)[0] for r in runners]
    finally:
        if paused is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(paused, signal.SIGCONT)
        for runner in runners:
            runner.kill()
    assert [r.returncode for r in runners] == [0, 0], outputs
    rows = _results(work)
    trained_by = {}
    for name, row in rows.items():
        assert row["status"] == "finished"
        events = _starts(work, row)
        assert [e["event"] for e in events] == ["start", "end"], (name, events)
        assert events[1]["outcome"] == "finished"
        trained_by[name] = int(events[0]["runner"])
    first, second = (r.pid for r in runners)
    assert trained_by["a"] == first
    assert second in trained_by.values(), trained_by  # both runners trained something
    assert "a: finished" in outputs[1]  # the second waited for a and reported it
