"""The rules of resuming a run: which config keys may change, the keys a saved config predates,
and the guard that refuses a run folder (``workdir``) holding training of another config.

A config is compared key by key once flattened (``flatten``: ``{"train.steps": 250_000}``).
Train, tasks, the sweep's workers and generate share these rules; ``sweep.spec``'s trial
hash leaves out the same resumable keys.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ml_collections import ConfigDict

from lmuscale import workdir
from lmuscale.models import family as families
from lmuscale.outcomes import ConfigError

# Keys that may differ when a run resumes: none of them changes the trained numbers. (The
# memory budget decides a micro-batch plan, which the workdir records: see train.memory.)
RESUMABLE_CHANGES = (
    "log.",
    "distributed.",
    "data.verify",
    "data.path",
    "data.prepare",
    "peak_flops",
    "train.memory_budget_gb",
    "model.loss_impl",  # the same loss to rounding (lmuscale.ops)
    "model.memory_impl",  # the same LMU memory to rounding
    "checkpoint.keep_steps",  # more checkpoints kept (a sweep adds its branches' points)
)
# The optimiser's keys added with the WSD schedule and AdamW, as every earlier run had them in
# effect: a trial's hash leaves each out while it has this value (``hashed``), so that no
# folder name of an earlier sweep changes.
OPTIM_ADDED = {
    "schedule": "cosine",
    "decay_shape": "1-sqrt",
    "decay_fraction": 0.2,
    "decay_steps": 0,
    "final_lr_fraction": 0.0,
    "weight_decay": 0.0,
    "weight_decay_norms": False,
    "weight_decay_biases": False,
    "weight_decay_embedding": False,
}
# Keys added after runs were saved, with the value those runs had in effect (``upgrade``).
ADDED_KEYS = {
    "train.memory_budget_gb": 0.0,
    "distributed.heartbeat_timeout": 100,
    "log.wandb": False,
    "log.wandb_project": "",
    "log.wandb_name": "",
    "log.wandb_mode": "",
    "log.wandb_group": "",
    "log.profile_steps": 0,
    "log.profile_start": 10,
    "data.prepare": False,
    "data.fingerprint": "",
    "checkpoint.keep_steps": "",
    **{f"optim.{key}": value for key, value in OPTIM_ADDED.items()},
}
# Filled in from the dataset by training (``train.loop.open_data``): "" is "not known yet" on
# either side of a comparison, and a trial's hash leaves it out unless it is pinned.
FINGERPRINT = "data.fingerprint"
# The same for model config fields, filled in only for a family whose config has the field.
ADDED_MODEL_FIELDS = {"loss_impl": "xla", "memory_impl": "xla"}


def flatten(config, prefix: str = "") -> dict:
    """A config (ConfigDict or dict) as ``{"section.key": value}``."""
    out = {}
    for key, value in config.items():
        if isinstance(value, ConfigDict | dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def hashed(config) -> dict:
    """The flattened keys of ``config`` that a trial's hash covers: those that change the
    trained numbers, less ``OPTIM_ADDED``'s at their old value and an unpinned fingerprint."""
    flat = {k: v for k, v in flatten(config).items() if not k.startswith(RESUMABLE_CHANGES)}
    for key, value in OPTIM_ADDED.items():
        if flat.get(f"optim.{key}") == value:
            del flat[f"optim.{key}"]
    if not flat.get(FINGERPRINT, True):
        del flat[FINGERPRINT]
    return flat


def upgrade(saved: dict) -> dict:
    """A saved config (config.json, a sweep trial's) with the keys it predates filled in as it
    ran (``ADDED_KEYS``, ``ADDED_MODEL_FIELDS``, its family's ``legacy``), to resume the run."""
    saved = dict(saved)
    for key, value in ADDED_KEYS.items():
        section, leaf = key.split(".")
        if isinstance(saved.get(section), dict) and leaf not in saved[section]:
            saved[section] = {**saved[section], leaf: value}
    model = saved.get("model", {})
    record = families.REGISTRY.get(model.get("family"))
    if record is None:
        return saved
    fields = {f.name for f in dataclasses.fields(record.config)}
    added = {k: v for k, v in ADDED_MODEL_FIELDS.items() if k in fields}
    return {**saved, "model": {**added, **record.legacy, **model}}


def differences(saved: dict, config: ConfigDict) -> dict[str, tuple]:
    """The keys whose value differs from a saved config.json (upgraded first) and would change
    the run, each with its (saved, new) value."""
    old, new = flatten(upgrade(saved)), flatten(config)
    if "" in (old.get(FINGERPRINT), new.get(FINGERPRINT)):
        for flat in (old, new):
            flat.pop(FINGERPRINT, None)
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return {k: (old.get(k), new.get(k)) for k in changed if not k.startswith(RESUMABLE_CHANGES)}


def check(config, folder: Path, has_training: bool) -> None:
    """Refuse a run folder that holds training (``has_training``: the caller's own checkpoint;
    or a finished summary) of another config, up to ``RESUMABLE_CHANGES``."""
    if not has_training and workdir.finished(folder) is None:  # finished() refuses a file
        return
    old = workdir.read_json(Path(folder) / workdir.CONFIG)
    if old is None:
        return
    changed = differences(old, config)
    if changed:
        listed = "; ".join(f"{k}: {was!r} -> {now!r}" for k, (was, now) in changed.items())
        raise ConfigError(
            f"{folder} holds a run of another config (differs in {listed}); use a new "
            "--workdir, or the saved config"
        )
