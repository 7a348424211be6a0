"""Atomic file writes: a reader sees the old file or the new one, never a part of either; and
the reader of the versioned JSON files written so (``read_tagged_json``). A write that fails
(a full disk, a read-only folder) is a ``StorageError`` naming the file (``unwritable``)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from lmuscale.outcomes import StorageError, reason


def unwritable(path, error: OSError) -> StorageError:
    """The one line for ``error`` while writing ``path``."""
    return StorageError(f"{path}: cannot be written ({reason(error)})")


@contextlib.contextmanager
def writing(path):
    """An ``OSError`` inside (a full disk, a read-only folder) as ``unwritable``'s error."""
    try:
        yield
    except OSError as error:
        raise unwritable(path, error) from error


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it over;
    ``unwritable``'s error when that fails."""
    path = Path(path)
    with writing(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            mask = os.umask(0)  # the only way to read the umask is to set it
            os.umask(mask)
            os.fchmod(fd, 0o666 & ~mask)  # mkstemp makes 0600; give the usual permissions
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def read_tagged_json(
    path: Path, tag: str, version: int, error: type[Exception], what: str, hint=""
):
    """The JSON object in ``path`` whose "format" is ``tag`` and "version" ``version``; anything
    else raises ``error`` naming the file (and line) and ``what`` was expected ("fits file");
    ``hint`` follows a missing file's message (what writes one)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such {what}{hint}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot be read ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
    except RecursionError:
        raise error(f"{path}: not a {what} (nested too deeply)") from None
    got = data.get("format") if isinstance(data, dict) else f"a JSON {type(data).__name__}"
    if got != tag:
        raise error(f"{path}: not a {what}: format is {got!r}, expected {tag!r}")
    if data.get("version") != version:
        raise error(f"{path}: version {data.get('version')!r}; this reader reads version {version}")
    return data
