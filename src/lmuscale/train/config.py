"""Training configs: Python files of ml_collections ConfigDicts, checked before anything runs.

A config file defines ``get_config(name)`` (``name``: the part after ``:`` in
``experiments/owt2.py:lmu-1M``, or None) returning ``base_config(model)`` with its changes:
every key and its type come from ``base_config``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import math
import traceback
from pathlib import Path

from ml_collections import ConfigDict

from lmuscale.models import ModelConfig
from lmuscale.models import family as families
from lmuscale.outcomes import ConfigError
from lmuscale.resume import flatten
from lmuscale.train import optim

POSITIVE = (lambda v: v >= 1, "> 0")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
# Each checked key's valid values: (test, the range as the error message says it). Floats must
# also be finite.
RANGES = {
    "train.steps": POSITIVE,
    "train.global_batch": POSITIVE,
    "data.seq_len": POSITIVE,
    "eval.every": POSITIVE,
    "eval.global_batch": POSITIVE,
    "checkpoint.every": POSITIVE,
    "checkpoint.keep": POSITIVE,
    "log.every": POSITIVE,
    "log.profile_start": POSITIVE,
    "mesh.model": POSITIVE,
    "distributed.heartbeat_timeout": POSITIVE,
    "train.microbatches": NON_NEGATIVE,
    "train.memory_budget_gb": NON_NEGATIVE,
    "log.profile_steps": NON_NEGATIVE,
    "optim.warmup_steps": NON_NEGATIVE,
    "optim.grad_clip": NON_NEGATIVE,
    "eval.batches": NON_NEGATIVE,
    "eval.final_batches": NON_NEGATIVE,
    "distributed.num_processes": NON_NEGATIVE,  # 0 = from the cluster's environment
    "peak_flops": NON_NEGATIVE,
    # jax.random.key keeps only the low 32 bits (without x64): seed 2**32 would draw seed 0's
    # parameters, but other batches.
    "train.seed": (lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    "optim.learning_rate": (lambda v: v > 0, "> 0"),
    # Adam divides by 1 - b**t: 1 is a division by zero at the first step.
    "optim.b1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.b2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.eps": (lambda v: v > 0, "> 0"),  # 0 would divide 0 by 0 where a gradient is 0
    "optim.schedule": (lambda v: v in optim.SCHEDULES, " or ".join(optim.SCHEDULES)),
    "optim.decay_shape": (lambda v: v in optim.DECAY_SHAPES, ", ".join(optim.DECAY_SHAPES)),
    "optim.decay_fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "optim.decay_steps": NON_NEGATIVE,
    "optim.final_lr_fraction": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.weight_decay": (lambda v: v >= 0, ">= 0"),
    "optim.plateau_factor": (lambda v: 0 < v < 1, "in (0, 1)"),
    "optim.plateau_rtol": (lambda v: 0 < v <= 1, "in (0, 1]"),  # optax's range when atol is 0
    # optax cuts the scale when its count of evaluations without improvement (0 after an
    # improvement) equals patience: 0 would cut at every improvement, a negative one never.
    "optim.plateau_patience": (lambda v: v >= 1, ">= 1"),
    "optim.plateau_cooldown": NON_NEGATIVE,  # below 0 acts as 0
    # The scale starts at 1 and is max(scale, min_scale): above 1 would raise the rate.
    "optim.plateau_min_scale": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "distributed.process_id": (lambda v: v >= -1, ">= -1"),  # -1 = from the environment
    "log.wandb_mode": (
        lambda v: v in ("", "online", "offline", "disabled"),
        "online, offline, disabled or empty (W&B's default, WANDB_MODE)",
    ),
}


def base_config(model: ModelConfig) -> ConfigDict:
    """Every key a training config has, with the paper's defaults (REFERENCE §2)."""
    record = families.of(model)
    fields = {k: v for k, v in dataclasses.asdict(model).items() if k not in record.fixed}
    c = ConfigDict()
    c.name = ""
    c.model = ConfigDict({"family": record.name, **fields})  # less what the family fixes
    c.data = ConfigDict(
        {
            # Made by ``python -m lmuscale.data prepare``, or by training for an embedded source
            # with ``prepare``. ``source``: what meta.json must say it was prepared from ("" any).
            "path": "",
            "source": "",
            "prepare": False,  # prepare the embedded ``source`` in ``path`` when nothing is there
            # The dataset's fingerprint (data.format): "" takes the one at ``path`` and records
            # it in config.json; a pinned one refuses any other dataset and names the trial anew.
            "fingerprint": "",
            "tokenizer": "gpt2",
            "seq_len": 1024,
            "verify": True,  # check the token files' sha256 against meta.json (process 0)
        }
    )
    c.train = ConfigDict(
        {
            "seed": 0,
            "steps": 25_000,
            "global_batch": 512,
            "microbatches": 1,  # per step; 0 = as few as fit the budget (train.memory)
            "memory_budget_gb": 0.0,  # per device; 0 = a fraction of the device's memory
        }
    )
    c.optim = ConfigDict(
        {
            "learning_rate": 1e-3,
            "warmup_steps": 500,
            # train.optim's schedules: "cosine" (the paper's) or "wsd" (warmup-stable-decay)
            "schedule": "cosine",
            "decay_shape": "1-sqrt",  # wsd's: linear, cosine or 1-sqrt
            "decay_fraction": 0.2,  # wsd's decay, as a fraction of train.steps ...
            "decay_steps": 0,  # ... or in steps (0: the fraction)
            "final_lr_fraction": 0.0,  # every schedule's floor, a fraction of the peak
            # AdamW's decoupled weight decay (0: Adam), and whether it takes these parameters
            "weight_decay": 0.0,
            "weight_decay_norms": False,
            "weight_decay_biases": False,
            "weight_decay_embedding": False,
            "b1": 0.9,
            "b2": 0.999,
            "eps": 1e-8,
            "grad_clip": 0.0,  # max global gradient norm; 0 = no clipping
            "plateau_factor": 0.5,
            "plateau_patience": 3,  # evaluations without improvement
            "plateau_rtol": 1e-4,
            "plateau_cooldown": 0,
            "plateau_min_scale": 0.0,
        }
    )
    c.eval = ConfigDict(
        {
            "every": 1000,  # steps between validation losses (also at the end)
            "global_batch": 64,
            "batches": 50,  # batches per periodic validation (0 = the whole split)
            "final_batches": 0,  # batches for the final val/test losses (0 = whole splits)
        }
    )
    # keep_steps: steps (comma-separated) also saved and always kept: the branch points of
    # cooldowns (a sweep's branch_from fills it in)
    c.checkpoint = ConfigDict({"every": 1000, "keep": 3, "keep_steps": ""})
    c.log = ConfigDict(
        {
            "every": 50,
            "progress": True,
            "tensorboard": True,
            # Weights & Biases (train.wandb_log); "" = W&B's default, the config's name, no group
            "wandb": False,
            "wandb_project": "",
            "wandb_name": "",
            "wandb_mode": "",  # online, offline or disabled
            "wandb_group": "",  # a sweep's trials get the sweep's name
            # A jax.profiler trace of profile_steps steps from profile_start into WORKDIR/profile
            "profile_steps": 0,
            "profile_start": 10,
        }
    )
    c.mesh = ConfigDict({"model": 1})  # the data axis takes every other device
    c.distributed = ConfigDict(
        {
            "initialize": False,
            "coordinator_address": "",
            "num_processes": 0,
            "process_id": -1,
            # seconds without a heartbeat after which the coordinator ends the other processes
            "heartbeat_timeout": 100,
        }
    )
    c.peak_flops = 0.0  # per device, for MFU; 0 = from the table of known devices
    return c


def model_config(section) -> ModelConfig:
    """The model dataclass of a config's ``model`` section (its own checks apply)."""
    fields = dict(section)
    try:
        record = families.get(fields.pop("family"))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    fixed = sorted(set(fields) & set(record.fixed))
    if fixed:
        raise ConfigError(
            f"model.{fixed[0]} is decided by model.family ({record.name!r}): leave it out"
        )
    try:
        return record.config(**fields, **record.fixed)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model: {error}") from None


def _type_name(value) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(type(value), "other")


def _a(kind: str) -> str:
    return f"an {kind}" if kind == "int" else f"a {kind}"


def _unknown(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown config key {key!r}{hint}"


def check(config: ConfigDict, where: str = "config") -> None:
    """Every key of ``config`` exists in the base config of its model, with the same type."""
    section = config.get("model")
    if not isinstance(section, ConfigDict) or "family" not in section:
        raise ConfigError(f"{where}: no model section; build configs with base_config(model)")
    model = model_config(section)
    check_schema(config, base_config(model), where)
    _check_values(config, model, where)


def check_schema(config: ConfigDict, base: ConfigDict, where: str) -> None:
    """``config`` has exactly the keys of ``base``, each of its type (or an int for a float)."""
    schema = flatten(base)
    values = flatten(config)
    for key, value in values.items():
        if key not in schema:
            raise ConfigError(f"{where}: {_unknown(key, schema)}")
        want = _type_name(schema[key])
        got = _type_name(value)
        if want != got and not (want == "float" and got == "int"):
            raise ConfigError(f"{where}: {key} must be {_a(want)}, got {value!r} ({got})")
        if want == "int" and not key.endswith("seed") and not -(2**31) <= value < 2**31:
            raise ConfigError(  # a seed's range is its own (RANGES)
                f"{where}: {key} = {value:,} is out of range: counts and sizes must be below "
                "2**31 (XLA's step counter and shapes are 32-bit)"
            )
    missing = sorted(set(schema) - set(values))
    if missing:
        raise ConfigError(f"{where}: missing keys {', '.join(missing)}")


def _check_values(c: ConfigDict, model: ModelConfig, where: str) -> None:
    values = flatten(c)
    for key, (test, bounds) in RANGES.items():
        value = values[key]
        if not test(value) or (isinstance(value, float) and not math.isfinite(value)):
            raise ConfigError(f"{where}: {key} must be {bounds}, got {value!r}")
    if c.train.microbatches and c.train.global_batch % c.train.microbatches:
        raise ConfigError(
            f"{where}: train.global_batch ({c.train.global_batch}) must be a multiple of "
            f"train.microbatches ({c.train.microbatches})"
        )
    if c.optim.warmup_steps >= c.train.steps:
        raise ConfigError(
            f"{where}: optim.warmup_steps ({c.optim.warmup_steps}) must be below train.steps "
            f"({c.train.steps})"
        )
    if c.optim.schedule == "wsd":
        decay = optim.decay_steps(c.optim, c.train.steps)
        if decay + c.optim.warmup_steps > c.train.steps:
            raise ConfigError(
                f"{where}: optim's decay ({decay} steps) and warmup ({c.optim.warmup_steps}) are "
                f"longer than the run (train.steps = {c.train.steps}): shorten the decay "
                "(optim.decay_steps or optim.decay_fraction)"
            )
    keep_steps(c, where)
    if c.log.profile_steps and c.log.profile_start > c.train.steps:
        raise ConfigError(
            f"{where}: log.profile_start ({c.log.profile_start}) is after the last step "
            f"(train.steps = {c.train.steps}): nothing would be traced"
        )
    max_len = getattr(model, "max_len", None)
    if max_len is not None and c.data.seq_len > max_len:
        raise ConfigError(
            f"{where}: data.seq_len ({c.data.seq_len}) exceeds model.max_len ({max_len})"
        )


def keep_steps(c: ConfigDict, where: str = "config") -> list[int]:
    """``checkpoint.keep_steps`` as steps, each in 1..train.steps (ConfigError otherwise)."""
    text = c.checkpoint.keep_steps.replace(" ", "")
    try:
        steps = sorted({int(part) for part in text.split(",")}) if text else []
    except ValueError:
        steps = None
    if steps is None or not all(1 <= s <= c.train.steps for s in steps):
        raise ConfigError(
            f"{where}: checkpoint.keep_steps is {c.checkpoint.keep_steps!r}; expected "
            f"comma-separated steps in 1..{c.train.steps} (train.steps)"
        )
    return steps


def load(spec: str, checker=check) -> ConfigDict:
    """``path/to/file.py[:name]`` -> the file's ``get_config(name)``, checked (by ``checker``,
    which raises ConfigError) and locked."""
    path_text, _, name = spec.partition(":")
    path = Path(path_text)
    get_config = getattr(load_module(path), "get_config", None)
    if get_config is None:
        raise ConfigError(f"{path}: defines no get_config(name)")
    with errors_named(path):
        config = get_config(name or None)
    if not isinstance(config, ConfigDict):
        raise ConfigError(f"{path}: get_config returned {type(config).__name__}, not ConfigDict")
    checker(config, where=str(path))
    config.lock()
    return config


def load_module(path: Path, what: str = "config file", expected: str = "FILE.py[:NAME]"):
    """Import a config (or sweep) file; an error in it names the file and line."""
    if path.suffix != ".py" or not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} not found (expected {expected})")
    module_name = f"_lmuscale_config_{abs(hash(path.resolve()))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    with errors_named(path):
        module_spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def errors_named(path: Path):
    """Code of the file ``path`` runs in this: an error it raises (but a ConfigError, which
    names what is wrong already) becomes a ConfigError naming the file and the line (the
    deepest frame in the file)."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:
        line = None
        for frame in traceback.extract_tb(error.__traceback__):
            if Path(frame.filename).resolve() == path.resolve():
                line = frame.lineno
        if isinstance(error, SyntaxError) and error.lineno:
            line = error.lineno
        where = f"{path}:{line}" if line else str(path)
        raise ConfigError(f"{where}: {type(error).__name__}: {error}") from None


def _parse(key: str, text: str, current):
    kind = _type_name(current)
    try:
        if kind == "bool":
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError
            return lowered in ("true", "1")
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ConfigError(f"--config.{key}: expected {_a(kind)}, got {text!r}") from None
    return text


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv``'s ``--config.KEY=VALUE`` and ``--config.KEY VALUE`` as ``KEY=VALUE`` strings
    (for ``override``), and the other arguments."""
    overrides, rest = [], []
    items = iter(argv)
    for item in items:
        if not item.startswith("--config."):
            rest.append(item)
            continue
        key_value = item[len("--config.") :]
        if "=" not in key_value:
            value = next(items, None)
            if value is None:
                raise ConfigError(f"{item} needs a value")
            key_value = f"{key_value}={value}"
        overrides.append(key_value)
    return overrides, rest


def override(config: ConfigDict, overrides: list[str], checker=check) -> ConfigDict:
    """Apply ``key=value`` strings (``train.steps=100``), each typed like the key's default."""
    values = flatten(config)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--config.{item}: expected --config.KEY=VALUE")
        if key not in values:
            raise ConfigError(f"--config.{key}: {_unknown(key, values)}")
        with config.unlocked():
            config.update_from_flattened_dict({key: _parse(key, text, values[key])})
    checker(config, where="command line")
    return config
