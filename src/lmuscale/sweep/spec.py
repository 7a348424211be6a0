"""Sweep files: Python modules whose ``get_trials()`` yields ``Trial(name, config, overrides)``,
optionally with ``THROUGHPUT`` (``lmuscale.sweep.throughput``), ``SLURM`` (submitit parameters)
and ``after(workdir)``, called once every trial has finished. A trial's folder is ``NAME-HASH``,
HASH a sha256 of the config keys that change the trained numbers (``config_hash``).

A branch: ``Trial(..., branch_from=("parent", step))`` trains from the checkpoint at ``step``
of the sweep's trial ``parent`` (``lmuscale.train.branch``), e.g. a cooldown of a
warmup-stable-decay run (``lmuscale.sweep.grids.wsd_grid``). It waits until the parent has
finished (the parent saves and keeps that step: ``checkpoint.keep_steps``), ends as "parent
diverged" when the parent diverged at or before that step, and its folder's hash covers its
parent's config but the parent's length.

A sweep in stages: ``get_trials(done)`` is given the result rows of the sweep's trials that
have ended (finished or diverged), by name (``lmuscale.sweepdir.result_row``). A trial that
needs results not there yet is yielded with ``waits="why"``: ``--dry-run`` lists it, the runner
does not run it, and once the trials before it have ended, asks ``get_trials`` again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict

from lmuscale import sweepdir
from lmuscale.models import count_params, flops_per_token
from lmuscale.outcomes import ConfigError
from lmuscale.resume import flatten, hashed
from lmuscale.sweep.throughput import Throughput, short_path
from lmuscale.train.config import errors_named, load, load_module, model_config, override
from lmuscale.workdir import DONE

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*")
# What a trial is for, which decides the analyses that take it (lmuscale.analysis.results): the
# paper's grid of sizes at one budget, an IsoFLOP budget, a learning-rate grid, or a repeat of
# a grid trial at another seed, or the stable run of warmup-stable-decay cooldowns (which
# feeds no fit: its branches do). Not part of the config, so it does not change the folder.
ROLES = ("grid", "isoflop", "learning_rate", "seed", "stable")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One training run: ``config`` is a ConfigDict or ``"FILE.py:NAME"`` (relative to the
    sweep file), changed by ``overrides`` (``{"train.steps": 250_000}``); ``role``: one of
    ``ROLES``; ``waits``: why it cannot run yet (see the module docstring); ``note``: what
    ``--dry-run`` should say of it, e.g. where its learning rate came from; ``branch_from``:
    ``(trial name, step)`` to start from (see the module docstring)."""

    name: str
    config: ConfigDict | str
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    role: str = "grid"
    waits: str = ""
    note: str = ""
    branch_from: tuple[str, int] | None = None
    origin: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self):
        if not self.origin:
            object.__setattr__(self, "origin", caller(2))  # 1 up: the dataclass's __init__


@dataclasses.dataclass(frozen=True)
class ResolvedTrial:
    name: str
    config: ConfigDict  # checked and locked; data.path is absolute
    key: str  # the config hash
    role: str = "grid"
    waits: str = ""
    note: str = ""
    branch_from: tuple[str, int] | None = None  # (the parent trial's name, the step)
    parent_folder: str = ""  # a branch's parent's folder name

    @property
    def folder_name(self) -> str:
        return f"{self.name}-{self.key}"

    def result_row(self, folder: Path) -> dict:
        return sweepdir.result_row(self, folder, lambda: sizes(self.config))


@dataclasses.dataclass(frozen=True)
class Sweep:
    path: Path
    trials: list[ResolvedTrial]
    throughput: Throughput  # model FLOP/s per trial, from the sweep file's THROUGHPUT
    slurm: dict = dataclasses.field(default_factory=dict)
    after: Callable[[Path], Any] | None = None
    workdir: Path | None = None  # where the ended trials given to get_trials were read
    overrides: tuple[str, ...] = ()  # the command line's, for every trial
    # the results table of workdir, whose rows get_trials is given; kept across reloads
    table: sweepdir.Table | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def waiting(self) -> list[ResolvedTrial]:
        return [t for t in self.trials if t.waits]

    def reload(self) -> Sweep:
        """The sweep file read again, given the trials ended in its workdir since: trials that
        waited for those may now run."""
        return load_sweep(self.path, self.workdir, self.overrides, self.table)


def config_hash(config: ConfigDict | dict, branch: tuple[str, int] | None = None) -> str:
    """12 hex digits of a sha256 over the keys that change the trained numbers
    (``resume.hashed``), and for a branch, ``(its parent's hash, the step)``."""
    flat = hashed(config)
    if branch is not None:
        flat["branch_from"] = list(branch)
    text = json.dumps(flat, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def load_sweep(
    path: str | Path,
    workdir: str | Path | None = None,
    overrides: Sequence[str] = (),
    table: sweepdir.Table | None = None,
) -> Sweep:
    """Run the sweep file and resolve every trial; errors name the file and line. A sweep in
    stages is given the ended trials in ``workdir`` (none without one), their rows from
    ``table``, the results table of ``workdir`` (a new one by default). ``overrides``:
    ``KEY=VALUE`` strings (the command line's ``--config.KEY=VALUE``) applied to every trial
    after its own."""
    path = Path(path)
    module = load_module(path, "sweep file", "a .py file")
    get_trials = getattr(module, "get_trials", None)
    if not callable(get_trials):
        raise ConfigError(f"{path}: defines no get_trials() returning Trial(...) items")
    staged = bool(inspect.signature(get_trials).parameters)
    workdir = None if workdir is None else Path(workdir)
    table = table or (None if workdir is None else sweepdir.Table(workdir))
    done: dict[str, dict] = {}
    while True:
        resolved = _trials(path, get_trials, done if staged else None, overrides)
        if not (staged and workdir and any(t.waits for t in resolved)):
            break
        now = _ended(resolved, table)
        if now.keys() <= done.keys():
            break
        done = now
    if any(t.branch_from for t in resolved):
        resolved = [_waits_for_parent(t, resolved, table) for t in resolved]
    throughput = _throughput(path, getattr(module, "THROUGHPUT", None))
    slurm = getattr(module, "SLURM", {})
    if not isinstance(slurm, dict):
        raise ConfigError(f"{path}: SLURM must be a dict of submitit parameters")
    after = getattr(module, "after", None)
    return Sweep(path, resolved, throughput, dict(slurm), after, workdir, tuple(overrides), table)


def _trials(path: Path, get_trials, done: dict | None, overrides=()) -> list[ResolvedTrial]:
    """``get_trials`` (given ``done`` unless it is None) called and its trials resolved."""
    with errors_named(path):
        trials = list(get_trials() if done is None else get_trials(dict(done)))
    if not trials:
        raise ConfigError(f"{path}: get_trials() returned no trials")
    resolved, seen, wheres = [], {}, {}
    for trial in trials:
        if not isinstance(trial, Trial):
            raise ConfigError(f"{path}: get_trials() gave {trial!r}; expected Trial(...) items")
        where = f"{_short(trial.origin)} (trial {trial.name!r})"
        if not isinstance(trial.name, str) or not NAME.fullmatch(trial.name):
            raise ConfigError(
                f"{where}: a trial name is letters, digits and . _ + = - (it names a folder)"
            )
        if trial.name in seen:
            raise ConfigError(
                f"{where}: the name is already used by the trial at {seen[trial.name]}"
            )
        if trial.role not in ROLES:
            raise ConfigError(
                f"{where}: role is {trial.role!r}; expected one of {', '.join(ROLES)}"
            )
        for key in ("waits", "note"):
            if not isinstance(getattr(trial, key), str):
                raise ConfigError(f"{where}: {key} is {getattr(trial, key)!r}; expected text")
        branch = trial.branch_from
        if branch is not None and not (
            isinstance(branch, tuple)
            and len(branch) == 2
            and isinstance(branch[0], str)
            and isinstance(branch[1], int)
            and not isinstance(branch[1], bool)
        ):
            raise ConfigError(f"{where}: branch_from is {branch!r}; expected (trial name, step)")
        seen[trial.name] = _short(trial.origin)
        resolved.append(_resolve(trial, path.parent, where, path.stem, overrides))
        wheres[trial.name] = where
    return _branches(resolved, wheres)


# The keys in which a branch may differ from its parent: its length, its schedule's decay and
# what trains no differently (evaluations, logs, checkpoints). The learning rate up to the
# branch point is compared too, step by step.
BRANCH_MAY_DIFFER = (
    "name",
    "train.steps",
    "optim.decay_",
    "optim.final_lr_fraction",
    "eval.",
    "log.",
    "checkpoint.",
)


def _branches(trials: list[ResolvedTrial], wheres: dict[str, str]) -> list[ResolvedTrial]:
    """Each branch checked against its parent (ConfigError naming the trial), its hash made its
    own; each parent given its branch points to save and keep (``checkpoint.keep_steps``)."""
    by_name = {t.name: t for t in trials}
    points: dict[str, set[int]] = {}
    out = []
    for trial in trials:
        if trial.branch_from is None:
            out.append(trial)
            continue
        name, step = trial.branch_from
        where, parent = wheres[trial.name], by_name.get(name)
        if parent is None:
            raise ConfigError(f"{where}: branch_from names {name!r}, which is not a trial here")
        if parent.branch_from is not None:
            raise ConfigError(
                f"{where}: its parent {name!r} is a branch itself; branch from {name!r}'s "
                f"parent, {parent.branch_from[0]!r}, instead"
            )
        length = parent.config.train.steps
        if step < 1:
            raise ConfigError(f"{where}: branch_from step {step}; expected a step >= 1")
        if step > length:
            raise ConfigError(
                f"{where}: branch_from step {step} is past its parent {name!r}, which trains "
                f"{length} steps"
            )
        if step >= trial.config.train.steps:
            raise ConfigError(
                f"{where}: it branches at step {step} but trains {trial.config.train.steps} "
                "steps (train.steps): nothing would be left to train"
            )
        mine, theirs = flatten(trial.config), flatten(parent.config)
        for key in mine:
            if not key.startswith(BRANCH_MAY_DIFFER) and mine[key] != theirs.get(key):
                raise ConfigError(
                    f"{where}: its {key} is {mine[key]!r} where its parent {name!r} has "
                    f"{theirs.get(key)!r}: a branch continues its parent's training (only "
                    "train.steps, the schedule's decay, eval, log and checkpoint may differ)"
                )
        _same_rate(trial, parent, step, where)
        points.setdefault(name, set()).add(step)
        # The parent's length is left out: a longer stable run (a larger budget added) trains
        # the same steps up to here, so its earlier branches keep their folders; whether the
        # branch point is its last step is not (that step is evaluated, for reduce-on-plateau).
        stem = {k: v for k, v in flatten(parent.config).items() if k != "train.steps"}
        key = config_hash(trial.config, (config_hash(stem), step, step == length))
        out.append(dataclasses.replace(trial, key=key, parent_folder=parent.folder_name))
    return [_keeping(t, points[t.name]) if t.name in points else t for t in out]


def _same_rate(trial: ResolvedTrial, parent: ResolvedTrial, step: int, where: str) -> None:
    """ConfigError unless the branch's learning rate equals its parent's at every step before
    the branch point: the same schedule, or the same kind (peak and warmup are the same keys)
    with both still at the peak there (e.g. not a cooldown that would start before it). Read
    from the configs: the runner computes nothing with JAX."""
    from lmuscale.train import optim

    mine, theirs = trial.config, parent.config
    if mine.optim.schedule != theirs.optim.schedule:
        raise ConfigError(
            f"{where}: its optim.schedule is {mine.optim.schedule!r} where its parent "
            f"{parent.name!r} has {theirs.optim.schedule!r}: a branch trains as its parent did up "
            "to the branch point"
        )
    if mine.train.steps == theirs.train.steps and mine.optim.to_dict() == theirs.optim.to_dict():
        return  # one schedule
    for config, whose in ((mine, "its"), (theirs, f"its parent {parent.name!r}'s")):
        first = optim.peak_until(config.optim, config.train.steps)
        if step > first:
            what = "decay" if config.optim.schedule == "wsd" else "cosine decay"
            raise ConfigError(
                f"{where}: {whose} {what} starts at step {first}, before the branch point (step "
                f"{step}): a branch trains as its parent did up to there; start the decay at or "
                "after it"
            )


def _keeping(trial: ResolvedTrial, steps: set[int]) -> ResolvedTrial:
    """``trial`` with ``steps`` added to its ``checkpoint.keep_steps`` (its hash stays)."""
    config = ConfigDict(trial.config.to_dict())
    own = {int(s) for s in config.checkpoint.keep_steps.replace(" ", "").split(",") if s}
    config.checkpoint.keep_steps = ",".join(str(s) for s in sorted(own | steps))
    config.lock()
    return dataclasses.replace(trial, config=config)


def _waits_for_parent(
    trial: ResolvedTrial, trials: list[ResolvedTrial], table: sweepdir.Table | None
) -> ResolvedTrial:
    """A branch waits until its parent has ended (a parent diverged before the branch point ends
    it, in its worker)."""
    if trial.branch_from is None or trial.waits:
        return trial
    name = trial.branch_from[0]
    parent = next(t for t in trials if t.name == name)
    state = None if table is None or parent.waits else table.row(parent)["status"]
    if state in DONE:
        return trial
    waits = f"their parent {name} to finish (each starts from one of its checkpoints)"
    return dataclasses.replace(trial, waits=waits)


def _ended(trials: list[ResolvedTrial], table: sweepdir.Table) -> dict[str, dict]:
    """The result rows of the trials (not waiting) that finished or diverged, by name. Every
    trial's row is in ``table`` after it: the runner's first table is these rows."""
    rows = {t.name: table.row(t) for t in trials if not t.waits}
    return {name: row for name, row in rows.items() if row["status"] in DONE}


def sizes(config: ConfigDict) -> dict:
    """The results row's model fields (``sweepdir.sizes``) counted from a trial's config."""
    model = model_config(config.model)
    params = count_params(model)
    return {
        "family": model.family,
        "N": params.non_embedding,
        "total_params": params.total,
        "flops_per_token": flops_per_token(model, config.data.seq_len).train,
    }


def twins(trials: list[ResolvedTrial]) -> list[list[str]]:
    """The names of trials whose configs differ in nothing but the name (they would train the
    same model), in groups; none for a sensible sweep, but an override can make some."""
    groups = {}
    for trial in trials:
        unnamed = {k: v for k, v in flatten(trial.config).items() if k != "name"}
        groups.setdefault(config_hash(unnamed), []).append(trial.name)
    return [names for names in groups.values() if len(names) > 1]


def _throughput(path: Path, value) -> Throughput:
    if isinstance(value, Throughput):
        return value
    if value is None:
        return Throughput(None, source=f"no THROUGHPUT in {path}")
    if isinstance(value, bool) or not (isinstance(value, int | float) and value > 0):
        raise ConfigError(
            f"{path}: THROUGHPUT is {value!r}; expected a positive number of FLOP/s or "
            "from_benchmarks(folder, default)"
        )
    return Throughput(float(value), source=f"THROUGHPUT {value:g} FLOP/s in {path}")


def _resolve(
    trial: Trial, folder: Path, where: str, group: str = "", overrides: Sequence[str] = ()
) -> ResolvedTrial:
    """``trial``'s checked config and its hash; ``group``: the W&B group when it names none;
    ``overrides``: command-line ``KEY=VALUE`` strings applied after the trial's own."""
    try:
        if isinstance(trial.config, str):
            file, sep, name = trial.config.partition(":")
            config = load(f"{folder / file}{sep}{name}")
        elif isinstance(trial.config, ConfigDict):
            config = ConfigDict(trial.config.to_dict())
        else:
            raise ConfigError(
                f"config is {type(trial.config).__name__}; expected a ConfigDict or 'FILE.py:NAME'"
            )
        if not isinstance(trial.overrides, Mapping):
            raise ConfigError(f"overrides must be a dict of config keys, not {trial.overrides!r}")
        with config.unlocked():
            config.name = trial.name
        override(config, [f"{key}={_text(value)}" for key, value in trial.overrides.items()])
    except ConfigError as error:
        # override() speaks of the command line; here the keys come from the sweep file.
        message = str(error).removeprefix("command line: ")
        raise ConfigError(f"{where}: {message.replace('--config.', 'overrides: ')}") from None
    except Exception as error:
        raise ConfigError(f"{where}: {type(error).__name__}: {error}") from None
    try:
        if overrides:
            override(config, list(overrides))
        with config.unlocked():
            if config.data.path:
                config.data.path = str(Path(config.data.path).absolute())
            if config.log.wandb and not config.log.wandb_group:
                config.log.wandb_group = group  # a log.* key: the hash stays the same
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    config.lock()
    return ResolvedTrial(
        trial.name,
        config,
        config_hash(config),
        trial.role,
        trial.waits.strip(),
        trial.note,
        trial.branch_from,
    )


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def caller(up: int) -> str:
    """``file:line`` of the frame ``up`` calls above the function calling this: the sweep
    file's line that made a trial, for the trial's error messages."""
    frame = sys._getframe(up + 1)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _short(origin: str) -> str:
    file, _, line = origin.rpartition(":")
    return f"{short_path(Path(file))}:{line}"
