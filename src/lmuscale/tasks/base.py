"""What a task is: its data splits, its loss, its metric and the paper's number to compare with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from ml_collections import ConfigDict

from lmuscale.outcomes import DataError


class TaskDataError(DataError):
    """A task's dataset is missing or unreadable: the message names the path and the fix."""


@dataclasses.dataclass(frozen=True)
class Split:
    """Inputs and targets of one split, as numpy arrays with the example axis first."""

    inputs: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return len(self.inputs)


@dataclasses.dataclass(frozen=True)
class Splits:
    train: Split
    val: Split
    test: Split
    source: str  # where the data came from, for the summary


@dataclasses.dataclass(frozen=True)
class Task:
    """A supervised task of the parallel-LMU paper: ``loss`` "mse", "softmax" or "sigmoid" (a
    binary logit); ``metric`` "nrmse" or "accuracy"; ``data`` the config section's defaults;
    ``load`` that section -> Splits (TaskDataError when the data is missing); ``paper`` the
    published metric by model."""

    name: str
    loss: str
    metric: str
    outputs: int
    sequence_output: bool
    data: dict
    load: Callable[[ConfigDict], Splits]
    paper: dict[str, float]
