"""Weights & Biases (``log.wandb``): the run's logs, config and summary, mirrored to a W&B run.

Off by default; ``wandb`` is imported only when it is on (``pip install -e '.[wandb]'``), and
only process 0 talks to W&B, through ``metrics.MetricsLog``:

- each line of metrics.jsonl and eval.jsonl is logged at its step as ``train/KEY`` and
  ``eval/KEY`` (TensorBoard's tags; a None, such as an unknown MFU, is left out);
- the W&B config is the resolved config, flattened (``train.steps``);
- at the end the W&B summary gets summary.json's values, nested keys flattened
  (``params.total``), and the per-position losses as a table (``per_position``: position,
  val_loss, test_loss in nats) and a line plot (``per_position_loss``). A run that ends
  without a finished summary (interrupted, diverged, failed) is finished in W&B with exit
  code 1; the session that completes it marks it finished.

One training run is one W&B run, however often it resumes: the first session picks the W&B
run id and writes it to ``WORKDIR/wandb.json`` before it starts W&B, and every session opens
that id with ``resume="allow"``. W&B's own files go to ``WORKDIR/wandb/`` unless ``WANDB_DIR``
is set (an offline run is uploaded with ``wandb sync WORKDIR/wandb/offline-run-*``).

Steps after a resume: W&B's step only goes up, and it drops, with a warning, anything logged
below the highest step it holds. A resumed run restarts at its checkpoint's step, so it logs
again the steps between that checkpoint and where the last session stopped (metrics.jsonl is
cut back to the checkpoint for the same reason). Those steps are recomputed bit for bit (the
batch and the keys are functions of (seed, step), the checkpoint holds the rest): the losses
and learning rates W&B already holds for them are the ones it would be sent again, and only
the timings differ. So when W&B says where the run's history ends (``starting_step``, on an
online resume) the steps below it are not sent. An offline session cannot know what the
server holds and records every step from the checkpoint on; W&B deals with the overlap when
the offline runs are synced. (W&B's rewind, ``resume_from``, would cut W&B's history back as
metrics.jsonl is cut, but it is a server-side feature with no offline form.)
"""

from __future__ import annotations

import json
import os
import secrets
import string
import sys
from pathlib import Path

from lmuscale.files import atomic_write_json
from lmuscale.outcomes import LoggingServiceError, one_line
from lmuscale.train.config import ConfigError, flatten
from lmuscale.workdir import WANDB

MISSING = "log.wandb=true needs the wandb package: pip install -e '.[wandb]'"
REMEDY = (
    "check the network and `wandb login`, or run with --config.log.wandb_mode=offline "
    "(upload later with `wandb sync`) or --config.log.wandb=false"
)


class WandbError(LoggingServiceError):
    """W&B could not start or log a run, or ``wandb.json`` is unreadable; the message names
    ``log.wandb`` (or the file) and says what to do."""


def import_wandb():
    """The ``wandb`` module, or the ConfigError that says how to install it."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(MISSING) from None
    return wandb


def require(config) -> None:
    """Before training: ``log.wandb`` needs the wandb package."""
    if config.log.wandb:
        import_wandb()


def stored_id(workdir: Path) -> str | None:
    """The W&B run id in ``WORKDIR/wandb.json``, or None when the run has none yet."""
    path = Path(workdir) / WANDB
    remedy = "mend it, or move it away and the run logs to a new W&B run"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise WandbError(f"{path}: cannot be read ({error}); {remedy}") from None
    run_id = record.get("id") if isinstance(record, dict) else None
    if not isinstance(run_id, str) or not run_id:
        raise WandbError(f'{path}: no W&B run id (expected {{"id": "..."}}); {remedy}')
    return run_id


def new_id() -> str:
    """A W&B run id: 8 lowercase letters and digits, as W&B makes them."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class WandbRun:
    """The W&B run of the training run in ``workdir``, started (or resumed) on construction
    from the run's ``config``."""

    def __init__(self, config, workdir: Path):
        self.wandb = import_wandb()
        workdir = Path(workdir)
        run_id = stored_id(workdir)
        if run_id is None:
            run_id = new_id()
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
            raise WandbError(
                f"log.wandb: W&B could not start run {run_id} "
                f"({one_line(error, named=True)}); {REMEDY}"
            ) from None
        self.finished = False

    def log(self, kind: str, record: dict) -> None:
        """One line of metrics.jsonl (``kind`` "train") or eval.jsonl ("eval") at its step."""
        step = record["step"]
        if step < self.first_step:
            return  # W&B holds this step already (see the module's docstring)
        data = {f"{kind}/{k}": v for k, v in record.items() if k != "step" and _is_number(v)}
        try:
            self.run.log(data, step=step)
        except Exception as error:
            raise WandbError(
                f"log.wandb: W&B could not log step {step} of run {self.id} "
                f"({one_line(error, named=True)}); {REMEDY}"
            ) from None

    def summary(self, summary: dict) -> None:
        """The run's summary (summary.json's dict): scalars, and per-position losses as a table
        and a line plot."""
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
            raise WandbError(
                f"log.wandb: W&B could not take the summary of run {self.id} "
                f"({one_line(error, named=True)}); {REMEDY}"
            ) from None
        self.finished = summary.get("status") == "finished"

    def _per_position(self, curves: dict[str, list[float]]) -> dict:
        wandb = self.wandb
        splits = list(curves)
        positions = list(range(len(curves[splits[0]])))
        rows = [[p, *(curves[s][p] for s in splits)] for p in positions]
        table = wandb.Table(columns=["position", *(f"{s}_loss" for s in splits)], data=rows)
        plot = wandb.plot.line_series(
            xs=positions,
            ys=[curves[s] for s in splits],
            keys=splits,
            title="loss at each position (nats)",
            xname="position",
        )
        return {"per_position": table, "per_position_loss": plot}

    def finish(self) -> None:
        """End the W&B session: exit code 0 after a finished summary, else 1. A failure here
        is said on stderr and not raised: the run's own files are complete, and raising would
        hide how the run ended."""
        try:
            self.run.finish(exit_code=0 if self.finished else 1)
        except Exception as error:
            print(
                f"log.wandb: W&B could not finish run {self.id} "
                f"({one_line(error, named=True)}); the workdir's logs and summary are complete",
                file=sys.stderr,
                flush=True,
            )
