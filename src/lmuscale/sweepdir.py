"""A sweep's folder: the one place that names its files and keeps its results table, as
``lmuscale.workdir`` is for one run's folder (each trial's, under ``trials/``).

``sweep.json`` indexes the trial folders by name (for ``python -m lmuscale.generate --trial``);
``results.jsonl`` and ``results.csv`` hold a row per trial, kept by ``Table``. Nothing here
imports training code: the analysis reads these names too.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from lmuscale.files import atomic_write_bytes, atomic_write_json
from lmuscale.workdir import ERROR, METRICS, last_record, read_json, status, summary

TRIALS = "trials"  # one run folder per trial: NAME-HASH
INDEX = "sweep.json"  # {"sweep": the sweep file, "trials": {name: "trials/NAME-HASH"}}
RESULTS = "results.jsonl"
AFTER = "after.json"  # the results table the sweep file's after() last ran on (its SHA-256)
RESULTS_CSV = "results.csv"  # the same rows; per-position losses as JSON lists, None empty

RESULT_FIELDS = (
    "trial",
    "family",
    "role",
    "N",
    "total_params",
    "seq_len",
    "tokenizer",
    "global_batch",
    "steps",
    "tokens",
    "flops_per_token",
    "total_flops",
    "branch_from",  # a branch's parent trial (its tokens and FLOPs include the parent's share)
    "branch_step",  # the parent's step it started from
    "spent_flops",  # the FLOPs its own training spent: total_flops less a branch's share
    "learning_rate",
    "seed",
    "val_loss",
    "test_loss",
    "val_bits_per_byte",
    "test_bits_per_byte",
    "wall_seconds",
    "status",
    "step",
    "error",
    "folder",
    "data_fingerprint",
    "val_per_position",
    "test_per_position",
)
# what a finished trial's row takes from its summary.json as it is: losses and time
FINAL = tuple(k for k in RESULT_FIELDS if k.startswith(("val_", "test_")) or k == "wall_seconds")


def write_index(workdir: Path, sweep: Path, folders: dict[str, str]) -> None:
    """``sweep.json``: the sweep file and each trial's folder name, by trial name (rewritten
    only when it changes)."""
    index = {
        "sweep": str(sweep.absolute()),
        "trials": {k: f"{TRIALS}/{v}" for k, v in folders.items()},
    }
    if read_json(workdir / INDEX) != index:
        atomic_write_json(workdir / INDEX, index)


def sizes(record: dict | None) -> dict | None:
    """The row's model fields from a run's final summary.json: family, N (non-embedding
    parameters), total_params and flops_per_token (training FLOPs); None when it has none."""
    record = record or {}
    params, flops = record.get("params"), record.get("flops_per_token")
    if not (isinstance(params, dict) and isinstance(flops, dict) and "family" in record):
        return None
    return {
        "family": record["family"],
        "N": params["non_embedding"],
        "total_params": params["total"],
        "flops_per_token": flops["train"],
    }


def result_row(trial, folder: Path, count: Callable[[], dict]) -> dict:
    """One row of the results table: ``trial`` (a ``ResolvedTrial``: name, role, config) and
    whatever its ``folder`` holds. The model's fields (``sizes``) come from the summary of a
    trial that ended, else from ``count()``: the config's model built and counted, the costly
    part of a row."""
    c, record, state = trial.config, summary(folder) or {}, status(folder)
    model = sizes(record) or count()
    tokens = c.train.steps * c.train.global_batch * c.data.seq_len
    row = dict.fromkeys(RESULT_FIELDS)
    row.update(
        trial=trial.name,
        family=model["family"],
        role=trial.role,
        N=model["N"],
        total_params=model["total_params"],
        seq_len=c.data.seq_len,
        tokenizer=c.data.tokenizer,
        global_batch=c.train.global_batch,
        steps=c.train.steps,
        tokens=tokens,
        flops_per_token=model["flops_per_token"],
        total_flops=model["flops_per_token"] * tokens,
        learning_rate=c.optim.learning_rate,
        seed=c.train.seed,
        status=state,
        folder=folder.name,
        data_fingerprint=(record.get("data") or {}).get("fingerprint")
        or c.data.fingerprint
        or None,
    )
    row["spent_flops"] = row["total_flops"]
    branch = getattr(trial, "branch_from", None)
    if branch is not None:
        parent, step = branch
        share = model["flops_per_token"] * step * c.train.global_batch * c.data.seq_len
        row.update(branch_from=parent, branch_step=step, spent_flops=row["total_flops"] - share)
    if state == "finished":
        row.update({key: record.get(key) for key in FINAL}, step=c.train.steps)
        return row
    last = last_record(folder / METRICS)
    if last:
        row["step"], row["wall_seconds"] = last.get("step"), last.get("elapsed")
    if state == "diverged":
        row["error"], row["step"] = record.get("error"), record.get("step")
    elif state == "failed":
        error = read_json(folder / ERROR) or {}
        row["error"] = error.get("traceback") or error.get("error")
    return row


class Table:
    """The results table of the sweep folder ``workdir``, its rows kept here by trial folder.
    A trial's row is built when the trial is first seen, and again only when it has ended: here
    (``write(..., ended=)``) or in another runner (its folder's status changed, to other than
    running). A trial's steps while it runs are in the progress line, not in the table."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.rows: dict[str, dict] = {}

    def row(self, trial, ended: bool = False) -> dict:
        folder = self.workdir / TRIALS / trial.folder_name
        row = self.rows.get(folder.name)
        if row is None or ended or status(folder) not in (row["status"], "running"):
            row = self.rows[folder.name] = trial.result_row(folder)
        return row

    def write(self, trials: Iterable, ended: Collection[str] = ()) -> list[dict]:
        """Rewrite results.jsonl and results.csv with the rows of ``trials`` (but those that
        wait for others: they have no folder yet), in their order; ``ended``: the folder
        names of trials that have just ended, whatever their status was before."""
        rows = [self.row(t, t.folder_name in ended) for t in trials if not t.waits]
        write_results(self.workdir, rows)
        return rows


def write_results(workdir: Path, rows: list[dict]) -> None:
    """``results.jsonl`` and ``results.csv``, each replaced atomically."""
    lines = "".join(json.dumps(_clean(row)) + "\n" for row in rows)
    atomic_write_bytes(Path(workdir) / RESULTS, lines.encode())
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=RESULT_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in _clean(rows):
        writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    atomic_write_bytes(Path(workdir) / RESULTS_CSV, buffer.getvalue().encode())


def _clean(value):
    """NaN and infinity become null, also inside lists: JSON has neither."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value
