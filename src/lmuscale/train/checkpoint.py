"""Checkpoints through orbax's CheckpointManager: the train state plus a little JSON.

Orbax writes each checkpoint into a temporary folder and renames it when complete, so a run
killed while saving leaves the previous checkpoints whole; the manager ignores (and cleans up)
the unfinished folder on the next start. Saves are asynchronous: the arrays are copied off
the device before ``save`` returns, then written while training goes on.

Each checkpoint's JSON holds a CRC-32 of every array of the state that process 0 holds whole
(all of them, except in a multi-process run with parameters split over processes), checked on
restore by every process. A checkpoint that fails the check, or that orbax cannot read
(a truncated file, a missing ``state/`` folder or manifest), raises ``CorruptCheckpoint``;
``set_aside`` moves it to ``checkpoints.corrupt/`` beside the folder, never deleting it.

A save that cannot be written (the folder cannot be made, no bytes or inodes left) raises
``CheckpointWriteError`` naming the checkpoint and the folder: before the save where the free
space is known to be short, otherwise from ``check`` once the background write has failed.
Orbax's own tracebacks of such failures are kept off the terminal: the error says it once.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from lmuscale.outcomes import StorageError

tree_paths = jax.tree_util.tree_leaves_with_path
CHECKSUMS = "checksums"  # in a checkpoint's JSON: {array path: CRC-32 of its bytes}
FILES_GUESS = 64  # inodes a first checkpoint may need; later saves count the newest one's


def _orbax_traceback(record: logging.LogRecord) -> bool:
    """False for the traceback orbax logs when a background save fails: ``Checkpoints``
    raises that failure as one named error, and the traceback would bury it."""
    return not (
        record.exc_info
        and record.levelno >= logging.ERROR
        and f"{os.sep}orbax{os.sep}" in record.pathname
    )


# The folders restores read (each ending in a separator): a restore raises the first failed
# read itself, so the others' later reports are echoes.
_RESTORED_FOLDERS: set[str] = set()


def _about_failed_read(error: BaseException | None) -> bool:
    """Whether ``error`` (or one it came from) names a file in a folder of ``_RESTORED_FOLDERS``."""
    seen = 0
    while error is not None and seen < 8:
        text = str(error)
        if any(folder in text for folder in _RESTORED_FOLDERS):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _unretrieved_read(record: logging.LogRecord) -> bool:
    """False for asyncio's "Task exception was never retrieved" report of a failed read."""
    return not (
        str(record.msg).startswith("Task exception was never retrieved")
        and record.exc_info is not None
        and _about_failed_read(record.exc_info[1])
    )


def quiet_failed_reads(path: Path) -> None:
    """Keep the echoes of a failed restore of ``path`` off the terminal. When one of orbax's
    concurrent reads fails, the restore raises that error, which the caller reports in one
    line; the other reads fail too and are reported later, tracebacks and all, at moments
    that depend on the threads' timing: asyncio logs "Task exception was never retrieved"
    when their tasks are collected, their coroutines raise again as they are closed
    (``sys.unraisablehook``), and tensorstore's threads find orbax's event loop closed.
    Errors that name other files, and all other errors, are reported as before."""
    _RESTORED_FOLDERS.add(f"{path}{os.sep}")  # a file in it: not .../12 for .../1
    asyncio_log = logging.getLogger("asyncio")
    if _unretrieved_read not in asyncio_log.filters:
        asyncio_log.addFilter(_unretrieved_read)
    previous = sys.unraisablehook
    if getattr(previous, "_drops_failed_reads", False):
        return

    def hook(unraisable):
        error = unraisable.exc_value
        closed = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        if not (closed or _about_failed_read(error)):
            previous(unraisable)

    hook._drops_failed_reads = True
    sys.unraisablehook = hook


class CheckpointWriteError(StorageError):
    """A checkpoint could not be written: the folder cannot be made, or the disk is full."""


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


class CorruptCheckpoint(StorageError):
    """A checkpoint that cannot be read, or whose arrays do not match their checksums."""


def _whole(x) -> bool:
    """Whether this process holds all of array ``x``: every array in a single-process run,
    the replicated ones in a multi-process run."""
    return getattr(x, "is_fully_addressable", True) or x.sharding.is_fully_replicated


def checksums(state) -> dict:
    """CRC-32 of the bytes of each array this process holds whole, by its path in the tree
    (in a multi-process run, arrays split across processes are left out)."""
    leaves = [(path, x) for path, x in tree_paths(state) if _whole(x)]
    local = [
        x if getattr(x, "is_fully_addressable", True) else x.addressable_data(0) for _, x in leaves
    ]
    values = jax.device_get(local)
    return {
        jax.tree_util.keystr(path): zlib.crc32(np.ascontiguousarray(value).tobytes())
        for (path, _), value in zip(leaves, values, strict=True)
    }


def mismatched(saved: dict, now: dict) -> list[str]:
    """The paths of the arrays in both whose CRC-32s differ."""
    return sorted(k for k in now if k in saved and saved[k] != now[k])


class Checkpoints:
    """``workdir/checkpoints``: the last ``keep`` states, by step."""

    def __init__(self, directory: Path, keep: int):
        self.directory = Path(directory).absolute()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointWriteError(
                f"checkpoint folder {self.directory} cannot be created ({_reason(error)})"
            ) from None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=True
        )
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)
        self.writing: int | None = None  # the step of the last save, until it is checked
        absl = logging.getLogger("absl")
        if _orbax_traceback not in absl.filters:
            absl.addFilter(_orbax_traceback)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """Save ``state`` at ``step``, first checking that the previous save was written and
        that there is room for this one (a full disk is named here, at the save that needs
        the space, and the older checkpoints stay)."""
        meta = {**meta, CHECKSUMS: checksums(state)}  # while the previous save is written
        self.wait()  # orbax would wait for it too; this names the step that failed
        self._check_room(step, sum(x.nbytes for x in jax.tree.leaves(state)))
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as error:
            raise CheckpointWriteError(
                f"saving checkpoint {step} in {self.directory} failed ({_reason(error)}); the "
                "checkpoints before it are kept"
            ) from None
        self.writing = step

    def _check_room(self, step: int, needed: int) -> None:
        no_room = f"no room for checkpoint {step} in {self.directory}: it needs about"
        keep = "the checkpoints before it are kept. Free some space and run again to resume"
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise CheckpointWriteError(f"{no_room} {needed:,} bytes and {free:,} are free; {keep}")
        stats = os.statvfs(self.directory)
        if stats.f_files:  # 0: a filesystem that does not count inodes
            newest = self.latest_step()
            files = FILES_GUESS
            if newest is not None:
                files = 1 + sum(1 for _ in (self.directory / str(newest)).rglob("*"))
            if stats.f_favail < files:
                raise CheckpointWriteError(
                    f"{no_room} {files} files and the filesystem has {stats.f_favail} free "
                    f"inodes; {keep}"
                )

    def check(self) -> None:
        """Raise ``CheckpointWriteError`` if the last save has failed in the background (the
        loop calls this at every logged step, so a failure is named soon after it happens)."""
        if self.writing is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def restore(self, step: int, abstract_state) -> tuple[dict, dict]:
        """The state at ``step``, each array placed with the sharding in ``abstract_state``
        (a tree of ``jax.ShapeDtypeStruct`` with shardings), and its JSON, checked against the
        checksums saved with it (``CorruptCheckpoint`` if it cannot be read or differs)."""
        where = self.directory / str(step)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
        )
        quiet_failed_reads(where)
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as error:
            raise CorruptCheckpoint(f"{where} cannot be read ({_reason(error)})") from None
        saved = (restored.meta or {}).get(CHECKSUMS)
        if saved:  # checkpoints written before checksums existed are taken as they are
            paths = {jax.tree_util.keystr(p) for p, _ in tree_paths(restored.state)}
            bad = mismatched(saved, checksums(restored.state))
            if bad or not set(saved) <= paths:
                what = bad[0] if bad else "the set of arrays"
                raise CorruptCheckpoint(
                    f"{where} does not match the checksums saved with it ({len(bad)} "
                    f"arrays differ, e.g. {what}): its files were damaged"
                )
        return restored.state, restored.meta

    def set_aside(self, step: int) -> Path:
        """Move checkpoint ``step`` to ``checkpoints.corrupt/STEP[-k]``; returns the new path."""
        aside = self.directory.parent / f"{self.directory.name}.corrupt"
        aside.mkdir(exist_ok=True)
        target, k = aside / str(step), 1
        while target.exists():
            target, k = aside / f"{step}-{k}", k + 1
        (self.directory / str(step)).rename(target)
        self.manager.reload()
        return target

    def wait(self) -> None:
        """Wait for the last save to be written; ``CheckpointWriteError`` if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as error:
            raise CheckpointWriteError(
                f"writing checkpoint {self.writing} in {self.directory} failed "
                f"({_reason(error)}); the checkpoints before it are kept"
            ) from None
        self.writing = None

    def close(self) -> None:
        """Stop the manager's threads (whatever a save left behind: nothing may keep the
        process from exiting)."""
        try:
            self.manager.wait_until_finished()
        except Exception:
            pass  # already reported by wait() or save()
        finally:
            self.manager.close()
