"""Task configs: ConfigDicts with a fixed schema per task; unknown keys and wrong types are
errors naming the key. An experiment file lists ``NAMES`` and defines ``get_config(name)``."""

from __future__ import annotations

import dataclasses
import math

from ml_collections import ConfigDict

from lmuscale.outcomes import ConfigError
from lmuscale.tasks import imdb, mackey_glass, psmnist
from lmuscale.tasks.base import Task
from lmuscale.tasks.models import TaskModelConfig
from lmuscale.train.config import check_schema

TASKS: dict[str, Task] = {t.name: t for t in (mackey_glass.TASK, psmnist.TASK, imdb.TASK)}


def task_of(config: ConfigDict) -> Task:
    try:
        return TASKS[config.task]
    except (KeyError, AttributeError):
        raise ConfigError(
            f"task must be one of {', '.join(TASKS)}, got {config.get('task')!r}"
        ) from None


def base_config(task: str, **model) -> ConfigDict:
    """Every key a task config has. ``model`` gives TaskModelConfig fields (``kind`` at least).
    Training is Adam with its defaults (lr 1e-3), as in the parallel-LMU paper."""
    spec = TASKS[task]
    made = TaskModelConfig(outputs=spec.outputs, sequence_output=spec.sequence_output, **model)
    fixed = ("outputs", "sequence_output")  # by the task, not by the config
    fields = {key: value for key, value in dataclasses.asdict(made).items() if key not in fixed}
    train = dict(seed=0, epochs=100, batch_size=32, learning_rate=1e-3, eval_batch_size=256)
    return ConfigDict(
        {"name": "", "task": task, "model": fields, "data": dict(spec.data), "train": train}
    )


def model_config(config: ConfigDict) -> TaskModelConfig:
    spec = task_of(config)
    try:
        return TaskModelConfig(
            outputs=spec.outputs, sequence_output=spec.sequence_output, **dict(config.model)
        )
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model: {error}") from None


def check(config: ConfigDict, where: str = "config") -> None:
    """The config has its task's keys with the right types, and sensible values."""
    model = model_config(config)
    check_schema(config, base_config(config.task, **dict(config.model)), where)
    if not 0 <= config.train.seed < 2**32:  # jax.random.key keeps the low 32 bits
        raise ConfigError(f"{where}: train.seed must be in [0, 2**32), got {config.train.seed!r}")
    for key in ("epochs", "batch_size", "eval_batch_size"):
        if config.train[key] <= 0:
            raise ConfigError(f"{where}: train.{key} must be > 0, got {config.train[key]!r}")
    lr = config.train.learning_rate
    if not (lr > 0 and math.isfinite(lr)):
        raise ConfigError(f"{where}: train.learning_rate must be finite and > 0, got {lr!r}")
    vocab = config.data.get("vocab")
    if vocab is not None and model.vocab_size != vocab:
        raise ConfigError(
            f"{where}: model.vocab_size ({model.vocab_size}) must equal data.vocab ({vocab})"
        )
