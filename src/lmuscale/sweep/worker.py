"""``python -m lmuscale.sweep.worker TRIAL_FOLDER``: train one trial of a sweep, once.

The runners (local and SLURM) start this process per trial. It holds the trial's lock for as
long as it lives, so two runners never train the same trial at once, and on Linux it dies
with the process that started it, so killing a runner leaves no orphan training behind. Its
exit status is the outcome's in ``lmuscale.outcomes.Exit``, 75 also when the runner died as it
started; a status not in ``ENDED`` is a failure, and error.json has its traceback (written by
the runner, ``record_crash``, when the worker died before it could).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

from lmuscale.files import atomic_write_json
from lmuscale.outcomes import DamagedFile, Exit, WorkdirBusy, run_main, stop_received
from lmuscale.processes import die_with_parent
from lmuscale.workdir import (
    ATTEMPTS,
    DONE,
    ERROR,
    LOG,
    SUMMARY,
    TRIAL,
    Lock,
    read_json,
    read_log,
    status,
    summary,
    write_summary,
)
from lmuscale.workdir import outcome as final_outcome

# How a worker that ended by itself says so: every other status is a failure (or a crash, when
# the worker left no error.json: the runner writes one).
ENDED = (Exit.FINISHED, Exit.DIVERGED, Exit.STOPPED, Exit.INTERRUPTED)
STOP_GRACE_SECONDS = 120  # how long a runner gives a worker it stops to write its checkpoint

PARENT = "LMUSCALE_SWEEP_PARENT"  # the pid of the runner (or SLURM task) that started us
# "RANK/TASKS" when the trial spans several processes (SLURM tasks): each runs a worker
TASK = "LMUSCALE_SWEEP_TASK"
# when the runner started this process (time.time()): attempts.jsonl's "spawned", from which
# the dry run measures a trial's start-up (lmuscale.sweep.plan)
SPAWNED = "LMUSCALE_SWEEP_SPAWNED"
# "1" when the sweep was run with --accept-unverified (train.run's accept_unverified)
ACCEPT_UNVERIFIED = "LMUSCALE_SWEEP_ACCEPT_UNVERIFIED"


def task() -> tuple[int, int]:
    """``(rank, tasks)`` of this worker within its trial: ``(0, 1)`` unless several."""
    value = os.environ.get(TASK, "0/1")
    try:
        rank, tasks = (int(x) for x in value.split("/"))
    except ValueError:
        raise ValueError(f"{TASK}={value!r}: expected RANK/TASKS, e.g. 0/2") from None
    if not 0 <= rank < tasks:
        raise ValueError(f"{TASK}={value!r}: the rank must be in 0..TASKS-1")
    return rank, tasks


def start(folder: Path, started: str, env: dict, log: str = LOG, **popen) -> subprocess.Popen:
    """Start a worker on ``folder``, its output appended to ``folder/log`` after a line that
    says when it ``started``; ``env`` is added to this process's environment."""
    with open(folder / log, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {started}\n".encode())
        out.flush()
        return subprocess.Popen(
            [sys.executable, "-m", "lmuscale.sweep.worker", str(folder)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=os.environ | env | {PARENT: str(os.getpid()), SPAWNED: repr(time.time())},
            **popen,
        )


def _attempt(folder: Path, record: dict) -> None:
    where = {"time": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    line = json.dumps(where | {"runner": os.environ.get(PARENT)} | record)
    with open(folder / ATTEMPTS, "a") as f:
        f.write(line + "\n")


def _close_attempt(folder: Path) -> None:
    """The end record of an attempt killed after it wrote the trial's final summary, before its
    own end record (the caller holds the trial's lock): at the summary's time."""
    events = read_log(folder / ATTEMPTS)
    final = final_outcome(folder)
    if final is None or not events or events[-1].get("event") != "start":
        return
    ended = (folder / SUMMARY).stat().st_mtime
    note = f"the worker ended before recording it; {SUMMARY} was written then"
    _attempt(folder, {"event": "end", "outcome": final, "time": ended, "note": note})


def settle(folder: Path) -> None:
    """``_close_attempt`` for a trial no worker holds (a runner's, for its ended trials)."""
    lock = Lock(folder)
    if lock.acquire():
        try:
            _close_attempt(folder)
        finally:
            lock.release()


def train(folder: Path) -> int:
    from lmuscale.train import run

    options = {"progress": False, "locked": True}
    options["accept_unverified"] = os.environ.get(ACCEPT_UNVERIFIED) == "1"

    rank, tasks = task()
    # Of a trial that spans several processes, task 0 holds the lock and keeps the trial's
    # records (attempts, error.json); the others only train.
    lock = Lock(folder)
    if rank == 0:
        # A runner's status check holds the lock for an instant: try a few times.
        for _ in range(10):
            if lock.acquire():
                break
            time.sleep(0.1)
        else:
            raise WorkdirBusy(f"trial {folder}: locked by {lock.holder()}; not started")
    try:
        final = final_outcome(folder)
        if final is not None:
            if rank == 0:
                _close_attempt(folder)
            return Exit.FINISHED if final == "finished" else Exit.DIVERGED
        options["branch"] = branch = _branch(folder)
        if branch is not None and _parent_diverged_first(branch) and rank > 0:
            return Exit.DIVERGED  # task 0 ends the trial so
        if rank > 0:
            run(_config(folder, tasks), folder, **options)
            return Exit.FINISHED
        (folder / ERROR).unlink(missing_ok=True)
        spawned = os.environ.get(SPAWNED)
        _attempt(folder, {"event": "start"} | ({"spawned": float(spawned)} if spawned else {}))
        if branch is not None and _parent_diverged_first(branch):
            return _parent_diverged(folder, branch)
        try:
            summary = run(_config(folder, tasks), folder, **options)
        except BaseException as error:
            outcome = Exit.of(error)
            if stop_received() is not None:  # the runner's SIGTERM, whatever it became
                outcome = Exit.STOPPED
            if outcome in (Exit.STOPPED, Exit.INTERRUPTED, Exit.DIVERGED):
                ended = "diverged" if outcome is Exit.DIVERGED else "interrupted"
            else:
                text = f"{type(error).__name__}: {error}"
                record = {"error": text, "traceback": traceback.format_exc(), "time": time.time()}
                atomic_write_json(folder / ERROR, record)
                ended = "failed"
            _attempt(folder, {"event": "end", "outcome": ended})
            raise
        _attempt(folder, {"event": "end", "outcome": "finished"})
        print(
            f"finished: val loss {summary['val_loss']:.4f}, test loss {summary['test_loss']:.4f}",
            flush=True,
        )
        return Exit.FINISHED
    finally:
        lock.release()


def _branch(folder: Path):
    """The ``train.branch.Branch`` that trial.json names, or None."""
    from lmuscale.train.branch import Branch

    record = (read_json(folder / TRIAL) or {}).get("branch_from")
    if record is None:
        return None
    return Branch(record["trial"], folder.parent / record["folder"], int(record["step"]))


def _parent_diverged_first(branch) -> bool:
    """Whether the parent diverged at or before the branch point (a later divergence leaves
    the branch's checkpoint good: the branch trains from it)."""
    parent = summary(branch.folder) or {}
    return parent.get("status") == "diverged" and (parent.get("step") or 0) <= branch.step


def _parent_diverged(folder: Path, branch) -> int:
    """End a branch whose parent diverged as diverged, untrained, saying so."""
    parent = summary(branch.folder) or {}
    message = (
        f"parent diverged: {branch.trial} diverged at step {parent.get('step')} ("
        f"{branch.folder.name}); this branch of its step {branch.step} was not trained"
    )
    write_summary(folder, {"status": "diverged", "error": message, "step": branch.step})
    _attempt(folder, {"event": "end", "outcome": "diverged"})
    print(message, flush=True)
    return Exit.DIVERGED


def record_crash(folder: Path, returncode: int) -> None:
    """A worker that died without its own error.json (a signal, a crash in native code, the
    kernel's OOM killer) gets one that says how it ended and ends with its last output."""
    if (folder / ERROR).exists():
        return
    lock = Lock(folder)
    if not lock.acquire():  # someone else has started the trial again: not ours to mark
        return
    try:
        if (folder / ERROR).exists():
            return
        if status(folder) in DONE:
            _close_attempt(folder)
            return
        how = f"exit status {returncode}"
        if returncode < 0:
            how = f"signal {signal.Signals(-returncode).name}"
        else:
            with contextlib.suppress(ValueError):  # a status outside the table says no more
                how += f" ({Exit(returncode).meaning})"
        log = folder / LOG
        tail = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
        text = "\n".join([f"the worker ended with {how}; the end of {LOG}:", *tail])
        atomic_write_json(folder / ERROR, {"error": f"worker ended with {how}", "traceback": text})
    finally:
        lock.release()


def _config(folder: Path, tasks: int):
    from ml_collections import ConfigDict

    from lmuscale.resume import upgrade
    from lmuscale.train.config import check

    record = read_json(folder / TRIAL)  # DamagedFile when it does not parse
    if record is None or not isinstance(record.get("config"), dict):
        raise DamagedFile(
            f"{folder / TRIAL}: missing, or without a config; run the sweep again to write it"
        )
    config = ConfigDict(upgrade(record["config"]))
    check(config, where=str(folder / TRIAL))
    if tasks > 1:  # the processes find each other through the cluster's environment
        config.distributed.initialize = True
    config.lock()
    return config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m lmuscale.sweep.worker TRIAL_FOLDER", file=sys.stderr)
        return Exit.ARGUMENTS
    parent = os.environ.get(PARENT)
    if not die_with_parent(int(parent) if parent else None):
        return Exit.BUSY  # the runner died while this process was starting
    return run_main(lambda: train(Path(argv[0])))


if __name__ == "__main__":
    sys.exit(main())
