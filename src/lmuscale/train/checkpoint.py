"""Every checkpoint lmuscale writes or reads, through orbax (training's, the task runs', and
``generate``'s parameters). ``CheckpointError`` is its one error.

A checkpoint ``checkpoints/STEP`` holds ``state/`` (the arrays), ``meta/`` (JSON, with a
CRC-32 of every array process 0 holds whole) and ``files.json`` (each file's size and CRC-32,
written once the save is complete). Reading checks the files before orbax opens any (so no
failed read reports from orbax's threads), then the arrays; without ``files.json`` (killed just
before it, or no room left to write it), the arrays alone. A checkpoint with neither (of an
older lmuscale, or its listing lost) cannot be verified: it is refused, named, unless the
command was told to accept it (``--accept-unverified``), and then said so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import traceback
import zlib
from collections.abc import Collection
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lmuscale.files import atomic_write_json
from lmuscale.outcomes import StorageError
from lmuscale.workdir import CHECKPOINTS, CONFIG

STATE = "state"  # the arrays' item in each checkpoint
META = "meta"  # the JSON item
TEMPORARY = ".orbax-checkpoint-tmp"  # in the name of a save not yet complete
FILES = "files.json"  # {path in the step folder: [bytes, CRC-32]}
CHECKSUMS = "checksums"  # in the JSON item: {array path: CRC-32 of its bytes}
FILES_GUESS = 64  # inodes a first checkpoint may need; later saves count the newest one's
EXPECTED = (
    "expected a training workdir, its checkpoints/N folder, checkpoints/N/state, or an orbax "
    "checkpoint of the variables"
)


class CheckpointError(StorageError):
    """A checkpoint that cannot be written, found or read. ``damaged``: it exists but its files
    or arrays are not those that were saved (training sets it aside and resumes earlier)."""

    def __init__(self, message: str, *, damaged: bool = False):
        super().__init__(message)
        self.damaged = damaged


def _reason(error: BaseException) -> str:
    """The innermost error's first line, without tensorstore's internal details."""
    seen = set()
    while (error.__cause__ or error.__context__) is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    reason = re.sub(r' in OCDBT database at local file "[^"]*"', "", reason)
    reason = re.sub(r" \[(tensorstore_spec|source locations)=.*", "", reason)
    reason = re.sub(r"\s*See full TensorStore details.*", "", reason)
    return reason if len(reason) <= 300 else reason[:297] + "..."


def _orbax_file(filename: str) -> bool:
    return f"{os.sep}orbax{os.sep}" in filename


def _orbax_traceback(record: logging.LogRecord) -> bool:
    """False for the traceback orbax logs when a background save fails (``wait`` names it)."""
    return not (
        record.exc_info and record.levelno >= logging.ERROR and _orbax_file(record.pathname)
    )


def _late_callback(unraisable) -> bool:
    """Whether ``unraisable`` (a ``sys.unraisablehook`` argument) is tensorstore, from its own
    thread, handing the end of a read or write to an asyncio loop that orbax has closed: after
    one of a save's writes fails, orbax stops waiting for the others, and each that ends later
    printed a traceback of ``Event loop is closed``. The failure itself is named once, by the
    call that waited for it."""
    error = unraisable.exc_value
    frames = traceback.extract_tb(unraisable.exc_traceback, limit=1)
    return (
        unraisable.object is None
        and isinstance(error, RuntimeError)
        and str(error) == "Event loop is closed"
        and bool(frames)
        and frames[0].name == "call_soon_threadsafe"
        and frames[0].filename == asyncio.base_events.__file__
    )


def _orbax_leftover(unraisable) -> bool:
    """Whether ``unraisable`` is what orbax leaves of a read or write that failed: a
    ``_late_callback``, or one of its coroutines that never ran to its end (a read of a
    damaged checkpoint left each of its other arrays' reads so: hundreds of tracebacks)."""
    code = getattr(unraisable.object, "cr_code", None)
    return _late_callback(unraisable) or (code is not None and _orbax_file(code.co_filename))


def _orbax_future(record: logging.LogRecord) -> bool:
    """False for asyncio's "exception was never retrieved" of orbax's tasks (a save that found
    the disk full: ``wait`` names the failure once)."""
    frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info else []
    return not any(_orbax_file(frame.filename) for frame in frames)


def quiet_late_callbacks() -> None:
    """Drop ``_orbax_leftover``s from ``sys.unraisablehook``, and orbax's futures from asyncio's
    log, for the rest of the process (they come after the call that started them, so the
    filters stay); nothing if they are in place."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_late_callbacks", False):
        return

    def hook(unraisable) -> None:
        if not _orbax_leftover(unraisable):
            previous(unraisable)

    hook.drops_late_callbacks = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_orbax_future)


def _whole(x) -> bool:
    """Whether this process holds all of array ``x`` (with several processes: replicated)."""
    return getattr(x, "is_fully_addressable", True) or x.sharding.is_fully_replicated


def checksums(state) -> dict:
    """CRC-32 of the bytes of each array this process holds whole, by its path in the tree."""
    leaves = [(path, x) for path, x in jax.tree_util.tree_leaves_with_path(state) if _whole(x)]
    local = [
        x if getattr(x, "is_fully_addressable", True) else x.addressable_data(0) for _, x in leaves
    ]
    values = jax.device_get(local)
    return {
        jax.tree_util.keystr(path): zlib.crc32(np.ascontiguousarray(value).tobytes())
        for (path, _), value in zip(leaves, values, strict=True)
    }


def _check_arrays(where: Path, saved: dict | None, restored, hint: str = "") -> None:
    """``CheckpointError`` when an array of ``restored`` differs from its saved CRC-32."""
    if not saved:
        return
    now = checksums(restored)
    bad = sorted(k for k in now if k in saved and saved[k] != now[k])
    if bad or not now.keys() & saved.keys():
        what = bad[0] if bad else "the set of arrays"
        raise CheckpointError(
            f"{where}: does not match the checksums saved with it ({len(bad)} arrays differ, "
            f"e.g. {what}): its files were damaged{hint}",
            damaged=True,
        )


def _file_sums(folder: Path) -> dict:
    sums = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != FILES:
            data = path.read_bytes()
            sums[str(path.relative_to(folder))] = [len(data), zlib.crc32(data)]
    return sums


def verify_files(folder: Path, hint: str = "") -> None:
    """``CheckpointError`` naming the first of ``folder``'s files that differs from its
    ``files.json`` (if it has one)."""
    try:
        saved = json.loads((folder / FILES).read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{folder / FILES}: cannot be read ({error})", damaged=True) from None
    for name, (size, crc) in saved.items():
        path = folder / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            problem = "is missing"
        except OSError as error:
            problem = f"cannot be read ({error.strerror})"
        else:
            if len(data) != size:
                problem = f"has {len(data):,} bytes, {size:,} when saved (truncated?)"
            elif zlib.crc32(data) != crc:
                problem = "differs from its CRC-32 when saved"
            else:
                continue
        raise CheckpointError(
            f"{folder}: cannot be read: {name} {problem}: its files were damaged{hint}",
            damaged=True,
        )


def _unverified(folder: Path) -> str | None:
    """What step folder ``folder`` lacks to be verified (None: its files.json or the arrays'
    CRC-32s in its JSON will check it); orbax's checkpoint of the variables has neither."""
    if (folder / "_METADATA").is_file():
        return "an orbax checkpoint of the variables alone, with no CRC-32s"
    if (folder / FILES).exists():
        return None
    try:
        meta = json.loads((folder / META / "metadata").read_text())
    except FileNotFoundError:
        return f"no {FILES} and no {META}/metadata"
    except (OSError, ValueError):
        return None  # unreadable: restoring it names the damage
    if isinstance(meta, dict) and meta.get(CHECKSUMS):
        return None
    return f"no {FILES} and no {CHECKSUMS} in {META}/metadata"


def check_verifiable(folder: Path, accept: bool | None, otherwise: str = "") -> None:
    """Refuse checkpoint ``folder`` when nothing can verify it, unless ``accept``; then say
    once that it is used unverified. ``accept`` None: the command has no
    ``--accept-unverified``; ``otherwise``: what else to do, for the message."""
    what = _unverified(folder)
    if what is None:
        return
    if accept:
        print(
            f"checkpoint: {folder}: used UNVERIFIED ({what}), as --accept-unverified asks",
            file=sys.stderr,
            flush=True,
        )
        return
    options = ["run again with --accept-unverified to use it anyway"] if accept is False else []
    options += [otherwise] if otherwise else []
    raise CheckpointError(
        f"{folder}: cannot be verified ({what}), so it is not used"
        + (f"; {', or '.join(options)}" if options else "")
    )


def steps(folder: Path) -> list[int]:
    """The steps of the complete checkpoints in ``folder``, oldest first."""
    try:
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as error:
        raise CheckpointError(f"{folder}: cannot be listed ({error.strerror})") from None


def _remove_unfinished(folder: Path) -> None:
    """Remove the folders of saves that a kill left under orbax's temporary name."""
    for path in folder.iterdir():
        if TEMPORARY in path.name and path.is_dir():
            try:
                shutil.rmtree(path)
            except OSError as error:
                raise CheckpointError(
                    f"{path}: an unfinished save that cannot be removed ({error.strerror})"
                ) from None


class Checkpoints:
    """A run's ``checkpoints`` folder: the last ``keep`` states, by step, and those of the steps
    in ``protect`` (branch points) whatever ``keep`` says. ``accept_unverified``: as
    ``check_verifiable``'s ``accept``."""

    def __init__(
        self,
        directory: Path,
        keep: int,
        accept_unverified: bool | None = None,
        protect: Collection[int] = (),
    ):
        self.directory = Path(directory).absolute()
        self.accept_unverified = accept_unverified
        self.keep, self.protect = keep, frozenset(protect)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointError(
                f"checkpoint folder {self.directory} cannot be created ({_reason(error)})"
            ) from None
        if jax.process_index() == 0:
            _remove_unfinished(self.directory)
        # Orbax's own clean-up runs on a thread that ``close`` does not wait for: a run that
        # stops at once (bad data) would exit under it, and it would report from its thread.
        # With steps to protect, the pruning is ours (``prune``): not every orbax we support
        # has a preservation policy.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if self.protect else keep, create=True, cleanup_tmp_directories=False
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.writing: int | None = None  # the step of the last save, until it is checked
        logging.getLogger("absl").addFilter(_orbax_traceback)
        quiet_late_callbacks()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        """Save ``state`` at ``step`` once the previous save is written and there is room (named
        here: orbax's threads would wait forever for a full disk or a read-only folder)."""
        meta = {**meta, CHECKSUMS: checksums(state)}  # while the previous save is written
        self.wait()  # orbax would wait for it too; this names the step that failed
        self.prune()
        self._check_room(step, sum(x.nbytes for x in jax.tree.leaves(state)))
        args = ocp.args.Composite(
            **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
        )
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as error:
            raise self._failed("saving", step, error) from None
        self.writing = step

    def _failed(self, doing: str, step, error: Exception) -> CheckpointError:
        return CheckpointError(
            f"{doing} checkpoint {step} in {self.directory} failed ({_reason(error)}); the "
            "checkpoints before it are kept"
        )

    def _check_room(self, step: int, needed: int) -> None:
        no_room = f"no room for checkpoint {step} in {self.directory}: it needs about"
        keep = "the checkpoints before it are kept. Free some space and run again to resume"
        try:
            fd, probe = tempfile.mkstemp(dir=self.directory, prefix=".probe-")
        except OSError as error:
            raise self._failed("writing", step, error) from None
        os.close(fd)
        os.unlink(probe)
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise CheckpointError(f"{no_room} {needed:,} bytes and {free:,} are free; {keep}")
        stats = os.statvfs(self.directory)
        if stats.f_files:  # 0: a filesystem that does not count inodes
            newest = self.latest_step()
            files = FILES_GUESS
            if newest is not None:
                files = 1 + sum(1 for _ in (self.directory / str(newest)).rglob("*"))
            if stats.f_favail < files:
                raise CheckpointError(
                    f"{no_room} {files} files and the filesystem has {stats.f_favail} free "
                    f"inodes; {keep}"
                )

    def check(self) -> None:
        """``CheckpointError`` if the last save has failed in the background."""
        if self.writing is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Wait for the last save to be written and record its files' sizes and CRC-32s;
        ``CheckpointError`` if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as error:
            raise self._failed("writing", self.writing, error) from None
        folder = self.directory / str(self.writing)
        if self.writing is not None and jax.process_index() == 0 and folder.is_dir():
            sums = _file_sums(folder)
            try:  # the arrays are written (and older steps past ``keep`` removed)
                atomic_write_json(folder / FILES, sums)
            except (OSError, StorageError) as error:
                cause = error.__cause__ if isinstance(error, StorageError) else error
                full = getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
                raise CheckpointError(
                    f"checkpoint {self.writing} in {self.directory} is written but its {FILES} is "
                    f"not ({_reason(error)}); a resume checks its arrays by their CRC-32s alone. "
                    + ("Free some space and run" if full else "Run")
                    + " again to resume"
                ) from None
        self.writing = None

    def prune(self) -> None:
        """With protected steps: remove the steps past the newest ``keep`` that are not
        protected (orbax keeps them all). Called by every process at the same point of a run,
        never from ``check``, whose timing differs between processes."""
        if not self.protect:
            return
        for step in sorted(self.manager.all_steps())[: -self.keep]:
            if step not in self.protect:
                try:
                    self.manager.delete(step)
                except Exception as error:
                    raise self._failed("removing", step, error) from None

    def restore(self, step: int, abstract_state) -> tuple[dict, dict]:
        """The state at ``step``, placed as ``abstract_state`` (``ShapeDtypeStruct``s with
        shardings) says, and its JSON."""
        where = self.directory / str(step)
        verify_files(where)
        earlier = [s for s in self.manager.all_steps() if s < step]
        check_verifiable(
            where,
            self.accept_unverified,
            f"move it out of {self.directory} to resume from checkpoint {max(earlier)}"
            if earlier
            else f"move it out of {self.directory} to train from the start",
        )
        args = ocp.args.Composite(
            **{STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
        )
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as error:
            raise CheckpointError(
                f"{where}: cannot be read ({_reason(error)})", damaged=True
            ) from None
        meta = restored[META] or {}
        _check_arrays(where, meta.get(CHECKSUMS), restored[STATE])
        return restored[STATE], meta

    def restore_latest(self, abstract_state) -> tuple[int, dict, dict] | None:
        """``(step, state, JSON)`` of the newest intact checkpoint, or None when there is none.
        A damaged one is set aside (by process 0), and said so, and the one before it tried."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, meta = self.restore(step, abstract_state)
            except CheckpointError as error:
                if not error.damaged:
                    raise
                if jax.process_index() == 0:
                    aside = self.set_aside(step)
                    print(f"checkpoint: {error}; moved to {aside}", file=sys.stderr, flush=True)
                continue
            return step, state, meta
        return None

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

    def close(self) -> None:
        """Stop the manager's threads, whatever a save left behind."""
        try:
            with contextlib.suppress(Exception):  # already reported by wait() or save()
                self.manager.wait_until_finished()
        finally:
            self.manager.close()
            logging.getLogger("absl").removeFilter(_orbax_traceback)


@dataclasses.dataclass(frozen=True)
class Found:
    """The orbax folder to read parameters from, and its training workdir (or None)."""

    state: Path
    workdir: Path | None


def locate(path) -> Found:
    """The ``Found`` of any path ``EXPECTED`` names (a workdir: its newest checkpoint)."""
    path = Path(os.path.abspath(path))  # "." and ".." resolved, so the folder names can be read
    if path.name == STATE and path.parent.name.isdigit() and path.parent.is_dir():
        return _step(path.parent)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not path.is_dir():
        raise CheckpointError(f"{path}: a file, not a checkpoint folder ({EXPECTED})")
    if (path / CHECKPOINTS).is_dir() or (path / CONFIG).is_file():
        return newest(path)
    if path.name == CHECKPOINTS and (path.parent / CONFIG).is_file():
        return newest(path.parent)
    if path.name.isdigit() and (path.parent.name == CHECKPOINTS or (path / STATE).is_dir()):
        return _step(path)
    if (path / "_METADATA").is_file():
        return Found(path, None)
    raise CheckpointError(f"{path}: not a checkpoint ({EXPECTED})")


def newest(workdir) -> Found:
    workdir = Path(os.path.abspath(workdir))
    if not workdir.is_dir():
        what = "not a folder" if workdir.exists() else "no such folder"
        raise CheckpointError(f"{workdir}: {what} (expected a training workdir)")
    folder = workdir / CHECKPOINTS
    found = steps(folder)
    if not found:
        raise CheckpointError(
            f"{folder}: no checkpoint yet (training saves one every checkpoint.every steps)"
        )
    return _step(folder / str(found[-1]))


def _step(folder: Path) -> Found:
    if not (folder / STATE).is_dir():
        raise CheckpointError(
            f"{folder}: no {STATE}/ folder (an incomplete or damaged checkpoint){_older(folder)}"
        )
    workdir = folder.parent.parent if folder.parent.name == CHECKPOINTS else None
    return Found(folder / STATE, workdir)


def _older(step_folder: Path) -> str:
    """A hint for a damaged checkpoint: the one saved before it, when there is one."""
    if not step_folder.name.isdigit():
        return ""
    earlier = [s for s in steps(step_folder.parent) if s < int(step_folder.name)]
    if not earlier:
        return ""
    return f"; try the one before: --checkpoint {step_folder.parent / str(earlier[-1])}"


def restore_target(tree, shardings=None):
    """``ShapeDtypeStruct``s of ``tree``'s arrays to restore into, placed by ``shardings`` (a
    tree like it) or else on the first local device."""
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, tree)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def read_variables(path: Path, model, accept_unverified: bool = False):
    """``model``'s variables (``{"params": ...}``) from an orbax checkpoint of them or of a
    training state, on the default device, verified as ``Checkpoints.restore`` does (orbax's
    checkpoint of the variables alone has nothing to verify it by: ``check_verifiable``)."""
    from etils import epath

    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    step = path.parent if path.name == STATE else None
    hint = _older(step) if step is not None else ""
    if step is not None:
        verify_files(step, hint)
    check_verifiable(step or path, accept_unverified, hint.removeprefix("; "))
    quiet_late_callbacks()
    with contextlib.closing(ocp.PyTreeCheckpointHandler()) as handler:
        try:
            saved = handler.metadata(epath.Path(path)).tree
        except Exception as error:  # orbax and tensorstore raise many kinds
            raise CheckpointError(f"{path}: cannot be read ({_reason(error)}){hint}") from None
        in_state = isinstance(saved.get("params"), dict) and "params" in saved["params"]
        expected = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
        _check_shapes(path, expected, saved["params"] if in_state else saved)
        target = restore_target(expected)
        item = {"params": target} if in_state else target
        args = ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True,
        )
        try:
            restored = handler.restore(epath.Path(path), args=args)
        except Exception as error:
            raise CheckpointError(f"{path}: cannot be read ({_reason(error)}){hint}") from None
    if not in_state:
        return restored
    try:
        meta = json.loads((step / META / "metadata").read_text())
    except (OSError, ValueError):
        meta = None  # no JSON beside the state: not written by our training loop
    saved_sums = meta.get(CHECKSUMS) if isinstance(meta, dict) else None
    _check_arrays(path, saved_sums, restored, hint)
    return restored["params"]


def _check_shapes(path: Path, expected, saved) -> None:
    def shapes(tree):
        leaves = jax.tree.leaves_with_path(tree)
        return {jax.tree_util.keystr(k): tuple(getattr(v, "shape", ())) for k, v in leaves}

    want, got = shapes(expected), shapes(saved)
    for key in sorted(want.keys() | got.keys()):
        if want.get(key) != got.get(key):
            raise CheckpointError(
                f"{path} does not fit the model: {key} has shape {got.get(key)} in the "
                f"checkpoint but {want.get(key)} in the model (a checkpoint of another model?)"
            )
