"""A training run: check everything, restore or initialise, train, evaluate, summarise.

``run(config, workdir)`` is the whole job. Before anything is compiled it checks the config,
finds (or, for an embedded corpus, prepares) the dataset, checks the dataset against the model
and the batch sizes against the mesh, and checks that a workdir with checkpoints holds a run of
the same config. A workdir with a checkpoint resumes from the latest one; since batches are a
function of (seed, step) and the checkpoint holds the rest, the resumed run computes the same
numbers as an uninterrupted one.

Workdir:
  config.json     the resolved config
  checkpoints/    orbax, the last ``checkpoint.keep`` steps
  metrics.jsonl   one line per logged step (train loss, lr, grad norm, tokens, tokens/s, MFU)
  eval.jsonl      one line per validation (val loss, plateau scale)
  tensorboard/    the same scalars as event files
  summary.json    at the end: final val/test loss, per-position loss, bits per byte, sizes

SIGTERM, SIGUSR1 or SIGUSR2 (a scheduler's notice of preemption or time limit) makes a
single-process run write a checkpoint at the end of the current step and raise
``TrainingInterrupted``, so a requeued run loses nothing. Schedulers often send more than one
of them at once, so further signals change nothing; SIGKILL stops a run at once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
from ml_collections import ConfigDict
from tqdm import tqdm

from lmuscale.data import DataError, TrainBatches, eval_batches, open_dataset
from lmuscale.data.format import META
from lmuscale.files import atomic_write_json
from lmuscale.models import build, count_params, flops_per_token
from lmuscale.train import config as config_lib
from lmuscale.train import optim
from lmuscale.train import step as step_lib
from lmuscale.train.checkpoint import Checkpoints
from lmuscale.train.metrics import MetricsLog, device_peak, mfu

EMBEDDED_SOURCES = ("shakespeare",)
SUMMARY = "summary.json"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class TrainingDiverged(RuntimeError):
    """The loss or the parameters became NaN or infinite."""


class TrainingInterrupted(RuntimeError):
    """A stop signal arrived; the run saved a checkpoint and can be resumed."""


class _StopSignals:
    """Turns the first stop signal into a flag the loop reads between steps."""

    def __init__(self):
        self.received = None
        self.previous = {}

    def __enter__(self):
        # Signals reach only the main thread, and in a multi-process run every process would
        # have to agree on the step to stop at: there the default handling stays.
        if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = self.received or signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self.previous = {}


def initialize_distributed(section) -> None:
    """``jax.distributed.initialize`` for multi-host runs (arguments left out are detected
    from the cluster environment: SLURM, Open MPI, TPU pods)."""
    if not section.initialize:
        return
    kwargs = {}
    if section.coordinator_address:
        kwargs["coordinator_address"] = section.coordinator_address
    if section.num_processes > 0:
        kwargs["num_processes"] = section.num_processes
    if section.process_id >= 0:
        kwargs["process_id"] = section.process_id
    jax.distributed.initialize(**kwargs)


def open_data(c: ConfigDict, primary: bool, progress: bool):
    """The prepared dataset of ``data.path``; an embedded ``data.source`` is prepared first."""
    if not c.data.path:
        raise config_lib.ConfigError(
            "data.path is empty: set --config.data.path=DIR, a folder made by "
            "'python -m lmuscale.data prepare'"
        )
    path = Path(c.data.path)
    if not (path / META).exists():
        if c.data.source in EMBEDDED_SOURCES:
            if primary:
                from lmuscale.data.prepare import prepare

                prepare(c.data.source, [], out=path, tokenizer=c.data.tokenizer, progress=progress)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("lmuscale-prepare")
        elif not path.exists():
            source = c.data.source or "SOURCE"
            raise config_lib.ConfigError(
                f"data.path: no dataset at {path}; prepare one with 'python -m lmuscale.data "
                f"prepare {source} INPUTS --tokenizer {c.data.tokenizer} --out {path}'"
            )
    try:
        return open_dataset(path, verify=c.data.verify and primary)
    except DataError as error:
        raise config_lib.ConfigError(f"data.path: {error}") from None


def check_dataset(c: ConfigDict, model_config, dataset) -> None:
    where = dataset.folder / META
    if dataset.tokenizer != c.data.tokenizer:
        raise config_lib.ConfigError(
            f"{where}: the dataset was tokenised with {dataset.tokenizer!r} but "
            f"data.tokenizer is {c.data.tokenizer!r}"
        )
    if dataset.vocab_size != model_config.vocab_size:
        raise config_lib.ConfigError(
            f"{where}: the dataset's vocabulary has {dataset.vocab_size} ids "
            f"({dataset.tokenizer}) but model.vocab_size is {model_config.vocab_size}"
        )
    try:
        for split in ("train", "val", "test"):
            dataset.windows(split, c.data.seq_len)
    except DataError as error:
        raise config_lib.ConfigError(f"data: {error}") from None


def check_batches(c: ConfigDict, mesh) -> None:
    data_axis = step_lib.data_parallel_size(mesh)
    per_micro = c.train.global_batch // c.train.microbatches
    if per_micro % data_axis:
        raise config_lib.ConfigError(
            f"train.global_batch / train.microbatches = {per_micro} sequences must be a "
            f"multiple of the mesh's data axis ({data_axis} devices)"
        )
    if c.eval.global_batch % data_axis:
        raise config_lib.ConfigError(
            f"eval.global_batch ({c.eval.global_batch}) must be a multiple of the mesh's data "
            f"axis ({data_axis} devices)"
        )


def _has_checkpoint(workdir: Path) -> bool:
    folder = workdir / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def check_workdir(c: ConfigDict, workdir: Path) -> None:
    """A workdir with checkpoints resumes only the same run (log settings may change)."""
    saved = workdir / "config.json"
    if not (saved.exists() and _has_checkpoint(workdir)):
        return
    try:
        old = json.loads(saved.read_text())
    except ValueError as error:
        raise config_lib.ConfigError(f"{saved}: not JSON ({error})") from None
    changed = config_lib.differences(old, c)
    if changed:
        old_flat, new_flat = config_lib.saved_flat(old), config_lib.flatten(c)
        listed = "; ".join(f"{k}: {old_flat.get(k)!r} -> {new_flat.get(k)!r}" for k in changed)
        raise config_lib.ConfigError(
            f"{workdir} holds checkpoints of a run with another config ({listed}); use a new "
            "--workdir, or the saved config"
        )


@dataclasses.dataclass
class Evaluation:
    loss: float  # nats per token
    per_position: list[float]  # nats at each position 0..seq_len-1
    tokens: int


def run(config: ConfigDict, workdir: str | Path, *, progress: bool | None = None) -> dict:
    """Train (or resume) ``config`` in ``workdir``; returns the summary (also summary.json).

    Raises ``ConfigError`` before compiling anything when the config, the dataset or the
    workdir is wrong, and ``TrainingDiverged`` when the loss becomes NaN or infinite.
    """
    c = config
    config_lib.check(c)
    initialize_distributed(c.distributed)
    workdir = Path(workdir)
    primary = jax.process_index() == 0
    show = c.log.progress if progress is None else progress
    model_config = config_lib.model_config(c.model)
    check_workdir(c, workdir)
    dataset = open_data(c, primary, show)
    check_dataset(c, model_config, dataset)
    mesh = step_lib.make_mesh(c.mesh.model)
    check_batches(c, mesh)
    if primary:
        workdir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(workdir / "config.json", c.to_dict())
    trainer = _Trainer(c, workdir, model_config, dataset, mesh, primary, show)
    try:
        with _StopSignals() as stop:
            return trainer.train(stop)
    finally:
        trainer.close()


class _Trainer:
    def __init__(self, c, workdir, model_config, dataset, mesh, primary, show):
        self.c, self.workdir, self.dataset, self.mesh = c, workdir, dataset, mesh
        self.primary, self.show = primary, show
        self.model_config = model_config
        self.model = build(model_config)
        self.seq_len = c.data.seq_len
        self.tokens_per_step = c.train.global_batch * self.seq_len
        self.tx, self.lr = optim.optimizer(c.optim, c.train.steps)
        self.plateau = optim.plateau(c.optim)
        init = step_lib.init_fn(self.model, self.tx, self.plateau, c.train.seed, self.seq_len)
        self.abstract = jax.eval_shape(init)
        self.shardings = step_lib.state_shardings(mesh, self.abstract)
        self.checkpoints = Checkpoints(workdir / "checkpoints", c.checkpoint.keep)
        latest = self.checkpoints.latest_step()
        if latest is None:
            self.state, self.meta = step_lib.init_state(init, mesh), {"elapsed": 0.0}
        else:
            target = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                self.abstract,
                self.shardings,
            )
            self.state, self.meta = self.checkpoints.restore(latest, target)
        self.start = int(jax.device_get(self.state["step"]))
        self.log = MetricsLog(
            workdir, self.start, enabled=primary, tensorboard=c.log.tensorboard and primary
        )
        self.train_step = step_lib.make_train_step(
            self.model, self.tx, self.lr, mesh, self.abstract
        )
        self.eval_step = step_lib.make_eval_step(self.model, mesh, self.abstract["params"])
        self.flops = flops_per_token(model_config, self.seq_len)
        self.peak = device_peak(model_config.dtype, c.peak_flops)
        self.devices = mesh.devices.size
        self.last_checkpoint = latest

    # -- the loop ---------------------------------------------------------------------------

    def train(self, stop: _StopSignals | None = None) -> dict:
        c = self.c
        summary_path = self.workdir / SUMMARY
        if self.start == c.train.steps and summary_path.exists():
            summary = json.loads(summary_path.read_text())
            if summary.get("status") == "finished":
                return summary
        batches = TrainBatches(
            self.dataset, seq_len=self.seq_len, global_batch=c.train.global_batch, seed=c.train.seed
        )
        batch_sharding = step_lib.batch_sharding(self.mesh, 3, axis=1)
        self.t0 = time.perf_counter()
        pending, losses_since_log = [], []
        mark = None  # (time, step) from which tokens/s is measured; set after compilation
        bar = tqdm(
            total=c.train.steps,
            initial=self.start,
            disable=not (self.show and self.primary),
            unit="step",
            dynamic_ncols=True,
        )
        try:
            for step in range(self.start, c.train.steps):
                rows = batches(step).reshape(c.train.microbatches, -1, self.seq_len + 1)
                tokens = step_lib.to_global(rows, batch_sharding)
                self.state, metrics = self.train_step(self.state, tokens)
                pending.append((step + 1, metrics))
                bar.update(1)
                done = step + 1
                last = done == c.train.steps
                is_log = done % c.log.every == 0 or last
                is_eval = done % c.eval.every == 0 or last
                is_checkpoint = done % c.checkpoint.every == 0 or last
                if mark is None or is_log or is_eval or is_checkpoint:
                    fetched = self._check(pending)
                    pending = []
                    losses_since_log += [m["loss"] for _, m in fetched]
                    if mark is None:
                        mark = (time.perf_counter(), done)
                    if is_log:
                        record = self._train_record(done, fetched[-1][1], losses_since_log, mark)
                        mark = (time.perf_counter(), done)
                        losses_since_log = []
                        self.log.write("train", record)
                        bar.set_postfix(
                            loss=f"{record['loss']:.4f}",
                            tok_s=f"{record['tokens_per_second'] or 0:,.0f}",
                        )
                if is_eval:
                    self._validate(done, bar)
                    mark = (time.perf_counter(), done)
                if is_checkpoint:
                    self.checkpoints.save(done, self.state, {"elapsed": self._elapsed()})
                    self.last_checkpoint = done
                    mark = (time.perf_counter(), done)
                if stop is not None and stop.received and not last:
                    self._interrupt(done, pending, stop.received)
        finally:
            bar.close()
        self.checkpoints.wait()
        return self._finish()

    def _interrupt(self, done: int, pending: list, name: str) -> None:
        self._check(pending)
        if self.last_checkpoint != done:
            self.checkpoints.save(done, self.state, {"elapsed": self._elapsed()})
        self.checkpoints.wait()
        raise TrainingInterrupted(
            f"{name} received: stopped after step {done} of {self.c.train.steps} with a "
            f"checkpoint in {self.workdir / 'checkpoints'}; run again to resume"
        )

    def _check(self, pending) -> list:
        """Fetch pending step metrics; stop at the first step with a non-finite loss."""
        fetched = [(s, jax.device_get(m)) for s, m in pending]
        for s, m in fetched:
            if not m["finite"]:
                self.checkpoints.wait()
                where = self.workdir / "checkpoints"
                kept = (
                    f"the last good checkpoint is step {self.last_checkpoint} in {where}"
                    if self.last_checkpoint is not None
                    else "no checkpoint was written before it"
                )
                message = (
                    f"training diverged at step {s}: loss {float(m['loss'])}, parameter norm "
                    f"{float(m['param_norm'])} (NaN or infinity); {kept}. Try a lower "
                    "optim.learning_rate, optim.grad_clip > 0 or model.dtype=float32"
                )
                if self.primary:
                    atomic_write_json(
                        self.workdir / SUMMARY,
                        {**self._sizes(), "status": "diverged", "error": message, "step": s},
                    )
                raise TrainingDiverged(message)
        return [(s, {k: float(v) for k, v in m.items()}) for s, m in fetched]

    def _elapsed(self) -> float:
        return self.meta["elapsed"] + time.perf_counter() - self.t0

    def _train_record(self, done, metrics, losses, mark) -> dict:
        seconds = time.perf_counter() - mark[0]
        steps = done - mark[1]
        speed = steps * self.tokens_per_step / seconds if steps and seconds > 0 else None
        return {
            "step": done,
            "loss": metrics["loss"],
            "loss_mean": float(np.mean(losses)),
            "lr": metrics["lr"],
            "grad_norm": metrics["grad_norm"],
            "param_norm": metrics["param_norm"],
            "tokens": done * self.tokens_per_step,
            "tokens_per_second": speed,
            "mfu": mfu(speed, self.flops.train, self.devices, self.peak) if speed else None,
            "elapsed": self._elapsed(),
        }

    def _validate(self, done: int, bar) -> None:
        result = self.evaluate("val", self.c.eval.batches)
        plateau = optim.plateau_update_jit(self.plateau, self.state["plateau"], result.loss)
        self.state["plateau"] = jax.device_put(plateau, self.shardings["plateau"])
        scale = float(jax.device_get(plateau.scale))
        self.log.write(
            "eval",
            {
                "step": done,
                "val_loss": result.loss,
                "val_tokens": result.tokens,
                "lr_scale": scale,
                "elapsed": self._elapsed(),
            },
        )
        if self.show and self.primary:
            bar.write(f"step {done}: val loss {result.loss:.4f} nats (lr scale {scale:g})")

    def evaluate(self, split: str, max_batches: int) -> Evaluation:
        """Mean loss over the split's windows in order (the first ``max_batches`` batches,
        or all with 0), and the mean loss at each position."""
        tokens_sharding = step_lib.batch_sharding(self.mesh, 2)
        valid_sharding = step_lib.batch_sharding(self.mesh, 1)
        outputs = []
        batches = eval_batches(
            self.dataset,
            split,
            seq_len=self.seq_len,
            global_batch=self.c.eval.global_batch,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            outputs.append(
                self.eval_step(
                    self.state["params"],
                    step_lib.to_global(batch.tokens, tokens_sharding),
                    step_lib.to_global(batch.valid, valid_sharding),
                )
            )
        total, per_position, rows = 0.0, np.zeros(self.seq_len), 0.0
        for out in jax.device_get(outputs):
            total += float(out["sum"])
            per_position += np.asarray(out["per_position"], np.float64)
            rows += float(out["rows"])
        return Evaluation(
            loss=total / (rows * self.seq_len),
            per_position=(per_position / rows).tolist(),
            tokens=int(rows) * self.seq_len,
        )

    def _sizes(self) -> dict:
        params = count_params(self.model_config)
        return {
            "name": self.c.name,
            "family": self.model_config.family,
            "params": {
                "non_embedding": params.non_embedding,
                "embedding": params.embedding,
                "total": params.total,
            },
            "flops_per_token": {"forward": self.flops.forward, "train": self.flops.train},
            "seq_len": self.seq_len,
            "global_batch": self.c.train.global_batch,
        }

    def _finish(self) -> dict:
        summary = {**self._sizes(), "status": "finished", "steps": self.c.train.steps}
        summary["tokens"] = self.c.train.steps * self.tokens_per_step
        for split in ("val", "test"):
            result = self.evaluate(split, self.c.eval.final_batches)
            tokens_per_byte = 1.0 / self.dataset.bytes_per_token(split)
            summary[f"{split}_loss"] = result.loss
            summary[f"{split}_bits_per_byte"] = result.loss * tokens_per_byte / math.log(2)
            summary[f"{split}_tokens"] = result.tokens
            summary[f"{split}_per_position"] = result.per_position
        summary["lr_scale"] = float(jax.device_get(self.state["plateau"].scale))
        summary["wall_seconds"] = self._elapsed()
        if self.primary:
            atomic_write_json(self.workdir / SUMMARY, summary)
        return summary

    def close(self) -> None:
        self.checkpoints.wait()
        self.checkpoints.close()
        self.log.close()
