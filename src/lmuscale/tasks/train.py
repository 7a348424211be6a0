"""One task run: load the data, train epoch by epoch, keep the best epoch, test it.

A checkpoint after every epoch holds parameters, Adam state and the best parameters so far;
batches are a function of (seed, epoch): a resumed run computes the numbers of one never stopped.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import ConfigDict
from tqdm import tqdm

from lmuscale import resume
from lmuscale import workdir as workdir_lib
from lmuscale.files import atomic_write_bytes
from lmuscale.outcomes import TrainingDiverged
from lmuscale.tasks.base import Split, Task
from lmuscale.tasks.config import model_config, task_of
from lmuscale.tasks.models import TaskModel, tree_params
from lmuscale.train.checkpoint import CheckpointError, Checkpoints, restore_target
from lmuscale.train.step import compilation_cache

# Task.loss -> the mean loss of a batch: predictions ``y_Bx...xO`` against targets.
LOSSES = {
    "mse": lambda y, t: jnp.mean((y - t) ** 2),
    "softmax": lambda y, t: optax.softmax_cross_entropy_with_integer_labels(y, t).mean(),
    "sigmoid": lambda y, t: optax.sigmoid_binary_cross_entropy(y[..., 0], t).mean(),
}


def metric(task: Task, predictions: np.ndarray, targets: np.ndarray) -> float:
    """NRMSE (RMS error over the targets' standard deviation) or accuracy in percent."""
    if task.metric == "nrmse":
        return float(np.sqrt(np.mean((predictions - targets) ** 2)) / np.std(targets))
    if task.loss == "softmax":
        right = predictions.argmax(-1) == targets
    else:
        right = (predictions[..., 0] > 0) == (targets > 0.5)
    return float(100.0 * np.mean(right))


def better(task: Task, value: float, best: float) -> bool:
    if math.isnan(best):
        return not math.isnan(value)
    return value > best if task.metric == "accuracy" else value < best


class Trainer:
    """The jitted train step and prediction of one model."""

    def __init__(self, config: ConfigDict):
        self.task = task_of(config)
        self.model = TaskModel(model_config(config))
        self.optimizer = optax.adam(config.train.learning_rate)  # otherwise Adam's defaults
        self.batch_size = config.train.batch_size
        self.eval_batch_size = config.train.eval_batch_size

        def loss(params, inputs, targets):
            return LOSSES[self.task.loss](self.model.apply(params, inputs), targets)

        def train_step(params, opt_state, inputs, targets):
            value, grads = jax.value_and_grad(loss)(params, inputs, targets)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        # No buffer donation: the best parameters so far may be the very arrays passed in.
        self.train_step = jax.jit(train_step)
        self.predict_batch = jax.jit(self.model.apply)

    def init(self, seed: int, example):
        params = self.model.init(jax.random.key(seed), jnp.asarray(example[:1]))
        return {
            "params": params,
            "opt_state": self.optimizer.init(params),
            "best_params": params,
        }

    def epoch(self, state, split: Split, seed: int, epoch: int, bar) -> float:
        """Epoch ``epoch``'s pass over ``split``, in a (seed, epoch)-shuffled order; the last
        partial batch is dropped so every step has one shape. Returns the mean training loss."""
        order = np.random.default_rng([seed, epoch]).permutation(len(split))
        batches = max(1, len(split) // self.batch_size)
        params, opt_state, total = state["params"], state["opt_state"], 0.0
        for i in range(batches):
            take = order[i * self.batch_size : (i + 1) * self.batch_size]
            params, opt_state, value = self.train_step(
                params, opt_state, split.inputs[take], split.targets[take]
            )
            total += float(value)
            bar.update(1)
        state.update(params=params, opt_state=opt_state)
        return total / batches

    def evaluate(self, params, split: Split) -> float:
        size = self.eval_batch_size
        parts = [
            np.asarray(self.predict_batch(params, split.inputs[i : i + size]))
            for i in range(0, len(split), size)
        ]
        return metric(self.task, np.concatenate(parts), split.targets)


def run_task(
    config: ConfigDict,
    workdir,
    progress: bool | None = None,
    accept_unverified: bool | None = None,
) -> dict:
    """Train (or resume, or just read back) one task run; returns its summary. The workdir
    is locked for the run, as a training run's is; ``accept_unverified``: as ``train.run``'s."""
    workdir = Path(workdir)
    compilation_cache()
    resume.check(config, workdir, workdir_lib.has_checkpoint(workdir))
    summary = workdir_lib.finished(workdir)
    if summary is not None:
        return summary
    with workdir_lib.Lock(workdir_lib.usable(workdir)):
        resume.check(config, workdir, workdir_lib.has_checkpoint(workdir))
        old = workdir / workdir_lib.OLD_TASK_CHECKPOINT
        if old.exists():
            raise CheckpointError(
                f"{old}: a task checkpoint of lmuscale before orbax checkpoints, which this "
                "version does not read; move it away to train from the start"
            )
        workdir_lib.write_config(config, workdir)
        checkpoints = Checkpoints(workdir / workdir_lib.CHECKPOINTS, 2, accept_unverified)
        try:
            summary = _train(config, workdir, checkpoints, progress)
        finally:
            checkpoints.close()
    workdir_lib.write_summary(workdir, summary)
    return summary


def _train(config: ConfigDict, workdir: Path, checkpoints: Checkpoints, progress) -> dict:
    task = task_of(config)
    splits = task.load(config.data)  # TaskDataError names the path and what to give
    trainer = Trainer(config)
    state = trainer.init(config.train.seed, splits.train.inputs)
    epoch = 0
    best, best_epoch = math.nan, 0  # NaN: no epoch has a finite validation metric yet
    restored = checkpoints.restore_latest(restore_target(state))
    if restored is not None:
        epoch, state, meta = restored
        best, best_epoch = float(meta["best_value"]), int(meta["best_epoch"])
    # A kill between the two writes of an epoch leaves a metrics row ahead of the checkpoint:
    # dropped here, and computed again.
    history = [
        r for r in workdir_lib.read_log(workdir / workdir_lib.METRICS) if r["epoch"] <= epoch
    ]

    batches = max(1, len(splits.train) // config.train.batch_size)
    with tqdm(
        total=config.train.epochs * batches,
        initial=epoch * batches,
        desc=f"{config.name or task.name} epoch {epoch}/{config.train.epochs}",
        unit="batch",
        disable=progress is False or (progress is None and not sys.stderr.isatty()),
        leave=False,
    ) as bar:
        while epoch < config.train.epochs:
            started = time.perf_counter()
            train_loss = trainer.epoch(state, splits.train, config.train.seed, epoch, bar)
            value = trainer.evaluate(state["params"], splits.val)
            if not math.isfinite(train_loss):
                raise TrainingDiverged(
                    f"{config.name}: the training loss is {train_loss} at epoch "
                    f"{epoch + 1}; lower train.learning_rate"
                )
            epoch += 1
            if better(task, value, best):
                best, best_epoch, state["best_params"] = value, epoch, state["params"]
            history.append(
                {
                    "epoch": epoch,
                    "train_loss": train_loss,
                    f"val_{task.metric}": value,
                    "seconds": time.perf_counter() - started,
                }
            )
            # Metrics first: see above.
            lines = "".join(json.dumps(row) + "\n" for row in history)
            atomic_write_bytes(workdir / workdir_lib.METRICS, lines.encode())
            checkpoints.save(epoch, state, {"best_value": best, "best_epoch": best_epoch})
            checkpoints.wait()
            bar.set_description(f"{config.name or task.name} epoch {epoch}/{config.train.epochs}")
            bar.set_postfix(loss=f"{train_loss:.4g}", **{f"val_{task.metric}": f"{value:.4g}"})

    return {
        "name": config.name,
        "status": "finished",
        "task": task.name,
        "kind": config.model.kind,
        "params": tree_params(state["params"]),
        "metric": task.metric,
        f"test_{task.metric}": trainer.evaluate(state["best_params"], splits.test),
        f"val_{task.metric}": best,
        f"last_val_{task.metric}": history[-1][f"val_{task.metric}"],
        "best_epoch": best_epoch,
        "epochs": config.train.epochs,
        "train_seconds": sum(row["seconds"] for row in history),
        "data": splits.source,
        "paper": task.paper,
        "provenance": workdir_lib.provenance(),
    }
