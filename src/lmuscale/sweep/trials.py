"""Trial folders (a training workdir plus the sweep's records, see ``lmuscale.workdir``): what
a trial's folder says about it, and the sweep's results table."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import signal
from pathlib import Path

from lmuscale.files import atomic_write_bytes, atomic_write_json
from lmuscale.models import count_params, flops_per_token
from lmuscale.outcomes import Exit
from lmuscale.sweep.spec import ResolvedTrial
from lmuscale.train.config import model_config
from lmuscale.workdir import DONE, ERROR, LOG, METRICS, TRIAL, Lock, last_record, read_json, status
from lmuscale.workdir import summary as read_summary

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
    "val_per_position",
    "test_per_position",
)


def prepare_folder(folder: Path, trial: ResolvedTrial) -> None:
    """Create the folder and its trial.json (the same bytes on every run of the runner)."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"name": trial.name, "key": trial.key, "config": trial.config.to_dict()}
    if read_json(folder / TRIAL) != record:
        atomic_write_json(folder / TRIAL, record)


def result_row(trial: ResolvedTrial, folder: Path) -> dict:
    """One row of the results table, from the config and whatever the folder holds."""
    c = trial.config
    model = model_config(c.model)
    params = count_params(model)
    flops = flops_per_token(model, c.data.seq_len).train
    tokens = c.train.steps * c.train.global_batch * c.data.seq_len
    row = dict.fromkeys(RESULT_FIELDS)
    row.update(
        trial=trial.name,
        family=model.family,
        role=trial.role,
        N=params.non_embedding,
        total_params=params.total,
        seq_len=c.data.seq_len,
        tokenizer=c.data.tokenizer,
        global_batch=c.train.global_batch,
        steps=c.train.steps,
        tokens=tokens,
        flops_per_token=flops,
        total_flops=flops * tokens,
        learning_rate=c.optim.learning_rate,
        seed=c.train.seed,
        status=status(folder),
        folder=folder.name,
    )
    summary = read_summary(folder) or {}
    if row["status"] == "finished":
        for key in (
            "val_loss",
            "test_loss",
            "val_bits_per_byte",
            "test_bits_per_byte",
            "wall_seconds",
            "val_per_position",
            "test_per_position",
        ):
            row[key] = summary.get(key)
        row["step"] = c.train.steps
    else:
        last = last_record(folder / METRICS)
        if last:
            row["step"], row["wall_seconds"] = last.get("step"), last.get("elapsed")
        if row["status"] == "diverged":
            row["error"], row["step"] = summary.get("error"), summary.get("step")
        elif row["status"] == "failed":
            error = read_json(folder / ERROR) or {}
            row["error"] = error.get("traceback") or error.get("error")
    return row


def write_results(workdir: Path, rows: list[dict]) -> None:
    """``results.jsonl`` and ``results.csv``, each replaced atomically (per-position losses
    are JSON lists in the CSV, and None an empty cell)."""
    lines = "".join(json.dumps(_clean(row)) + "\n" for row in rows)
    atomic_write_bytes(workdir / "results.jsonl", lines.encode())
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=RESULT_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in _clean(rows):
        writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    atomic_write_bytes(workdir / "results.csv", buffer.getvalue().encode())


def _clean(value):
    """NaN and infinity become null, also inside lists: JSON has neither."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def record_crash(folder: Path, returncode: int) -> None:
    """A worker that died without its own error.json (a signal, a crash in native code, the
    kernel's OOM killer) gets one that says how it ended and ends with its last output."""
    if (folder / ERROR).exists():
        return
    lock = Lock(folder)
    if not lock.acquire():  # someone else has started the trial again: not ours to mark
        return
    try:
        if (folder / ERROR).exists() or status(folder) in DONE:
            return
        how = f"exit status {returncode}"
        if returncode < 0:
            how = f"signal {signal.Signals(-returncode).name}"
        else:
            with contextlib.suppress(ValueError):  # a status outside the table says no more
                how += f" ({Exit(returncode).meaning})"
        log = folder / LOG
        tail = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
        text = "\n".join([f"the worker ended with {how}; the end of {LOG}:", *tail])
        atomic_write_json(folder / ERROR, {"error": f"worker ended with {how}", "traceback": text})
    finally:
        lock.release()
