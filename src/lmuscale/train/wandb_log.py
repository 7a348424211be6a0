"""Weights & Biases (``log.wandb``): the run's logs, config and summary, mirrored to a W&B run.

``wandb`` is imported only when it is on; only process 0 talks to W&B (``metrics.MetricsLog``).
One training run is one W&B run however often it resumes: its id is kept in ``wandb.json``.
A resume recomputes the steps after its checkpoint, and W&B drops anything logged below its
highest step, so steps below ``starting_step`` (known online) are not sent again; an offline
session sends them all (W&B's rewind, ``resume_from``, is server-side only).
"""

from __future__ import annotations

import json
import os
import secrets
import string
import sys
from pathlib import Path

from lmuscale.files import atomic_write_json
from lmuscale.outcomes import ConfigError, LoggingServiceError, one_line
from lmuscale.resume import flatten
from lmuscale.workdir import WANDB

MISSING = "log.wandb=true needs the wandb package: pip install -e '.[wandb]'"
REMEDY = (
    "check the network and `wandb login`, or run with --config.log.wandb_mode=offline "
    "(upload later with `wandb sync`) or --config.log.wandb=false"
)


def import_wandb():
    """The ``wandb`` module, or the ConfigError that says how to install it."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(MISSING) from None
    return wandb


def stored_id(workdir: Path) -> str | None:
    """The W&B run id in ``WORKDIR/wandb.json``, or None when the run has none yet."""
    path = workdir / WANDB
    remedy = "mend it, or move it away and the run logs to a new W&B run"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise LoggingServiceError(f"{path}: cannot be read ({error}); {remedy}") from None
    run_id = record.get("id") if isinstance(record, dict) else None
    if not isinstance(run_id, str) or not run_id:
        raise LoggingServiceError(f'{path}: no W&B run id (expected {{"id": "..."}}); {remedy}')
    return run_id


def _failed(what: str, error: Exception, remedy: str = REMEDY) -> LoggingServiceError:
    return LoggingServiceError(
        f"log.wandb: W&B could not {what} ({one_line(error, named=True)}); {remedy}"
    )


class WandbRun:
    """The W&B run of the training run in ``workdir``, started or resumed on construction."""

    def __init__(self, config, workdir: Path):
        self.wandb = import_wandb()
        run_id = stored_id(workdir)
        if run_id is None:
            alphabet = string.ascii_lowercase + string.digits  # W&B's ids: 8 of these
            run_id = "".join(secrets.choice(alphabet) for _ in range(8))
            # Before W&B starts: a session killed at any moment after this resumes this id.
            atomic_write_json(workdir / WANDB, {"id": run_id})
        self.id = run_id
        log = config.log
        options = {
            "id": run_id,
            "resume": "allow",  # "must" would refuse an offline run's id the server never saw
            "project": log.wandb_project or None,
            "name": log.wandb_name or config.name or None,
            "group": log.wandb_group or None,
            "mode": log.wandb_mode or None,
            "config": flatten(config),
        }
        if not os.environ.get("WANDB_DIR"):
            options["dir"] = str(workdir)
        try:
            self.run = self.wandb.init(**options)
            # Where W&B's history of a resumed run ends (online; 0 for a new or offline run).
            self.first_step = int(self.run.starting_step or 0)
        except Exception as error:
            raise _failed(f"start run {run_id}", error) from None
        self.finished = False

    def log(self, step: int, scalars: dict) -> None:
        """A metrics.jsonl or eval.jsonl line's numbers, named ``train/KEY`` or ``eval/KEY``."""
        if step < self.first_step:
            return  # W&B holds this step already (see the module's docstring)
        try:
            self.run.log(scalars, step=step)
        except Exception as error:
            raise _failed(f"log step {step} of run {self.id}", error) from None

    def summary(self, summary: dict) -> None:
        """summary.json's dict: scalars, and per-position losses as a table and a line plot."""
        curves = {
            key.removesuffix("_per_position"): value
            for key, value in summary.items()
            if key.endswith("_per_position")
        }
        scalars = flatten({k: v for k, v in summary.items() if not k.endswith("_per_position")})
        try:
            self.run.summary.update(scalars)
            if curves:
                self.run.log(self._per_position(curves))
        except Exception as error:
            raise _failed(f"take the summary of run {self.id}", error) from None
        self.finished = summary.get("status") == "finished"

    def _per_position(self, curves: dict[str, list[float]]) -> dict:
        splits = list(curves)
        positions = list(range(len(curves[splits[0]])))
        rows = [[p, *(curves[s][p] for s in splits)] for p in positions]
        table = self.wandb.Table(columns=["position", *(f"{s}_loss" for s in splits)], data=rows)
        plot = self.wandb.plot.line_series(
            xs=positions,
            ys=[curves[s] for s in splits],
            keys=splits,
            title="loss at each position (nats)",
            xname="position",
        )
        return {"per_position": table, "per_position_loss": plot}

    def finish(self) -> None:
        """End the W&B session: exit code 0 after a finished summary, else 1. A failure is
        said on stderr, not raised: it would hide how the run ended."""
        try:
            self.run.finish(exit_code=0 if self.finished else 1)
        except Exception as error:
            complete = "the workdir's logs and summary are complete"
            print(_failed(f"finish run {self.id}", error, complete), file=sys.stderr, flush=True)
