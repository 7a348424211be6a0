"""The SLURM executor on a real single-node cluster (Debian's slurm-wlm and munge).

``scripts/slurm/cluster.sh`` starts a private cluster in a temporary folder; ``make test``
installs the packages first where it can (``scripts/slurm/install.sh``: root and apt-get).
A 2-trial sweep is submitted as a job array with ``--detach``, then a second runner waits for
it. One task is preempted mid-run (USR2, as SLURM sends before a time limit or preemption):
the worker writes a checkpoint, submitit requeues the task, and the trial resumes. Its results
must equal a run of the same sweep with the local executor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from compile_cache import env as cache_env
from sweep_files import environment, run_sweep, sweep_command, wait_for, write_sweep

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "scripts" / "slurm" / "cluster.sh"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory):
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(
            f"SLURM is not installed here ({', '.join(missing)} missing) and could not be: "
            "scripts/slurm/install.sh, which `make test` runs, needs root and apt-get"
        )
    folder = tmp_path_factory.mktemp("slurm")
    try:
        started = subprocess.run(
            ["bash", str(CLUSTER), "start", str(folder)], capture_output=True, text=True
        )
        assert started.returncode == 0, f"no test cluster:\n{started.stdout}{started.stderr}"
        yield folder / "slurm.conf"
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(folder)], capture_output=True)


def _slurm(conf: Path, *args: str) -> str:
    out = subprocess.run(
        list(args), capture_output=True, text=True, env=os.environ | {"SLURM_CONF": str(conf)}
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_slurm_sweep_survives_preemption(slurm_conf, tmp_path, byte_corpus):
    steps = 60
    sweep = write_sweep(tmp_path, {"a": {"train.steps": steps}, "b": {"train.seed": 1}})
    work = tmp_path / "work"
    # The requeued task and the local run load trial a's train step from the cache its first
    # task wrote (a stop signal only sets a flag: a cache entry being written is finished).
    cache = cache_env(tmp_path / "xla-cache")
    env = environment(byte_corpus) | {"SLURM_CONF": str(slurm_conf)} | cache
    slurm = ["--executor", "slurm", "--slurm", "cpus_per_task=1", "--quiet"]

    detached = subprocess.run(
        sweep_command(sweep, work, *slurm, "--detach"), env=env, capture_output=True, text=True
    )
    assert detached.returncode == 0, detached.stdout + detached.stderr
    assert "submitted SLURM job array" in detached.stdout and "(2 tasks)" in detached.stdout
    tasks = json.loads((work / "slurm" / "jobs.json").read_text())["tasks"]
    assert len(tasks) == 2 and len({t.split("_")[0] for t in tasks.values()}) == 1  # one array

    waiter = subprocess.Popen(
        sweep_command(sweep, work, *slurm),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        folder_a = next(work.glob("trials/a-*"))
        task_a = tasks[folder_a.name]
        wait_for(lambda: (folder_a / "checkpoints" / "8").exists(), 180, "trial a's checkpoint 8")
        _slurm(slurm_conf, "scancel", "--signal=USR2", task_a)
        # SLURM holds a requeued batch job for about two minutes; release it at once.
        wait_for(
            lambda: (
                "BeginTime" in _slurm(slurm_conf, "squeue", "-h", "-r", "-o", "%i %r", "-j", task_a)
            ),
            120,
            "the preempted task to be requeued",
        )
        # Not within the second of the requeue: slurmd refuses a credential from the same second as
        # the revoked one ("Job credential revoked"), and the task would end without running.
        time.sleep(3)
        _slurm(slurm_conf, "scontrol", "update", f"JobId={task_a}", "StartTime=now")
        output = waiter.communicate(timeout=300)[0]
    finally:
        waiter.kill()
    assert waiter.returncode == 0, output
    # The second runner submitted nothing: both tasks were queued.
    assert "nothing (every trial to run is already queued or running)" in output

    rows = {json.loads(line)["trial"]: json.loads(line) for line in (work / "results.jsonl").open()}
    assert [rows[n]["status"] for n in ("a", "b")] == ["finished", "finished"]
    outcomes = [json.loads(line).get("outcome") for line in (folder_a / "attempts.jsonl").open()]
    assert outcomes == [None, "interrupted", None, "finished"], outcomes
    log = (folder_a / "train.log").read_text()
    assert "stopped: SIG" in log and log.count(f"started by SLURM job {task_a}") == 2
    steps_logged = [json.loads(line)["step"] for line in (folder_a / "metrics.jsonl").open()]
    assert steps_logged == list(range(1, steps + 1))  # each step once, across the requeue
    # submitit's own logs are linked from the trial folder.
    out_log = folder_a / f"slurm-{task_a}.out"
    assert out_log.is_symlink() and out_log.resolve().is_file()
    assert "preempted" in (folder_a / f"slurm-{task_a}.err").read_text()

    local = run_sweep(sweep, tmp_path / "local", byte_corpus, "--only", "a", extra_env=cache)
    assert local.returncode == 0, local.stdout + local.stderr
    reference = {
        json.loads(line)["trial"]: json.loads(line)
        for line in (tmp_path / "local" / "results.jsonl").open()
    }
    for key in ("val_loss", "test_loss", "val_per_position", "test_per_position"):
        assert rows["a"][key] == reference["a"][key], key  # the preempted trial
    assert reference["b"]["status"] == "pending"  # --only a


def test_a_trial_of_two_tasks_trains_as_two_processes(slurm_conf, tmp_path, byte_corpus):
    """``tasks_per_node=2``: each task runs a worker; the two join through
    ``jax.distributed.initialize()``, which reads the job's SLURM environment (without it,
    or with the workers apart, the initialisation fails)."""
    sweep = write_sweep(tmp_path, {"pair": {"train.global_batch": 8}})
    work = tmp_path / "work"
    env = environment(byte_corpus) | {"SLURM_CONF": str(slurm_conf)}
    slurm = ["--slurm", "tasks_per_node=2", "--slurm", "cpus_per_task=1"]
    done = subprocess.run(
        sweep_command(sweep, work, "--executor", "slurm", *slurm, "--quiet"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    folder = next(work.glob("trials/pair-*"))
    logs = {p.name: p.read_text() for p in folder.glob("train*.log")}
    assert done.returncode == 0, done.stdout + done.stderr + json.dumps(logs, indent=1)
    assert "task 0 of 2" in logs["train.log"] and "task 1 of 2" in logs["train.rank1.log"]
    assert json.loads((folder / "config.json").read_text())["distributed"]["initialize"]
    # each step logged once: by process 0 alone
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").open()]
    assert steps == sorted(set(steps)) and steps[-1] == 12

    [row] = [json.loads(line) for line in (work / "results.jsonl").open()]
    assert row["status"] == "finished"
    # The numbers of two processes against one: tests/test_train_multiprocess.py.
