"""What a run records: metrics.jsonl and eval.jsonl (data first), TensorBoard, W&B, MFU.

Only process 0 writes. A resumed run first cuts both JSONL files back to the restored step
(dropping lines a killed run wrote after its last checkpoint, and a torn last line), and
starts TensorBoard with ``purge_step`` so that TensorBoard hides the old events past it: each
step appears once. The cut truncates the file in place: only a suffix goes, so a kill during
it loses nothing, and a long log costs one read and no copy.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax

from lmuscale.outcomes import StorageError

# Dense peak FLOP/s per device by device kind (first match wins) and compute dtype. On GPUs,
# float32 matmuls run as TF32 under JAX's default precision, so float32 uses the TF32 peak.
# Vendor data sheets; sparsity excluded.
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


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """Peak FLOP/s of one device for ``dtype`` compute, or None for an unknown device."""
    for name, peaks in PEAK_FLOPS:
        if name.lower() in device_kind.lower():
            return peaks[dtype]
    return None


def device_peak(dtype: str, configured: float = 0.0) -> float | None:
    if configured > 0:
        return configured
    return peak_flops(jax.devices()[0].device_kind, dtype)


def mfu(tokens_per_second: float, train_flops_per_token: float, devices: int, peak) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak (None if unknown)."""
    if not peak:
        return None
    return tokens_per_second * train_flops_per_token / (devices * peak)


class DamagedLog(StorageError):
    """A metrics.jsonl or eval.jsonl that a resumed run cannot continue: a line other than the
    last is not a log line, or the steps go back. The message names the file and line."""


def _step(line: bytes) -> int | None:
    """The step of a log line, or None."""
    try:
        record = json.loads(line.decode())  # json.loads decodes bytes a third slower
    except ValueError:  # UnicodeDecodeError included
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _cut(path: Path, step: int) -> None:
    """Truncate ``path`` after its last line whose step is <= ``step``, in place.

    A kill can tear only the last line, which is dropped; an unreadable line anywhere else,
    or a step below an earlier one, is damage that a cut would hide or spread: DamagedLog.
    """
    if not path.exists():
        return
    remedy = f"mend it, or move it away and the run starts a new one after step {step}"
    with path.open("r+b") as f:
        offset = keep = 0  # bytes read; bytes of the lines kept
        bad, previous = None, None  # an unreadable line's number; the last step seen
        ended = True  # whether the kept lines end with a newline
        for number, line in enumerate(f, 1):
            if bad is not None:
                raise DamagedLog(
                    f"{path}:{bad}: not a JSON log line with a step, and not the last line "
                    f"(only a kill's torn last line is dropped); {remedy}"
                )
            at = _step(line)
            if at is None:
                bad = number
                continue
            if previous is not None and at < previous:
                raise DamagedLog(
                    f"{path}:{number}: step {at} after step {previous}; the lines must be in "
                    f"step order (did two runs write to this workdir?); {remedy}"
                )
            previous = at
            offset += len(line)
            if at <= step:
                keep, ended = offset, line.endswith(b"\n")
        if keep < f.seek(0, os.SEEK_END):
            f.truncate(keep)
        elif not ended:  # a whole last line without its newline (a kill, or an editor)
            f.write(b"\n")
        else:
            return
        os.fsync(f.fileno())


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN; "nan" / "inf" keep the line loadable
    return value


class MetricsLog:
    """Append-only JSONL logs plus TensorBoard scalars and, with ``wandb`` (the run's config
    when ``log.wandb`` is on), the same records in W&B (``wandb_log``); for process 0 (no-ops
    elsewhere). W&B starts last, after the logs are cut: a damaged log stops the run first."""

    def __init__(
        self, workdir: Path, resume_step: int, *, enabled: bool, tensorboard: bool, wandb=None
    ):
        self.enabled = enabled
        self.paths = {"train": workdir / "metrics.jsonl", "eval": workdir / "eval.jsonl"}
        self.files = {}
        self.writer = None
        self.wandb = None
        if not enabled:
            return
        for path in self.paths.values():
            _cut(path, resume_step)
        try:
            for kind, path in self.paths.items():
                self.files[kind] = path.open("a", encoding="utf-8")
            if tensorboard:
                from tensorboardX import SummaryWriter

                # Also at step 0: a run killed before its first checkpoint left events to hide.
                self.writer = SummaryWriter(
                    str(workdir / "tensorboard"), purge_step=resume_step + 1
                )
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
        file.write(json.dumps(clean) + "\n")
        file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{kind}/{key}", value, record["step"])
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(kind, record)

    def summary(self, summary: dict) -> None:
        """The run's summary (summary.json's dict), for W&B; the caller writes the file."""
        if self.wandb is not None:
            self.wandb.summary(summary)

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.files = {}
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
