"""A sweep's THROUGHPUT from GPU benchmark files: which file, which rows, which figure per
trial, and the dry run of a copy of sweeps/owt2.py pointed at a folder of fake benchmarks."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from sweep_files import sweep_command, write_sweep

from lmuscale.outcomes import ConfigError, DamagedFile
from lmuscale.sweep import BenchmarkError, Throughput, from_benchmarks, load_sweep
from lmuscale.sweep.plan import plan, table
from lmuscale.sweep.throughput import load_benchmarks

REPO = Path(__file__).resolve().parent.parent
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(autouse=True)
def _no_choice(monkeypatch):
    monkeypatch.delenv("LMUSCALE_GPU_BENCHMARK", raising=False)


def row(family: str, n: int, speed: float | None = None, **extra) -> dict:
    """A benchmark row as benchmarks/gpu.py writes it (the keys read here, and a few others)."""
    out = {"model": f"{family}-{n}", "family": family, "non_embedding_params": n}
    out.update(seq_len=1024, batch=512, dtype="bfloat16", tokens_per_second=1.0)
    if speed is not None:
        out["model_flops_per_second"] = speed
    return out | extra


def write_benchmark(
    folder: Path,
    device: str,
    written: str,
    parts: dict[str, list],
    platform: str = "gpu",
    **machine,
) -> Path:
    """``folder/gpu-<slug>.json`` for ``device`` with ``parts`` (name -> rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"gpu-{re.sub(r'[^a-z0-9]+', '-', device.lower())}.json"
    data = {
        "benchmark": "gpu",
        "written": written,
        "machine": {"platform": platform, "device_kind": device, "device_count": 1, **machine},
        "parts": {name: {"rows": rows} for name, rows in parts.items()},
    }
    path.write_text(json.dumps(data))
    return path


def test_a_trial_takes_its_model_then_its_family_then_the_default(tmp_path):
    path = write_benchmark(
        tmp_path,
        H100,
        "2026-11-23T10:00:00+00:00",
        {
            "train/lmu": [
                row("lmu", 100, 2e13),
                row("lmu", 300, 4e13),
                row("lmu", 200, 9e20, error="RESOURCE_EXHAUSTED: out of memory"),
                row("lmu", 400),  # no speed
                row("lmu", 300, 9e20, batch=8),  # a quick check at another shape
            ],
            "train/transformer": [row("transformer", 100, 5e13)],
            "long": [row("lmu", 500, 7e20)],  # not the paper's 512 x 1024 training
        },
    )
    throughput = from_benchmarks(tmp_path, default=1e14)
    assert throughput.measured == {
        ("lmu", 100): 2e13,
        ("lmu", 300): 4e13,
        ("transformer", 100): 5e13,
    }
    assert throughput.lookup("lmu", 100) == (2e13, "benchmark")
    assert throughput.lookup("transformer", 100) == (5e13, "benchmark")
    # The failed row and the long-context part leave the family's median at (2e13 + 4e13) / 2.
    assert throughput.lookup("lmu", 200) == (3e13, "benchmark family (guess)")
    assert throughput.lookup("lmu", 500) == (3e13, "benchmark family (guess)")
    assert throughput.lookup("transformer", 7) == (5e13, "benchmark family (guess)")
    assert throughput.lookup("lstm", 100) == (1e14, "guess")
    assert path.name == "gpu-nvidia-h100-80gb-hbm3.json"
    assert f"{path.name} ({H100}, written 2026-11-23T10:00:00+00:00)" in throughput.source
    assert from_benchmarks(tmp_path).lookup("lstm", 100) == (None, None)


def test_rows_of_the_cross_entropy_auto_would_not_take_are_left_out(tmp_path):
    # On a GPU where the fused loss was not measured faster (not in ops.LOSS.faster), "auto"
    # takes XLA's cross-entropy: the kernels' rows are left out.
    a100 = "NVIDIA A100-SXM4-80GB"
    rows = [
        row("lmu", 100, 2e13, loss_impl="xla"),
        row("lmu", 100, 6e13, loss_impl="pallas"),
        row("lmu", 300, 4e13),  # written before loss_impl was recorded: the XLA path
        row("lmu", 100, 3e13, loss_impl="xla", dtype="float32"),
        # gpu.py --tuned-loss: the kernels under launches not committed, never counted
        row("lmu", 100, 9e13, loss_impl="pallas", loss_tuned="dh from the forward, fastest"),
    ]
    when = "2026-11-23T10:00:00+00:00"
    write_benchmark(tmp_path, a100, when, {"train/lmu": rows}, compute_capability="8.0")
    measured = from_benchmarks(tmp_path, default=1e14).measured
    assert measured == {("lmu", 100): 2e13, ("lmu", 300): 4e13}
    # On the H100, measured faster in bfloat16, "auto" takes them there, on one device (on
    # several it does not), and not in float32.
    shutil.rmtree(tmp_path)
    write_benchmark(tmp_path, H100, when, {"train/lmu": rows}, compute_capability="9.0")
    assert from_benchmarks(tmp_path, default=1e14).measured == {("lmu", 100): 6e13}
    in_float32 = from_benchmarks(tmp_path, default=1e14, dtype="float32").measured
    assert in_float32 == {("lmu", 100): 3e13}
    write_benchmark(
        tmp_path, H100, when, {"train/lmu": rows}, compute_capability="9.0", device_count=8
    )
    assert from_benchmarks(tmp_path, default=1e14).measured == measured


def test_rows_of_the_lmu_memory_auto_would_not_take_are_left_out(tmp_path):
    # "auto" takes no fused LMU memory anywhere (this version has none): rows of the old
    # kernels drop out, the XLA rows stay, and the transformer's, which has no LMU memory.
    a100 = "NVIDIA A100-SXM4-80GB"  # where "auto" takes XLA's cross-entropy, as the rows ran
    rows = {
        "train/lmu": [
            row("lmu", 100, 2e13, memory_impl="xla"),
            row("lmu", 100, 6e13, memory_impl="pallas"),
            row("lmu", 300, 4e13),  # written before memory_impl was recorded: the XLA path
            row("lmu", 100, 3e13, memory_impl="xla", dtype="float32"),
        ],
        "train/transformer": [row("transformer", 100, 5e13)],  # a family without the switch
    }
    when = "2026-11-23T10:00:00+00:00"
    write_benchmark(tmp_path, a100, when, rows, compute_capability="8.0")
    measured = {("lmu", 100): 2e13, ("lmu", 300): 4e13, ("transformer", 100): 5e13}
    assert from_benchmarks(tmp_path, default=1e14).measured == measured
    in_float32 = from_benchmarks(tmp_path, default=1e14, dtype="float32").measured
    assert in_float32 == {("lmu", 100): 3e13}


def test_without_a_benchmark_the_default_is_a_guess(tmp_path):
    throughput = from_benchmarks(tmp_path / "results", default=1e14)
    assert throughput.measured == {} and throughput.lookup("lmu", 100) == (1e14, "guess")
    assert "guess 1e+14" in throughput.source and str(tmp_path / "results") in throughput.source
    assert from_benchmarks(tmp_path).lookup("lmu", 100) == (None, None)
    with pytest.raises(BenchmarkError, match="positive"):
        from_benchmarks(tmp_path, default=0)


def test_the_newest_file_or_the_one_the_environment_names(tmp_path, monkeypatch):
    # 12:00+05:00 is 07:00 UTC: written before the A100's 09:00 UTC, though it sorts after it
    # as text.
    h100 = write_benchmark(
        tmp_path, H100, "2026-11-24T12:00:00+05:00", {"train/lmu": [row("lmu", 100, 3e13)]}
    )
    a100 = write_benchmark(
        tmp_path,
        "NVIDIA A100-SXM4-80GB",
        "2026-11-24T09:00:00+00:00",
        {"train/lmu": [row("lmu", 100, 1e13)]},
    )
    assert from_benchmarks(tmp_path).lookup("lmu", 100) == (1e13, "benchmark")
    assert a100.name in from_benchmarks(tmp_path).source
    # benchmarks/gpu.py run on a CPU, written last: not a figure for the sweeps' trials.
    cpu = write_benchmark(
        tmp_path, "cpu", "2026-11-25T09:00:00+00:00", {"train/lmu": [row("lmu", 100, 1e9)]}, "cpu"
    )
    assert from_benchmarks(tmp_path).lookup("lmu", 100) == (1e13, "benchmark")
    monkeypatch.setenv("LMUSCALE_GPU_BENCHMARK", str(cpu))  # unless named
    assert from_benchmarks(tmp_path).lookup("lmu", 100) == (1e9, "benchmark")
    for choice in ("h100", "H100 80GB", str(h100)):
        monkeypatch.setenv("LMUSCALE_GPU_BENCHMARK", choice)
        throughput = from_benchmarks(tmp_path)
        assert throughput.lookup("lmu", 100) == (3e13, "benchmark"), choice
        assert h100.name in throughput.source
    monkeypatch.setenv("LMUSCALE_GPU_BENCHMARK", "v100")
    with pytest.raises(BenchmarkError) as error:
        load_benchmarks(tmp_path)
    assert str(error.value) in from_benchmarks(tmp_path, 1e14).source  # a sweep still loads
    for part in ("LMUSCALE_GPU_BENCHMARK='v100'", a100.name, h100.name, H100):
        assert part in str(error.value)
    monkeypatch.setenv("LMUSCALE_GPU_BENCHMARK", "nvidia")
    with pytest.raises(BenchmarkError, match="matches several"):
        load_benchmarks(tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"benchmark": "gpu", "written": ', "not a readable JSON file"),
        ('{"benchmark": "cpu"}', '"benchmark": "gpu"'),
        ('{"benchmark": "gpu", "machine": {}, "parts": {}}', "device_kind"),
        (
            '{"benchmark": "gpu", "machine": {"device_kind": "X"}, "parts": {}, "written": "now"}',
            "'now'; expected an ISO time",
        ),
        (
            '{"benchmark": "gpu", "machine": {"device_kind": "X"}, "written": "2026-11-23", '
            '"parts": {"train/lmu": {"rows": [{"model": "m", "model_flops_per_second": 1e13}]}}}',
            "row 0 ('m')",
        ),
    ],
)
def test_a_malformed_benchmark_names_its_file(tmp_path, text, message):
    write_benchmark(tmp_path, H100, "2026-11-23T10:00:00+00:00", {})
    (tmp_path / "gpu-broken.json").write_text(text)
    with pytest.raises(BenchmarkError) as error:
        load_benchmarks(tmp_path, default=1e14)
    assert str(tmp_path / "gpu-broken.json") in str(error.value)
    assert message in str(error.value)
    # The sweep itself still loads: the dry run guesses and says why.
    fallback = from_benchmarks(tmp_path, default=1e14)
    assert fallback.measured == {} and fallback.lookup("lmu", 1) == (1e14, "guess")
    assert fallback.source == f"THROUGHPUT guess 1e+14 FLOP/s, as {error.value}"


def test_sweep_throughput_is_a_number_or_a_benchmark(tmp_path):
    header = "from lmuscale.sweep import Trial, from_benchmarks\n"
    trials = "def get_trials():\n    yield Trial('a', '../experiments/owt2.py:lmu-55k')\n"
    (tmp_path / "experiments").symlink_to(REPO / "experiments")
    sweeps = tmp_path / "sweeps"
    sweeps.mkdir()
    write_benchmark(tmp_path / "results", H100, "2026-11-23T10:00:00", {})
    for value, expected in (
        ("5e9", Throughput(5e9, source=f"THROUGHPUT 5e+09 FLOP/s in {sweeps / 's.py'}")),
        (f"from_benchmarks({str(tmp_path / 'results')!r}, 1e14)", None),
    ):
        (sweeps / "s.py").write_text(f"{header}THROUGHPUT = {value}\n{trials}")
        throughput = load_sweep(sweeps / "s.py").throughput
        assert throughput == (expected or from_benchmarks(tmp_path / "results", 1e14))
    (sweeps / "s.py").write_text(f"{header}{trials}")
    assert load_sweep(sweeps / "s.py").throughput.default is None
    (sweeps / "s.py").write_text(f"{header}THROUGHPUT = '1e14'\n{trials}")
    with pytest.raises(ConfigError, match=r"s\.py: THROUGHPUT is '1e14'; expected a positive"):
        load_sweep(sweeps / "s.py")


def _owt2_copy(tmp_path: Path) -> Path:
    """sweeps/owt2.py as it is, in a tree whose benchmarks/results is tmp_path's."""
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "experiments").symlink_to(REPO / "experiments")
    return Path(shutil.copy(REPO / "sweeps" / "owt2.py", tmp_path / "sweeps" / "owt2.py"))


def _dry_run(sweep: Path, workdir: Path, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LMUSCALE_GPU_BENCHMARK"}
    out = subprocess.run(
        sweep_command(sweep, workdir, "--dry-run", *extra),
        capture_output=True,
        text=True,
        env=env | {"JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_owt2_dry_run_estimates_from_the_benchmark(tmp_path):
    sweep_path = _owt2_copy(tmp_path)
    path = write_benchmark(
        tmp_path / "benchmarks" / "results",
        H100,
        "2026-11-23T10:00:00+00:00",
        {
            "train/lmu": [
                row("lmu", 1_000_053, 3.25e13),  # lmu-1M
                row("lmu", 55_065, 1.25e13),  # lmu-55k
                row("lmu", 500_157, 9e20, error="RESOURCE_EXHAUSTED"),  # lmu-500k, failed
            ],
            "train/transformer": [row("transformer", 1_004_496, 5e13)],  # transformer-1M
        },
    )
    sweep = load_sweep(sweep_path)
    rows = {r["trial"]: r for r in plan(sweep.trials, tmp_path / "w", sweep.throughput)}
    expected = {
        "lmu-1M": (3.25e13, "benchmark"),
        "lmu-55k": (1.25e13, "benchmark"),
        "lmu-500k": (2.25e13, "benchmark family (guess)"),
        "lmu-100k": (2.25e13, "benchmark family (guess)"),
        "transformer-1M": (5e13, "benchmark"),
        "transformer-1M-10x": (5e13, "benchmark"),
        "transformer-55k-10x": (5e13, "benchmark family (guess)"),
        "lmu_g-1M": (1e14, "guess"),  # no lmu_g in the benchmark: the guess
    }
    for trial, (speed, source) in expected.items():
        r = rows[trial]
        assert (r["flops_per_second"], r["source"]) == (speed, source), trial
        assert r["seconds"] == pytest.approx(r["total_flops"] / speed), trial

    stdout = _dry_run(sweep_path, tmp_path / "w")
    assert table(list(rows.values())) in stdout
    source = stdout.splitlines()[-1]
    assert source == f"FLOP/s for trials not yet measured: {sweep.throughput.source}"
    assert f"{path} ({H100}, written 2026-11-23T10:00:00+00:00)" in source
    assert not (tmp_path / "w").exists()

    # A trial's own measurement still comes first, and its family's before the benchmark.
    folder = tmp_path / "w" / "trials" / rows["lmu-55k"]["folder"]
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens_per_second": 1e5}))
    again = {r["trial"]: r for r in plan(sweep.trials, tmp_path / "w", sweep.throughput)}
    speed = 1e5 * rows["lmu-55k"]["flops_per_token"]
    assert (again["lmu-55k"]["source"], again["lmu-55k"]["flops_per_second"]) == (
        "measured",
        pytest.approx(speed),
    )
    assert (again["lmu-1M"]["source"], again["lmu-1M"]["flops_per_second"]) == (
        "family",
        pytest.approx(speed),
    )
    assert again["transformer-1M"]["source"] == "benchmark"
    # A kill's torn last line is dropped; a damaged line before it is named, as in training.
    metrics = folder / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '\n{"step": 2, "tokens_')
    torn = {r["trial"]: r for r in plan(sweep.trials, tmp_path / "w", sweep.throughput)}
    assert torn["lmu-55k"]["flops_per_second"] == pytest.approx(speed)
    metrics.write_text('{"step": 1, "tok\n' + json.dumps({"step": 2, "tokens_per_second": 1e5}))
    with pytest.raises(DamagedFile, match=rf"^{re.escape(str(metrics))}:1: not a JSON log line"):
        plan(sweep.trials, tmp_path / "w", sweep.throughput)
    shutil.rmtree(tmp_path / "w")

    # --throughput replaces the benchmark for every trial not measured.
    stdout = _dry_run(sweep_path, tmp_path / "w", "--throughput", "2e14")
    trial_rows = [line for line in stdout.splitlines() if line.startswith("| ")][1:-1]
    assert len(trial_rows) == 24
    assert all("| 200T | configured |" in line for line in trial_rows)
    assert stdout.splitlines()[-1] == "FLOP/s for trials not yet measured: --throughput 2e+14"


def test_owt2_dry_run_without_a_benchmark_says_it_guesses(tmp_path):
    sweep_path = _owt2_copy(tmp_path)
    stdout = _dry_run(sweep_path, tmp_path / "w")
    trial_rows = [line for line in stdout.splitlines() if line.startswith("| ")][1:-1]
    assert len(trial_rows) == 24
    assert all("| 100T | guess |" in line for line in trial_rows)
    assert stdout.splitlines()[-1] == (
        "FLOP/s for trials not yet measured: THROUGHPUT guess 1e+14 FLOP/s, as there is no GPU "
        f"benchmark (gpu-*.json, train_throughput-*.json) in {tmp_path / 'benchmarks' / 'results'}"
    )


def test_a_newer_file_without_training_rows_does_not_hide_an_older_one(tmp_path):
    h100 = write_benchmark(
        tmp_path, H100, "2026-11-23T10:00:00+00:00", {"train/lmu": [row("lmu", 100, 3e13)]}
    )
    write_benchmark(  # only the block part, later, on another GPU
        tmp_path, "NVIDIA H200", "2026-11-24T10:00:00+00:00", {"block": [row("lmu", 100, 1e15)]}
    )
    throughput = from_benchmarks(tmp_path, 1e14)
    assert throughput.lookup("lmu", 100) == (3e13, "benchmark") and h100.name in throughput.source
    small = from_benchmarks(tmp_path, 1e14, batch=8)  # rows at another shape: none
    assert small.measured == {} and "no GPU benchmark training rows at 8 x 1024" in small.source


def write_train_throughput(
    folder: Path, name: str, device: str, rows: list, written: str | None = None, **machine
) -> Path:
    """``folder/train_throughput-<name>.json`` as benchmarks/train_throughput.py writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "benchmark": "train_throughput",
        "machine": {"platform": "gpu", "device_kind": device, "device_count": 1, **machine},
        "results": rows,
    } | ({"written": written} if written else {})
    path = folder / f"train_throughput-{name}.json"
    path.write_text(json.dumps(data))
    return path


def result(model: str, n: int, tokens_per_second: float, flops: float, **extra) -> dict:
    """A train_throughput.py result row (the keys read here, and a few others)."""
    out = {"model": model, "seq_len": 1024, "batch": 512, "dtype": "bfloat16"}
    out.update(non_embedding_params=n, train_flops_per_token=flops, step_seconds=1.0, mfu=0.1)
    return out | {"tokens_per_second": tokens_per_second} | extra


def test_train_throughput_files_newest_per_device_and_model(tmp_path, monkeypatch):
    old = write_train_throughput(
        tmp_path,
        "h100",
        H100,
        [
            result("lmu-1M", 1_000, 4e5, 8e7),
            result("lmu-1M", 1_000, 9e9, 8e7, dtype="float32"),  # another dtype
            result("lmu-1M", 1_000, 9e9, 8e7, batch=64),  # another shape
            result("lmu_g-1M", 990, 2e5, 9e7),
            result("transformer-1M", 1_004, 6e5, 7e7),
            {"model": "lmu-55k", "seq_len": 1024, "batch": 512, "error": "OOM"},
        ],
    )  # no "written": older than every file that has it, whatever its modification time
    os.utime(old, (time.time() + 1e6, time.time() + 1e6))
    new = write_train_throughput(
        tmp_path, "h100-new", H100, [result("lmu-1M", 1_000, 5e5, 8e7)], "2026-11-24T10:00:00"
    )
    write_benchmark(  # the same device in benchmarks/gpu.py's format, newer still: lmu_g only
        tmp_path, H100, "2026-11-25T10:00:00+00:00", {"train/lmu_g": [row("lmu_g", 990, 7e13)]}
    )
    other = write_train_throughput(  # another device, written before the H100's newest
        tmp_path, "a100", "NVIDIA A100", [result("lmu-1M", 1_000, 1e5, 8e7)], "2026-11-20"
    )
    cpu = write_train_throughput(  # a CPU, newest of all: not a figure unless named
        tmp_path, "cpu", "cpu", [result("lmu-1M", 1_000, 1e3, 8e7)], "2026-11-26", platform="cpu"
    )
    throughput = from_benchmarks(tmp_path, default=1e14)
    # Each model from the newest file of the H100's that has it, at 512 x 1024 in bfloat16.
    assert throughput.measured == {
        ("lmu", 1_000): 5e5 * 8e7,
        ("lmu_g", 990): 7e13,
        ("transformer", 1_004): 6e5 * 7e7,
    }
    # tokens/s where a row gives its FLOPs per token (these gpu rows do not)
    assert throughput.tokens_per_second == {("lmu", 1_000): 5e5, ("transformer", 1_004): 6e5}
    # A benchmarked model takes its tokens/s at today's FLOPs count; the others the FLOP/s.
    assert throughput.lookup("lmu", 1_000, 9e7) == (5e5 * 9e7, "benchmark")
    assert throughput.lookup("lmu", 1_000, 9e7, "float32") == (1e14, "guess")
    assert throughput.lookup("lmu", 2_000, 9e7) == (5e5 * 8e7, "benchmark family (guess)")
    assert throughput.platform == "gpu" and throughput.dtype == "bfloat16"
    source = throughput.source
    assert source.startswith("GPU benchmark ") and source.count(H100) == 3
    assert f"{new.name} ({H100}, written 2026-11-24T10:00:00)" in source
    assert f"{old.name} ({H100}, no written time)" in source and other.name not in source
    # $LMUSCALE_GPU_BENCHMARK picks another device, or the CPU file.
    monkeypatch.setenv("LMUSCALE_GPU_BENCHMARK", "a100")
    assert from_benchmarks(tmp_path).lookup("lmu", 1_000, 8e7) == (1e5 * 8e7, "benchmark")
    monkeypatch.setenv("LMUSCALE_GPU_BENCHMARK", str(cpu))
    named = from_benchmarks(tmp_path)
    assert named.lookup("lmu", 1_000, 8e7) == (1e3 * 8e7, "benchmark")
    assert named.platform == "cpu" and named.source.startswith("CPU benchmark")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"benchmark": "gpu", "machine": {"device_kind": "X"}, "results": []}', "train_through"),
        ('{"benchmark": "train_throughput", "machine": {"device_kind": "X"}}', '"results"'),
        (
            '{"benchmark": "train_throughput", "machine": {"device_kind": "X"}, "results": '
            '[{"model": "lmu-1M", "non_embedding_params": 5, "tokens_per_second": 1e5}]}',
            "results row 0 ('lmu-1M')",
        ),
    ],
)
def test_a_malformed_train_throughput_file_names_its_file_and_key(tmp_path, text, message):
    (tmp_path / "train_throughput-broken.json").write_text(text)
    with pytest.raises(BenchmarkError) as error:
        load_benchmarks(tmp_path, default=1e14)
    assert str(tmp_path / "train_throughput-broken.json") in str(error.value)
    assert message in str(error.value)


def _cells(stdout: str) -> dict[str, dict[str, str]]:
    """The dry-run table's rows by trial, each as {column header: cell}."""
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    rows = [dict(zip(header, cells, strict=True)) for cells in rows]
    return {r["trial"]: r for r in rows[1:]}


def test_owt2_dry_run_with_the_committed_h100_benchmark(tmp_path, monkeypatch):
    """The hours of lmu-1M and transformer-1M are the committed file's tokens/s (bf16, as the
    paper configs compute), within 5% with the overhead; the table has the learning rate,
    tokens in the figures' units and tokens per parameter; the missing OWT2 folder is named."""
    from lmuscale.analysis.figures import human

    committed = REPO / "benchmarks" / "results" / "train_throughput-h100.json"
    sweep_path = _owt2_copy(tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    shutil.copy(committed, tmp_path / "benchmarks" / "results")
    data = json.loads(committed.read_text())
    speeds = {
        r["model"]: r["tokens_per_second"]
        for r in data["results"]
        if r["dtype"] == "bfloat16" and (r["seq_len"], r["batch"]) == (1024, 512)
    }
    missing = tmp_path / "no-owt2"
    monkeypatch.setenv("LMUSCALE_OWT2", str(missing))
    sweep = load_sweep(sweep_path)
    rows = {r["trial"]: r for r in plan(sweep.trials, tmp_path / "w", sweep.throughput)}
    env = {"LMUSCALE_OWT2": str(missing)}
    out = subprocess.run(
        sweep_command(sweep_path, tmp_path / "w", "--dry-run"),
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "LMUSCALE_GPU_BENCHMARK"}
        | env
        | {"JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    cells = _cells(out.stdout)
    for model in ("lmu-1M", "transformer-1M"):
        r, expected = rows[model], rows[model]["tokens"] / speeds[model]
        assert r["source"] == "benchmark"
        assert r["seconds"] == pytest.approx(expected, rel=1e-9)
        assert r["estimate"] == pytest.approx(expected, rel=0.05)
        shown = cells[model]["est. time"]
        assert shown.endswith(" h") and float(shown[:-2]) == pytest.approx(expected / 3600, 0.05)
    copy = tmp_path / "benchmarks" / "results" / committed.name
    device = data["machine"]["device_kind"]
    assert f"GPU benchmark {copy} ({device}, no written time)" in out.stdout.splitlines()[-1]
    # The new columns: the learning rate, tokens as the figures count them, tokens per parameter.
    for trial in sweep.trials:
        r, c = rows[trial.name], cells[trial.name]
        assert float(c["learning rate"]) == trial.config.optim.learning_rate
        assert c["tokens"] == human(r["tokens"]) and c["tokens"][-1] == "B"
        assert int(c["tokens/param"].replace(",", "")) == round(r["tokens"] / r["N"])
    # One warning for the one data folder all 24 trials read, naming it, with the command.
    (warning,) = out.stderr.strip().splitlines()
    assert str(missing) in warning and "24 trial(s)" in warning
    assert f"python -m lmuscale.data prepare owt2 INPUT --out {missing}" in warning


def test_owt2_dry_run_is_the_same_whatever_the_files_modification_times(tmp_path, monkeypatch):
    # The committed GPU benchmarks, touched in one order and then the other (as a checkout
    # may leave them): the dry run picks the newest device by the time each file records, and
    # its estimate does not move.
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    files = [
        Path(shutil.copy(path, results))
        for pattern in ("gpu-*.json", "train_throughput-*.json")
        for path in sorted((REPO / "benchmarks" / "results").glob(pattern))
    ]
    assert len({json.loads(f.read_text())["machine"]["device_kind"] for f in files}) >= 3
    monkeypatch.setenv("LMUSCALE_OWT2", str(tmp_path / "no-owt2"))
    monkeypatch.delenv("LMUSCALE_GPU_BENCHMARK", raising=False)
    sweep_path = _owt2_copy(tmp_path)
    estimates = []
    for order in (files, files[::-1]):
        for i, path in enumerate(order):
            os.utime(path, (1.8e9 + i, 1.8e9 + i))
        sweep = load_sweep(sweep_path)
        rows = plan(sweep.trials, tmp_path / "w", sweep.throughput)
        estimates.append(([(r["flops_per_second"], r["source"]) for r in rows], sweep.throughput))
    (speeds, throughput), (speeds_again, throughput_again) = estimates
    assert speeds == speeds_again and throughput.source == throughput_again.source
    newest = max(
        (f for f in files if "written" in json.loads(f.read_text())),
        key=lambda f: json.loads(f.read_text())["written"],
    )
    device = json.loads(newest.read_text())["machine"]["device_kind"]
    assert throughput.source.startswith(f"GPU benchmark {results / newest.name} ({device}, ")


def test_the_data_warning_names_each_missing_folder_once(tmp_path, byte_corpus, monkeypatch):
    from lmuscale.sweep.plan import missing_data

    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    half = tmp_path / "half"  # a folder with no meta.json: not a prepared dataset
    half.mkdir()
    trials = {
        "a": {},
        "b": {"train.seed": 1},
        "c": {"data.path": str(tmp_path / "gone")},
        "d": {"data.path": str(half)},
        "e": {"data.path": str(half), "train.seed": 1},
        "f": {
            "data.path": str(tmp_path / "elsewhere"),
            "data.source": "shakespeare",
            "data.prepare": True,
        },
    }
    sweep = load_sweep(write_sweep(tmp_path, trials))
    warnings = missing_data(sweep.trials)
    assert len(warnings) == 2  # "gone" and "half"; the prepared corpus and embedded data are not
    gone, partial = warnings
    assert f"{tmp_path / 'gone'}: no such folder" in gone and "1 trial(s) (c)" in gone
    assert f"{half}: not a prepared dataset (no meta.json)" in partial
    assert "2 trial(s) (d, e)" in partial and f"--out {half}" in partial


def test_overhead_from_the_sweeps_finished_trials_else_the_default(
    tmp_path, byte_corpus, monkeypatch
):
    import jax

    from lmuscale.sweep.plan import OVERHEAD_SECONDS

    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    names = ("a", "b", "old", "resumed", "pending")
    sweep = load_sweep(write_sweep(tmp_path, {n: {"train.seed": i} for i, n in enumerate(names)}))
    work = tmp_path / "work"

    def fake(name: str, speeds: list[float], *events: dict) -> None:
        (trial,) = [t for t in sweep.trials if t.name == name]
        folder = work / "trials" / trial.folder_name
        folder.mkdir(parents=True)
        lines = [json.dumps({"step": i, "tokens_per_second": s}) for i, s in enumerate(speeds)]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (folder / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))

    tokens = 12 * 8 * 32
    start = {"event": "start", "spawned": 100.0, "time": 102.0}
    fake("a", [1000.0, 3000.0, 2000.0], start, {"event": "end", "outcome": "finished", "time": 130})
    start = {"event": "start", "spawned": 200.0, "time": 203.0}
    fake("b", [tokens], start, {"event": "end", "outcome": "finished", "time": 215.0})
    # not measured: started by a runner that did not record the process's start; two attempts
    fake("old", [1e3], {"event": "start", "time": 1.0}, {"event": "end", "time": 99.0})
    ended = {"event": "end", "outcome": "interrupted", "time": 9.0}
    again = {"event": "start", "spawned": 10.0, "time": 11.0}
    fake("resumed", [1e3], start | {"spawned": 0.0}, ended, again, ended | {"time": 20.0})
    expected = ((130 - 100 - tokens / 2000) + (215 - 200 - 1)) / 2  # the median of two
    rows = plan(sweep.trials, work, Throughput(1e9, platform="gpu"))
    for r in rows:
        assert (r["overhead"], r["overhead_source"]) == (
            pytest.approx(expected),
            "measured (2 finished trials)",
        )
        assert r["estimate"] == pytest.approx(r["seconds"] + expected)
    assert f"{expected:.0f} s a trial" in table(rows) and "measured (2 finished" in table(rows)
    # With no finished trial to measure: the Throughput's, else the default of its device kind.
    fresh = tmp_path / "fresh"
    for throughput, (seconds, source) in (
        (Throughput(1e9, platform="gpu"), OVERHEAD_SECONDS["gpu"]),
        (Throughput(1e9, platform="cpu"), OVERHEAD_SECONDS["cpu"]),
        (Throughput(1e9), OVERHEAD_SECONDS.get(jax.default_backend(), OVERHEAD_SECONDS["gpu"])),
        (Throughput(1e9, platform="cpu", overhead=5.0), (5.0, "configured")),
    ):
        rows = plan(sweep.trials, fresh, throughput)
        assert {(r["overhead"], r["overhead_source"]) for r in rows} == {(seconds, source)}
        assert sum(r["estimate"] for r in rows) == pytest.approx(
            sum(r["total_flops"] for r in rows) / 1e9 + len(rows) * seconds
        )
    assert OVERHEAD_SECONDS["cpu"][1] == "CPU default" and "guess" in OVERHEAD_SECONDS["gpu"][1]
