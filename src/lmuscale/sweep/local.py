"""The local executor: each trial in a worker process, K at a time, each worker with its own
share of the visible GPUs (CUDA_VISIBLE_DEVICES); on a CPU the workers share it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lmuscale.outcomes import STOP_SIGNALS, ConfigError, Exit
from lmuscale.sweep.worker import ENDED, STOP_GRACE_SECONDS, record_crash, start
from lmuscale.workdir import DONE, is_locked, status

POLL_SECONDS = 0.5


def gpu_slots(parallel: int) -> list[dict]:
    """The environment of each of ``parallel`` worker slots."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    elif shutil.which("nvidia-smi"):
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        gpus = [
            str(i) for i, line in enumerate(listing.stdout.splitlines()) if line.startswith("GPU")
        ]
    else:
        gpus = []
    if not gpus:
        return [{} for _ in range(parallel)]
    if parallel > len(gpus):
        raise ConfigError(f"--parallel {parallel} is more than the {len(gpus)} GPUs visible")
    per = len(gpus) // parallel
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per : (i + 1) * per])} for i in range(parallel)
    ]


def run_local(
    folders: list[Path],
    parallel: int,
    on_update: Callable[[dict[Path, str]], None],
    on_end: Callable[[Path, str], None],
) -> None:
    """Train every folder that is not done; ``on_update`` sees the running folders each poll,
    ``on_end`` each folder whose worker ended (with its status)."""
    free = gpu_slots(parallel)
    queue = [f for f in folders if status(f) not in DONE]
    waiting: list[Path] = []  # locked by another runner: retried when the lock is free
    running: dict[Path, tuple[subprocess.Popen, dict]] = {}
    try:
        while queue or waiting or running:
            for folder in [f for f in waiting if not is_locked(f)]:
                waiting.remove(folder)
                state = status(folder)
                if state in (*DONE, "failed"):  # another runner's result: not retried here
                    on_end(folder, state)
                else:
                    queue.append(folder)
            while queue and free:
                folder = queue.pop(0)
                if is_locked(folder):
                    waiting.append(folder)
                    continue
                slot = free.pop(0)
                # A session of its own: Ctrl-C reaches the runner, which stops the workers cleanly.
                process = start(folder, "worker started", slot, start_new_session=True)
                running[folder] = (process, slot)
            on_update({f: "running" for f in running} | {f: "waiting" for f in waiting})
            time.sleep(POLL_SECONDS)
            for folder, (process, slot) in list(running.items()):
                code = process.poll()
                if code is None:
                    continue
                del running[folder]
                free.append(slot)
                if code == Exit.BUSY:
                    waiting.append(folder)
                    continue
                if code not in ENDED:
                    record_crash(folder, code)
                on_end(folder, status(folder))
    except BaseException:
        _stop(running)
        raise


def _stop(running: dict) -> None:
    """SIGTERM every worker (each writes a checkpoint and exits), then wait for them. Another
    stop signal meanwhile is ignored: it would end this process, and with it (they die with
    it) the workers before their checkpoints."""
    here = threading.current_thread() is threading.main_thread()  # where handlers can change
    signals = (*STOP_SIGNALS, signal.SIGHUP) if here else ()
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        for process, _ in running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process, _ in running.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
