"""Child processes that die with their parent, so that killing it (even with SIGKILL) leaves
no orphan running: a sweep runner's trial workers, ``prepare``'s tokenizer pool."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent(parent: int | None) -> bool:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG); False
    when ``parent``, the pid that started this one, died before that took effect (no signal will
    come: the caller should exit). Linux signals when the *thread* that started this process
    ends, so start such children from the main thread."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return True
    return parent is None or os.getppid() == parent
