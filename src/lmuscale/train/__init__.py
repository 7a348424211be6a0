"""Training: configs, the sharded train step, checkpoints, evaluation and metrics.

In Python: ``run(load("experiments/owt2.py:tiny"), "runs/tiny")``. The names below are imported
on first use, so that a Ctrl-C while ``python -m lmuscale.train`` imports JAX is one line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmuscale.outcomes import ConfigError, TrainingDiverged, TrainingInterrupted
    from lmuscale.train.config import base_config, load, model_config, override
    from lmuscale.train.loop import run

_HOMES = {
    "ConfigError": "lmuscale.outcomes",
    "TrainingDiverged": "lmuscale.outcomes",
    "TrainingInterrupted": "lmuscale.outcomes",
    "base_config": "lmuscale.train.config",
    "load": "lmuscale.train.config",
    "model_config": "lmuscale.train.config",
    "override": "lmuscale.train.config",
    "run": "lmuscale.train.loop",
}

__all__ = [
    "ConfigError",
    "TrainingDiverged",
    "TrainingInterrupted",
    "base_config",
    "load",
    "model_config",
    "override",
    "run",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
