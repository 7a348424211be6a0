"""Exact resume: a run killed with SIGKILL and started again equals an uninterrupted run.

Both runs are real subprocesses of ``python -m lmuscale.train``. The killed run is stopped as
soon as its first checkpoint is complete; the restarted run must then log the same losses, the
same validation losses and plateau scales, and end with bit-identical parameters.

Every run of the module uses the same config, so they share a persistent compilation cache
(``compile_cache``): the first, uninterrupted run compiles and writes it, the others (killed
ones included) only read it, and start in ~4 s instead of ~15 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from compile_cache import env as cache_env

from lmuscale.train.checkpoint import Checkpoints

HERE = Path(__file__).resolve().parent
STEPS = 120
OVERRIDES = [
    f"--config.train.steps={STEPS}",
    "--config.checkpoint.every=10",
    "--config.checkpoint.keep=3",
    "--config.eval.every=6",
    # every evaluation after the first lowers the plateau scale, so its state must resume too
    "--config.optim.plateau_rtol=0.5",
    "--config.optim.plateau_patience=1",
    "--config.optim.plateau_min_scale=0.01",
]


def _command(workdir: Path) -> list[str]:
    config = f"{HERE / 'small_config.py'}:small"
    return [sys.executable, "-m", "lmuscale.train", "--config", config, "--workdir", str(workdir)]


def _env(data: Path, cache: Path, write: bool = False) -> dict:
    """A training subprocess's environment; only an uninterrupted run may ``write`` the
    compilation cache (see ``compile_cache``)."""
    extra = {"LMUSCALE_TEST_DATA": str(data), "PYTHONPATH": str(HERE)}
    return {**os.environ, **extra, **cache_env(cache, write)}


def _train(workdir: Path, data: Path, cache: Path, write: bool = False) -> None:
    result = subprocess.run(
        [*_command(workdir), *OVERRIDES, "--quiet"],
        env=_env(data, cache, write),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _complete_checkpoints(workdir: Path) -> list[int]:
    folder = workdir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def _records(path: Path, keys) -> list:
    lines = path.read_text().splitlines()
    return [tuple(json.loads(line)[k] for k in keys) for line in lines]


def _params(workdir: Path):
    checkpoints = Checkpoints(workdir / "checkpoints", keep=3)
    step = checkpoints.latest_step()
    restored = checkpoints.manager.restore(step)
    checkpoints.close()
    return step, jax.tree.leaves(restored["state"]["params"])


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xla-cache")


@pytest.fixture(scope="module")
def runs(byte_corpus, tmp_path_factory, xla_cache):
    root = tmp_path_factory.mktemp("resume")
    whole, killed = root / "whole", root / "killed"
    _train(whole, byte_corpus, xla_cache, write=True)

    process = subprocess.Popen(
        [*_command(killed), *OVERRIDES, "--quiet"],
        env=_env(byte_corpus, xla_cache),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 300
    while not _complete_checkpoints(killed) and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    stderr = process.stderr.read().decode()
    process.stderr.close()
    interrupted = {
        "returncode": process.returncode,
        "checkpoints": _complete_checkpoints(killed),
        "logged": len((killed / "metrics.jsonl").read_text().splitlines()),
        "stderr": stderr,
    }
    print(f"killed run: { ({k: v for k, v in interrupted.items() if k != 'stderr'}) }")
    _train(killed, byte_corpus, xla_cache)
    return whole, killed, interrupted


def test_the_run_was_killed_mid_run_after_a_checkpoint(runs):
    _, killed, interrupted = runs
    assert interrupted["returncode"] == -signal.SIGKILL, interrupted["stderr"][-2000:]
    assert interrupted["checkpoints"], "killed before any checkpoint"
    assert max(interrupted["checkpoints"]) < STEPS
    assert (killed / "summary.json").exists()  # written by the second start


def test_resumed_losses_equal_the_uninterrupted_run_bit_for_bit(runs):
    whole, killed, _ = runs
    keys = ("step", "loss", "lr", "grad_norm", "param_norm", "tokens")
    assert _records(killed / "metrics.jsonl", keys) == _records(whole / "metrics.jsonl", keys)
    keys = ("step", "val_loss", "lr_scale")
    evals = _records(whole / "eval.jsonl", keys)
    assert _records(killed / "eval.jsonl", keys) == evals
    assert len({scale for _, _, scale in evals}) > 3  # the plateau scale really moved


def test_resumed_final_parameters_are_bit_identical(runs):
    whole, killed, _ = runs
    step_a, params_a = _params(whole)
    step_b, params_b = _params(killed)
    assert step_a == step_b == STEPS
    for a, b in zip(params_a, params_b, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_resumed_summary_equals_the_uninterrupted_one(runs):
    whole, killed, _ = runs
    a = json.loads((whole / "summary.json").read_text())
    b = json.loads((killed / "summary.json").read_text())
    for key in ("val_loss", "test_loss", "val_per_position", "lr_scale", "tokens"):
        assert a[key] == b[key], key


def _start_and_wait_for(stopped: Path, data: Path, cache: Path, lines: int) -> subprocess.Popen:
    """A training subprocess in ``stopped``, once it has logged ``lines`` steps."""
    process = subprocess.Popen(
        [*_command(stopped), *OVERRIDES, "--quiet"],
        env=_env(data, cache),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    metrics = stopped / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    return process


def test_sigterm_writes_a_checkpoint_at_the_current_step_and_resumes_exactly(
    runs, tmp_path, xla_cache
):
    """What a scheduler's preemption notice does: stop after this step, with a checkpoint."""
    whole, _, _ = runs
    stopped = tmp_path / "stopped"
    data = Path(json.loads((whole / "config.json").read_text())["data"]["path"])
    process = _start_and_wait_for(stopped, data, xla_cache, 13)
    metrics = stopped / "metrics.jsonl"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 4, stderr.decode()[-2000:]
    logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert "stopped: SIGTERM received" in stderr.decode()
    assert max(_complete_checkpoints(stopped)) == logged < STEPS
    _train(stopped, data, xla_cache)
    keys = ("step", "loss", "lr", "grad_norm", "param_norm", "tokens")
    assert _records(stopped / "metrics.jsonl", keys) == _records(whole / "metrics.jsonl", keys)
    keys = ("step", "val_loss", "lr_scale")
    assert _records(stopped / "eval.jsonl", keys) == _records(whole / "eval.jsonl", keys)


def test_ctrl_c_stops_like_sigterm_with_one_line_and_status_130(runs, tmp_path, xla_cache):
    whole, _, _ = runs
    stopped = tmp_path / "stopped"
    data = Path(json.loads((whole / "config.json").read_text())["data"]["path"])
    process = _start_and_wait_for(stopped, data, xla_cache, 5)
    metrics = stopped / "metrics.jsonl"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    text = stderr.decode()
    assert process.returncode == 130, text[-2000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    stopped_lines = [line for line in text.splitlines() if line.startswith("stopped:")]
    assert len(stopped_lines) == 1 and "SIGINT received: stopped after step" in text
    logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert max(_complete_checkpoints(stopped)) == logged < STEPS


def test_five_kills_at_random_moments_then_exact_equality(runs, tmp_path, xla_cache):
    """SIGKILL at 5 seeded random moments: one while starting up (after the run has written
    its config, before its first step), four a random number of steps into training (so
    during a step, a save or an evaluation)."""
    import random

    whole, _, _ = runs
    data = Path(json.loads((whole / "config.json").read_text())["data"]["path"])
    workdir = tmp_path / "killed"
    rng = random.Random(20)
    kills = []
    for _ in range(5):
        process = subprocess.Popen(
            [*_command(workdir), *OVERRIDES, "--quiet"],
            env=_env(data, xla_cache),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        metrics = workdir / "metrics.jsonl"
        if not kills:  # the first while starting up: imports done, not yet training
            deadline = time.monotonic() + 300
            while not (workdir / "config.json").exists() and process.poll() is None:
                assert time.monotonic() < deadline, "no config.json within 300 s"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.5))
        else:  # the others a random number of logged steps into training, plus a moment
            logged = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            target, deadline = logged + rng.randint(1, 20), time.monotonic() + 300
            while process.poll() is None and time.monotonic() < deadline:
                if metrics.exists() and len(metrics.read_text().splitlines()) >= target:
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert process.returncode == -signal.SIGKILL, f"kill {len(kills) + 1} found it ended"
        kills.append(max(_complete_checkpoints(workdir), default=None))
    print(f"checkpoints after each kill: {kills}")
    _train(workdir, data, xla_cache)
    keys = ("step", "loss", "lr", "grad_norm", "param_norm", "tokens")
    assert _records(workdir / "metrics.jsonl", keys) == _records(whole / "metrics.jsonl", keys)
    keys = ("step", "val_loss", "lr_scale")
    assert _records(workdir / "eval.jsonl", keys) == _records(whole / "eval.jsonl", keys)
    (whole_step, whole_params), (step, params) = _params(whole), _params(workdir)
    assert step == whole_step == STEPS
    for a, b in zip(whole_params, params, strict=True):
        np.testing.assert_array_equal(a, b)
