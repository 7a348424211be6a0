"""A training run: check everything, restore or initialise, train on a schedule, summarise.

``run(config, workdir)`` is the whole job. Before anything is compiled it checks the config,
checks the workdir (``train.workdir``: the same config, or a finished run whose summary it
returns), finds (or, for an embedded corpus, prepares) the dataset, and checks the dataset
against the model and the batch sizes against the mesh. Then ``restore_or_init`` gives the
state, the step loop runs its schedule of (when, action) pairs: log, evaluate, checkpoint,
stop on a signal; and ``finish`` evaluates the final model and writes the summary. A workdir
with a checkpoint resumes from the latest one; since batches are a function of (seed, step)
and the checkpoint holds the rest, the resumed run computes the same numbers as an
uninterrupted one.

Workdir:
  config.json     the resolved config
  plan.json       the micro-batch count and XLA's memory estimate of the train step
  checkpoints/    orbax, the last ``checkpoint.keep`` steps
  metrics.jsonl   one line per logged step (train loss, lr, grad norm, tokens, tokens/s, MFU)
  eval.jsonl      one line per validation (val loss, plateau scale)
  tensorboard/    the same scalars as event files
  summary.json    at the end: final val/test loss, per-position loss, bits per byte, sizes
  wandb.json      with log.wandb: the W&B run's id, so that a resumed run continues it
  wandb/          with log.wandb: W&B's own files, offline runs included (unless WANDB_DIR is set)

SIGTERM, SIGUSR1 or SIGUSR2 (a scheduler's notice of preemption or time limit) makes a run
write a checkpoint at the end of the current step and raise ``TrainingInterrupted``, so a
requeued run loses nothing. Schedulers often send more than one of them at once, so further
signals change nothing; SIGKILL stops a run at once.

Several processes (``distributed.initialize``; one per host, or several on one machine): each
reads only its rows of every batch, process 0 alone writes the workdir's files (orbax saves
checkpoints from all of them), and a stop signal sent to any one process stops every process
after the same step. Each step exchanges the processes' signal flags in a tiny all-reduce, read
one step later so that the host never waits for the step it has just dispatched: a signal
received during step s stops all processes after step s + 1 (or s + 2). When a collective
fails because another process died, the run raises ``LostProcess``; the command line then exits
at once instead of waiting for the coordinator's heartbeat timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import ConfigDict
from tqdm import tqdm

from lmuscale.data import (
    EMBEDDED_SOURCES,
    DataError,
    TrainBatches,
    eval_batches,
    open_dataset,
    prepare_embedded,
)
from lmuscale.data.format import META
from lmuscale.files import atomic_write_json
from lmuscale.models import build, count_params, flops_per_token
from lmuscale.outcomes import LostProcess, TrainingInterrupted
from lmuscale.train import config as config_lib
from lmuscale.train import memory, optim, wandb_log
from lmuscale.train import step as step_lib
from lmuscale.train import workdir as workdir_lib
from lmuscale.train.checkpoint import Checkpoints, CorruptCheckpoint
from lmuscale.train.metrics import MetricsLog, device_peak, mfu
from lmuscale.train.profile import StepTrace
from lmuscale.train.workdir import TrainingDiverged

# A scheduler's notices of preemption or time limit, and Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class _StopSignals:
    """Turns the first stop signal into a flag the loop reads between steps."""

    def __init__(self):
        self.received = None  # the signal's number
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals reach only it
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = self.received or signum

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self.previous = {}


class _StopAgreement:
    """Every process's stop flag (a signal's number, 0 for none), combined across processes
    by a max all-reduce launched each step and read at the next one, so that all of them see
    the same value after the same step without the host waiting on the step just dispatched."""

    def __init__(self, mesh):
        self.sharding = NamedSharding(mesh, PartitionSpec(step_lib.AXES))
        self.local_devices = len(self.sharding.addressable_devices)
        self.combine = jax.jit(lambda flags: flags.max(), out_shardings=step_lib.replicated(mesh))
        self.launched = None

    def __call__(self, local: int) -> int:
        """Launch the exchange of ``local``; the value of the exchange launched last call."""
        flags = np.full(self.local_devices, local, np.int32)
        launched = self.combine(jax.make_array_from_process_local_data(self.sharding, flags))
        previous, self.launched = self.launched, launched
        return 0 if previous is None else int(jax.device_get(previous))


def initialize_distributed(section) -> None:
    """``jax.distributed.initialize`` for multi-host runs (arguments left out are detected
    from the cluster environment: SLURM, Open MPI, TPU pods). ``heartbeat_timeout``: seconds
    after which the coordinator declares a silent process dead and ends the others."""
    if not section.initialize:
        return
    kwargs = {"heartbeat_timeout_seconds": section.heartbeat_timeout}
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
    if c.data.source in EMBEDDED_SOURCES:
        if primary:
            prepare_embedded(path, c.data.source, c.data.tokenizer, progress)
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
    if c.train.microbatches == 0 and c.train.global_batch % data_axis:
        raise config_lib.ConfigError(
            f"train.global_batch ({c.train.global_batch}) must be a multiple of the mesh's "
            f"data axis ({data_axis} devices)"
        )
    per_micro = c.train.global_batch // max(1, c.train.microbatches)
    if c.train.microbatches and per_micro % data_axis:
        raise config_lib.ConfigError(
            f"train.global_batch / train.microbatches = {per_micro} sequences must be a "
            f"multiple of the mesh's data axis ({data_axis} devices)"
        )
    if c.eval.global_batch % data_axis:
        raise config_lib.ConfigError(
            f"eval.global_batch ({c.eval.global_batch}) must be a multiple of the mesh's data "
            f"axis ({data_axis} devices)"
        )


def check_workdir(c: ConfigDict, workdir: Path) -> None:
    """A workdir with a checkpoint or a summary resumes only the same run."""
    workdir_lib.check(c, workdir, workdir_lib.has_checkpoint(workdir))


@dataclasses.dataclass
class Evaluation:
    loss: float  # nats per token
    per_position: list[float]  # nats at each position 0..seq_len-1
    tokens: int


def run(
    config: ConfigDict, workdir: str | Path, *, progress: bool | None = None, locked: bool = False
) -> dict:
    """Train (or resume) ``config`` in ``workdir``; returns the summary (also summary.json).

    The workdir is locked for the run (``workdir.Lock``; ``locked``: the caller holds the lock
    already), so a second process on it stops at once with ``workdir.WorkdirBusy``.

    Raises ``ConfigError`` before compiling anything when the config, the dataset or the
    workdir is wrong; ``memory.OutOfMemoryBudget`` (a ``ConfigError``) when, compiled, no
    micro-batch count fits the memory budget, before any step; ``metrics.DamagedLog`` (a
    ``ConfigError``) when a resumed run's metrics.jsonl or eval.jsonl has a bad line before its
    last or steps out of order, before any step; and ``TrainingDiverged`` when the loss becomes
    NaN or infinite.
    """
    c = config
    config_lib.check(c)
    initialize_distributed(c.distributed)
    workdir = Path(workdir)
    primary = jax.process_index() == 0
    show = (c.log.progress if progress is None else progress) and primary
    model_config = config_lib.model_config(c.model)
    check_workdir(c, workdir)
    summary = workdir_lib.finished(workdir)
    if summary is not None:
        return summary
    config_lib.loss_implementation(model_config)  # "pallas" where it cannot run: refused now
    if primary:
        wandb_log.require(c)
    dataset = open_data(c, primary, show)
    check_dataset(c, model_config, dataset)
    mesh = step_lib.make_mesh(c.mesh.model)
    check_batches(c, mesh)
    with contextlib.ExitStack() as hold:
        if primary and not locked:
            hold.enter_context(workdir_lib.Lock(workdir_lib.usable(workdir)))
            check_workdir(c, workdir)  # again, now that no other process can change it
        return _train(c, workdir, model_config, dataset, mesh, primary, show)


def _train(c, workdir: Path, model_config, dataset, mesh, primary: bool, show: bool) -> dict:
    if primary:
        workdir_lib.write_config(c, workdir)
    session = Session(c, workdir, model_config, dataset, mesh, primary)
    try:
        # The final evaluation too: a signal during it is noted, and the run still finishes.
        with _StopSignals() as stop:
            session.train(stop, show)
            return session.finish()
    except jax.errors.JaxRuntimeError as error:
        if jax.process_count() == 1:
            raise
        session.lost = True  # orbax's threads would wait for the lost process: leave them
        raise LostProcess(
            f"process {jax.process_index()} of {jax.process_count()} lost contact with the "
            f"others ({str(error).splitlines()[0][:300]}): another process has died or hangs. "
            f"The checkpoints in {workdir / workdir_lib.CHECKPOINTS} are kept: start all "
            f"{jax.process_count()} processes again to resume"
        ) from None
    finally:
        session.close()


def restore_or_init(
    init, mesh, shardings, checkpoints: Checkpoints
) -> tuple[dict, float, int | None]:
    """``(state, elapsed seconds, step)`` of the latest intact checkpoint, each array placed
    with its sharding (a tree like the state's); the initial state, 0 and None when there is
    none. A checkpoint that cannot be read or fails its checksums is set aside, and said so."""
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        jax.eval_shape(init),
        shardings,
    )
    for step in reversed(checkpoints.all_steps()):
        try:
            state, meta = checkpoints.restore(step, target)
        except CorruptCheckpoint as error:
            if jax.process_index() == 0:
                aside = checkpoints.set_aside(step)
                print(f"checkpoint: {error}; moved to {aside}", file=sys.stderr, flush=True)
            continue
        return state, meta["elapsed"], step
    return step_lib.init_state(init, mesh, shardings), 0.0, None


class Clock:
    """The run's wall-clock seconds across sessions, and the training speed since the last
    ``restart`` (the loop restarts it after compiling and after any periodic action, so
    evaluations and checkpoints do not count as training time)."""

    def __init__(self, elapsed_before: float):
        self.before, self.t0 = elapsed_before, time.perf_counter()
        self.since = None  # (time, step)

    def elapsed(self) -> float:
        return self.before + time.perf_counter() - self.t0

    def restart(self, step: int) -> None:
        self.since = (time.perf_counter(), step)

    def steps_per_second(self, step: int) -> float | None:
        if self.since is None:
            return None
        seconds, steps = time.perf_counter() - self.since[0], step - self.since[1]
        return steps / seconds if steps and seconds > 0 else None


def first_nonfinite(fetched: list[tuple[int, dict]]) -> tuple[int, dict] | None:
    """The first ``(step, metrics)`` whose loss or parameters are not finite."""
    return next(((step, m) for step, m in fetched if not m["finite"]), None)


class Session:
    """One process's part of a run, from the restored (or initial) state to the summary."""

    def __init__(self, c, workdir, model_config, dataset, mesh, primary):
        self.c, self.workdir, self.dataset, self.mesh = c, workdir, dataset, mesh
        self.primary, self.model_config = primary, model_config
        self.loss_impl = config_lib.loss_implementation(model_config)
        model = build(model_config)
        self.seq_len = c.data.seq_len
        self.tokens_per_step = c.train.global_batch * self.seq_len
        tx, lr = optim.optimizer(c.optim, c.train.steps)
        self.plateau = optim.plateau(c.optim)
        init = step_lib.init_fn(model, tx, self.plateau, c.train.seed, self.seq_len)
        abstract = jax.eval_shape(init)
        shardings = step_lib.state_shardings(mesh, abstract)
        self.plateau_sharding = shardings["plateau"]
        # Planned (and compiled) before a checkpoint is restored or a log opened: a budget
        # that nothing fits stops the run here, having written only config.json.
        self.plan, self.train_step = self.compile_train_step(
            step_lib.make_train_step(model, tx, lr, mesh, abstract), abstract
        )
        self.checkpoints = Checkpoints(workdir / workdir_lib.CHECKPOINTS, c.checkpoint.keep)
        try:
            self.state, self.elapsed_before, self.last_checkpoint = restore_or_init(
                init, mesh, shardings, self.checkpoints
            )
            self.start = int(jax.device_get(self.state["step"]))
            self.log = MetricsLog(
                workdir,
                self.start,
                enabled=primary,
                tensorboard=c.log.tensorboard and primary,
                wandb=c if c.log.wandb else None,
            )
        except BaseException:  # a damaged log, say: no orbax thread may outlive the error
            self.checkpoints.close()
            raise
        self.eval_step = step_lib.make_eval_step(model, mesh, abstract["params"])
        self.flops = flops_per_token(model_config, self.seq_len)
        self.peak = device_peak(model_config.dtype, c.peak_flops)
        self.pending = []  # (step, metrics on the device) not yet fetched
        self.losses = []  # training losses fetched since the last log line
        self.latest = None  # the last fetched step's metrics
        self.lost = False  # another process died: close() must not wait for it

    def compile_train_step(self, train_step, abstract_state):
        """The micro-batch plan (``train.memory``) and the train step compiled for it."""
        plan, compiled = memory.plan_train_step(
            train_step, abstract_state, self.c, self.mesh, self.workdir
        )
        if self.primary:
            memory.write(self.workdir, plan)
            print(
                f"train step: {memory.describe(plan)}; cross-entropy: {self.loss_impl}",
                flush=True,
            )
        return plan, compiled

    def train(self, stop: _StopSignals, show: bool) -> None:
        """The step loop: after each step, the actions of the schedule that are due."""
        c, last = self.c, self.c.train.steps
        self.clock = Clock(self.elapsed_before)

        def every(period: int):
            return lambda step: step % period == 0 or step == last

        self.bar = tqdm(
            total=last, initial=self.start, disable=not show, unit="step", dynamic_ncols=True
        )
        schedule = [
            (lambda step: step == self.start + 1, lambda _: self.fetch()),  # clock starts
            (every(c.log.every), self.log_step),
            (every(c.eval.every), self.validate),
            (every(c.checkpoint.every), self.checkpoint),
            (
                lambda step: step < last and stopping(),
                lambda done: self.stop(done, stopping(), stop.received),
            ),
        ]
        agree = _StopAgreement(self.mesh) if jax.process_count() > 1 else None
        agreed = 0  # with several processes: the stop signal's number once all have seen it

        def stopping() -> int:
            return agreed if agree else stop.received or 0

        batches = TrainBatches(
            self.dataset, seq_len=self.seq_len, global_batch=c.train.global_batch, seed=c.train.seed
        )
        sharding = step_lib.batch_sharding(self.mesh, 3, axis=1)
        trace = StepTrace(
            self.workdir, c.log.profile_start, c.log.profile_steps, self.start, last, self.primary
        )
        with self.bar, contextlib.closing(trace):
            for step in range(self.start, last):
                rows = batches(step).reshape(self.plan.microbatches, -1, self.seq_len + 1)
                tokens = step_lib.to_global(rows, sharding)
                trace.before(step + 1, self.state)
                with trace.annotate(step + 1):
                    self.state, metrics = self.train_step(self.state, tokens)
                trace.after(step + 1, metrics)
                self.pending.append((step + 1, metrics))
                self.bar.update(1)
                if agree:
                    agreed = agree(stop.received or 0)
                ran = False
                for when, action in schedule:  # in order: a signal during one is seen after it
                    if when(step + 1):
                        action(step + 1)
                        ran = True
                if ran:
                    self.clock.restart(step + 1)
        self.checkpoints.wait()

    # -- the actions: each is called with the number of steps done (the bar is train()'s) ----

    def fetch(self) -> None:
        """Wait for the pending steps; a non-finite one ends the run (``diverged``)."""
        fetched = [(s, jax.device_get(m)) for s, m in self.pending]
        self.pending = []
        bad = first_nonfinite(fetched)
        if bad is not None:
            self.diverged(*bad)
        for _, metrics in fetched:
            self.latest = {k: float(v) for k, v in metrics.items()}
            self.losses.append(self.latest["loss"])

    def log_step(self, done: int) -> None:
        self.fetch()
        m = self.latest
        steps_per_second = self.clock.steps_per_second(done)
        speed = steps_per_second * self.tokens_per_step if steps_per_second else None
        record = {
            "step": done,
            "loss": m["loss"],
            "loss_mean": float(np.mean(self.losses)),
            "lr": m["lr"],
            "grad_norm": m["grad_norm"],
            "param_norm": m["param_norm"],
            "tokens": done * self.tokens_per_step,
            "tokens_per_second": speed,
            "mfu": mfu(speed, self.flops.train, self.mesh.devices.size, self.peak)
            if speed
            else None,
            "elapsed": self.clock.elapsed(),
        }
        self.losses = []
        self.log.write("train", record)
        self.checkpoints.check()  # a save that failed in the background is named here
        self.bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{speed or 0:,.0f}")

    def validate(self, done: int) -> None:
        self.fetch()
        result = self.evaluate("val", self.c.eval.batches)
        plateau = optim.plateau_update_jit(self.plateau, self.state["plateau"], result.loss)
        self.state["plateau"] = jax.device_put(plateau, self.plateau_sharding)
        scale = float(jax.device_get(plateau.scale))
        record = {"step": done, "val_loss": result.loss, "val_tokens": result.tokens}
        self.log.write("eval", {**record, "lr_scale": scale, "elapsed": self.clock.elapsed()})
        if not self.bar.disable:
            self.bar.write(f"step {done}: val loss {result.loss:.4f} nats (lr scale {scale:g})")

    def checkpoint(self, done: int) -> None:
        self.fetch()  # never a checkpoint of a step not known to be finite
        if self.last_checkpoint != done:
            self.checkpoints.save(done, self.state, {"elapsed": self.clock.elapsed()})
            self.last_checkpoint = done

    def stop(self, done: int, signum: int, received: int | None) -> None:
        """Checkpoint and raise ``TrainingInterrupted`` for signal ``signum`` (``received``:
        the one this process received, if any; in a multi-process run, another's may stop it)."""
        self.checkpoint(done)
        self.checkpoints.wait()
        name = signal.Signals(signum).name
        by = ""
        if jax.process_count() > 1:
            by = " by this process" if received == signum else " by another process"
        raise TrainingInterrupted(
            f"{name} received{by}: stopped after step {done} of {self.c.train.steps} with a "
            f"checkpoint in {self.workdir / workdir_lib.CHECKPOINTS}; run again to resume",
            name,
        )

    # -- evaluation and the end of the run ---------------------------------------------------

    def diverged(self, step: int, metrics: dict) -> None:
        """Write the diverged summary and raise ``TrainingDiverged``; or, right after a
        restore, name the restored checkpoint as suspect and write no summary (so that a
        sweep tries the trial again)."""
        self.checkpoints.wait()
        where = self.workdir / workdir_lib.CHECKPOINTS
        if self.start > 0 and step <= self.start + max(1, self.c.log.every):
            raise TrainingDiverged(
                f"training diverged at step {step}, {step - self.start} step(s) after resuming "
                f"from checkpoint {where / str(self.start)}: that checkpoint is suspect (damaged "
                f"files, or written by another version). Move it aside (e.g. into "
                f"{where}.corrupt/) and run again to resume from the one before it"
            )
        kept = (
            f"the last good checkpoint is step {self.last_checkpoint} in {where}"
            if self.last_checkpoint is not None
            else "no checkpoint was written before it"
        )
        message = (
            f"training diverged at step {step}: loss {float(metrics['loss'])}, parameter norm "
            f"{float(metrics['param_norm'])} (NaN or infinity); {kept}. Try a lower "
            "optim.learning_rate, optim.grad_clip > 0 or model.dtype=float32"
            + (" in a new --workdir" if self.last_checkpoint is not None else "")
        )
        if self.primary:
            summary = {**self.sizes(), "status": "diverged", "error": message, "step": step}
            atomic_write_json(self.workdir / workdir_lib.SUMMARY, summary)
            self.log.summary(summary)
        raise TrainingDiverged(message)

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

    def sizes(self) -> dict:
        params = count_params(self.model_config)
        return {
            "name": self.c.name,
            "family": self.model_config.family,
            "loss_impl": self.loss_impl,
            "params": {
                "non_embedding": params.non_embedding,
                "embedding": params.embedding,
                "total": params.total,
            },
            "flops_per_token": {"forward": self.flops.forward, "train": self.flops.train},
            "seq_len": self.seq_len,
            "global_batch": self.c.train.global_batch,
            "microbatches": self.plan.microbatches,
            "memory": self.plan.record(),
        }

    def finish(self) -> dict:
        """The final validation and test losses: the summary, written as summary.json."""
        summary = {**self.sizes(), "status": "finished", "steps": self.c.train.steps}
        summary["tokens"] = self.c.train.steps * self.tokens_per_step
        for split in ("val", "test"):
            result = self.evaluate(split, self.c.eval.final_batches)
            tokens_per_byte = 1.0 / self.dataset.bytes_per_token(split)
            summary[f"{split}_loss"] = result.loss
            summary[f"{split}_bits_per_byte"] = result.loss * tokens_per_byte / math.log(2)
            summary[f"{split}_tokens"] = result.tokens
            summary[f"{split}_per_position"] = result.per_position
        summary["lr_scale"] = float(jax.device_get(self.state["plateau"].scale))
        summary["wall_seconds"] = self.clock.elapsed()
        self.log.summary(summary)  # before summary.json: a W&B failure leaves the run to resume
        if self.primary:
            atomic_write_json(self.workdir / workdir_lib.SUMMARY, summary)
        return summary

    def close(self) -> None:
        try:
            if not self.lost:
                self.checkpoints.close()
        finally:
            self.log.close()
