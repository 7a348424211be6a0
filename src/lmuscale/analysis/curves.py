"""Evaluation curves: each run's validation loss against the tokens (and FLOPs) trained on,
from the ``eval.jsonl`` (``step``, ``val_loss``) of the trial folder the results table names."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from lmuscale.analysis.results import Results, Run
from lmuscale.sweepdir import TRIALS
from lmuscale.workdir import EVAL


@dataclass(frozen=True)
class Curve:
    """One run's evaluations in step order: ``tokens`` trained on and ``loss`` (nats) there."""

    run: Run
    tokens: np.ndarray
    loss: np.ndarray

    @property
    def flops(self) -> np.ndarray:
        """Training FLOPs at each evaluation (needs the table's flops_per_token)."""
        if self.run.flops_per_token is None:
            raise ValueError(f"{self.run.trial}: the results table has no flops_per_token")
        return self.tokens * self.run.flops_per_token


def load_curves(results: Results) -> tuple[dict[str, Curve], list[str]]:
    """The curve of every run that has one, by trial name, and one line for each run left
    without (or each line of eval.jsonl left out: the last may be torn by a kill)."""
    curves, missing = {}, []
    for run in results.runs:
        if run.folder is None:
            missing.append(f"{run.trial}: the results table names no folder")
            continue
        # a sweep's table sits beside trials/, and names each trial's folder in it
        folder = results.path.parent / run.folder
        if not folder.is_dir() and (results.path.parent / TRIALS / run.folder).is_dir():
            folder = results.path.parent / TRIALS / run.folder
        path = folder / EVAL
        try:
            text = path.read_text()
        except FileNotFoundError:
            missing.append(f"{run.trial}: no {path}")
            continue
        except (OSError, UnicodeDecodeError) as e:
            missing.append(f"{run.trial}: {path} cannot be read ({e})")
            continue
        losses = {}  # by step: a resumed run's repeat replaces the first
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step, loss = int(row["step"]), float(row["val_loss"])
            except (ValueError, TypeError, KeyError):
                missing.append(f"{run.trial}: {path}:{number} is not an evaluation; left out")
                continue
            if math.isfinite(loss) and 0 < step <= run.steps:
                losses[step] = loss
        if len(losses) < 2:
            missing.append(f"{run.trial}: {path} has {len(losses)} finite evaluation(s)")
            continue
        order = sorted(losses)
        tokens = np.array(order, float) * run.batch_tokens
        curves[run.trial] = Curve(run, tokens, np.array([losses[s] for s in order]))
    return curves, missing
