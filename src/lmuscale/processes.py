"""Child processes that die with their parent, so that killing it (even with SIGKILL) leaves
no orphan running: a sweep runner's trial workers, ``prepare``'s tokenizer pool."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent(parent: int | None) -> bool:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG).

    ``parent`` is the pid of the process that started this one. It may have died while this
    one was starting, before prctl took effect, and then no signal comes: the answer is False
    when that happened (the caller should exit), True otherwise and where there is no prctl.
    Linux signals when the *thread* that started this process ends, so start such children
    from a thread that lives as long as they should (the main one).
    """
    if not sys.platform.startswith("linux"):
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return True
    return parent is None or os.getppid() == parent
