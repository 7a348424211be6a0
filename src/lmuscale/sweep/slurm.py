"""The SLURM executor: one job array through submitit, one trial per array task.

Each task runs the trial's worker, its output in the trial's train.log (``train.rankN.log`` for
task N > 0 of a trial that spans several) beside links to submitit's logs. On USR2 (preemption,
or near the time limit) the worker writes a checkpoint and stops, and submitit requeues the
task. Jobs are recorded in ``WORKDIR/slurm/jobs.json``, so a second runner waits for trials
already queued instead of submitting them again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from lmuscale.files import atomic_write_json
from lmuscale.outcomes import ConfigError, Exit
from lmuscale.sweep.spec import Sweep
from lmuscale.sweep.worker import ENDED, STOP_GRACE_SECONDS, TASK, record_crash, start
from lmuscale.sweepdir import TRIALS
from lmuscale.workdir import DONE, LOG, is_locked, read_json, status

try:
    import submitit
    from submitit.helpers import Checkpointable, DelayedSubmission
except ImportError:  # the local executor needs none of it
    submitit = None
    Checkpointable = object

# The USR2 notice comes 180 s before the time limit; the worker gets 120 s of it to write its
# checkpoint, which leaves time to requeue. A 250k-step trial may need many requeues.
DEFAULTS = {"timeout_min": 24 * 60, "slurm_signal_delay_s": 180}
MAX_REQUEUES = 1000
POLL_SECONDS = 2.0
REQUEUE_GRACE_SECONDS = 30.0
JOBS = Path("slurm", "jobs.json")  # trial folder -> array task (JOB_TASK) of every submission


class TrialJob(Checkpointable):
    """What one array task runs: the trial's worker, stopped cleanly on preemption."""

    process = None  # the running worker

    def __getstate__(self):  # the running process stays behind when submitit pickles this
        return {}

    def __call__(self, folder: str) -> str:
        folder = Path(folder)
        job = submitit.JobEnvironment()
        rank, tasks = job.global_rank, job.num_tasks
        tag = f".rank{rank}" if tasks > 1 else ""
        for source, suffix in ((job.paths.stdout, "out"), (job.paths.stderr, "err")):
            link = folder / f"slurm-{job.job_id}{tag}.{suffix}"
            if not link.is_symlink():
                link.symlink_to(Path(str(source)).absolute())
        log = LOG if rank == 0 else f"{Path(LOG).stem}.rank{rank}.log"
        while True:
            started = f"worker started by SLURM job {job.job_id}, task {rank} of {tasks}"
            self.process = start(folder, started, {TASK: f"{rank}/{tasks}"}, log)
            code = self.process.wait()
            if code != Exit.BUSY:
                break
            while is_locked(folder):  # another runner trains it: wait, then look again
                time.sleep(POLL_SECONDS)
        if code not in ENDED and rank == 0:
            record_crash(folder, code)
        return status(folder)

    def checkpoint(self, folder: str):
        """Called by submitit on USR2: stop the worker after a checkpoint, then requeue."""
        if self.process is not None and self.process.returncode is None:
            _stop(self.process.pid)
        return DelayedSubmission(TrialJob(), folder)


def _stop(pid: int) -> None:
    """SIGTERM the worker and reap it. This runs inside submitit's signal handler, which
    interrupted ``Popen.wait`` in ``__call__``: Popen's own wait would block on its lock."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def queued(tasks: Iterable[str]) -> set[str]:
    """The array tasks (``JOB_TASK``) of these tasks' jobs that SLURM has queued or running."""
    job_ids = sorted({task.split("_")[0] for task in tasks})
    if not job_ids:
        return set()
    command = ["squeue", "-h", "-r", "-o", "%i", "-j", ",".join(job_ids)]
    for attempt in range(10):  # a busy controller may not answer at once
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            error = "no answer in 60 s"
        else:
            if result.returncode == 0:
                return {line.strip() for line in result.stdout.splitlines() if line.strip()}
            if "Invalid job id" in result.stderr:  # every one of them has left the queue
                return set()
            error = result.stderr.strip()
        time.sleep(min(60, 2**attempt))
    raise ConfigError(f"{' '.join(command)} failed 10 times: {error}")


def _recorded(workdir: Path) -> dict[str, str]:
    return (read_json(workdir / JOBS) or {}).get("tasks", {})


def run_slurm(
    sweep: Sweep, workdir: Path, folders: list[Path], parallel: int | None, params: dict | None
) -> str:
    """Submit one job array for the folders not already queued; returns a description."""
    if submitit is None:
        raise ConfigError("--executor slurm needs submitit: pip install submitit")
    recorded = _recorded(workdir)
    live = queued(recorded.values())
    # Trials already queued, or being trained by another runner, are not submitted again.
    todo = [f for f in folders if recorded.get(f.name) not in live and not is_locked(f)]
    if not todo:
        return "nothing (every trial to run is already queued or running)"
    executor = submitit.AutoExecutor(
        folder=workdir / "slurm" / "%j", cluster="slurm", slurm_max_num_timeout=MAX_REQUEUES
    )
    settings = {**DEFAULTS, **sweep.slurm, **(params or {})}
    settings.setdefault("slurm_array_parallelism", parallel or len(todo))
    settings.setdefault("name", f"lmuscale-{sweep.name}")
    try:
        executor.update_parameters(**settings)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"SLURM parameters {settings}: {error}") from None
    try:
        jobs = executor.map_array(TrialJob(), [str(f.absolute()) for f in todo])
    except Exception as error:  # sbatch's own message says what the cluster refused
        raise ConfigError(f"SLURM refused the job array: {type(error).__name__}: {error}") from None
    recorded |= {folder.name: job.job_id for folder, job in zip(todo, jobs, strict=True)}
    atomic_write_json(workdir / JOBS, {"tasks": recorded})
    return f"SLURM job array {jobs[0].job_id.split('_')[0]} ({len(jobs)} tasks)"


def wait(workdir: Path, on_update: Callable[[dict], None], write: Callable[[str], None]) -> None:
    """Wait until every recorded array task has left SLURM's queue for good: a preempted task
    leaves it for a moment before it is requeued, so a task gone while its trial is unfinished
    counts as ended only after ``REQUEUE_GRACE_SECONDS``."""
    folders = {task: workdir / TRIALS / name for name, task in _recorded(workdir).items()}
    gone_since: dict[str, float] = {}
    ended = set()
    while True:
        live = queued(folders)
        now = time.monotonic()
        for task, folder in folders.items():
            if task in live:
                gone_since.pop(task, None)
                continue
            gone_since.setdefault(task, now)
            state = status(folder)
            final = state in (*DONE, "failed") or now - gone_since[task] >= REQUEUE_GRACE_SECONDS
            if final and task not in ended:
                ended.add(task)
                write(f"{folder.name}: task {task} ended, {state}")
        if ended >= set(folders):
            return
        on_update({folders[t]: "running" for t in live if t in folders})
        time.sleep(POLL_SECONDS)
