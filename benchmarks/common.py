"""What every benchmark script shares: the machine and versions record, a text table, JSON out."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

import jax
import numpy as np
import scipy

from lmuscale import __version__
from lmuscale.files import atomic_write_json


def machine() -> dict:
    device = jax.devices()[0]
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "system": platform.platform(),
    }


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "flax": importlib.metadata.version("flax"),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "lmuscale": __version__,
    }


def print_table(title: str, header: tuple, rows: list[tuple], left: int = 1) -> None:
    """Columns after the first ``left`` are right-aligned (numbers)."""
    table = [tuple(header)] + [tuple(str(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(table):
        cells = (
            cell.ljust(w) if j < left else cell.rjust(w)
            for j, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        print("  ".join(cells))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_json(out: Path, record: dict, quiet: bool = False) -> None:
    """Write atomically: a reader never sees half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, record)
    if not quiet:
        print(f"\nwrote {out}")
