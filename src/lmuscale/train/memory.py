"""How many micro-batches a train step needs: compile it, read XLA's memory analysis, fit a budget.

``train.microbatches = 0`` asks for the plan: the fewest micro-batches whose compiled train
step fits in the memory budget. The candidates are the divisors of the per-device batch (so
every micro-batch still splits evenly over the mesh's data axis). A step's estimate is what XLA
assigns for one device: its arguments, outputs and temporaries, less the outputs that reuse
donated arguments (the new state takes the old state's buffers). The estimate shrinks as the
count grows (the temporaries scale with the sequences of one micro-batch), so the search
compiles the fewest count, guesses from its temporaries, and walks to the boundary (see
``search``); the compiled step it ends on is the one the run uses.

The budget, per device, is ``train.memory_budget_gb`` when it is above 0, else:

- on an accelerator, ``DEVICE_FRACTION`` of the memory JAX may allocate on it
  (``memory_stats()["bytes_limit"]``), leaving room for the evaluation step and the
  allocator's fragmentation;
- on CPU, which reports no memory size, ``HOST_FRACTION`` of the machine's physical memory,
  shared by the process's local devices.

The plan is written to ``plan.json`` in the workdir. A resumed run on the same kind of device,
with the same number of devices and the same budget, reuses its count, so it computes the
same numbers as an uninterrupted run. Anything else plans again and says so: the sums are then
accumulated in another grouping and differ by float rounding.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from lmuscale.files import atomic_write_json
from lmuscale.train import step as step_lib
from lmuscale.train.config import ConfigError

PLAN = "plan.json"
DEVICE_FRACTION = 0.9
HOST_FRACTION = 0.5
GB = 1e9


class OutOfMemoryBudget(ConfigError):
    """No micro-batch count's train step fits in the memory budget."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """XLA's buffers for one device of a compiled step, in bytes."""

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
    """The per-device budget: ``configured_gb`` when > 0, else a fraction of what the device
    (or, on CPU, the machine) has; see the module docstring."""
    if configured_gb > 0:
        return Budget(int(configured_gb * GB), "train.memory_budget_gb")
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        limit = stats["bytes_limit"]
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


def search(compile_for: Callable[[int], object], counts: list[int], limit: int):
    """The fewest of ``counts`` whose compiled step's estimate is at most ``limit`` bytes.

    Returns ``(count, compiled, estimates)`` with every estimate made, or raises
    ``OutOfMemoryBudget`` when even the most micro-batches do not fit. Assumes, as holds for
    a train step, that the estimate does not grow with the count. The first count is tried
    first; if it does not fit, its temporaries divided by the count give a first guess (the
    arguments and outputs do not change with the count), and the search walks from there:
    up while a count does not fit, down while the one below fits. Usually three
    compilations.
    """
    estimates: dict[int, Estimate] = {}
    compiled: dict[int, object] = {}

    def fits(index: int) -> bool:
        count = counts[index]
        if count not in estimates:
            compiled[count] = compile_for(count)
            estimates[count] = Estimate.of(count, compiled[count])
        return estimates[count].total <= limit

    def result(index: int):
        count = counts[index]
        return count, compiled[count], [estimates[c] for c in sorted(estimates)]

    def too_big():
        best = min(estimates.values(), key=lambda e: e.total)
        return OutOfMemoryBudget(
            f"no micro-batch count fits the memory budget of {limit / GB:.3g} GB per device: "
            f"the smallest estimate is {best.total / GB:.3g} GB with {best.microbatches} "
            f"micro-batch{'es' if best.microbatches > 1 else ''} per step; raise "
            "train.memory_budget_gb, or lower train.global_batch, data.seq_len or the "
            "model's size"
        )

    if fits(0):
        return result(0)
    if len(counts) == 1:
        raise too_big()
    first = estimates[counts[0]]
    fixed = first.total - first.temp
    scaled = [fixed + first.temp * counts[0] / count for count in counts]
    index = next((i for i, total in enumerate(scaled) if total <= limit), len(counts) - 1)
    index = max(index, 1)
    while not fits(index):
        if index == len(counts) - 1:
            raise too_big()
        index += 1
    while index > 1 and fits(index - 1):
        index -= 1
    for count in list(compiled):  # free the executables that will not run
        if count != counts[index]:
            del compiled[count]
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
    """The micro-batch count of a run and its compiled train step (``compile_for(count)``).

    ``microbatches > 0`` is taken as given (its estimate is still reported). With 0, a plan in
    ``workdir`` made on the same device, device count and budget is reused; otherwise the
    count is searched for (see ``search``).
    """
    if microbatches > 0:
        compiled = compile_for(microbatches)
        estimate = Estimate.of(microbatches, compiled)
        return Plan(microbatches, estimate, None, device, "train.microbatches"), compiled
    limit = budget(budget_gb)
    old = saved(workdir) if workdir is not None else None
    if old and old.get("planned"):
        same = old.get("device") == dataclasses.asdict(device) and (
            old.get("budget_bytes") == limit.bytes
        )
        if same:
            count = int(old["microbatches"])
            compiled = compile_for(count)
            estimate = Estimate.of(count, compiled)
            return Plan(count, estimate, limit, device, "the workdir's plan"), compiled
        before = old.get("device", {})
        note = (
            f"planned again: the workdir's plan ({old.get('microbatches')} micro-batches) was "
            f"made for {before.get('count')} x {before.get('kind')} with a budget per step; raise "
            f"{old.get('budget_gb')} GB, and the numbers from here on differ from an "
            "uninterrupted run by float rounding"
        )
    else:
        note = "planned"
    count, compiled, _ = search(compile_for, candidates(global_batch, data_axis), limit.bytes)
    if jax.process_count() > 1:  # every process runs process 0's count
        from jax.experimental import multihost_utils

        agreed = int(multihost_utils.broadcast_one_to_all(count))
        if agreed != count:
            count, compiled = agreed, compile_for(agreed)
    estimate = Estimate.of(count, compiled)
    return Plan(count, estimate, limit, device, note), compiled


def plan_train_step(train_step, abstract_state, config, mesh, workdir: Path | None = None):
    """``plan`` for a jitted ``step.make_train_step`` of ``config`` (its ``train`` section
    and ``data.seq_len``) on ``mesh``: ``(plan, compiled step)``."""
    train, seq_len = config.train, config.data.seq_len
    sharding = step_lib.batch_sharding(mesh, 3, axis=1)

    def compile_for(count: int):
        shape = (count, train.global_batch // count, seq_len + 1)
        tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
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


def write(workdir: Path, the_plan: Plan) -> None:
    atomic_write_json(Path(workdir) / PLAN, the_plan.record())


def describe(the_plan: Plan) -> str:
    """One line for the log: the count, the estimate and where the count came from."""
    count = the_plan.microbatches
    text = (
        f"{count} micro-batch{'es' if count > 1 else ''}, estimated "
        f"{the_plan.estimate.total / GB:.3g} GB per device"
    )
    if the_plan.budget is not None:
        text += f" of a {the_plan.budget.bytes / GB:.3g} GB budget ({the_plan.budget.source})"
    return f"{text}; {the_plan.note}"
