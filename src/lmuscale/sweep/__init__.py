"""Sweeps: many training runs from one sweep file (``lmuscale.sweep.spec``), run locally or on
SLURM, and one table: ``python -m lmuscale.sweep sweeps/owt2.py``."""

from __future__ import annotations

from lmuscale.sweep.spec import Sweep, Trial, config_hash, load_sweep
from lmuscale.sweep.throughput import BenchmarkError, Throughput, from_benchmarks

__all__ = [
    "BenchmarkError",
    "Sweep",
    "Throughput",
    "Trial",
    "config_hash",
    "from_benchmarks",
    "load_sweep",
]
