"""benchmarks/gpu.py on CPU, shrunk: it runs its parts, writes one JSON, and keeps earlier parts."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A timed loss's differences from the reference's, as the loss-tiles sweep records them.
LOSS_KEYS = ("loss_max_abs_diff", "dh_max_diff_rel_to_max", "dw_max_diff_rel_to_max")


def _gpu(out: Path, *args: str) -> str:
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_gpu_benchmark_parts_write_one_json(tmp_path):
    out = tmp_path / "gpu-cpu.json"
    small = ["--sizes", "55k", "--seq-len", "16", "--batch", "4", "--steps", "1"]
    # The transformer, whose step compiles in about half the LMU's time, in the train part and
    # the precision part below (through lmuscale.train.run): their code is the same for every
    # family, and the LMU's train step is run by the train tests.
    _gpu(out, "--only", "train/transformer", "plan/transformer", *small, "--budget-gb", "50")
    first = json.loads(out.read_text())
    assert set(first["parts"]) == {"train/transformer", "plan/transformer"}
    (row,) = first["parts"]["train/transformer"]["rows"]
    assert (row["model"], row["family"], row["size"], row["dtype"]) == (
        "transformer-55k",
        "transformer",
        "55k",
        "bfloat16",
    )
    assert row["loss_impl"] == "xla"  # "auto", resolved on this CPU
    assert row["microbatches"] == 1 and 0 < row["estimate_gb"] <= row["budget_gb"] == 50
    assert row["model_flops_per_second"] == row["tokens_per_second"] * row["train_flops_per_token"]
    assert row["tokens_per_second"] == 4 * 16 / row["step_seconds"]
    (planned,) = first["parts"]["plan/transformer"]["rows"]
    assert "step_seconds" not in planned and planned["microbatches"] == 1

    # A later run keeps the first run's parts, and a plan part run again for another size
    # keeps the rows of the sizes it did not run. (train/, plan/ and long parts are merged by
    # the same code, so a plan part, which compiles but runs no step, stands for all three.)
    stdout = _gpu(
        out,
        "--only",
        "precision",
        "attention",
        "loss",
        "plan/transformer",
        "--xent-batch",
        "1",
        "--xent-repeats",
        "1",
        "--sizes",
        "100k",
        "--seq-len",
        "16",
        "--batch",
        "4",
        "--budget-gb",
        "50",
        "--precision-model",
        "transformer-55k",
        "--loss-steps",
        "3",
        "--loss-batch",
        "2",
        "--loss-seq-len",
        "16",
        "--loss-data",
        str(tmp_path / "plays"),
    )
    second = json.loads(out.read_text())
    assert second["parts"]["train/transformer"] == first["parts"]["train/transformer"]
    rows = second["parts"]["plan/transformer"]["rows"]
    assert [r["model"] for r in rows] == ["transformer-55k", "transformer-100k"]
    assert rows[0] == planned
    assert second["parts"]["attention"]["skipped"].startswith("cuDNN attention is not used")
    # The cross-entropy alone: XLA's path timed at both widths and dtypes, the kernels (the
    # Triton ones in both forms, the flash ones) not run here and saying why.
    loss_rows = second["parts"]["loss"]["rows"]
    assert [(r["impl"], r["d"], r["dtype"]) for r in loss_rows] == [
        (impl, d, dtype)
        for d in (48, 204)
        for dtype in ("bfloat16", "float32")
        for impl in ("xla", "pallas", "pallas, dh from the forward", "flash")
    ]
    for r in loss_rows:
        if r["impl"] == "xla":
            assert r["median_ms"] > 0 and r["useful_tflop"] == 6 * 16 * 50257 * r["d"] / 1e12
        else:
            assert "need one NVIDIA GPU" in r["skipped"] or "need NVIDIA GPUs" in r["skipped"]
            assert r["skipped"].endswith("but this run's devices are cpu (cpu)")
    precision = second["parts"]["precision"]
    assert (precision["model"], precision["steps"]) == ("transformer-55k", 3)
    f32, bf16 = precision["loss_float32"], precision["loss_bfloat16"]
    assert len(f32) == len(bf16) == 3 and f32 != bf16
    assert precision["max_abs_difference"] == max(
        abs(a - b) for a, b in zip(f32, bf16, strict=True)
    )
    assert "transformer-55k, 3 steps: bfloat16 - float32 training loss" in stdout


def test_an_unknown_part_is_named():
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--only", "trian/*"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "'trian/*' matches no part" in done.stderr


def _benchmark(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _gpu_module():
    return _benchmark("gpu")


def test_parts_run_in_the_order_only_names_them():
    gpu = _gpu_module()
    names = ["train/lmu", "train/transformer", "train/lstm", "profile", "block"]
    picked = gpu.chosen(names, ["train/transformer", "profile", "train/*", "profile"])
    assert picked == ["train/transformer", "profile", "train/lmu", "train/lstm"]


def test_a_spent_time_budget_starts_nothing_and_keeps_the_json_s_earlier_parts(tmp_path):
    out = tmp_path / "gpu-cpu.json"
    earlier = {"rows": [], "skipped": "an earlier run's", "args": {}}
    out.write_text(json.dumps({"machine": {"device_kind": "cpu"}, "parts": {"attention": earlier}}))
    # Importing JAX alone takes longer than a millisecond: nothing may start.
    _gpu(out, "--time-budget", "0.001", "--only", "plan/transformer", "long")
    record = json.loads(out.read_text())
    assert record["parts"] == {"attention": earlier}
    what = ["plan/transformer", "long"]
    assert record["not_started"] == {"session": "", "time_budget_s": 0.001, "what": what}


def _plan_row(name, config, impls=None):
    row = {"model": name, "seq_len": config.data.seq_len, "batch": 4, "estimate_gb": 1.0}
    return {**row, "microbatches": 1}


def test_a_train_part_stopped_part_way_keeps_the_models_that_finished(tmp_path, monkeypatch):
    # The second model's measurement is stopped (as a command's time limit would stop it):
    # the first model's row is in the JSON already, beside an earlier run's row of another
    # size, and the part is marked unfinished.
    gpu = _gpu_module()
    calls = []

    def measure_plan(name, config, impls=None):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return _plan_row(name, config)

    monkeypatch.setattr(gpu, "measure_plan", measure_plan)
    out = tmp_path / "gpu-cpu.json"
    earlier = {
        "model": "transformer-1M",
        "seq_len": 16,
        "batch": 4,
        "estimate_gb": 2.0,
        "microbatches": 1,
    }
    parts = {"plan/transformer": {"rows": [earlier], "args": {}}}
    out.write_text(json.dumps({"machine": {"device_kind": "cpu"}, "parts": parts}))
    argv = ["--out", str(out), "--only", "plan/transformer", "--sizes", "55k", "100k"]
    with pytest.raises(KeyboardInterrupt):
        gpu.main([*argv, "--seq-len", "16", "--batch", "4", "--microbatches", "2"])
    part = json.loads(out.read_text())["parts"]["plan/transformer"]
    assert [r["model"] for r in part["rows"]] == ["transformer-1M", "transformer-55k"]
    assert part["unfinished"] is True and part["args"]["microbatches"] == 2
    assert calls == ["transformer-55k", "transformer-100k"]


def test_a_model_after_the_time_budget_is_listed_in_its_part(tmp_path, monkeypatch):
    # The budget runs out during the first model: the part keeps it, lists the second as not
    # started, and is marked unfinished; an error row carries its shape and the kernels it
    # asked for, so that a later run of the same model, shape and kernels replaces it.
    gpu = _gpu_module()

    def measure_plan(name, config, impls=None):
        gpu.DEADLINE.seconds = 1e-9  # spent from now on
        raise RuntimeError("out of memory")

    monkeypatch.setattr(gpu, "measure_plan", measure_plan)
    out = tmp_path / "gpu-cpu.json"
    argv = ["--out", str(out), "--only", "plan/transformer", "attention", "--sizes", "55k", "100k"]
    gpu.main([*argv, "--seq-len", "16", "--batch", "4", "--session", "s1"])
    record = json.loads(out.read_text())
    part = record["parts"]["plan/transformer"]
    (row,) = part["rows"]
    assert row == {
        "model": "transformer-55k",
        "error": "RuntimeError: out of memory",
        "loss_impl": "xla",  # "auto" on this CPU
        "seq_len": 16,
        "batch": 4,
    }
    assert part["unfinished"] is True and part["not_started"] == ["transformer-100k"]
    assert list(record["parts"]) == ["plan/transformer"]
    assert record["not_started"]["what"] == ["transformer-100k", "attention"]

    # The same session's next run adds what it left out; the error row is replaced.
    monkeypatch.setattr(gpu, "measure_plan", _plan_row)
    gpu.main(
        [
            *argv[:3],
            "plan/transformer",
            "--sizes",
            "55k",
            "--seq-len",
            "16",
            "--batch",
            "4",
            "--session",
            "s1",
        ]
    )
    record = json.loads(out.read_text())
    (row,) = record["parts"]["plan/transformer"]["rows"]
    assert row == _plan_row("transformer-55k", gpu.paper_config("transformer-55k", 16, 4, 0.0))
    assert record["not_started"]["what"] == ["transformer-100k", "attention"]


def test_the_gpu_session_script_runs_its_groups_in_the_budget_and_writes_into_out(tmp_path):
    # benchmarks/gpu_session.sh with this Python and a budget of 0 s, spent before the first
    # group (1 s was too, unless the script's start took under a second: bash counts whole
    # seconds; the options shrink whatever would start after all): each group's process lists
    # its parts as not started, in one list for the session.
    wheels = tmp_path / "no-wheels"  # this Python has the project's dependencies
    wheels.mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "WHEELS": str(wheels)}
    tiny = ["--sizes", "55k", "--seq-len", "16", "--batch", "8", "--steps", "1"]
    command = ["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "0", *tiny]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["device.txt", "gpu-cpu.json", "gpu.log"]
    assert "jax " in (out / "device.txt").read_text()
    log = (out / "gpu.log").read_text()
    groups_named = (
        "flash",
        "block",
        "loss_tiles",
        "profile",
        "loss, attention, train/sru, train/sru_pp",
        "xla_options",
    )
    for group in groups_named:
        assert f"not started, the time budget of 0.001 s being spent: {group}" in log
    record = json.loads((out / "gpu-cpu.json").read_text())
    groups = [
        ["flash"],  # the flash loss's kernels against XLA's path
        ["train/lmu", "train/transformer"],  # at 1M with them
        ["train/lmu", "train/transformer", "train/lmu_g"],  # at 1M and 55k
        ["loss_tiles"],
        ["train/lmu"],  # at 1M with the loss as loss_tiles tuned it
        ["profile"],
        ["block"],
        ["loss", "attention", "train/sru", "train/sru_pp", "train/lstm", "long"],
        ["precision"],
        ["xla_options"],
    ]
    everything = [part for group in groups for part in group]
    assert list(record["parts"]) + record["not_started"]["what"] == everything  # in order
    assert record["not_started"]["session"].startswith("session-")

    bad = subprocess.run([*command[:2], "1.5"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "SECONDS must be a whole number" in bad.stderr


# benchmarks/gpu.py's stand-in for the test below: its profile part leaves a Perfetto trace in
# and its compiled program in each profiled label's folder (FOLDERS, as ``part_profile``
# names them), the other parts nothing.
_STUB_GPU_PY = """
import pathlib, sys
if "profile" in sys.argv:
    for folder in FOLDERS:
        trace = pathlib.Path("benchmarks/results/profile-stub", folder, "plugins/profile/1")
        trace.mkdir(parents=True)
        (trace / "perfetto_trace.json.gz").write_text(folder)
        (trace.parents[2] / "compiled_hlo.txt.gz").write_text("HloModule " + folder)
"""


def test_the_gpu_session_script_brings_every_profiles_trace_into_out(tmp_path):
    # gpu_session.sh in a copy of the repository whose gpu.py only writes the profile part's
    # traces and programs: each profiled label's trace and program come back in $OUT, and a
    # trace from before the session does not (its folder is a label no longer profiled).
    gpu = _gpu_module()
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    (repo / "benchmarks" / "gpu_session.sh").write_text(script)
    folders = [gpu.profile_folder_name(label) for label in gpu.PROFILED]
    stub = f"FOLDERS = {folders!r}\n" + _STUB_GPU_PY
    (repo / "benchmarks" / "gpu.py").write_text(stub)
    old = repo / "benchmarks/results/profile-stub/an-old-label/plugins/perfetto_trace.json.gz"
    old.parent.mkdir(parents=True)
    old.write_text("before")
    os.utime(old, (1e9, 1e9))
    wheels, out = tmp_path / "no-wheels", tmp_path / "out"
    wheels.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "WHEELS": str(wheels)}
    command = ["bash", str(repo / "benchmarks" / "gpu_session.sh"), "60"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    traces = {p.name: p.read_text() for p in out.glob("profile-*.json.gz")}
    assert folders and traces == {f"profile-{folder}.json.gz": folder for folder in folders}
    programs = {p.name: p.read_text() for p in out.glob("hlo-*.txt.gz")}
    assert programs == {f"hlo-{folder}.txt.gz": f"HloModule {folder}" for folder in folders}


def test_the_profile_part_ranks_a_traced_programs_operations_and_names_their_source(tmp_path):
    # The parsing half of gpu.py's profile part, on a small program traced here: a big matmul
    # and a small one run three times, so the big one leads and counts once a step.
    import jax
    import jax.numpy as jnp

    gpu = _gpu_module()

    def program(a, b):
        return a @ a, jnp.tanh(b @ b)

    a, b = jnp.ones((768, 768)), jnp.ones((8, 8))
    compiled = jax.jit(program).lower(a, b).compile()
    jax.block_until_ready(compiled(a, b))
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    for _ in range(3):
        jax.block_until_ready(compiled(a, b))
    jax.profiler.stop_trace()
    ops = gpu.top_operations(tmp_path, 3, gpu.hlo_sources(compiled.as_text()))
    assert ops and all(op["ms"] > 0 for op in ops)
    assert [op["ms"] for op in ops] == sorted((op["ms"] for op in ops), reverse=True)
    # Not the Python tracer's calls, nor the runtime's wrappers around the program.
    assert not any(op["op"].startswith(("$", "Pjit")) or "::" in op["op"] for op in ops)
    top = ops[0]
    assert top["count"] == 1 and "dot_general" in top["source"], ops[:3]


def test_the_profile_part_names_the_source_of_a_kernel_replayed_in_a_cuda_graph(tmp_path):
    # As an H200 traced lmu-1M: a kernel run inside a command buffer has the buffer's name as
    # hlo_op and its fusion's as its own name, spelled with an underscore where the compiled
    # module has a dot (input_transpose_fusion.33); a kernel outside one has its fusion as
    # hlo_op. The host's events are not the device's operations.
    import gzip

    gpu = _gpu_module()
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 7, "dur": 900.0, "name": "PjitFunction(step)"},
    ]
    for _ in range(2):  # two steps
        events += [
            {"ph": "X", "pid": 1, "dur": 6000.0, "name": "input_transpose_fusion_33",
             "args": {"hlo_op": "command_buffer_272"}},
            {"ph": "X", "pid": 1, "dur": 1000.0, "name": "void cutlass::Kernel2<gemm>()",
             "args": {"hlo_op": "command_buffer_272"}},
            {"ph": "X", "pid": 1, "dur": 2000.0, "name": "loop_pad_fusion",
             "args": {"hlo_op": "loop_pad_fusion"}},
        ]  # fmt: skip
    (folder / "perfetto_trace.json.gz").write_bytes(
        gzip.compress(json.dumps({"traceEvents": events}).encode())
    )
    sources = gpu.hlo_sources(
        "  %input_transpose_fusion.33 = f32[4,8]{1,0} fusion(%p), kind=kInput, "
        'metadata={op_name="jit(step)/jvp(ImplicitSelfAttention)/transpose"}\n'
        "  %loop_pad_fusion = f32[8]{0} fusion(%q), kind=kLoop, "
        'metadata={op_name="jit(step)/pad"}\n'
    )
    ops = gpu.top_operations(tmp_path, 2, sources)
    assert [(op["op"], op["ms"], op["count"], op["source"]) for op in ops] == [
        ("input_transpose_fusion_33", 6.0, 1, "jit(step)/jvp(ImplicitSelfAttention)/transpose"),
        ("loop_pad_fusion", 2.0, 1, "jit(step)/pad"),
        ("void cutlass::Kernel2<gemm>()", 1.0, 1, ""),
    ]


def test_the_profile_part_traces_a_cpu_s_layout_beside_what_a_gpu_resolves():
    # The third profile is lmu-1M with its products in a CPU's layout, as every GPU step was
    # before the channels-last one; the others trace the ops as a run resolves them. Here, as
    # for an H100 (channels-last), without a GPU.
    import dataclasses
    import types

    from lmuscale import ops
    from lmuscale.models import named_config

    gpu = _gpu_module()
    assert gpu.PROFILED == {
        "lmu-1M": ("lmu-1M", {}),
        "transformer-1M": ("transformer-1M", {}),
        "lmu-1M steps-last": ("lmu-1M", {"memory_layout": "steps-last"}),
    }
    h100 = types.SimpleNamespace(platform="gpu", device_kind="H100", compute_capability="9.0")
    resolved = ops.resolve(named_config("lmu-1M", dtype="bfloat16"), [h100])
    layouts = {
        label: dataclasses.replace(resolved, **changes).memory_layout
        for label, (_, changes) in gpu.PROFILED.items()
    }
    assert layouts["lmu-1M"] == "channels-last" and layouts["lmu-1M steps-last"] == "steps-last"


def test_the_lmu_s_parts_are_cut_down_models_of_less_work():
    # lmu_vs_transformer's breakdown of lmu-1M, here one layer of lmu-55k on 16 tokens: each
    # cut-down model (its own classes, not a patch of the layers) does less work than the one
    # before it, its parameters are those it was traced with, and the whole model is the
    # family's own.
    from lmuscale.models import LMULanguageModel

    bench = _benchmark("lmu_vs_transformer")
    flops, memory_params = {}, {}
    for label, model_class in bench.LMU_PARTS.items():
        lowered, init = bench.loss_and_grad_program(
            "lmu-55k", 16, model_class, vocab_size=256, n_layers=1
        )
        flops[label] = lowered.cost_analysis()["flops"]
        memory_params[label] = sorted(init()["params"]["block_0"].get("memory", {}))
    whole, attention_reads_once, no_memory = flops.values()
    assert whole > attention_reads_once > no_memory > 0, flops
    assert list(memory_params.values()) == [["bias", "l", "p"], ["bias", "l", "p"], []]
    assert bench.LMU_PARTS["lmu-1M"] is LMULanguageModel


def test_the_block_benchmark_times_each_layout_and_compares_it_with_the_resolved_path():
    # One small block of lmu-55k: the chunked memory as a run here resolves it (a CPU's
    # steps-last layout), and in each layout, given to the block (nothing patched): the
    # steps-last row is the same program here, the channels-last one the same function to
    # float32's rounding.
    from lmuscale.models import named_config

    lmu_memory = _benchmark("lmu_memory")
    shape = {"n": 12, "d": 48, "q": 50, "q_prime": 5, "theta": 350.0}
    rows = lmu_memory.bench_block(shape, 1, 1, [8], ["float32"], model="lmu-55k")
    assert [r["mode"] for r in rows] == ["fft", "chunked/8", "steps-last/8", "channels-last/8"]
    assert [r["memory_layout"] for r in rows[1:]] == ["steps-last", "steps-last", "channels-last"]
    steps_last, channels = rows[2:]
    assert steps_last["output_max_diff_rel_to_max"] == steps_last["grad_max_diff_rel_to_max"] == 0
    assert 0 < channels["output_max_diff_rel_to_max"] <= 1e-5  # traced anew, not a cached trace
    assert channels["grad_max_diff_rel_to_max"] <= 1e-4
    for row in rows[1:]:
        flops = row["forward_flops"]
        assert flops == lmu_memory.block_flops(named_config("lmu-55k"), 1, 12, 8)
        for phase, count in (("forward", flops), ("forward_backward", 3 * flops)):
            assert row[phase]["tflops_per_s"] == count / row[phase]["median_s"] / 1e12


def test_the_step_s_bytes_count_a_loop_at_every_trip_beside_xla_s_once_in_all():
    # XLA's cost analysis counts a loop's body once; lmu_vs_transformer also gives the bytes
    # with the body counted at every trip, here 8 trips of an elementwise pass over a 256 KB
    # array (read and written at each), compiled on this CPU.
    import jax
    import jax.numpy as jnp
    from jax import lax

    bench = _benchmark("lmu_vs_transformer")
    array = jnp.ones((256, 256), jnp.float32)
    step = jax.jit(lambda a: lax.fori_loop(0, 8, lambda i, a: jnp.sin(a) * 1.1, a)).lower(array)
    compiled = step.compile()
    assert '"known_trip_count":{"n":"8"}' in compiled.as_text()  # still a loop, not unrolled
    figures = bench.analysis(compiled)
    one_pass = array.size * 4
    # Each trip reads and writes the array; around the loop at most a copy in and out.
    assert 8 * 2 * one_pass <= figures["bytes_all_trips"] <= (8 * 2 + 4) * one_pass
    assert figures["bytes_accessed"] < 8 * 2 * one_pass  # the body counted once


# A compiled module as XLA's GPU compiler prints one, cut down: a loop of 8 trips whose body
# reads one row of a (8, 256) f32 array through a slicing fusion and writes it back in place,
# then a matmul after the loop.
_HLO = """HloModule jit_f, entry_computation_layout={(f32[8,256]{1,0})->f32[8,128]{1,0}}

%fused_row (param_0.1: f32[8,256], param_1.1: s32[]) -> f32[1,256] {
  %param_0.1 = f32[8,256]{1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %constant.1 = s32[] constant(0)
  ROOT %dynamic-slice.1 = f32[1,256]{1,0} dynamic-slice(%param_0.1, %param_1.1, %constant.1), \
dynamic_slice_sizes={1,256}
}

%fused_put (param_0.2: f32[8,256], param_1.2: f32[1,256], param_2.2: s32[]) -> f32[8,256] {
  %param_0.2 = f32[8,256]{1,0} parameter(0)
  %param_1.2 = f32[1,256]{1,0} parameter(1)
  %param_2.2 = s32[] parameter(2)
  %constant.2 = s32[] constant(0)
  %negate.1 = f32[1,256]{1,0} negate(%param_1.2), metadata={op_name="jit(f)/while/body/neg"}
  ROOT %dynamic-update-slice.1 = f32[8,256]{1,0} dynamic-update-slice(%param_0.2, %negate.1, \
%param_2.2, %constant.2)
}

%body (arg.1: (f32[8,256], s32[])) -> (f32[8,256], s32[]) {
  %arg.1 = (f32[8,256]{1,0}, s32[]) parameter(0)
  %x.1 = f32[8,256]{1,0} get-tuple-element(%arg.1), index=0
  %i.1 = s32[] get-tuple-element(%arg.1), index=1
  %row = f32[1,256]{1,0} fusion(%x.1, %i.1), kind=kLoop, calls=%fused_row, \
metadata={op_name="jit(f)/while/body/dynamic_slice"}
  %put = f32[8,256]{1,0} fusion(%x.1, %row, %i.1), kind=kLoop, calls=%fused_put
  %one = s32[] constant(1)
  %next = s32[] add(%i.1, %one)
  ROOT %tuple.1 = (f32[8,256]{1,0}, s32[]) tuple(%put, %next)
}

ENTRY %main (a.1: f32[8,256], w.1: f32[256,128]) -> f32[8,128] {
  %a.1 = f32[8,256]{1,0} parameter(0)
  %w.1 = f32[256,128]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (f32[8,256]{1,0}, s32[]) tuple(%a.1, %zero)
  %loop = (f32[8,256]{1,0}, s32[]) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"8"}}
  %x.2 = f32[8,256]{1,0} get-tuple-element(%loop), index=0
  ROOT %dot.1 = f32[8,128]{1,0} dot(%x.2, %w.1), lhs_contracting_dims={1}, \
rhs_contracting_dims={0}, metadata={op_name="jit(f)/mlp/up/dot_general"}
}
""".replace("\\\n", "")


def test_the_gpu_compile_s_kernels_count_what_they_move_and_loops_per_trip():
    gpu_aot = _benchmark("gpu_aot")
    rows = {r["name"]: r for r in gpu_aot.kernels_of(_HLO)}
    assert set(rows) == {"row", "put", "next", "dot.1"}
    row = 256 * 4
    # The slicing fusion reads its row (not the array), the scalar index, writes the row.
    assert rows["row"]["bytes"] == 8 * (row + 4 + row) and rows["row"]["launches"] == 8
    # The update in place writes the row and counts it twice; the array it updates is not read.
    assert rows["put"]["bytes"] == 8 * (2 * row + row + 4)
    # A fusion whose own line names no source takes the first its body names.
    assert rows["row"]["source"] == "jit(f)/while/body/dynamic_slice"
    assert rows["put"]["source"] == "jit(f)/while/body/neg"
    assert rows["next"]["bytes"] == 8 * 12
    dot = rows["dot.1"]
    assert dot["launches"] == 1 and dot["flops"] == 2 * 8 * 128 * 256
    assert dot["bytes"] == 4 * (8 * 256 + 256 * 128 + 8 * 128)
    assert gpu_aot.part_of(dot["source"]) == "feed-forward"
    sources = {
        "jit(step)/transpose(jvp(LMULanguageModel.loss))/pallas_call": "loss",
        "jit(step)/jvp(LMULanguageModel.loss)/while/body/closed_call/reduce_sum": "loss",
        "jit(step)/jvp(LMULanguageModel.loss)/LMULanguageModel.hidden/block_0/memory/"
        "memory._attend/pallas_call": "memory",
        "jit(step)/jvp(TransformerLanguageModel.loss)/TransformerLanguageModel.hidden/block_1/"
        "attention/vmap()/mul": "attention",
        "jit(step)/jvp(LMULanguageModel.loss)/LMULanguageModel.hidden/block_0/pre/qkv/"
        "dot_general": "attention",
        "jit(step)/jvp(LMULanguageModel.loss)/LMULanguageModel.hidden/block_0/pre/up/"
        "dot_general": "feed-forward",
        "jit(step)/jvp(SRULanguageModel.loss)/SRULanguageModel.hidden/block_0/while/body/mul": (
            "other layers"
        ),
        "jit(step)/jvp(SRULanguageModel.loss)/reduce_sum": "loss",
        "jit(step)/jvp(SRULanguageModel.loss)/SRULanguageModel.embed/gather": "other",
        "jit(step)/adam/mul": "other",
    }
    assert {s: gpu_aot.part_of(s) for s in sources} == sources
    total = gpu_aot.summary(list(rows.values()))
    assert total["bytes"] == sum(r["bytes"] for r in rows.values())
    # The H100's 3.35 TB/s from the target the compiler is given, 989 TFLOP/s from PEAK_FLOPS.
    assert (gpu_aot.HBM_BYTES_PER_S, gpu_aot.BF16_FLOPS_PER_S) == (3.35232e12, 989.4e12)
    assert total["floor_seconds"] == pytest.approx(
        sum(max(r["bytes"] / 3.35232e12, r["flops"] / 989.4e12) for r in rows.values())
    )


def test_the_loss_tile_sweep_times_every_launch_of_each_kernel_and_they_agree(tmp_path):
    # In interpret mode at a tiny shape (times mean nothing on a CPU): 33 tokens and V = 53
    # are whole tiles for no launch, so every launch pads both, as the kernels do on a GPU.
    # One launch of dh, marked as spilling in a compile's resources, is left out.
    cross_entropy = _benchmark("cross_entropy")
    out, resources = tmp_path / "tiles.json", tmp_path / "resources.json"
    spilling = {"case": "loss d=40 float32 4x16", "d": 40, "kernel": "dh_kernel", "rows": 4}
    spilling.update(step=16, num_warps=4, num_stages=1, fits_h100=True, spill_store_bytes=8)
    fitting = {**spilling, "kernel": "dw_kernel", "spill_store_bytes": 0}
    resources.write_text(json.dumps({"rows": [spilling, fitting]}))
    cross_entropy.main(
        [
            *("--part", "loss-tiles", "--interpret", "--vocab", "53", "--batch", "3"),
            *("--seq-len", "11", "--widths", "40", "--dtypes", "float32"),
            *("--tiles", "4", "16", "--warps", "4", "--stages", "1", "--repeats", "1"),
            *("--resources", str(resources), "--out", str(out)),
        ]
    )
    [record] = json.loads(out.read_text())["records"]
    assert record["not_started"] == 0 and not [r for r in record["rows"] if "error" in r]
    launches = {(r["kernel"], r["rows"], r["step"]) for r in record["rows"]}
    kernels = ("forward", "forward_expected", "dh", "dw")
    every = {(k, a, b) for k in kernels for a in (4, 16) for b in (4, 16)}
    assert launches == every - {("dh", 4, 16)} and record["left_out"] == 1
    # Every launch computes the default tiling's numbers, but for the order of the sums.
    assert max(r["max_diff_rel_to_max"] for r in record["rows"]) < 1e-6
    assert set(record["fastest"]) == set(kernels)
    forms = ("dh kernel", "dh from the forward")
    # d = 40 pads to 64 whole, to 48 (32 + 16) split: each loss is timed both ways.
    tilings = ("default", "fastest", "default, split width", "fastest, split width")
    assert set(record["loss_ms"]) == {f"{f}, {t}" for f in forms for t in tilings}
    # Each timed loss's launches, as --tuned-loss reads them back.
    from lmuscale.ops.cross_entropy_pallas import Launch, Tiling

    assert set(record["tilings"]) == set(record["loss_ms"]) == set(record["loss_diffs"])
    assert record["loss_errors"] == {} and record["loss_reference"] == "dh kernel, default"
    # Every timed loss agrees with the reference (the dh kernel at the default tiling).
    assert record["loss_diffs"]["dh kernel, default"] == dict.fromkeys(LOSS_KEYS, 0.0)
    assert max(max(d.values()) for d in record["loss_diffs"].values()) < 1e-5
    fastest = {k: Launch(**v) for k, v in record["fastest"].items()}
    default = Tiling.from_dict(record["default"])
    by_forward = Tiling.from_dict(record["tilings"]["dh from the forward, fastest"])
    assert by_forward == Tiling(fastest["forward_expected"], default.dh, fastest["dw"])
    by_kernel = Tiling.from_dict(record["tilings"]["dh kernel, fastest"])
    assert by_kernel == Tiling(fastest["forward"], fastest["dh"], fastest["dw"])
    split = Tiling.from_dict(record["tilings"]["dh kernel, fastest, split width"])
    assert split == Tiling(fastest["forward"], fastest["dh"], fastest["dw"], split_width=True)


def _launched_on_a_gpu(loss, h, w, targets) -> dict:
    """Each fused-loss kernel in ``loss``'s forward+backward, lowered for CUDA here: its name
    and (programs, warps, stages)."""
    import re

    import jax

    from lmuscale import ops

    def loss_and_grads(h, w, targets):
        return jax.value_and_grad(lambda h, w: loss(h, w, targets).mean(), (0, 1))(h, w)

    launched = {}
    for line in ops.lowered_for_cuda(loss_and_grads, h, w, targets).as_text().splitlines():
        if "xla.gpu.triton" in line:
            [name] = re.findall(r'name = "_(\w+)_kernel"', line)
            keys = ("grid_x", "num_warps", "num_stages")
            launched[name] = tuple(int(re.search(rf"{k} = (\d+)", line).group(1)) for k in keys)
    return launched


def test_the_tuned_loss_is_the_sweeps_fastest_whole_loss_and_runs_only_at_its_width():
    # A loss_tiles part as the sweep records it: the whole loss was fastest in the form with
    # dh from the forward under the kernels' fastest launches. Under --tuned-loss a model's
    # fused loss at that (d, dtype) runs exactly that (two kernels, their grids, warps and
    # stages); at another width, or without the fused loss, as committed (three kernels).
    import dataclasses
    import functools
    from dataclasses import asdict

    import jax
    import jax.numpy as jnp

    from lmuscale import ops
    from lmuscale.models import named_config
    from lmuscale.ops import cross_entropy_pallas as fused_loss
    from lmuscale.ops.cross_entropy import cross_entropy
    from lmuscale.ops.cross_entropy_pallas import Launch, Tiling

    gpu = _gpu_module()
    fastest = Tiling(Launch(32, 64, 4, 1), Launch(64, 32, 8, 3), Launch(128, 16, 16, 2))
    default = fused_loss.default_tiling(204, jnp.bfloat16)
    split = dataclasses.replace(fastest, split_width=True)
    timed = {"dh kernel, default": 5.0, "dh kernel, fastest": 4.0}
    timed |= {"dh from the forward, default": 4.5, "dh from the forward, fastest": 3.0}
    timed |= {"dh kernel, fastest, split width": 3.5}
    tilings = {k: asdict(fastest if "fastest" in k else default) for k in timed}
    tilings["dh kernel, fastest, split width"] = asdict(split)
    close = dict(zip(LOSS_KEYS, (1e-6, 4e-3, 1e-4), strict=True))
    diffs = dict.fromkeys(timed, close)
    part = {"d": 204, "dtype": "bfloat16", "loss_ms": timed, "tilings": tilings}
    part |= {"loss_diffs": diffs, "loss_reference": "dh kernel, default"}
    part |= {"args": {"session": "session-1"}}
    tuned = gpu.tuned_loss_from({"parts": {"loss_tiles": part}}, "gpu-x.json")
    assert tuned["label"] == "dh from the forward, fastest" and tuned["dh_from_forward"]
    assert tuned["tiling"] == fastest and (tuned["loss_ms"], tuned["default_ms"]) == (3.0, 4.5)
    assert tuned["committed_ms"] == 5.0  # the committed form: the dh kernel's default
    assert tuned["sweep_session"] == "session-1"
    # Were the split width fastest, it is what runs, in its own form; unless its gradients
    # disagreed with the reference's on the GPU, when the next fastest runs.
    part_split = {**part, "loss_ms": {**timed, "dh kernel, fastest, split width": 2.0}}
    tuned_split = gpu.tuned_loss_from({"parts": {"loss_tiles": part_split}}, "gpu-x.json")
    assert tuned_split["tiling"] == split and not tuned_split["dh_from_forward"]
    assert tuned_split["default_ms"] == 5.0
    wrong = {**diffs, "dh kernel, fastest, split width": {**close, "dw_max_diff_rel_to_max": 0.3}}
    part_wrong = {**part_split, "loss_diffs": wrong}
    not_split = gpu.tuned_loss_from({"parts": {"loss_tiles": part_wrong}}, "gpu-x.json")
    assert not_split["label"] == "dh from the forward, fastest"

    # 600 tokens pad to 640 (dh's 64 rows, though dh is not launched), V = 50,257 to 50,304.
    w = jax.ShapeDtypeStruct((50257, 204), jnp.float32)
    targets = jax.ShapeDtypeStruct((2, 300), jnp.int32)
    h = jax.ShapeDtypeStruct((2, 300, 204), jnp.bfloat16)
    committed = {"forward": (10, 8, 2), "dh": (10, 8, 2), "dw": (786, 8, 2)}  # 64 x 64 tiles
    h_48 = jax.ShapeDtypeStruct((2, 300, 48), jnp.bfloat16)
    w_48 = jax.ShapeDtypeStruct((50257, 48), jnp.float32)
    fused = ops.Impls(loss="pallas")

    def launched(model, impls, h, w):
        impls, ran = gpu.tuned_impls(model, impls, tuned)
        kernels = impls.loss_kernels
        loss = functools.partial(cross_entropy, impl=impls.loss, kernels=kernels)
        return _launched_on_a_gpu(loss, h, w, targets), ran

    lmu_1m, lmu_55k = (named_config(f"lmu-{n}", dtype="bfloat16") for n in ("1M", "55k"))
    assert launched(lmu_1m, fused, h, w) == ({"forward": (20, 4, 1), "dw": (393, 16, 2)}, tuned)
    # A model of d = 48 runs as committed, and is not labelled; one on XLA's loss neither.
    assert launched(lmu_55k, fused, h_48, w_48) == (committed, None)
    assert gpu.tuned_impls(lmu_1m, ops.Impls(), tuned) == (ops.Impls(), None)
    assert gpu.tuned_impls(lmu_1m, fused, None) == (fused, None)

    # Its rows say what ran, and are kept beside the committed code's rows of the model.
    row = {"model": "lmu-1M", "seq_len": 1024, "batch": 512, "loss_impl": "pallas"}
    tuned_row = gpu._with_tuning({**row, "step_seconds": 0.5}, tuned)
    assert tuned_row["loss_tuned"] == "dh from the forward, fastest"
    assert tuned_row["loss_tiling"] == tilings["dh from the forward, fastest"]
    assert tuned_row["loss_tuned_ms"] == {"tuned": 3.0, "default": 4.5, "committed": 5.0}
    assert tuned_row["loss_tuned_session"] == "session-1"
    assert gpu._with_tuning(row, None) == row
    kept = gpu.merged([{**row, "step_seconds": 0.6}], [tuned_row])
    assert [r["step_seconds"] for r in kept] == [0.6, 0.5]
    other = {**tuned_row, "loss_tuned": "dh kernel, fastest", "step_seconds": 0.4}
    again = gpu.merged(kept, [other])  # the latest tuned run's row, whatever it chose
    assert [r["step_seconds"] for r in again] == [0.6, 0.4]
    failed = {"model": "lmu-1M", "seq_len": 1024, "batch": 512, "error": "..."}
    failed |= {"loss_impl": "pallas", "loss_tuned": None}  # as part_train marks it
    assert gpu.merged(again, [failed]) == [again[0], failed]  # the committed row stays
    # With the memory's switch too: a failed row names it as a row that ran does.
    with_memory = [{**r, "memory_impl": "pallas"} for r in again]
    failed_memory = {**failed, "memory_impl": "pallas"}
    assert gpu.merged(with_memory, [failed_memory]) == [with_memory[0], failed_memory]


def test_a_tuned_loss_without_its_sweep_is_named(tmp_path, capsys):
    gpu = _gpu_module()
    with pytest.raises(ValueError, match=r"gpu-x.json has no loss_tiles part"):
        gpu.tuned_loss_from({"parts": {}}, "gpu-x.json")
    skipped = {"loss_tiles": {"skipped": "this run's devices are cpu (cpu)"}}
    with pytest.raises(ValueError, match=r'"loss_tiles"\]: this run.s devices are cpu'):
        gpu.tuned_loss_from({"parts": skipped}, "gpu-x.json")
    part = {"d": 204, "dtype": "bfloat16", "loss_ms": {"dh kernel, default": 1.0}}
    part["tilings"] = {"dh kernel, default": {"forward": {"rows": 64}, "dh": {}, "dw": {}}}
    part["loss_diffs"] = {"dh kernel, default": dict.fromkeys(LOSS_KEYS, 0.0)}
    unchecked = {k: v for k, v in part.items() if k != "loss_reference"}
    with pytest.raises(ValueError, match=r"the reference loss \(dh kernel, default\) did not"):
        gpu.tuned_loss_from({"parts": {"loss_tiles": unchecked}}, "gpu-x.json")
    part["loss_reference"] = "dh kernel, default"
    with pytest.raises(ValueError, match=r'\["dh kernel, default"\]: tiling.forward must be'):
        gpu.tuned_loss_from({"parts": {"loss_tiles": part}}, "gpu-x.json")
    disagreeing = {**part, "tilings": {"dh kernel, default": {}}, "loss_diffs": {}}
    with pytest.raises(ValueError, match=r"no timed loss has differences .* within"):
        gpu.tuned_loss_from({"parts": {"loss_tiles": disagreeing}}, "gpu-x.json")
    out = tmp_path / "gpu.json"
    with pytest.raises(SystemExit):  # argparse: --tuned-loss only tunes the fused loss
        gpu.main(["--tuned-loss", "--only", "train/lmu", "--out", str(out)])
    assert "--tuned-loss tunes the fused loss: give --loss-impl pallas" in capsys.readouterr().err
    assert not out.exists()


def test_a_failed_model_s_row_names_the_kernels_it_asked_for():
    # So that a failed run of the fused loss (refused on this CPU) does not replace the row of
    # the XLA path's run of the same model and shape, and a later such run replaces it.
    import argparse

    gpu = _gpu_module()
    args = argparse.Namespace(budget_gb=0.0, memory_impl="auto")
    pallas = argparse.Namespace(**vars(args), loss_impl="pallas")
    auto = argparse.Namespace(**vars(args), loss_impl="auto")
    asked_pallas = gpu._kernels_asked("lmu-55k", pallas, 16, 4)
    assert asked_pallas == {"loss_impl": "pallas"}  # "auto" memory: as it resolves, XLA's
    assert gpu._kernels_asked("lmu-55k", auto, 16, 4) == {"loss_impl": "xla", "memory_impl": "xla"}
    assert gpu._kernels_asked("transformer-55k", auto, 16, 4) == {"loss_impl": "xla"}
    # Where the config cannot be built, what was asked of the loss (not "auto").
    assert gpu._kernels_asked("no-such-model", auto, 16, 4) == {}
    assert gpu._kernels_asked("no-such-model", pallas, 16, 4) == {"loss_impl": "pallas"}
    shape = {"model": "lmu-55k", "seq_len": 16, "batch": 4}
    ran = {**shape, "loss_impl": "xla", "memory_impl": "xla", "step_seconds": 1.0}
    failed = {**shape, "error": "ValueError: ...", **asked_pallas}
    assert gpu.merged([ran], [failed]) == [ran, failed]
    assert gpu.merged([ran, failed], [{**failed, "error": "again"}])[0] == ran
    # --tuned-loss marks a failed model as tuned only at the swept d and dtype (lmu-1M's),
    # where a row that ran would say so.
    at = argparse.Namespace(**vars(pallas), seq_len=1024, batch=512)
    assert gpu.SWEPT == (204, "bfloat16")
    assert gpu._tuned_width("lmu-1M", at) and gpu._tuned_width("transformer-1M", at)
    assert not gpu._tuned_width("lmu-55k", at)


def test_a_sweep_whose_reference_loss_fails_keeps_its_timings_and_tunes_nothing(monkeypatch):
    # The whole loss under the default tiling (dh kernel) is the others' reference: when it
    # fails to compile, the others are still timed, but none is checked, so --tuned-loss
    # takes none; a failing loss leaves the sweep's other results in place.
    cross_entropy, gpu = _benchmark("cross_entropy"), _gpu_module()
    from lmuscale.ops import cross_entropy_pallas as fused_loss

    programs = cross_entropy._loss_program
    default = fused_loss.default_tiling(12, "float32")

    def refusing(tiling, dh_from_forward, interpret):
        if tiling == default and not dh_from_forward:
            raise RuntimeError("Triton refused this launch")
        return programs(tiling, dh_from_forward, interpret)

    monkeypatch.setattr(cross_entropy, "_loss_program", refusing)
    candidates = [fused_loss.Launch(4, 16, 4, 1)]
    record = cross_entropy.sweep_launches(
        12, "float32", 3, 11, 53, candidates=candidates, repeats=1, interpret=True
    )
    assert list(record["loss_errors"]) == ["dh kernel, default"]
    assert "RuntimeError: Triton refused" in record["loss_errors"]["dh kernel, default"]
    assert "dh from the forward, default" in record["loss_ms"]
    assert record["loss_diffs"] == {} and "loss_reference" not in record
    part = {"d": 12, "dtype": "float32", **record}
    with pytest.raises(ValueError, match=r"the reference loss \(dh kernel, default\) did not"):
        gpu.tuned_loss_from({"parts": {"loss_tiles": part}}, "gpu-x.json")
