"""How many micro-batches a train step needs: compile it, read XLA's memory analysis, fit a budget.

``train.microbatches = 0`` asks for the fewest micro-batches (a divisor of the per-device
batch) whose compiled step fits the per-device ``budget``. The plan is written to
``plan.json``; a resume on the same kind and number of devices with the same budget reuses its
count while it fits, so it computes the same numbers (a new count changes them by rounding).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import jax

from lmuscale.files import atomic_write_json
from lmuscale.outcomes import ConfigError, OutOfMemoryBudget
from lmuscale.train import step as step_lib
from lmuscale.workdir import PLAN

DEVICE_FRACTION = 0.9
HOST_FRACTION = 0.5
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Estimate:
    """XLA's buffers for one device of a compiled step, in bytes (``aliased``: outputs that
    reuse donated arguments)."""

    microbatches: int
    temp: int
    arguments: int
    outputs: int
    aliased: int

    @property
    def total(self) -> int:
        return self.temp + self.arguments + self.outputs - self.aliased

    @classmethod
    def of(cls, microbatches: int, compiled) -> Estimate:
        stats = compiled.memory_analysis()
        return cls(
            microbatches,
            int(stats.temp_size_in_bytes),
            int(stats.argument_size_in_bytes),
            int(stats.output_size_in_bytes),
            int(stats.alias_size_in_bytes),
        )


@dataclasses.dataclass(frozen=True)
class Budget:
    bytes: int
    source: str  # how it was set, for the messages: "train.memory_budget_gb", "90% of ..."


@dataclasses.dataclass(frozen=True)
class Device:
    """What a plan depends on besides the config: the kind and number of devices."""

    platform: str
    kind: str
    count: int

    @classmethod
    def of(cls, mesh) -> Device:
        first = mesh.devices.flat[0]
        return cls(first.platform, first.device_kind, int(mesh.devices.size))


def budget(configured_gb: float, device=None) -> Budget:
    """The per-device budget: ``configured_gb`` when > 0, else ``DEVICE_FRACTION`` of what JAX
    may allocate on the device (room for the eval step and fragmentation), or on CPU
    ``HOST_FRACTION`` of the machine's memory, shared by the local devices."""
    if configured_gb > 0:
        return Budget(int(configured_gb * GB), "train.memory_budget_gb")
    device = device or jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if not limit:
            raise ConfigError(
                f"the {device.device_kind} reports no memory limit (memory_stats() has no "
                "bytes_limit, e.g. under XLA_PYTHON_CLIENT_ALLOCATOR=platform): set "
                "train.memory_budget_gb, or give train.microbatches"
            )
        return Budget(
            int(DEVICE_FRACTION * limit),
            f"{DEVICE_FRACTION:.0%} of the {limit / GB:.1f} GB JAX may use on a "
            f"{device.device_kind}",
        )
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    local = jax.local_device_count()
    share = f", over {local} devices" if local > 1 else ""
    return Budget(
        int(HOST_FRACTION * ram / local),
        f"{HOST_FRACTION:.0%} of this machine's {ram / GB:.1f} GB{share}",
    )


def candidates(global_batch: int, data_axis: int) -> list[int]:
    """Micro-batch counts that divide the per-device batch, fewest first."""
    per_device = global_batch // data_axis
    return [m for m in range(1, per_device + 1) if per_device % m == 0]


def search(compile_for: Callable[[int], object], counts: list[int], limit: Budget):
    """``(count, compiled, estimates made)`` for the fewest of ``counts`` whose compiled step's
    estimate is within ``limit`` (for a train step, it does not grow with the count);
    ``OutOfMemoryBudget`` when none fits. If the first count does not fit, its temporaries scaled
    by 1 / count give a first guess; the search walks up while a count does not fit, then down
    while the one below fits: usually three compilations."""
    estimates: dict[int, Estimate | None] = {}  # None: the compilation ran out of memory
    compiled: dict[int, object] = {}

    def fits(index: int) -> bool:
        count = counts[index]
        if count not in estimates:
            try:
                compiled[count] = compile_for(count)
            except Exception as error:
                if "RESOURCE_EXHAUSTED" not in str(error):  # out of memory compiling (TPU)
                    raise
                estimates[count] = None
            else:
                estimates[count] = Estimate.of(count, compiled[count])
        estimate = estimates[count]
        return estimate is not None and estimate.total <= limit.bytes

    def result(index: int):
        count = counts[index]
        return count, compiled[count], [estimates[c] for c in sorted(compiled)]

    def too_big():
        made = [e for e in estimates.values() if e is not None]
        smallest = "every compilation ran out of memory"
        if made:
            best = min(made, key=lambda e: e.total)
            plural = "es" if best.microbatches > 1 else ""
            smallest = (
                f"the smallest estimate is {best.total / GB:.3g} GB with {best.microbatches} "
                f"micro-batch{plural} per step"
            )
        return OutOfMemoryBudget(
            f"no micro-batch count fits the memory budget of {limit.bytes / GB:.3g} GB per "
            f"device ({limit.source}): {smallest}; set a larger train.memory_budget_gb if the "
            "device has the room, or spread the model over more devices (mesh.model), or "
            "lower train.global_batch, data.seq_len or the model's size"
        )

    if fits(0):
        return result(0)
    if len(counts) == 1:
        raise too_big()
    first = estimates[counts[0]]
    index = len(counts) - 1
    if first is not None:
        fixed = first.total - first.temp
        scaled = [fixed + first.temp * counts[0] / count for count in counts]
        index = next((i for i, total in enumerate(scaled) if total <= limit.bytes), index)
    index = max(index, 1)
    while not fits(index):
        if index == len(counts) - 1:
            raise too_big()
        index += 1
    while index > 1 and fits(index - 1):
        index -= 1
    return result(index)


@dataclasses.dataclass(frozen=True)
class Plan:
    microbatches: int
    estimate: Estimate
    budget: Budget | None  # None: train.microbatches was given
    device: Device
    note: str  # how the count was decided, for the log

    def record(self) -> dict:
        """The plan as plan.json holds it and the summary reports it."""
        return {
            "microbatches": self.microbatches,
            "planned": self.budget is not None,
            "estimate_gb": self.estimate.total / GB,
            "memory_bytes": dataclasses.asdict(self.estimate),
            "budget_gb": self.budget.bytes / GB if self.budget else None,
            "budget_bytes": self.budget.bytes if self.budget else None,
            "budget_source": self.budget.source if self.budget else None,
            "device": dataclasses.asdict(self.device),
        }


def saved(workdir: Path) -> dict | None:
    path = Path(workdir) / PLAN
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as error:
        raise ConfigError(f"{path}: not JSON ({error}); move it away to plan again") from None


def plan(
    compile_for: Callable[[int], object],
    *,
    microbatches: int,
    global_batch: int,
    data_axis: int,
    budget_gb: float,
    device: Device,
    workdir: Path | None = None,
) -> tuple[Plan, object]:
    """The micro-batch count of a run and its compiled train step (``compile_for(count)``):
    ``microbatches`` when > 0, else the workdir's plan while it holds, else a ``search``. In
    a multi-process run, process 0 decides and the others compile its count."""
    if microbatches > 0:
        compiled = compile_for(microbatches)
        estimate = Estimate.of(microbatches, compiled)
        return Plan(microbatches, estimate, None, device, "train.microbatches"), compiled
    limit = budget(budget_gb)
    counts = candidates(global_batch, data_axis)
    decide = _decide if jax.process_count() == 1 else _decide_on_process_0
    count, compiled, note = decide(compile_for, counts, limit, device, workdir)
    return Plan(count, Estimate.of(count, compiled), limit, device, note), compiled


def _decide(compile_for, counts, limit: Budget, device: Device, workdir: Path | None):
    """``(count, compiled, note)``: the workdir's plan while it holds, else a search."""
    old = saved(workdir) if workdir is not None else None
    old_count = int(old["microbatches"]) if old and old.get("planned") else None
    if old_count is not None:
        before = old.get("device", {})
        if before != dataclasses.asdict(device) or old.get("budget_bytes") != limit.bytes:
            why = (
                f"the workdir's plan ({old_count} micro-batches) was made on {before.get('count')}"
                f" x {before.get('kind')} with a budget of {old.get('budget_gb')} GB; this run "
                f"has {device.count} x {device.kind} and {limit.bytes / GB:.3g} GB"
            )
        else:
            compiled = compile_for(old_count)
            estimate = Estimate.of(old_count, compiled)
            if estimate.total <= limit.bytes:
                return old_count, compiled, "the workdir's plan"
            why = (
                f"the workdir's plan ({old_count} micro-batches) is now estimated at "
                f"{estimate.total / GB:.3g} GB, over the budget"
            )
    count, compiled, _ = search(compile_for, counts, limit)
    if old_count is None:
        return count, compiled, "planned"
    effect = "the same count, so the same numbers"
    if count != old_count:
        effect = "the numbers from here on differ from an uninterrupted run by float rounding"
    return count, compiled, f"planned again: {why}; {effect}"


def _decide_on_process_0(compile_for, counts, limit, device, workdir):
    """``_decide`` on process 0; every process then compiles its count (0 = none fits)."""
    import numpy as np
    from jax.experimental import multihost_utils

    error, count, compiled, note = None, 0, None, "process 0's plan"
    if jax.process_index() == 0:
        try:
            count, compiled, note = _decide(compile_for, counts, limit, device, workdir)
        except OutOfMemoryBudget as caught:
            error = caught
    agreed = int(multihost_utils.broadcast_one_to_all(np.int32(count)))
    if error is not None:
        raise error
    if agreed == 0:
        raise OutOfMemoryBudget("process 0 found no micro-batch count that fits; see its log")
    if compiled is None:
        compiled = compile_for(agreed)
    return agreed, compiled, note


def plan_train_step(train_step, abstract_state, config, mesh, workdir: Path | None = None):
    """``plan`` for a jitted ``step.make_train_step`` of ``config`` on ``mesh``."""
    train, seq_len = config.train, config.data.seq_len

    def compile_for(count: int):
        tokens = step_lib.MicroBatches(mesh, count).abstract(train.global_batch, seq_len)
        return train_step.lower(abstract_state, tokens).compile()

    return plan(
        compile_for,
        microbatches=train.microbatches,
        global_batch=train.global_batch,
        data_axis=step_lib.data_parallel_size(mesh),
        budget_gb=train.memory_budget_gb,
        device=Device.of(mesh),
        workdir=workdir,
    )


def write(workdir: Path, the_plan: Plan, **more) -> None:
    """plan.json: the plan's record, and ``more`` (the run's ``ops``)."""
    atomic_write_json(Path(workdir) / PLAN, {**the_plan.record(), **more})


def describe(the_plan: Plan) -> str:
    """One line for the log: the count and how it was decided, and XLA's estimate of the
    step's memory per device against the budget."""
    count, budget = the_plan.microbatches, the_plan.budget
    why, against = "train.microbatches; 0 plans the fewest that fit in memory", ""
    if budget is not None:
        why = f"the fewest that fit the budget; {the_plan.note}"
        against = f" against a budget of {budget.bytes / GB:.3g} GB ({budget.source})"
    return (
        f"{count} micro-batch{'es' if count > 1 else ''} per step ({why}), XLA estimates its "
        f"memory at {the_plan.estimate.total / GB:.3g} GB per device{against}"
    )
