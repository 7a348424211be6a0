"""The rules every run's workdir follows, for language-model training (``train``), the
parallel-LMU tasks (``tasks``) and the sweep's trials, which are ``train`` workdirs:

- ``config.json`` holds the run's resolved config. A workdir that holds training (a
  checkpoint, or a finished summary) resumes only the same config (``check``); one that
  holds none (a run that failed or diverged before its first checkpoint) takes a new one.
- ``summary.json`` with ``"status": "finished"`` is a finished run: running it again returns
  that summary and trains nothing (``finished``), whatever checkpoints or data remain.
- A loss that becomes NaN or infinite stops the run with ``TrainingDiverged``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ml_collections import ConfigDict

from lmuscale.files import atomic_write_bytes
from lmuscale.train.config import ConfigError, differences, flatten, saved_flat, to_json

CONFIG = "config.json"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"  # language-model training's (and so a sweep trial's)


class TrainingDiverged(RuntimeError):
    """The loss or the parameters became NaN or infinite."""


def check(config: ConfigDict, workdir: Path, has_checkpoint: bool) -> None:
    """Refuse a workdir that holds training of another config (``has_checkpoint``: the
    caller's own checkpoint, or a finished summary); keys that do not change the trained
    numbers (``config.RESUMABLE_CHANGES``) may differ."""
    saved = Path(workdir) / CONFIG
    if not ((has_checkpoint or finished(workdir) is not None) and saved.exists()):
        return
    try:
        old = json.loads(saved.read_text())
    except ValueError as error:
        raise ConfigError(f"{saved}: not JSON ({error})") from None
    changed = differences(old, config)
    if changed:
        old_flat, new_flat = saved_flat(old), flatten(config)
        listed = "; ".join(f"{k}: {old_flat.get(k)!r} -> {new_flat.get(k)!r}" for k in changed)
        raise ConfigError(
            f"{workdir} holds a run of another config (differs in {listed}); use a new "
            "--workdir, or the saved config"
        )


def has_checkpoint(workdir: Path) -> bool:
    folder = Path(workdir) / CHECKPOINTS
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def write_config(config: ConfigDict, workdir: Path) -> None:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(workdir / CONFIG, to_json(config).encode())


def finished(workdir: Path) -> dict | None:
    """The summary of a finished run in ``workdir``, or None."""
    path = Path(workdir) / SUMMARY
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as error:
        raise ConfigError(f"{path}: not JSON ({error}); move it away to run again") from None
    # A task summary written before summaries had a status is a finished run (a training
    # summary has always had one).
    return summary if summary.get("status", "finished") == "finished" else None
