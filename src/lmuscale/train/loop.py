"""A training run: check everything, restore or initialise, train on a schedule, summarise.

Batches are a function of (seed, step) and a checkpoint holds the rest, so a resumed run computes
the same numbers as an uninterrupted one. A stop signal (``STOP_SIGNALS``) checkpoints after the
current step and raises ``TrainingInterrupted``. With several processes, process 0 alone writes
the workdir's files (orbax saves from all), a signal to any one stops all after the same step
(``_StopAgreement``), and a collective that fails because another process died (a step's, or
one in a checkpoint's save) raises ``LostProcess`` at once instead of after the coordinator's
heartbeat timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import ConfigDict
from tqdm import tqdm

from lmuscale import ops, outcomes, resume
from lmuscale import workdir as workdir_lib
from lmuscale.data import (
    EMBEDDED_SOURCES,
    DataError,
    TrainBatches,
    eval_batches,
    open_dataset,
    prepare_embedded,
)
from lmuscale.data.format import META
from lmuscale.models import build, count_params, flops_per_token
from lmuscale.outcomes import ConfigError, LostProcess, TrainingDiverged, TrainingInterrupted
from lmuscale.train import branch as branch_lib
from lmuscale.train import config as config_lib
from lmuscale.train import memory, optim, wandb_log
from lmuscale.train import step as step_lib
from lmuscale.train.checkpoint import CheckpointError, Checkpoints, restore_target
from lmuscale.train.metrics import MetricsLog, StepMetrics, device_peak, mfu, progress_line
from lmuscale.train.profile import StepTrace

# A scheduler's notices of preemption or time limit, and Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
# The checkpoint meta's key for the training losses since the last log line (their mean is
# the next line's loss_mean): a run resumed between two log lines logs the same mean.
LOG_WINDOW = "log_window"
LOGGED = "logged"  # in a checkpoint's JSON: the step of each log's last line (MetricsLog.last)


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


class _StopAgreement:
    """The processes' stop flags (a signal's number, 0 for none), combined by a max
    all-reduce launched each step and read at the next, so the host never waits for it."""

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
    """``jax.distributed.initialize``; arguments left out come from the cluster (SLURM, ...)."""
    if section.initialize:
        jax.distributed.initialize(
            coordinator_address=section.coordinator_address or None,
            num_processes=section.num_processes or None,
            process_id=section.process_id if section.process_id >= 0 else None,
            heartbeat_timeout_seconds=section.heartbeat_timeout,
        )


def open_data(c: ConfigDict, model_config, primary: bool, progress: bool):
    """The prepared dataset of ``data.path``, checked against the config (its source and
    fingerprint; ``data.fingerprint`` is filled in when empty); with ``data.prepare``, the
    embedded ``data.source`` is prepared there first."""
    if not c.data.path:
        raise ConfigError(
            "data.path is empty: set --config.data.path=DIR, a folder made by "
            "'python -m lmuscale.data prepare'"
        )
    path = Path(c.data.path)
    if c.data.prepare:
        if c.data.source not in EMBEDDED_SOURCES:
            raise ConfigError(
                f"data.prepare is for the embedded sources ({', '.join(EMBEDDED_SOURCES)}), "
                f"not data.source = {c.data.source!r}; prepare it with 'python -m lmuscale.data "
                f"prepare' instead"
            )
        if primary:
            prepare_embedded(path, c.data.source, c.data.tokenizer, progress)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("lmuscale-prepare")
    elif not path.exists():
        embedded = c.data.source in EMBEDDED_SOURCES
        raise ConfigError(
            f"data.path: no dataset at {path}; "
            + (
                f"set --config.data.prepare=true to prepare the embedded {c.data.source} there"
                if embedded
                else "prepare one with 'python -m lmuscale.data prepare "
                f"{c.data.source or 'SOURCE'} INPUTS --tokenizer {c.data.tokenizer} --out {path}'"
            )
        )
    try:
        dataset = open_dataset(path, verify=c.data.verify and primary)
    except DataError as error:
        raise ConfigError(f"data.path: {error}") from None
    where = dataset.folder / META
    if c.data.source and dataset.source != c.data.source:
        raise ConfigError(
            f"{where}: the dataset was prepared from {dataset.source!r} but data.source is "
            f"{c.data.source!r}; give data.path of a {c.data.source} dataset, or set "
            f"data.source to {dataset.source!r}"
        )
    if c.data.fingerprint and dataset.fingerprint != c.data.fingerprint:
        raise ConfigError(
            f"{where}: the dataset's fingerprint is {dataset.fingerprint}, but data.fingerprint "
            f"pins {c.data.fingerprint}: this is other data than the config names"
        )
    c.data.fingerprint = dataset.fingerprint  # recorded in config.json and the summary
    if dataset.tokenizer != c.data.tokenizer:
        raise ConfigError(
            f"{where}: the dataset was tokenised with {dataset.tokenizer!r} but "
            f"data.tokenizer is {c.data.tokenizer!r}"
        )
    if dataset.vocab_size != model_config.vocab_size:
        raise ConfigError(
            f"{where}: the dataset's vocabulary has {dataset.vocab_size} ids "
            f"({dataset.tokenizer}) but model.vocab_size is {model_config.vocab_size}"
        )
    try:
        for split in ("train", "val", "test"):
            dataset.windows(split, c.data.seq_len)
    except DataError as error:
        raise ConfigError(f"data: {error}") from None
    return dataset


def check_batches(c: ConfigDict, mesh) -> None:
    """Each batch (a micro-batch, if given) splits evenly over the mesh's data axis."""
    data_axis = step_lib.data_parallel_size(mesh)
    train_batch = c.train.global_batch, f"train.global_batch ({c.train.global_batch})"
    if c.train.microbatches:
        per_micro = c.train.global_batch // c.train.microbatches
        train_batch = per_micro, f"train.global_batch / train.microbatches = {per_micro} sequences"
    eval_batch = c.eval.global_batch, f"eval.global_batch ({c.eval.global_batch})"
    for size, what in (train_batch, eval_batch):
        if size % data_axis:
            raise ConfigError(
                f"{what} must be a multiple of the mesh's data axis ({data_axis} devices)"
            )


def check_workdir(c: ConfigDict, workdir: Path) -> None:
    """A workdir with a checkpoint or a summary resumes only the same run."""
    resume.check(c, workdir, workdir_lib.has_checkpoint(workdir))


def run(
    config: ConfigDict,
    workdir: str | Path,
    *,
    progress: bool | None = None,
    locked: bool = False,
    accept_unverified: bool | None = None,
    branch: branch_lib.Branch | None = None,
) -> dict:
    """Train (or resume) ``config`` in ``workdir``; returns the summary (also summary.json).

    The workdir is locked (``locked``: by the caller already): a second process on it raises
    ``workdir.WorkdirBusy``. Before any step: ``ConfigError`` (config, dataset or workdir),
    ``OutOfMemoryBudget``, ``DamagedFile`` (a resumed run's logs); ``TrainingDiverged`` later.
    Process 0 shows a bar when ``progress`` (default ``log.progress``) and stderr is a terminal,
    else prints a line every ``log.every`` steps (``metrics.progress_line``).
    ``accept_unverified``: resume from a checkpoint nothing can verify (``checkpoint.
    check_verifiable``; None: refuse it without naming the flag, which the caller lacks).
    ``branch``: start from another run's checkpoint (``train.branch``) when ``workdir`` has none.
    """
    c = config.copy_and_resolve_references()  # open_data records the data's fingerprint in it
    config_lib.check(c)
    step_lib.compilation_cache()
    initialize_distributed(c.distributed)
    workdir = Path(workdir)
    primary = jax.process_index() == 0
    show = (c.log.progress if progress is None else progress) and primary and sys.stderr.isatty()
    model_config = config_lib.model_config(c.model)
    check_workdir(c, workdir)
    summary = workdir_lib.finished(workdir)
    if summary is not None:
        return summary
    impls = ops.resolve(model_config)  # once a run; "pallas" where it cannot run: refused now
    if primary and c.log.wandb:
        wandb_log.import_wandb()  # a ConfigError before any step when it is missing
    dataset = open_data(c, model_config, primary, show)
    mesh = step_lib.make_mesh(c.mesh.model)
    check_batches(c, mesh)
    with contextlib.ExitStack() as hold:
        if primary and not locked:
            hold.enter_context(workdir_lib.Lock(workdir_lib.usable(workdir)))
        if branch is not None:
            if primary and not workdir_lib.has_checkpoint(workdir):
                branch_lib.seed(workdir, branch)
                print(f"branch of {branch.trial}: starts from its step {branch.step}", flush=True)
            if jax.process_count() > 1:  # every process, whichever saw the seeded folder
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("lmuscale-branch")
        check_workdir(c, workdir)  # again: locked, and with the data's fingerprint known
        if primary:
            workdir_lib.write_config(c, workdir)
        program = compile_program(c, workdir, model_config, impls, mesh, primary)
        accept = accept_unverified
        return _train(Session(c, workdir, dataset, mesh, program, primary, show, accept, branch))


def _train(session: Session) -> dict:
    try:
        # The final evaluation too: a signal during it is noted, and the run still finishes.
        with _StopSignals() as stop:
            train(session, stop)
            return summarise(session)
    except (jax.errors.JaxRuntimeError, CheckpointError) as error:
        lost = _lost_peer(error) if jax.process_count() > 1 else None
        if lost is None:
            raise
        session.lost = True  # orbax's threads would wait for the lost process: leave them
        where = "in a checkpoint's save: " if isinstance(error, CheckpointError) else ""
        raise LostProcess(
            f"process {jax.process_index()} of {jax.process_count()} lost contact with the "
            f"others ({where}{outcomes.one_line(lost)[:300]}): another process has died or "
            f"hangs. The checkpoints in {session.checkpoints.directory} are kept: start all "
            f"{jax.process_count()} processes again to resume"
        ) from None
    finally:
        session.close()


# What a collective says when another process is gone: gloo's errors (on CPUs; orbax's save
# meets them as a ValueError, "Gloo AllGather failed: ... Connection closed by peer"), NCCL's,
# and the coordinator's UNAVAILABLE.
_LOST_PEER = re.compile(
    r"\bGloo [\w-]+ failed|\bNCCL\b|\bUNAVAILABLE\b|[Cc]onnection (closed|reset)"
)


def _lost_peer(error: BaseException) -> BaseException | None:
    """The error that shows another process is gone, or None: ``error`` itself when it is
    XLA's runtime error (a step's collective), else the innermost error it was raised from
    whose message is a failed collective's (``_LOST_PEER``). A checkpoint that fails for
    another reason (a full disk, an out-of-memory) stays what it is."""
    if isinstance(error, jax.errors.JaxRuntimeError):
        return error
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    return next((e for e in reversed(chain) if _LOST_PEER.search(str(e))), None)


class Clock:
    """Wall-clock seconds across sessions, the training speed since the last ``restart``, and
    the time left at this session's pace since its first ``restart`` (hooks included)."""

    def __init__(self, elapsed_before: float):
        self.before, self.t0 = elapsed_before, time.perf_counter()
        self.since = self.first = None  # (time, step)

    def elapsed(self) -> float:
        return self.before + time.perf_counter() - self.t0

    def restart(self, step: int) -> None:
        self.since = (time.perf_counter(), step)
        self.first = self.first or self.since

    def seconds_left(self, step: int, last: int) -> float | None:
        if self.first is None or step <= self.first[1]:
            return None
        return (time.perf_counter() - self.first[0]) / (step - self.first[1]) * (last - step)

    def steps_per_second(self, step: int) -> float | None:
        if self.since is None:
            return None
        seconds, steps = time.perf_counter() - self.since[0], step - self.since[1]
        return steps / seconds if steps and seconds > 0 else None


def train(session: Session, stop: _StopSignals) -> None:
    """Each step, then the hooks due (every ``every`` steps and after the last), then a stop
    signal (one during a hook counts for that step). The clock restarts after the first step
    and any hook, so tokens/s and MFU count only training."""
    c, start, last = session.c, session.start, session.c.train.steps
    hooks = [  # (every, action), each action called with the number of steps done
        (c.log.every, session.log_step),
        (c.eval.every, session.validate),
        (c.checkpoint.every, session.checkpoint),
    ]
    agree = _StopAgreement(session.mesh) if jax.process_count() > 1 else None
    agreed = 0  # with several processes: the stop signal's number once all have seen it
    batches = TrainBatches(
        session.dataset,
        seq_len=c.data.seq_len,
        global_batch=c.train.global_batch,
        seed=c.train.seed,
    )
    layout = step_lib.MicroBatches(session.mesh, session.program.plan.microbatches)
    trace = StepTrace(
        session.workdir, c.log.profile_start, c.log.profile_steps, start, last, session.primary
    )
    with session.bar, contextlib.closing(trace):
        for done in range(start + 1, last + 1):
            tokens = layout.place(batches(done - 1))
            trace.before(done, session.state)
            with trace.annotate(done):
                session.state, metrics = session.program.train_step(session.state, tokens)
            trace.after(done, metrics)
            session.metrics.add(done, metrics)
            session.bar.update(1)
            if agree:
                agreed = agree(stop.received or 0)
            first = done == start + 1
            if first:
                session.fetch()  # the clock starts once the first step is done
            due = [action for every, action in hooks if done % every == 0 or done == last]
            if done in session.keep_steps and session.checkpoint not in due:
                due.append(session.checkpoint)
            for action in due:
                action(done)
            if first or due:
                session.clock.restart(done)
            signum = agreed if agree else stop.received
            if signum and done < last:
                session.stop(done, signum, stop.received)
    session.checkpoints.wait()
    session.checkpoints.prune()  # every process, here: orbax's delete waits for them all


@dataclasses.dataclass(frozen=True)
class Program:
    """The run's model compiled for the mesh: its steps, initial state and FLOPs per token."""

    model_config: object
    impls: ops.Impls  # what each op runs (ops.resolve)
    init: Callable[[], dict]
    shardings: dict  # the state's, a tree like it
    plan: memory.Plan
    train_step: Callable
    eval_step: Callable
    plateau: object  # optim.plateau's transform
    flops: object  # flops_per_token's


def compile_program(c, workdir: Path, model_config, impls, mesh, primary: bool) -> Program:
    """Plans the micro-batches (``train.memory``), writes plan.json (with ``impls``, what each
    op runs) and compiles the steps."""
    model = build(model_config, dataclasses.replace(impls, mesh=mesh))
    tx, lr = optim.optimizer(c.optim, c.train.steps)
    plateau = optim.plateau(c.optim)
    init = step_lib.init_fn(model, tx, plateau, c.train.seed, c.data.seq_len)
    abstract = jax.eval_shape(init)
    plan, train_step = memory.plan_train_step(
        step_lib.make_train_step(model, tx, lr, mesh, abstract), abstract, c, mesh, workdir
    )
    if primary:
        memory.write(workdir, plan, ops=impls.record())
        print(f"train step: {memory.describe(plan)}; {impls.describe()}", flush=True)
    return Program(
        model_config=model_config,
        impls=impls,
        init=init,
        shardings=step_lib.state_shardings(mesh, abstract),
        plan=plan,
        train_step=train_step,
        eval_step=step_lib.make_eval_step(model, mesh, abstract["params"]),
        plateau=plateau,
        flops=flops_per_token(model_config, c.data.seq_len),
    )


class Session:
    """One process's part of a run: state, checkpoints, logs, and ``train``'s hook actions."""

    def __init__(
        self, c, workdir: Path, dataset, mesh, program: Program, primary, show, accept, branch
    ):
        self.c, self.workdir, self.dataset, self.mesh = c, workdir, dataset, mesh
        self.program, self.primary, self.branch = program, primary, branch
        self.keep_steps = frozenset(config_lib.keep_steps(c))  # saved and kept: branch points
        self.checkpoints = Checkpoints(
            workdir / workdir_lib.CHECKPOINTS,
            c.checkpoint.keep,
            accept_unverified=accept,
            protect=self.keep_steps,
        )
        try:
            target = restore_target(jax.eval_shape(program.init), program.shardings)
            # meta: the checkpoint's JSON, with "elapsed" and LOG_WINDOW
            restored = self.checkpoints.restore_latest(target)
            if restored is None and branch is not None:  # every one was set aside
                raise CheckpointError(
                    f"{self.checkpoints.directory}: no intact checkpoint left, and a branch does "
                    f"not start from the beginning: run again to start over from {branch.trial}'s "
                    f"step {branch.step}"
                )
            if restored is None:
                restored = None, step_lib.init_state(program.init, mesh, program.shardings), {}
            self.last_checkpoint, self.state, meta = restored
            self.start = int(jax.device_get(self.state["step"]))
            self.log = MetricsLog(
                workdir,
                self.start,
                enabled=primary,
                tensorboard=c.log.tensorboard and primary,
                wandb=c if c.log.wandb else None,
                logged=meta.get(LOGGED),
            )
        except BaseException:  # a damaged log, say: no orbax thread may outlive the error
            self.checkpoints.close()
            raise
        self.metrics = StepMetrics(meta.get(LOG_WINDOW, []))
        self.tokens_per_step = c.train.global_batch * c.data.seq_len
        self.peak = device_peak(program.model_config.dtype, c.peak_flops)
        self.lost = False  # another process died: close() must not wait for it
        self.clock = Clock(meta.get("elapsed", 0.0))
        self.lines = primary and not show  # a plain line per log step instead of the bar
        self.bar = tqdm(
            total=c.train.steps,
            initial=self.start,
            disable=not show,
            unit="step",
            dynamic_ncols=True,
        )

    def fetch(self) -> None:
        """Wait for the pending steps; a non-finite one ends the run (``diverged``)."""
        bad = self.metrics.fetch()
        if bad is not None:
            diverged(self, *bad)

    def log_step(self, done: int) -> None:
        self.fetch()
        m = self.metrics.latest
        steps_per_second = self.clock.steps_per_second(done)
        speed = steps_per_second * self.tokens_per_step if steps_per_second else None
        devices = self.mesh.devices.size
        mean_of = len(self.metrics.window)
        record = {
            "step": done,
            "loss": m["loss"],
            "loss_mean": self.metrics.window_mean(),
            "lr": m["lr"],
            "grad_norm": m["grad_norm"],
            "param_norm": m["param_norm"],
            "tokens": done * self.tokens_per_step,
            "tokens_per_second": speed,
            "mfu": mfu(speed, self.program.flops.train, devices, self.peak) if speed else None,
            "elapsed": self.clock.elapsed(),
        }
        self.log.write("train", record)
        self.checkpoints.check()  # a save that failed in the background is named here
        self.bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{speed or 0:,.0f}")
        if self.lines:
            left = self.clock.seconds_left(done, self.c.train.steps)
            print(progress_line(record, self.c.train.steps, mean_of, left), flush=True)

    def validate(self, done: int) -> None:
        self.fetch()
        result = evaluate(self, "val", self.c.eval.batches)
        program = self.program
        plateau = optim.plateau_update_jit(program.plateau, self.state["plateau"], result.loss)
        self.state["plateau"] = jax.device_put(plateau, program.shardings["plateau"])
        scale = float(jax.device_get(plateau.scale))
        record = {"step": done, "val_loss": result.loss, "val_tokens": result.tokens}
        self.log.write("eval", {**record, "lr_scale": scale, "elapsed": self.clock.elapsed()})
        line = f"step {done}: val loss {result.loss:.4f} nats (lr scale {scale:g})"
        if not self.bar.disable:
            self.bar.write(line)
        elif self.lines:
            print(line, flush=True)

    def checkpoint(self, done: int) -> None:
        self.fetch()  # never a checkpoint of a step not known to be finite
        if self.last_checkpoint != done:
            # A copy of the window: the save may write it after the next step's loss is added.
            meta = {"elapsed": self.clock.elapsed(), LOG_WINDOW: list(self.metrics.window)}
            self.log.sync()  # the lines this checkpoint covers are on disk before it is
            self.checkpoints.save(done, self.state, {**meta, LOGGED: dict(self.log.last)})
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

    def close(self) -> None:
        try:
            self.bar.close()
            if not self.lost:
                self.checkpoints.close()
        finally:
            self.log.close()


@dataclasses.dataclass
class Evaluation:
    loss: float  # nats per token
    per_position: list[float]  # nats at each position 0..seq_len-1
    tokens: int


def evaluate(session: Session, split: str, max_batches: int) -> Evaluation:
    """Mean loss over the split's windows in order, in batches of ``eval.global_batch`` windows
    (the first ``max_batches`` batches, or all with 0), and at each position."""
    seq_len = session.c.data.seq_len
    tokens_sharding = step_lib.batch_sharding(session.mesh, 2)
    valid_sharding = step_lib.batch_sharding(session.mesh, 1)
    batches = eval_batches(
        session.dataset, split, seq_len=seq_len, global_batch=session.c.eval.global_batch
    )
    outputs = [
        session.program.eval_step(
            session.state["params"],
            step_lib.to_global(batch.tokens, tokens_sharding),
            step_lib.to_global(batch.valid, valid_sharding),
        )
        for batch in itertools.islice(batches, max_batches or None)
    ]
    total, per_position, rows = 0.0, np.zeros(seq_len), 0.0
    for out in jax.device_get(outputs):
        total += float(out["sum"])
        per_position += np.asarray(out["per_position"], np.float64)
        rows += float(out["rows"])
    return Evaluation(
        loss=total / (rows * seq_len),
        per_position=(per_position / rows).tolist(),
        tokens=int(rows) * seq_len,
    )


def sizes(c, program: Program) -> dict:
    """What the summary says of the model and the batch."""
    params = count_params(program.model_config)
    return {
        "name": c.name,
        "family": program.model_config.family,
        **program.impls.record(),
        "params": {**dataclasses.asdict(params), "total": params.total},
        "flops_per_token": {"forward": program.flops.forward, "train": program.flops.train},
        "seq_len": c.data.seq_len,
        "global_batch": c.train.global_batch,
        "microbatches": program.plan.microbatches,
        "memory": program.plan.record(),
        "data": {"fingerprint": c.data.fingerprint, "path": str(Path(c.data.path).resolve())},
        "provenance": workdir_lib.provenance(),
    }


def summarise(session: Session) -> dict:
    """The final validation and test losses: the summary, written as summary.json."""
    c = session.c
    summary = {**sizes(c, session.program), "status": "finished", "steps": c.train.steps}
    summary["tokens"] = c.train.steps * session.tokens_per_step  # a branch's parent's share too
    if session.branch is not None:
        summary["branch_from"] = session.branch.record()
    for split in ("val", "test"):
        result = evaluate(session, split, c.eval.final_batches)
        tokens_per_byte = 1.0 / session.dataset.bytes_per_token(split)
        summary[f"{split}_loss"] = result.loss
        summary[f"{split}_bits_per_byte"] = result.loss * tokens_per_byte / math.log(2)
        summary[f"{split}_tokens"] = result.tokens
        summary[f"{split}_per_position"] = result.per_position
    summary["lr_scale"] = float(jax.device_get(session.state["plateau"].scale))
    summary["wall_seconds"] = session.clock.elapsed()
    session.log.summary(summary)  # before summary.json: a W&B failure leaves the run to resume
    if session.primary:
        workdir_lib.write_summary(session.workdir, summary)
    return summary


def diverged(session: Session, step: int, metrics: dict) -> None:
    """Write the diverged summary and raise ``TrainingDiverged``; right after a restore, name
    the checkpoint as suspect instead, with no summary (so that a sweep tries again)."""
    session.checkpoints.wait()
    c, start, last_checkpoint = session.c, session.start, session.last_checkpoint
    where = session.workdir / workdir_lib.CHECKPOINTS
    seeded = session.branch is not None and start == session.branch.step  # the parent's state
    if start > 0 and step <= start + max(1, c.log.every) and not seeded:
        raise TrainingDiverged(
            f"training diverged at step {step}, {step - start} step(s) after resuming from "
            f"checkpoint {where / str(start)}: that checkpoint is suspect (damaged files, or "
            f"written by another version). Move it aside (e.g. into {where}.corrupt/) and run "
            "again to resume from the one before it"
        )
    kept = "no checkpoint was written before it"
    if last_checkpoint is not None:
        kept = f"the last good checkpoint is step {last_checkpoint} in {where}"
    message = (
        f"training diverged at step {step}: loss {float(metrics['loss'])}, parameter norm "
        f"{float(metrics['param_norm'])} (NaN or infinity); {kept}. Try a lower "
        "optim.learning_rate, optim.grad_clip > 0 or model.dtype=float32"
        + (" in a new --workdir" if last_checkpoint is not None else "")
    )
    if session.primary:
        summary = {**sizes(c, session.program), "status": "diverged", "error": message}
        summary["step"] = step
        workdir_lib.write_summary(session.workdir, summary)
        session.log.summary(summary)
    raise TrainingDiverged(message)
