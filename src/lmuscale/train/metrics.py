"""What a run records: metrics.jsonl and eval.jsonl (data first), TensorBoard, W&B, MFU, and
the plain progress line printed instead of a bar when the output is not a terminal.

Only process 0 writes. Both JSONL files are on disk (fsync) before each checkpoint is saved,
and the checkpoint records the step of each one's last line. A resumed run cuts both back to the
restored step, says which lines that the checkpoint covers are missing (a log written by an
older lmuscale, or a filesystem that lost them), and starts TensorBoard with ``purge_step``
(which hides the old events past it): each step appears once.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import jax
import numpy as np

from lmuscale.files import unwritable, writing
from lmuscale.workdir import EVAL, METRICS, TENSORBOARD, cut_log

# Dense peak FLOP/s per device by device kind (first match wins) and compute dtype, from vendor
# data sheets. On GPUs, float32 matmuls run as TF32 under JAX's default precision: the TF32 peak.
PEAK_FLOPS = (
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 378e12}),
    ("H100", {"bfloat16": 989.4e12, "float32": 494.7e12}),
    ("H200", {"bfloat16": 989.4e12, "float32": 494.7e12}),
    ("A100", {"bfloat16": 312e12, "float32": 156e12}),
    ("TPU v4", {"bfloat16": 275e12, "float32": 275e12}),
    ("TPU v5 lite", {"bfloat16": 197e12, "float32": 197e12}),
    ("TPU v5", {"bfloat16": 459e12, "float32": 459e12}),
    ("TPU v6 lite", {"bfloat16": 918e12, "float32": 918e12}),
)


def device_peak(dtype: str, configured: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: ``configured`` when > 0, else ``PEAK_FLOPS``'s (or None)."""
    if configured > 0:
        return configured
    device_kind = jax.devices()[0].device_kind.lower()
    return next((peaks[dtype] for name, peaks in PEAK_FLOPS if name.lower() in device_kind), None)


def mfu(tokens_per_second: float, train_flops_per_token: float, devices: int, peak) -> float | None:
    """Achieved model FLOP/s over the devices' peak (None if unknown)."""
    return tokens_per_second * train_flops_per_token / (devices * peak) if peak else None


def duration(seconds) -> str:
    """``seconds`` for a person: "42 s", "3.5 min" or "2.1 h" ("-" for None)."""
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def progress_line(record: dict, steps: int, mean_of: int, seconds_left: float | None) -> str:
    """One line for a ``metrics.jsonl`` record of a run of ``steps`` steps, whose ``loss_mean``
    is the mean of ``mean_of`` steps' losses."""
    speed = record["tokens_per_second"]
    return (
        f"step {record['step']}/{steps}: loss {record['loss']:.4f} ({mean_of}-step mean "
        f"{record['loss_mean']:.4f}), {f'{speed:,.0f}' if speed else '?'} tokens/s, "
        f"{duration(record['elapsed'])} elapsed, "
        + ("ETA unknown" if seconds_left is None else f"ETA {duration(seconds_left)}")
    )


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN; "nan" / "inf" keep the line loadable
    return value


class Events:
    """TensorBoard scalars in an event file of their own, written in this thread (tensorboardX's
    writer has a thread and an exit hook of its own, which a full disk turned into tracebacks
    at exit). ``purge_step``: TensorBoard hides the folder's older events from it on."""

    def __init__(self, folder: Path, purge_step: int):
        from tensorboardX.proto import event_pb2
        from tensorboardX.record_writer import RecordWriter

        self.event = event_pb2.Event
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        path, k = folder / stem, 1
        while path.exists():  # a resume within the same second
            path, k = folder / f"{stem}.{k}", k + 1
        self.records = RecordWriter(str(path))
        self._add(step=purge_step, file_version="brain.Event:2")
        self._add(step=purge_step, session_log={"status": "START"})

    def _add(self, **fields) -> None:
        self.records.write(self.event(wall_time=time.time(), **fields).SerializeToString())

    def write(self, step: int, scalars: dict) -> None:
        values = [{"tag": tag, "simple_value": float(v)} for tag, v in scalars.items()]
        self._add(step=step, summary={"value": values})
        self.records.flush()

    def close(self) -> None:
        self.records.close()


class MetricsLog:
    """Append-only JSONL logs, TensorBoard scalars and, with ``wandb`` (the run's config), W&B;
    no-ops unless ``enabled``. W&B starts last, after the logs are cut: a damaged log stops the
    run first. ``logged``: each log's last step when the restored checkpoint was saved (``last``
    then; absent in a checkpoint of an older lmuscale)."""

    def __init__(
        self,
        workdir: Path,
        resume_step: int,
        *,
        enabled: bool,
        tensorboard: bool,
        wandb=None,
        logged: dict | None = None,
    ):
        self.enabled = enabled
        self.paths = paths = {"train": workdir / METRICS, "eval": workdir / EVAL}
        self.files = {}
        self.last = dict(logged or {})  # {kind: the step of its last line written}
        self.writer = self.wandb = None
        if not enabled:
            return
        for kind, path in paths.items():
            kept = cut_log(path, resume_step)
            lost = self.last.get(kind)
            if lost is not None and (kept is None or kept < lost):
                after = "from its start" if kept is None else f"after step {kept}"
                print(
                    f"warning: {path}: its lines {after} through step {lost} are lost (written "
                    f"before checkpoint {resume_step} was, but not on disk); the run goes on "
                    "without them",
                    file=sys.stderr,
                    flush=True,
                )
                self.last[kind] = kept  # said once: the next checkpoint records what is there
        try:
            for kind, path in paths.items():
                self.files[kind] = path.open("a", encoding="utf-8")
            if tensorboard:
                # Also at step 0: a run killed before its first checkpoint left events to hide.
                self.events_path = workdir / TENSORBOARD
                with writing(self.events_path):
                    self.writer = Events(self.events_path, purge_step=resume_step + 1)
            if wandb is not None:
                from lmuscale.train.wandb_log import WandbRun

                self.wandb = WandbRun(wandb, workdir)
        except BaseException:
            self.close()
            raise

    def write(self, kind: str, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: _json_value(v) for k, v in record.items()}
        file = self.files[kind]
        with writing(self.paths[kind]):  # a full disk: the checkpoints before this are intact
            file.write(json.dumps(clean) + "\n")
            file.flush()
        self.last[kind] = record["step"]
        scalars = {
            f"{kind}/{key}": value
            for key, value in record.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
        }
        if self.writer is not None:
            with writing(self.events_path):
                self.writer.write(record["step"], scalars)
        if self.wandb is not None:
            self.wandb.log(record["step"], scalars)

    def sync(self) -> None:
        """Put both logs on disk (before a checkpoint that covers their lines is saved)."""
        for kind, file in self.files.items():
            with writing(self.paths[kind]):
                os.fsync(file.fileno())

    def summary(self, summary: dict) -> None:
        """summary.json's dict, for W&B; the caller writes the file."""
        if self.wandb is not None:
            self.wandb.summary(summary)

    def close(self) -> None:
        failed = None
        for kind, file in self.files.items():
            try:
                file.close()  # flushes what a failed write left
            except OSError as error:
                failed = failed or unwritable(self.paths[kind], error)
        self.files = {}
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as error:
                failed = failed or unwritable(self.events_path, error)
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if failed is not None:
            raise failed


class StepMetrics:
    """The train steps' metrics on their way from the devices (``add``) to the log (``fetch``),
    and the losses fetched since the last log line (``window``; a checkpoint holds it)."""

    def __init__(self, window: list[float] = ()):
        self.pending = []  # (step, metrics on the device) not yet fetched
        self.window = [float(loss) for loss in window]
        self.latest = None  # the last fetched step's metrics, as floats

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, metrics))

    def fetch(self) -> tuple[int, dict] | None:
        """Wait for the pending steps: the first ``(step, metrics)`` whose loss or parameters
        are not finite (the window is left as it was), else None."""
        fetched = [(step, jax.device_get(m)) for step, m in self.pending]
        self.pending = []
        bad = next(((step, m) for step, m in fetched if not m["finite"]), None)
        if bad is not None:
            return bad
        for _, metrics in fetched:
            self.latest = {k: float(v) for k, v in metrics.items()}
            self.window.append(self.latest["loss"])
        return None

    def window_mean(self) -> float:
        """The mean loss of the window, which then starts again, empty."""
        mean = float(np.mean(self.window))
        self.window = []
        return mean
