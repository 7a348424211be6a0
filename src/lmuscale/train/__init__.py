"""Training: configs, the sharded train step, checkpoints, evaluation and metrics.

``python -m lmuscale.train --config experiments/owt2.py:lmu-1M --workdir runs/lmu-1M``; in
Python, ``run(load("experiments/owt2.py:tiny"), "runs/tiny")``.
"""

from __future__ import annotations

from lmuscale.outcomes import TrainingDiverged
from lmuscale.train.config import ConfigError, base_config, load, model_config, override
from lmuscale.train.loop import TrainingInterrupted, run

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
