"""A disk that fills up, for tests: the OS calls lmuscale's writes make raise ENOSPC, for the
files named, as a full filesystem's would."""

from __future__ import annotations

import errno
import os
import pathlib

NO_SPACE = "no space left on the device (or no inodes)"  # how lmuscale says ENOSPC


def _refusal() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def no_space(*_args, **_kwargs):
    """In place of an OS call that writes: ENOSPC."""
    raise _refusal()


def fsync_fails(monkeypatch, *names: str, seen: list | None = None) -> None:
    """``os.fsync`` of a file whose name begins with one of ``names``, or of an atomic write's
    temporary file for one (``.NAME.*.tmp``), raises ENOSPC; ``seen`` gets every name synced."""
    real = os.fsync

    def fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if seen is not None:
            seen.append(name)
        if any(name.startswith((n, f".{n}.")) for n in names):
            raise _refusal()
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


class _FillingFile:
    """A file opened for appending that takes ``room`` more lines, then no more."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, text: str) -> int:
        if self.room <= 0:
            raise _refusal()
        self.room -= text.count("\n")
        return self.file.write(text)

    def __getattr__(self, name):
        return getattr(self.file, name)


def appends_fail(monkeypatch, name: str, room: int) -> None:
    """A file ``name`` opened for appending (``Path.open("a")``) takes ``room`` more lines; each
    write after them raises ENOSPC."""
    real = pathlib.Path.open

    def opening(self, mode="r", *args, **kwargs):
        file = real(self, mode, *args, **kwargs)
        return _FillingFile(file, room) if self.name == name and "a" in mode else file

    monkeypatch.setattr(pathlib.Path, "open", opening)
