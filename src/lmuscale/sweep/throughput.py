"""The model FLOP/s a sweep's trials are assumed to reach before they have measured their own.

A sweep file's ``THROUGHPUT`` is a number (``5e9``), a ``Throughput`` (per-family figures, a
per-trial overhead), or ``from_benchmarks(folder, default)``: the training speeds measured at
512 x 1024 tokens per step by ``benchmarks/gpu.py`` (``folder/gpu-<device>.json``) and
``benchmarks/train_throughput.py`` (``folder/train_throughput-<device>.json``).
``$LMUSCALE_GPU_BENCHMARK`` picks the device (a file, or part of the device name such as
``h100``; naming none is an error, not a silent guess); otherwise that of the most recently
written file not measured on a CPU. Of that device's files, each model's figure is the newest
file's. "Newest" is by the time each file records ("written"); a file that records none (an
old ``train_throughput`` one) ranks below every one that does, whatever its modification time,
which a checkout sets at random.
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

from lmuscale import ops
from lmuscale.models import family as families
from lmuscale.outcomes import DataError

ENV = "LMUSCALE_GPU_BENCHMARK"
PATTERNS = ("gpu-*.json", "train_throughput-*.json")


class BenchmarkError(DataError):
    """A GPU benchmark file that cannot be read, or ``$LMUSCALE_GPU_BENCHMARK`` picking none."""


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Model FLOP/s per trial: ``measured`` maps (family, non-embedding N) to a benchmark's
    figure (at the FLOPs count of its day; ``tokens_per_second`` holds its tokens/s where the
    file gives that count), ``families`` and then ``default`` cover the rest, and ``source``
    says where they came from. ``dtype``: the benchmark's; a trial computing in another does
    not take it. ``platform`` ("gpu", "cpu"; "" for this machine's) and ``overhead`` (seconds
    per trial, when known) set the dry run's start-up allowance (``lmuscale.sweep.plan``)."""

    default: float | None
    measured: Mapping[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    source: str = ""
    tokens_per_second: Mapping[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    families: Mapping[str, float] = dataclasses.field(default_factory=dict)
    dtype: str = ""
    platform: str = ""
    overhead: float | None = None
    guessed: bool = False  # ``default`` is ``from_benchmarks``' guess, not a figure given

    def lookup(
        self, family: str, n: int, flops_per_token: float | None = None, dtype: str | None = None
    ) -> tuple[float | None, str | None]:
        """(FLOP/s, label) for a model: ``"benchmark"`` (this model was benchmarked: its
        tokens/s times ``flops_per_token`` where both are known), ``"benchmark family"`` (the
        median of its family's, a guess), ``"configured"`` (``families``, then the default;
        ``"guess"`` where ``guessed``), or (None, None) when there is no figure at all."""
        benchmark = {} if dtype and self.dtype and dtype != self.dtype else self.measured
        if (family, n) in benchmark:
            speed = self.tokens_per_second.get((family, n))
            if speed and flops_per_token:
                return speed * flops_per_token, "benchmark"
            return benchmark[(family, n)], "benchmark"
        same_family = [speed for (f, _), speed in benchmark.items() if f == family]
        if same_family:
            return statistics.median(same_family), "benchmark family (guess)"
        if self.families.get(family):
            return self.families[family], "configured"
        label = "guess" if self.guessed else "configured"
        return (self.default, label) if self.default else (None, None)


@dataclasses.dataclass(frozen=True)
class _Benchmark:
    path: Path
    platform: str  # "gpu", "tpu", "cpu"
    device: str  # the device kind, e.g. "NVIDIA H100 80GB HBM3"
    devices: int
    written: str | None  # as the file gives it
    when: datetime  # written, parsed (UTC where it names no zone); the earliest time without
    speeds: dict[tuple[str, int], tuple[float, float | None]]  # FLOP/s, tokens/s

    @property
    def name(self) -> str:
        return self.device + (f" x{self.devices}" if self.devices != 1 else "")


def from_benchmarks(
    folder: str | Path,
    default: float | None = None,
    *,
    seq_len: int = 1024,
    batch: int = 512,
    dtype: str = "bfloat16",
) -> Throughput:
    """The GPU benchmarks in ``folder`` (see the module docstring), or else just ``default``,
    with a ``source`` (which ``--dry-run`` prints) that says it is a guess, and why."""
    if default is not None and not (isinstance(default, int | float) and default > 0):
        raise BenchmarkError(f"from_benchmarks: default must be a positive FLOP/s, not {default!r}")
    default = default and float(default)
    try:
        return load_benchmarks(folder, default, seq_len=seq_len, batch=batch, dtype=dtype)
    except BenchmarkError as error:
        guess = f"THROUGHPUT guess {default:g} FLOP/s" if default else "no FLOP/s"
        return Throughput(default, source=f"{guess}, as {error}", platform="gpu", guessed=True)


def load_benchmarks(
    folder: str | Path,
    default: float | None = None,
    *,
    seq_len: int = 1024,
    batch: int = 512,
    dtype: str = "bfloat16",
) -> Throughput:
    """``from_benchmarks`` without its fallback: where there is no benchmark to use (none in
    ``folder``, a file that cannot be read, ``$LMUSCALE_GPU_BENCHMARK`` naming none), a
    ``BenchmarkError`` that says why."""
    folder = Path(folder)
    shape = (seq_len, batch, dtype)
    paths = sorted(p for pattern in PATTERNS for p in folder.glob(pattern))
    found = [_read(path, shape) for path in paths]
    choice = os.environ.get(ENV, "")
    if choice:
        chosen = _pick(choice, found, folder, shape)
    else:
        # benchmarks run on a CPU (to check them, or to plan memory) give no figure for a
        # sweep's trials, unless $LMUSCALE_GPU_BENCHMARK names them.
        usable = [b for b in found if b.platform != "cpu" and b.speeds]
        if not usable:
            what = (
                f"training rows at {batch} x {seq_len} tokens in {dtype}"
                if found
                else f"({', '.join(PATTERNS)})"
            )
            raise BenchmarkError(f"there is no GPU benchmark {what} in {short_path(folder)}")
        device = max(usable, key=lambda b: b.when).name
        chosen = [b for b in usable if b.name == device]
    speeds: dict[tuple[str, int], tuple[float, float | None]] = {}
    used = []
    for benchmark in sorted(chosen, key=lambda b: b.when, reverse=True):  # newest first
        new = {key: value for key, value in benchmark.speeds.items() if key not in speeds}
        speeds |= new
        if new:
            written = f"written {benchmark.written}" if benchmark.written else "no written time"
            used.append(f"{short_path(benchmark.path)} ({benchmark.name}, {written})")
    platform = chosen[0].platform if chosen else "gpu"
    source = f"{platform.upper()} benchmark {'; '.join(used) or 'with no rows'}"
    if default:
        source += f"; models and families it lacks: {default:g} FLOP/s (a guess)"
    return Throughput(
        default,
        {key: flops for key, (flops, _) in speeds.items()},
        source,
        {key: tokens for key, (_, tokens) in speeds.items() if tokens},
        dtype=dtype,
        platform=platform,
        guessed=True,
    )


def _read(path: Path, shape: tuple[int, int, str]) -> _Benchmark:
    """A benchmark file of either kind, checked for the keys this module reads."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BenchmarkError(f"{path}: not a readable JSON file ({error})") from None
    kind = "gpu" if path.name.startswith("gpu-") else "train_throughput"
    problem = None
    machine = data.get("machine") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("benchmark") != kind:
        problem = f'expected an object with "benchmark": "{kind}"'
    elif not isinstance(machine, dict) or not isinstance(machine.get("device_kind"), str):
        problem = 'expected "machine": {"device_kind": "...", ...}'
    elif kind == "gpu" and not isinstance(data.get("parts"), dict):
        problem = 'expected "parts": {"train/FAMILY": {"rows": [...]}, ...}'
    elif kind == "train_throughput" and not isinstance(data.get("results"), list):
        problem = 'expected "results": [{"model": ..., "tokens_per_second": ...}, ...]'
    if problem:
        raise BenchmarkError(f"{path}: {problem}")
    written = data.get("written")
    if written is None and kind == "train_throughput":  # it wrote no time before issue 35
        when = datetime.min
    else:
        try:
            when = datetime.fromisoformat(written)
        except (TypeError, ValueError):
            raise BenchmarkError(
                f'{path}: "written" is {written!r}; expected an ISO time such as '
                '"2026-11-23T10:00:00+00:00"'
            ) from None
    if kind == "gpu":
        rows = [
            (f'parts["{name}"]', part.get("rows") if isinstance(part, dict) else None)
            for name, part in data["parts"].items()
            if name.startswith("train/")
        ]
        auto = _auto_kernels(machine, shape[2])
    else:  # train_throughput ran the XLA paths
        rows, auto = [("results", data["results"])], {"loss_impl": "xla", "memory_impl": "xla"}
    return _Benchmark(
        path,
        str(machine.get("platform", "gpu")),
        machine["device_kind"],
        machine.get("device_count", 1),
        written,
        when if when.tzinfo else when.replace(tzinfo=UTC),
        _speeds(path, rows, shape, auto),
    )


def _auto_kernels(machine: dict, dtype: str) -> dict[str, str]:
    """What each kernel switch's "auto" took on a benchmark's machine in ``dtype``:
    ``{"loss_impl": ..., "memory_impl": ...}``."""
    devices = [
        SimpleNamespace(
            platform=machine.get("platform", "gpu"),
            device_kind=machine["device_kind"],
            compute_capability=machine.get("compute_capability", ""),
        )
    ] * int(machine.get("device_count", 1))
    return {switch.key: switch.choose("auto", dtype, devices) for switch in (ops.LOSS, ops.MEMORY)}


def _ran_auto(row: dict, family: str, auto: dict[str, str]) -> bool:
    """Whether a benchmark row ran what "auto" takes (``auto``) for each of its family's kernel
    switches; a row that names no choice ran "xla" (it predates the switch)."""
    record = families.REGISTRY.get(family)
    fields = {f.name for f in dataclasses.fields(record.config)} if record else set()
    return all(row.get(key, "xla") == impl for key, impl in auto.items() if key in fields)


def _speeds(
    path: Path,
    parts: list[tuple[str, list | None]],
    shape: tuple[int, int, str],
    auto: dict[str, str],
) -> dict[tuple[str, int], tuple[float, float | None]]:
    """(model FLOP/s, tokens/s) by (family, N): the medians of the training rows (gpu.py's
    ``train/*`` parts; train_throughput.py's results) at ``shape`` (seq_len, batch, dtype)
    that ran the kernels "auto" takes on that device (``_ran_auto``). tokens/s only where the
    row gives its FLOPs per token; rows without a speed, with ``error``, or with ``loss_tuned``
    (gpu.py --tuned-loss) are left out."""
    speeds: dict[tuple[str, int], list[tuple[float, float | None]]] = {}
    for where, rows in parts:
        if not isinstance(rows, list):
            raise BenchmarkError(f'{path}: {where} has no "rows" list')
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or "error" in row or "loss_tuned" in row:
                continue  # a failure, or the loss under launches that are not committed
            model, family = row.get("model"), row.get("family")
            if where == "results" and family is None and isinstance(model, str):
                family = model.rsplit("-", 1)[0]  # train_throughput names "lmu_g-1M" only
            n, per_token = row.get("non_embedding_params"), row.get("train_flops_per_token")
            if where == "results":
                speed = row.get("tokens_per_second")
                flops = speed * per_token if _positive(speed) and _positive(per_token) else None
                wanted = '"model" (FAMILY-SIZE), "train_flops_per_token" and "tokens_per_second"'
            else:
                flops = row.get("model_flops_per_second")
                if flops is None:
                    continue
                wanted = 'a "family" name, a positive "model_flops_per_second"'
            if not (isinstance(family, str) and isinstance(n, int) and _positive(flops)):
                raise BenchmarkError(
                    f"{path}: {where} row {i} ({model!r}): expected {wanted} and an integer "
                    f'"non_embedding_params"; got {family!r}, {n!r}, {flops!r}'
                )
            tokens = flops / per_token if _positive(per_token) else None
            got = (row.get("seq_len"), row.get("batch"), row.get("dtype", shape[2]))
            if got == shape and _ran_auto(row, family, auto):
                speeds.setdefault((family, n), []).append((float(flops), tokens))
    return {
        key: (
            statistics.median(f for f, _ in values),
            statistics.median(t for _, t in values) if all(t for _, t in values) else None,
        )
        for key, values in speeds.items()
    }


def _positive(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _pick(
    choice: str, found: list[_Benchmark], folder: Path, shape: tuple[int, int, str]
) -> list[_Benchmark]:
    """The benchmarks ``$LMUSCALE_GPU_BENCHMARK`` names: a file, or one device's name in part."""
    if Path(choice).is_file():
        return [_read(Path(choice), shape)]
    matches = [b for b in found if choice.lower() in b.device.lower()]
    devices = sorted({b.name for b in matches})
    if len(devices) == 1:
        return matches
    if matches:
        raise BenchmarkError(
            f"{ENV}={choice!r} matches several GPU benchmarks in {folder}: "
            f"{', '.join(f'{b.path.name} ({b.name})' for b in matches)}; give more of the "
            "device name or a path"
        )
    listed = ", ".join(f"{b.path.name} ({b.device})" for b in found) or "none"
    raise BenchmarkError(
        f"{ENV}={choice!r} is neither a file nor part of the device name of a GPU benchmark "
        f"in {folder}; found: {listed}"
    )


def short_path(path: Path) -> str:
    """``path`` relative to the current folder where it lies under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
