"""The parallel-LMU paper's tasks (papers/parallel-lmu.txt §4): Mackey-Glass, psMNIST, IMDB,
each with a small model, a parallel LMU or an LSTM (README, "Tasks from the parallel-LMU paper")."""

from lmuscale.tasks.base import Split, Splits, Task, TaskDataError
from lmuscale.tasks.config import TASKS, base_config, check, model_config
from lmuscale.tasks.models import TaskModel, TaskModelConfig
from lmuscale.tasks.train import run_task

__all__ = [
    "TASKS",
    "Split",
    "Splits",
    "Task",
    "TaskDataError",
    "TaskModel",
    "TaskModelConfig",
    "base_config",
    "check",
    "model_config",
    "run_task",
]
