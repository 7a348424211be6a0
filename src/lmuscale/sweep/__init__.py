"""Sweeps: many training runs from one sweep file, run locally or on SLURM, and one table.

``python -m lmuscale.sweep sweeps/owt2.py`` (see ``lmuscale.sweep.__main__``); a sweep file
defines ``get_trials()`` returning ``Trial(name, config, overrides)`` items (see
``lmuscale.sweep.spec``).
"""

from __future__ import annotations

from lmuscale.sweep.spec import Sweep, SweepError, Trial, config_hash, load_sweep
from lmuscale.sweep.throughput import BenchmarkError, Throughput, from_benchmarks

__all__ = [
    "BenchmarkError",
    "Sweep",
    "SweepError",
    "Throughput",
    "Trial",
    "config_hash",
    "from_benchmarks",
    "load_sweep",
]
