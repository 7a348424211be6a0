"""The micro-batch plan: the fewest micro-batches whose compiled train step fits the budget."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from compile_cache import in_process
from small_config import small

from lmuscale.outcomes import Exit
from lmuscale.train import ConfigError, memory, run
from lmuscale.workdir import PLAN


class _Stats:
    def __init__(self, temp):
        self.temp_size_in_bytes = temp
        self.argument_size_in_bytes = 100
        self.output_size_in_bytes = 100
        self.alias_size_in_bytes = 90


class _Compiled:
    def __init__(self, count, temp):
        self.count, self.temp = count, temp

    def memory_analysis(self):
        return _Stats(self.temp)


def _fake(temp_of):
    """``compile_for`` whose temporaries are ``temp_of(count)``, counting its calls."""
    calls = []

    def compile_for(count):
        calls.append(count)
        return _Compiled(count, temp_of(count))

    return compile_for, calls


CPU = memory.Device("cpu", "cpu", 1)


@pytest.mark.parametrize("limit", [210, 300, 1000, 5000, 51_310, 100_000])
@pytest.mark.parametrize("shape", ["proportional", "steps"])
def test_search_finds_the_fewest_count_that_fits(limit, shape):
    counts = memory.candidates(512, 1)
    assert counts == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]

    def temp(count):  # the estimate is temp + 110 bytes
        if shape == "proportional":
            return 51200 // count
        return 51200 if count < 64 else 100  # far from the first count's guess

    compile_for, calls = _fake(temp)
    count, compiled, estimates = memory.search(compile_for, counts, memory.Budget(limit, "test"))
    fitting = [c for c in counts if temp(c) + 110 <= limit]
    assert count == fitting[0]
    assert compiled.count == count
    assert {e.microbatches: e.total for e in estimates}[count] <= limit
    assert len(calls) == len(set(calls))  # no count compiled twice
    if shape == "proportional":
        assert len(calls) <= 3


def test_a_compilation_that_runs_out_of_memory_does_not_fit():
    def compile_for(count):
        if count < 4:
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
        return _Compiled(count, 100)

    count, _, estimates = memory.search(
        compile_for, memory.candidates(16, 1), memory.Budget(1000, "test")
    )
    # 1 and 2 ran out of memory while compiling; walked down from the most micro-batches.
    assert count == 4 and [e.microbatches for e in estimates] == [4, 8, 16]

    def broken(count):
        raise RuntimeError("INTERNAL: something else")

    with pytest.raises(RuntimeError, match="something else"):  # not taken for a full memory
        memory.search(broken, [1, 2], memory.Budget(1000, "test"))


def test_candidates_divide_the_per_device_batch():
    assert memory.candidates(24, 2) == [1, 2, 3, 4, 6, 12]
    assert memory.candidates(8, 8) == [1]


def test_an_impossible_budget_names_the_budget_and_the_smallest_estimate():
    compile_for, _ = _fake(lambda count: 4_000_000_000 // count)
    with pytest.raises(memory.OutOfMemoryBudget) as caught:
        memory.search(compile_for, memory.candidates(16, 1), memory.Budget(int(0.1e9), "a test"))
    message = str(caught.value)
    assert "budget of 0.1 GB per device (a test)" in message
    assert "smallest estimate is 0.25 GB with 16 micro-batches per step" in message
    assert Exit.of(caught.value) is Exit.MEMORY
    with pytest.raises(memory.OutOfMemoryBudget, match="with 1 micro-batch per step"):
        memory.search(compile_for, memory.candidates(8, 8), memory.Budget(int(0.1e9), "a test"))


def _plan(workdir, temp_of, budget_gb, device=CPU):
    compile_for, calls = _fake(temp_of)
    plan, _ = memory.plan(
        compile_for,
        microbatches=0,
        global_batch=64,
        data_axis=1,
        budget_gb=budget_gb,
        device=device,
        workdir=workdir,
    )
    return plan, calls


def test_a_resume_on_the_same_device_reuses_the_plan_and_another_device_plans_again(tmp_path):
    plan, _ = _plan(tmp_path, lambda count: 6400 // count, budget_gb=1000e-9)
    assert plan.microbatches == 8  # 800 + 110 bytes fits in 1000, 1600 + 110 does not
    memory.write(tmp_path, plan)
    record = json.loads((tmp_path / PLAN).read_text())
    assert record["microbatches"] == 8 and record["planned"] and record["budget_bytes"] == 1000

    # The same device and budget: the count is reused, compiled once, even if the estimates
    # would now give another (here: everything fits).
    again, calls = _plan(tmp_path, lambda count: 0, budget_gb=1000e-9)
    assert (again.microbatches, calls) == (8, [8])
    assert again.note == "the workdir's plan"

    # Another kind of device: planned again, and said so.
    other = memory.Device("gpu", "NVIDIA H100 80GB HBM3", 1)
    moved, _ = _plan(tmp_path, lambda count: 0, budget_gb=1000e-9, device=other)
    assert moved.microbatches == 1
    assert moved.note.startswith("planned again: the workdir's plan (8 micro-batches) was made")
    assert "on 1 x cpu with a budget of 1e-06 GB; this run has 1 x NVIDIA H100" in moved.note
    assert moved.note.endswith("differ from an uninterrupted run by float rounding")

    # The same device and budget, but the saved count no longer fits (say, a new XLA):
    # planned again, here to 1 micro-batch.
    grown, calls = _plan(tmp_path, lambda count: 12800 // count if count == 8 else 800, 1000e-9)
    assert grown.microbatches == 1 and calls[0] == 8
    assert "is now estimated at 1.71e-06 GB, over the budget" in grown.note
    memory.write(tmp_path, grown)
    # Planned again for another budget, to the same count: nothing changes.
    same, _ = _plan(tmp_path, lambda count: 800, budget_gb=2000e-9)
    assert same.microbatches == 1 and same.note.endswith("the same count, so the same numbers")
    memory.write(tmp_path, plan)

    # Another budget: planned again too.
    rebudget, _ = _plan(tmp_path, lambda count: 6400 // count, budget_gb=2000e-9)
    assert rebudget.microbatches == 4 and "planned again" in rebudget.note


def test_a_given_count_is_kept_and_its_estimate_reported(tmp_path):
    compile_for, calls = _fake(lambda count: 10**12)
    plan, _ = memory.plan(
        compile_for,
        microbatches=2,
        global_batch=64,
        data_axis=1,
        budget_gb=1e-6,
        device=CPU,
        workdir=tmp_path,
    )
    assert (plan.microbatches, calls, plan.budget) == (2, [2], None)
    assert plan.estimate.total == 10**12 + 110


class _Accelerator:
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_the_default_budget_on_an_accelerator_is_a_fraction_of_what_jax_may_use():
    limit = 60_000_000_000
    default = memory.budget(0.0, _Accelerator({"bytes_limit": limit, "bytes_in_use": 0}))
    assert default.bytes == int(memory.DEVICE_FRACTION * limit)
    assert default.source == "90% of the 60.0 GB JAX may use on a NVIDIA H100 80GB HBM3"
    with pytest.raises(ConfigError, match=r"reports no memory limit.*train\.memory_budget_gb"):
        memory.budget(0.0, _Accelerator({}))
    assert memory.budget(3.0, _Accelerator({})).bytes == 3_000_000_000


def test_the_default_budget_on_cpu_is_a_fraction_of_the_machines_memory():
    import os

    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    default = memory.budget(0.0)
    assert default.bytes == int(memory.HOST_FRACTION * ram)  # one local CPU device here
    assert "of this machine's" in default.source
    assert memory.budget(2.5) == memory.Budget(2_500_000_000, "train.memory_budget_gb")


# -- the plan in a real run ------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def xla_cache(tmp_path_factory):
    """The runs below compile the same train steps (1 and 2 micro-batches) again and again,
    each run building its own: they share a persistent compilation cache."""
    with in_process(tmp_path_factory.mktemp("xla-cache")):
        yield


def _run(byte_corpus, workdir, **train):
    config = small(str(byte_corpus))
    config.train.update(steps=6, **train)
    config.eval.update(every=3, batches=1)
    config.checkpoint.every = 3
    summary = run(config, workdir)
    losses = [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").open()]
    return summary, losses


@pytest.fixture(scope="module")
def fixed_and_tight(byte_corpus, tmp_path_factory):
    """Runs with 1 and 2 micro-batches given, and a planned one whose budget lies between
    their estimates: ``(fixed {count: (summary, losses)}, tight summary, losses, budget)``."""
    root = tmp_path_factory.mktemp("plan")
    fixed = {m: _run(byte_corpus, root / f"fixed{m}", microbatches=m) for m in (1, 2)}
    total = {m: fixed[m][0]["memory"]["estimate_gb"] * 1e9 for m in fixed}
    budget_gb = (total[1] + total[2]) / 2 / 1e9
    tight, losses = _run(byte_corpus, root / "tight", microbatches=0, memory_budget_gb=budget_gb)
    return fixed, tight, losses, budget_gb, root / "tight"


def test_a_small_budget_plans_more_micro_batches_and_equals_the_fixed_run(
    byte_corpus, tmp_path, fixed_and_tight
):
    fixed, tight, tight_losses, budget_gb, tight_workdir = fixed_and_tight
    estimates = {m: fixed[m][0]["memory"]["memory_bytes"] for m in fixed}
    # Half the sequences per micro-batch: fewer temporaries.
    assert estimates[2]["temp"] < estimates[1]["temp"]
    assert fixed[2][0]["memory"]["estimate_gb"] < fixed[1][0]["memory"]["estimate_gb"]

    roomy, roomy_losses = _run(byte_corpus, tmp_path / "roomy", microbatches=0)
    assert roomy["microbatches"] == 1 and roomy["memory"]["planned"]
    np.testing.assert_allclose(roomy_losses, fixed[1][1], rtol=1e-6)

    assert tight["microbatches"] == 2
    assert tight["memory"]["estimate_gb"] <= budget_gb
    assert tight["memory"]["budget_source"] == "train.memory_budget_gb"
    np.testing.assert_allclose(tight_losses, fixed[2][1], rtol=1e-6)
    # Accumulating two halves is the same step as one whole, to float rounding.
    np.testing.assert_allclose(tight_losses, fixed[1][1], rtol=1e-5)
    plan = json.loads((tight_workdir / PLAN).read_text())
    assert plan["microbatches"] == 2 and plan["device"]["platform"] == "cpu"


def test_an_impossible_budget_stops_the_run_before_training(byte_corpus, tmp_path):
    with pytest.raises(memory.OutOfMemoryBudget, match=r"budget of 1e-06 GB.*smallest estimate"):
        _run(byte_corpus, tmp_path / "w", microbatches=0, memory_budget_gb=1e-6)
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


def _resume_from_step_3(workdir):
    """Undo the end of a finished run: what a run killed after its step-3 checkpoint left."""
    shutil.rmtree(workdir / "checkpoints" / "6")
    (workdir / "summary.json").unlink()


def test_a_resumed_planned_run_reuses_the_plan_and_ends_bit_identical(
    byte_corpus, tmp_path, capsys, fixed_and_tight
):
    _, whole, whole_losses, budget_gb, tight_workdir = fixed_and_tight
    workdir = tmp_path / "resumed"
    shutil.copytree(tight_workdir, workdir)
    _resume_from_step_3(workdir)
    capsys.readouterr()

    def no_search(*args):
        raise AssertionError("the workdir's plan should have been reused")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "search", no_search)
        resumed, resumed_losses = _run(
            byte_corpus, workdir, microbatches=0, memory_budget_gb=budget_gb
        )
    assert "the workdir's plan" in capsys.readouterr().out
    assert resumed_losses == whole_losses  # bit for bit
    assert resumed["val_loss"] == whole["val_loss"]

    # The plan was made on another device: planned again, and the log says so.
    record = json.loads((workdir / PLAN).read_text())
    record["device"]["kind"] = "another cpu"
    (workdir / PLAN).write_text(json.dumps(record))
    _resume_from_step_3(workdir)
    capsys.readouterr()
    replanned, replanned_losses = _run(
        byte_corpus, workdir, microbatches=0, memory_budget_gb=budget_gb
    )
    out = capsys.readouterr().out
    assert "planned again" in out and "1 x another cpu" in out
    assert replanned["microbatches"] == 2
    np.testing.assert_allclose(replanned_losses, whole_losses, rtol=1e-6)


@pytest.mark.parametrize("process", [0, 1])
def test_in_a_multi_process_run_process_0_decides(process, monkeypatch, tmp_path):
    import jax
    from jax.experimental import multihost_utils

    sent = []

    def broadcast(value):  # what process 0 sends reaches every process
        sent.append(int(value))
        return 4 if process else value

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: process)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
    plan, calls = _plan(tmp_path, lambda count: 6400 // count, budget_gb=2000e-9)
    assert plan.microbatches == 4
    if process:
        assert calls == [4] and plan.note == "process 0's plan"  # no search of its own
    else:
        assert sent == [4] and plan.note == "planned"

    # A budget nothing fits: process 0 names it; the others stop too, instead of waiting.
    if process:
        monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda value: 0)
    with pytest.raises(memory.OutOfMemoryBudget, match="budget" if not process else "process 0"):
        _plan(tmp_path, lambda count: 6400 // count, budget_gb=1e-9)
