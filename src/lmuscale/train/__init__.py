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
    "lmuscale.outcomes": ("ConfigError", "TrainingDiverged", "TrainingInterrupted"),
    "lmuscale.train.config": ("base_config", "load", "model_config", "override"),
    "lmuscale.train.loop": ("run",),
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
    for module, names in _HOMES.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
