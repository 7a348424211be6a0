"""A run's folder (its workdir): the one place that names its files and keeps their rules.

``train``, ``tasks`` and the sweep's trials share them (the README lists them): a workdir that
holds training resumes only the same config (``lmuscale.resume.check``); a ``"finished"`` or
``"diverged"`` summary is final (``DONE``); ``lock`` is an flock held for the whole run, which
the kernel drops when its holder dies. JSON files are written whole (``lmuscale.files``),
JSONL logs a line at a time. One policy for damage: a torn last line is dropped; any other
file or line that does not parse is a ``DamagedFile`` naming it (and its line), never skipped
in silence.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

from lmuscale import __version__
from lmuscale.files import atomic_write_bytes, atomic_write_json
from lmuscale.outcomes import ConfigError, DamagedFile, StorageError, WorkdirBusy, reason

CONFIG = "config.json"  # the resolved config
SUMMARY = "summary.json"  # written once, at the end
CHECKPOINTS = "checkpoints"  # orbax, one folder per step (train.checkpoint)
METRICS = "metrics.jsonl"  # one line per logged step (train) or per epoch (tasks)
EVAL = "eval.jsonl"  # one line per validation
PLAN = "plan.json"  # the micro-batch count and XLA's memory estimate of the train step
WANDB = "wandb.json"  # the W&B run's id, so that a resumed run continues it
TENSORBOARD = "tensorboard"
PROFILE = "profile"  # jax.profiler traces (log.profile_steps)
LOCK = "lock"
OLD_TASK_CHECKPOINT = "checkpoint.msgpack"  # a task run's before orbax: refused by name
# a sweep trial's own records, beside its training files
TRIAL = "trial.json"  # the resolved trial, written by the runner
LOG = "train.log"  # the worker's output, every attempt appended
ATTEMPTS = "attempts.jsonl"  # one line per attempt: start and end, host, pid, outcome
ERROR = "error.json"  # the exception and traceback of a failed attempt

DONE = ("finished", "diverged")  # final results: never run again


@functools.cache
def provenance() -> dict:
    """What made a run, for its summary: this package's version; its git commit and whether the
    checkout had uncommitted changes, where it runs from a checkout (else None); the versions of
    Python and of the libraries that compute the numbers."""
    commit = dirty = None
    root = Path(__file__).resolve().parents[2]  # src/lmuscale/workdir.py -> the checkout
    if (root / ".git").exists() and (root / "pyproject.toml").exists():
        git = ["git", "-C", str(root)]
        try:
            head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, timeout=30)
            changes = subprocess.run(
                [*git, "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            head = changes = None
        if head and head.returncode == 0 and changes.returncode == 0:
            commit, dirty = head.stdout.decode().strip(), bool(changes.stdout.strip())
    versions = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"lmuscale": __version__, "commit": commit, "dirty": dirty, "versions": versions}


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``; None when there is no such file."""
    try:
        value = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise DamagedFile(f"{path}: not JSON ({error}); move it away to run again") from None
    except OSError as error:
        raise DamagedFile(f"{path}: cannot be read: {reason(error)}") from None
    if not isinstance(value, dict):
        raise DamagedFile(
            f"{path}: a JSON {type(value).__name__}, not an object; move it away to run again"
        )
    return value


def summary(workdir: Path) -> dict | None:
    """``summary.json``, or None before the run has ended."""
    return read_json(Path(workdir) / SUMMARY)


def write_summary(workdir: Path, record: dict) -> None:
    atomic_write_json(Path(workdir) / SUMMARY, record)


def outcome(workdir: Path) -> str | None:
    """The summary's status when it is final (``DONE``), else None."""
    record = summary(workdir)
    # A task summary written before summaries had a status is a finished run.
    state = record.get("status", "finished") if record is not None else None
    return state if state in DONE else None


def finished(workdir: Path) -> dict | None:
    folder_or_absent(workdir)
    record = summary(workdir)
    return record if record is not None and record.get("status", "finished") == "finished" else None


def status(workdir: Path) -> str:
    """finished | diverged | failed | running | interrupted | pending."""
    final = outcome(workdir)
    if final is not None:
        return final
    if is_locked(workdir):
        return "running"
    if (Path(workdir) / ERROR).exists():
        return "failed"
    if has_checkpoint(workdir):
        return "interrupted"
    return "pending"


def has_checkpoint(workdir: Path) -> bool:
    folder = Path(workdir) / CHECKPOINTS
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def write_config(config, workdir: Path) -> None:
    """Write ``config.json`` (a ConfigDict's, keys sorted) into a workdir that exists (the
    caller holds its ``Lock``)."""
    text = json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"
    atomic_write_bytes(Path(workdir) / CONFIG, text.encode())


def folder_or_absent(workdir: Path) -> None:
    """A workdir is a folder, or does not exist yet under folders: else a ``ConfigError``."""
    path = Path(workdir)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"workdir {workdir}: it (or a folder above it) is a file")


def usable(workdir: Path) -> Path:
    """Create ``workdir`` (and its parents) if needed; a ``ConfigError`` names it where it is
    a file, a ``StorageError`` where it cannot be made."""
    workdir = Path(workdir)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"workdir {workdir}: it (or a folder above it) is a file") from None
    except OSError as error:
        raise StorageError(f"workdir {workdir}: cannot be created: {reason(error)}") from None
    return workdir


def _parse(line: bytes) -> dict | None:
    try:
        record = json.loads(line.decode())  # json.loads decodes bytes a third slower
    except ValueError:  # UnicodeDecodeError included
        return None
    return record if isinstance(record, dict) else None


def read_log(path: Path) -> list[dict]:
    """Every record of a JSONL log (none when there is no file): a torn last line is dropped,
    any other line that is not a JSON object is a ``DamagedFile`` naming it."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _parse(line)
        if record is None:
            if number == len(lines):
                break
            raise DamagedFile(
                f"{path}:{number}: not a JSON log line, and not the last line (only a kill's "
                "torn last line is dropped); mend it, or move the file away"
            )
        records.append(record)
    return records


def last_record(path: Path) -> dict | None:
    """The last complete record of a JSONL log (read from its end), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        record = _parse(line)
        if record is not None:
            return record
    return None


def cut_log(path: Path, step: int) -> int | None:
    """Truncate a step log after its last line whose step is <= ``step``, in place (a resumed
    run continues it); returns that line's step (None: no such line). A torn last line is
    dropped; an unreadable line anywhere else, or a step below an earlier one, is damage that a
    cut would hide or spread: ``DamagedFile``."""
    if not path.exists():
        return None
    remedy = f"mend it, or move it away and the run starts a new one after step {step}"
    with path.open("r+b") as f:
        lines = f.readlines()
        offset = keep = 0  # bytes read; bytes of the lines kept
        previous = kept = None  # the last step seen; the last kept
        for number, line in enumerate(lines, 1):
            record = _parse(line)
            at = record.get("step") if record is not None else None
            if not isinstance(at, int) or isinstance(at, bool):
                if number == len(lines):
                    break
                raise DamagedFile(
                    f"{path}:{number}: not a JSON log line with a step, and not the last line "
                    f"(only a kill's torn last line is dropped); {remedy}"
                )
            if previous is not None and at < previous:
                raise DamagedFile(
                    f"{path}:{number}: step {at} after step {previous}; the lines must be in "
                    f"step order (did two runs write to this workdir?); {remedy}"
                )
            previous = at
            offset += len(line)
            if at <= step:
                keep, kept = offset, at
        if keep < f.tell():
            f.truncate(keep)
        elif lines and not lines[-1].endswith(b"\n"):  # a whole last line without its newline
            f.write(b"\n")
        else:
            return kept
        os.fsync(f.fileno())
    return kept


class Lock:
    """An exclusive flock on ``WORKDIR/lock`` holding its holder's pid, host and start time.

    Two opens of the file conflict even within one process, so code that already holds the
    lock (a sweep worker) tells ``train.run`` so rather than taking it twice.
    """

    def __init__(self, workdir: Path):
        self.path = Path(workdir).absolute() / LOCK
        self.fd = None

    def acquire(self) -> bool:
        cannot = f"workdir {self.path.parent}: cannot write in it"
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise StorageError(f"{cannot}: {reason(error)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        holder = f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
        except OSError as error:
            os.close(fd)
            raise StorageError(f"{cannot} ({self.path}: {reason(error)})") from None
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None

    def holder(self) -> str:
        """Who holds the lock, as its holder wrote it ("pid 12 on host since ...")."""
        try:
            return self.path.read_text().strip() or "another process"
        except OSError:
            return "another process"

    def __enter__(self):
        if not self.acquire():
            raise WorkdirBusy(
                f"workdir {self.path.parent} is in use by {self.holder()}; wait for that run "
                "to end (or stop it), or use another --workdir"
            )
        return self

    def __exit__(self, *exc):
        self.release()


def is_locked(workdir: Path) -> bool:
    """Whether another process holds the workdir's lock (False when there is no lock file)."""
    lock = Lock(workdir)
    if not lock.path.exists():
        return False
    free = lock.acquire()
    lock.release()
    return not free
