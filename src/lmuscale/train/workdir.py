"""The rules every run's workdir follows, for language-model training (``train``), the
parallel-LMU tasks (``tasks``) and the sweep's trials, which are ``train`` workdirs:

- ``config.json`` holds the run's resolved config. A workdir that holds training (a
  checkpoint, or a finished summary) resumes only the same config (``check``); one that
  holds none (a run that failed or diverged before its first checkpoint) takes a new one.
- ``summary.json`` with ``"status": "finished"`` is a finished run: running it again returns
  that summary and trains nothing (``finished``), whatever checkpoints or data remain.
- A loss that becomes NaN or infinite stops the run with ``TrainingDiverged``.
- ``lock`` is held (an flock) by the process that trains in the workdir, for the whole run:
  a second process on the same workdir stops at once, naming the holder. The kernel drops
  the lock when its holder dies, so a killed run never leaves the workdir locked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ml_collections import ConfigDict

from lmuscale.files import atomic_write_bytes
from lmuscale.outcomes import TrainingDiverged as TrainingDiverged
from lmuscale.outcomes import WorkdirBusy
from lmuscale.train.config import ConfigError, differences, flatten, saved_flat, to_json

CONFIG = "config.json"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"  # language-model training's (and so a sweep trial's)
LOCK = "lock"
PROFILE = "profile"  # jax.profiler traces (log.profile_steps)


def check(config: ConfigDict, workdir: Path, has_checkpoint: bool) -> None:
    """Refuse a workdir that holds training of another config (``has_checkpoint``: the
    caller's own checkpoint, or a finished summary); keys that do not change the trained
    numbers (``config.RESUMABLE_CHANGES``) may differ."""
    folder_or_absent(workdir)
    saved = Path(workdir) / CONFIG
    if not ((has_checkpoint or finished(workdir) is not None) and saved.exists()):
        return
    try:
        old = json.loads(saved.read_text())
    except ValueError as error:
        raise ConfigError(f"{saved}: not JSON ({error})") from None
    changed = differences(old, config)
    if changed:
        old_flat, new_flat = saved_flat(old), flatten(config)
        listed = "; ".join(f"{k}: {old_flat.get(k)!r} -> {new_flat.get(k)!r}" for k in changed)
        raise ConfigError(
            f"{workdir} holds a run of another config (differs in {listed}); use a new "
            "--workdir, or the saved config"
        )


def folder_or_absent(workdir: Path) -> None:
    """A workdir is a folder, or does not exist yet under folders: else a ``ConfigError``."""
    path = Path(workdir)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"workdir {workdir}: it (or a folder above it) is a file")


def has_checkpoint(workdir: Path) -> bool:
    folder = Path(workdir) / CHECKPOINTS
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def write_config(config: ConfigDict, workdir: Path) -> None:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(workdir / CONFIG, to_json(config).encode())


def finished(workdir: Path) -> dict | None:
    """The summary of a finished run in ``workdir``, or None."""
    folder_or_absent(workdir)
    path = Path(workdir) / SUMMARY
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"{path}: not JSON ({error}); move it away to run again") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read: {_reason(error)}") from None
    if not isinstance(summary, dict):
        raise ConfigError(
            f"{path}: a JSON {type(summary).__name__}, not a summary; move it away to run again"
        )
    # A task summary written before summaries had a status is a finished run (a training
    # summary has always had one).
    return summary if summary.get("status", "finished") == "finished" else None


def usable(workdir: Path) -> Path:
    """Create ``workdir`` (and its parents) if needed; a path that cannot be a workdir (a file,
    a read-only filesystem, no permission) is a ``ConfigError`` that names it."""
    workdir = Path(workdir)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"workdir {workdir}: it (or a folder above it) is a file") from None
    except OSError as error:
        raise ConfigError(f"workdir {workdir}: cannot be created: {_reason(error)}") from None
    return workdir


def _reason(error: OSError) -> str:
    if error.errno == errno.EROFS:
        return "the filesystem is read-only"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if error.errno == errno.ENOSPC:
        return "no space (or no inodes) left on the device"
    return error.strerror or str(error)


class Lock:
    """An exclusive flock on ``WORKDIR/lock`` holding its holder's pid, host and start time.

    flock conflicts between two opens of the file even within one process, so code that
    already holds a workdir's lock (a sweep worker, around the training of its trial) tells
    ``train.run`` so rather than taking it twice.
    """

    def __init__(self, workdir: Path):
        self.path = Path(workdir).absolute() / LOCK
        self.fd = None

    def acquire(self) -> bool:
        """Take the lock if it is free."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            where = self.path.parent
            raise ConfigError(f"workdir {where}: cannot write in it: {_reason(error)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        holder = f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
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
