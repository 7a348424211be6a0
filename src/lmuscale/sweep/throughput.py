"""The model FLOP/s a sweep's trials are assumed to reach before they have measured their own.

A sweep file's ``THROUGHPUT`` is a number (``5e9``) or ``from_benchmarks(folder, default)``:
the per-model training speeds ``benchmarks/gpu.py`` measured at 512 x 1024 tokens per step,
from ``folder/gpu-<device>.json``. ``$LMUSCALE_GPU_BENCHMARK`` picks the file (a path, or part
of the device name such as ``h100``; naming none is an error, not a silent guess); otherwise
the most recently written one that was not measured on a CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

from lmuscale.models import fused_loss
from lmuscale.outcomes import DataError

ENV = "LMUSCALE_GPU_BENCHMARK"


class BenchmarkError(DataError):
    """A GPU benchmark file that cannot be read, or ``$LMUSCALE_GPU_BENCHMARK`` picking none."""


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Model FLOP/s per trial: ``measured`` maps (family, non-embedding N) to a benchmark's
    figure, ``default`` covers the rest, and ``source`` says where they came from."""

    default: float | None
    measured: Mapping[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    source: str = ""

    def lookup(self, family: str, n: int) -> tuple[float | None, str | None]:
        """(FLOP/s, label) for a model: ``"benchmark"`` (this model was benchmarked),
        ``"benchmark family"`` (the median of its family's), ``"configured"`` (the default),
        or (None, None) when there is no figure at all."""
        if (family, n) in self.measured:
            return self.measured[(family, n)], "benchmark"
        same_family = [speed for (f, _), speed in self.measured.items() if f == family]
        if same_family:
            return statistics.median(same_family), "benchmark family"
        if self.default:
            return self.default, "configured"
        return None, None


@dataclasses.dataclass(frozen=True)
class _Benchmark:
    path: Path
    platform: str  # "gpu", "tpu", "cpu"
    device: str  # the device kind, e.g. "NVIDIA H100 80GB HBM3"
    devices: int
    written: str  # as the file gives it
    when: datetime  # written, parsed (UTC where it names no zone)
    speeds: dict[tuple[str, int], float]


def from_benchmarks(
    folder: str | Path, default: float | None = None, *, seq_len: int = 1024, batch: int = 512
) -> Throughput:
    """The GPU benchmark in ``folder`` (see the module docstring), or else just ``default``,
    with a ``source`` (which ``--dry-run`` prints) that says it is a guess, and why."""
    if default is not None and not (isinstance(default, int | float) and default > 0):
        raise BenchmarkError(f"from_benchmarks: default must be a positive FLOP/s, not {default!r}")
    default = default and float(default)
    try:
        return load_benchmarks(folder, default, seq_len=seq_len, batch=batch)
    except BenchmarkError as error:
        guess = f"THROUGHPUT guess {default:g} FLOP/s" if default else "no FLOP/s"
        return Throughput(default, source=f"{guess}, as {error}")


def load_benchmarks(
    folder: str | Path, default: float | None = None, *, seq_len: int = 1024, batch: int = 512
) -> Throughput:
    """``from_benchmarks`` without its fallback: where there is no benchmark to use (none in
    ``folder``, a file that cannot be read, ``$LMUSCALE_GPU_BENCHMARK`` naming none), a
    ``BenchmarkError`` that says why."""
    folder = Path(folder)
    found = [_read(path, seq_len, batch) for path in sorted(folder.glob("gpu-*.json"))]
    choice = os.environ.get(ENV, "")
    if choice:
        benchmark = _pick(choice, found, folder, seq_len, batch)
    else:
        # benchmarks/gpu.py run on a CPU (to check it, or to plan memory) writes gpu-cpu.json:
        # no figure for a sweep's trials, unless $LMUSCALE_GPU_BENCHMARK names it.
        usable = [b for b in found if b.platform != "cpu" and b.speeds]
        if not usable:
            what = f"training rows at {batch} x {seq_len} tokens" if found else "(gpu-*.json)"
            raise BenchmarkError(f"there is no GPU benchmark {what} in {_short(folder)}")
        benchmark = max(usable, key=lambda b: b.when)
    device = benchmark.device + (f" x{benchmark.devices}" if benchmark.devices != 1 else "")
    source = f"GPU benchmark {_short(benchmark.path)} ({device}, written {benchmark.written})"
    if default:
        source += f"; models and families it lacks: {default:g} FLOP/s"
    return Throughput(default, benchmark.speeds, source)


def _read(path: Path, seq_len: int, batch: int) -> _Benchmark:
    """A benchmark file, checked for the keys this module reads."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BenchmarkError(f"{path}: not a readable JSON file ({error})") from None
    problem = None
    machine = data.get("machine") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("benchmark") != "gpu":
        problem = 'expected an object with "benchmark": "gpu"'
    elif not isinstance(machine, dict) or not isinstance(machine.get("device_kind"), str):
        problem = 'expected "machine": {"device_kind": "...", ...}'
    elif not isinstance(data.get("parts"), dict):
        problem = 'expected "parts": {"train/FAMILY": {"rows": [...]}, ...}'
    if problem:
        raise BenchmarkError(f"{path}: {problem}")
    try:
        when = datetime.fromisoformat(data.get("written"))
    except (TypeError, ValueError):
        raise BenchmarkError(
            f'{path}: "written" is {data.get("written")!r}; expected an ISO time such as '
            '"2026-11-23T10:00:00+00:00"'
        ) from None
    return _Benchmark(
        path,
        str(machine.get("platform", "gpu")),
        machine["device_kind"],
        machine.get("device_count", 1),
        data["written"],
        when if when.tzinfo else when.replace(tzinfo=UTC),
        _speeds(path, data["parts"], seq_len, batch, _auto_loss(machine)),
    )


def _auto_loss(machine: dict) -> str:
    """The cross-entropy ``loss_impl="auto"`` took on a benchmark's machine."""
    devices = [
        SimpleNamespace(
            platform=machine.get("platform", "gpu"),
            device_kind=machine["device_kind"],
            compute_capability=machine.get("compute_capability", ""),
        )
    ] * int(machine.get("device_count", 1))
    return fused_loss.resolve("auto", devices)


def _speeds(
    path: Path, parts: dict, seq_len: int, batch: int, auto: str
) -> dict[tuple[str, int], float]:
    """Model FLOP/s by (family, N), the median of the ``train/*`` rows at ``batch`` x
    ``seq_len`` that ran the cross-entropy ``loss_impl="auto"`` takes on that device (rows
    that do not name it ran "xla"); rows without a speed, or with ``error``, are left out."""
    speeds: dict[tuple[str, int], list[float]] = {}
    for name, part in parts.items():
        if not name.startswith("train/"):
            continue
        rows = part.get("rows") if isinstance(part, dict) else None
        if not isinstance(rows, list):
            raise BenchmarkError(f'{path}: parts["{name}"] has no "rows" list')
        for i, row in enumerate(rows):
            speed = row.get("model_flops_per_second") if isinstance(row, dict) else None
            if speed is None or "error" in row:
                continue
            family, n = row.get("family"), row.get("non_embedding_params")
            if not (
                isinstance(family, str)
                and isinstance(n, int)
                and isinstance(speed, int | float)
                and speed > 0
            ):
                raise BenchmarkError(
                    f'{path}: parts["{name}"] row {i} ({row.get("model")!r}): expected a '
                    '"family" name, an integer "non_embedding_params" and a positive '
                    f'"model_flops_per_second"; got {family!r}, {n!r}, {speed!r}'
                )
            shape = (row.get("seq_len"), row.get("batch"), row.get("loss_impl", "xla"))
            if shape == (seq_len, batch, auto):
                speeds.setdefault((family, n), []).append(float(speed))
    return {key: statistics.median(values) for key, values in speeds.items()}


def _pick(
    choice: str, found: list[_Benchmark], folder: Path, seq_len: int, batch: int
) -> _Benchmark:
    """The benchmark ``$LMUSCALE_GPU_BENCHMARK`` names: a file, or one device's name in part."""
    if Path(choice).is_file():
        return _read(Path(choice), seq_len, batch)
    matches = [b for b in found if choice.lower() in b.device.lower()]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise BenchmarkError(
            f"{ENV}={choice!r} matches several GPU benchmarks in {folder}: "
            f"{', '.join(b.path.name for b in matches)}; give more of the device name or a path"
        )
    listed = ", ".join(f"{b.path.name} ({b.device})" for b in found) or "none"
    raise BenchmarkError(
        f"{ENV}={choice!r} is neither a file nor part of the device name of a GPU benchmark "
        f"in {folder}; found: {listed}"
    )


def _short(path: Path) -> str:
    """``path`` relative to the current folder where it lies under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
