"""Sweep files for the sweep tests, written into a test's folder.

Every trial is ``tests/small_config.py:small`` (a 1-layer byte LMU) on the ``byte_corpus``
dataset, whose path reaches the runner through ``$LMUSCALE_TEST_DATA``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMALL = f"{HERE / 'small_config.py'}:small"


def write_sweep(folder: Path, trials: dict[str, dict], name: str = "sweep.py") -> Path:
    """A sweep file with one ``Trial(name, small, overrides)`` per item."""
    lines = ["from lmuscale.sweep import Trial", "", "", "def get_trials():"]
    for trial, overrides in trials.items():
        lines.append(f"    yield Trial({trial!r}, {SMALL!r}, {overrides!r})")
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return path


def environment(data: Path) -> dict:
    return os.environ | {"LMUSCALE_TEST_DATA": str(data), "JAX_PLATFORMS": "cpu"}


def sweep_command(sweep: Path, workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lmuscale.sweep", str(sweep), "--workdir", str(workdir), *extra]


def run_sweep(
    sweep: Path,
    workdir: Path,
    data: Path,
    *extra: str,
    timeout: float = 600,
    extra_env: dict | None = None,
):
    """The runner, to its end, on the ``byte_corpus`` data (``extra_env``: more variables, such
    as ``compile_cache.env``)."""
    return subprocess.run(
        sweep_command(sweep, workdir, "--quiet", *extra),
        env=environment(data) | (extra_env or {}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for(predicate, timeout: float, what: str):
    """Poll ``predicate`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
