"""A run of two processes on localhost, as on two hosts: ``jax.distributed.initialize`` with a
coordinator on a free loopback port, JAX's CPU collectives (gloo), one CPU device each.

Every run is a real ``python -m lmuscale.train`` (through ``multiprocess_train.py``, which
records the windows each process reads). The reference is one process with two devices: the
same mesh and the same global batch, so the two-process run must equal it bit for bit. A
checkpoint of two processes must also restore in one process of one device, where the
gradient's all-reduce adds in another order: there the numbers agree to float32 rounding.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import compile_cache
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from small_config import small

from lmuscale.data import TrainBatches, open_dataset
from lmuscale.train import override, run

HERE = Path(__file__).resolve().parent
STEPS = 40
GLOBAL_BATCH = 8
OVERRIDES = [
    f"train.steps={STEPS}",
    "checkpoint.every=8",
    "checkpoint.keep=3",
    "eval.every=8",
]
# The coordinator ends the other processes this long after one stops sending heartbeats
# (the bound where a process waits on the dead one outside a collective: in a save, say).
HEARTBEAT_TIMEOUT = 20
# Seconds the survivor of a SIGKILL may take to exit. Killed between two checkpoints, it exits
# at its next collective, which fails at once.
LOST_BOUND = 60
# Measured between one device and two processes over the 40 steps: losses and norms differ
# by at most 1.8e-7 relative, parameters by at most 4.3e-7.
RTOL, ATOL = 2e-6, 2e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(
    workdir: Path,
    data: Path,
    processes: int,
    devices: int,
    reads: str = "",
    cache: bool = True,
    hang: dict[int, str] | None = None,
) -> list:
    """``processes`` training processes of ``devices`` CPU devices each on ``workdir``; they
    compile through the module's cache (``cache``: and write to it; not a run to be killed).
    ``hang``: ``LMUSCALE_TEST_HANG`` (``multiprocess_train.py``) of the processes it names."""
    port = _free_port()
    flags = os.environ.get("XLA_FLAGS", "")  # the suite's (conftest.py)
    started = []
    for i in range(processes):
        env = {
            **os.environ,
            **compile_cache.env(workdir.parent / "compile-cache", write=cache),
            "LMUSCALE_TEST_DATA": str(data),
            "PYTHONPATH": str(HERE),
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
            "LMUSCALE_TEST_READS": f"{workdir}.{reads}{i}.reads" if reads else "",
            "LMUSCALE_TEST_HANG": (hang or {}).get(i, ""),
        }
        command = [
            sys.executable,
            str(HERE / "multiprocess_train.py"),
            "--config",
            f"{HERE / 'small_config.py'}:small",
            "--workdir",
            str(workdir),
            "--quiet",
            *[f"--config.{o}" for o in OVERRIDES],
        ]
        if processes > 1:
            command += [
                "--config.distributed.initialize=true",
                f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                f"--config.distributed.num_processes={processes}",
                f"--config.distributed.process_id={i}",
                f"--config.distributed.heartbeat_timeout={HEARTBEAT_TIMEOUT}",
            ]
        started.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return started


def _finish(processes: list, timeout: float = 300) -> list[tuple[int, str, str]]:
    """``(status, stdout, stderr)`` of each process; kills the rest if one is stuck."""
    out = []
    try:
        for p in processes:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, _ours(stderr)))
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def _ours(stderr: str) -> str:
    """stderr less gloo's connection notices."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("[Gloo]"))


def _wait_for(
    workdir: Path,
    processes: list,
    lines: int,
    checkpoint: bool = False,
    marker: Path | None = None,
) -> None:
    """Until ``metrics.jsonl`` has ``lines`` lines, a checkpoint is written (``checkpoint``)
    and ``marker`` exists (when given)."""
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (
        metrics.exists()
        and len(metrics.read_text().splitlines()) >= lines
        and (not checkpoint or _checkpoints(workdir))
        and (marker is None or marker.exists())
    ):
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            raise AssertionError(f"the run ended or stalled: {_finish(processes, 10)}")
        time.sleep(0.01)


def _checkpoints(workdir: Path) -> list[int]:
    folder = workdir / "checkpoints"
    return (
        sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _params(workdir: Path) -> list[np.ndarray]:
    """The newest checkpoint's parameters, read onto this process's one device whatever the
    devices that wrote them."""
    step = _checkpoints(workdir)[-1]
    path = workdir / "checkpoints" / str(step) / "state"
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.metadata(path).item_metadata
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved
        )
        restored = checkpointer.restore(path, target)
    return [np.asarray(x) for x in jax.tree.leaves(restored["params"])]


TRAIN_KEYS = ("step", "loss", "lr", "grad_norm", "param_norm", "tokens")
EVAL_KEYS = ("step", "val_loss", "lr_scale")


def _records(path: Path, keys) -> list[tuple]:
    return [tuple(r[k] for k in keys) for r in _lines(path)]


@pytest.fixture(scope="module")
def reference(byte_corpus, tmp_path_factory):
    """One process with two devices, uninterrupted."""
    workdir = tmp_path_factory.mktemp("multiprocess") / "reference"
    [(status, _, stderr)] = _finish(_start(workdir, byte_corpus, 1, 2))
    assert status == 0, stderr[-3000:]
    return workdir


@pytest.fixture(scope="module")
def killed(byte_corpus, reference):
    """Two processes; process 1 is killed (SIGKILL) between the first and the second
    checkpoint, and both are started again."""
    workdir = reference.parent / "killed"
    # Process 1 waits before its batch of step 12, where process 0 can go no further than its
    # next collective: the kill lands there whatever the two processes' speeds, never in the
    # save of step 16 (where only the coordinator's heartbeat timeout ends a survivor; the
    # README says so). By then the run has compiled all it ever will (the train and eval steps,
    # the plateau update), so it may write the compilation cache: the kill cannot tear an entry.
    hanging = workdir.parent / "killed.hanging"
    processes = _start(workdir, byte_corpus, 2, 1, reads="a", hang={1: f"batch:12:{hanging}"})
    _wait_for(workdir, processes, 1, checkpoint=True, marker=hanging)
    processes[1].kill()
    killed_at = time.monotonic()
    [(status, _, stderr)] = _finish(processes[:1], timeout=LOST_BOUND)
    seconds = time.monotonic() - killed_at
    _finish(processes[1:])
    print(f"process 0 exited {seconds:.2f} s after process 1 was killed, status {status}")
    left = _checkpoints(workdir), _lines(workdir / "metrics.jsonl")[-1]["step"]
    restarted = _finish(_start(workdir, byte_corpus, 2, 1, reads="b"))
    return workdir, status, stderr, seconds, restarted, left


def test_the_survivor_of_a_killed_process_exits_with_a_named_error(killed):
    _, status, stderr, seconds, _, (checkpoints, last_step) = killed
    assert (checkpoints, last_step) == ([8], 11)  # killed where the fixture meant to
    assert status == 5, stderr[-3000:]
    assert seconds < LOST_BOUND
    assert "Traceback" not in stderr
    [line] = [line for line in stderr.splitlines() if line.strip()]
    assert line.startswith("error: process 0 of 2 lost contact with the others")
    assert "start all 2 processes again to resume" in line


def test_a_process_killed_in_a_save_ends_the_other_at_the_save_s_first_collective(
    byte_corpus, reference
):
    """Orbax's save begins with an all-gather across the processes: the survivor fails there
    at once (gloo's error, a ValueError, under the checkpoint's) and exits as from a step's."""
    workdir = reference.parent / "killed-saving"
    hanging = workdir.parent / "killed-saving.hanging"
    processes = _start(workdir, byte_corpus, 2, 1, hang={1: f"save:16:{hanging}"})
    _wait_for(workdir, processes, 1, marker=hanging)
    processes[1].kill()
    [(status, _, stderr)] = _finish(processes[:1], timeout=LOST_BOUND)
    _finish(processes[1:])
    assert status == 5, stderr[-3000:]
    [line] = [line for line in stderr.splitlines() if line.strip()]
    assert line.startswith(
        "error: process 0 of 2 lost contact with the others (in a checkpoint's save: "
    )
    assert "Gloo AllGather failed" in line
    assert "start all 2 processes again to resume" in line
    assert _checkpoints(workdir) == [8]


def test_only_a_failed_collective_makes_a_failed_save_a_lost_process():
    # As Checkpoints raises a failed save: a CheckpointError naming the reason, raised from
    # None with the error it caught as its context.
    from lmuscale.train.checkpoint import CheckpointError
    from lmuscale.train.loop import _lost_peer

    def failed_save(inner: Exception) -> CheckpointError:
        try:
            try:
                raise inner
            except Exception:
                reason = f"{type(inner).__name__}: {inner}"
                raise CheckpointError(f"saving checkpoint 16 in /w failed ({reason})") from None
        except CheckpointError as error:
            return error

    gathered = ValueError("UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer")
    reduced = ValueError("UNKNOWN: Gloo all-reduce failed: [pair.cc:547] Read error")
    for inner in (gathered, reduced):
        assert _lost_peer(failed_save(inner)) is inner  # the innermost, named in the line
    step = jax.errors.JaxRuntimeError("INTERNAL: a step's all-reduce failed")
    assert _lost_peer(step) is step
    others = (
        OSError(28, "No space left on device"),
        jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4 GiB"),
        ValueError('NOT_FOUND: Error writing local file "/w/checkpoints/16/state"'),
    )
    for inner in others:
        assert _lost_peer(failed_save(inner)) is None


def test_both_processes_restarted_resume_to_the_reference_bit_for_bit(killed, reference):
    workdir, *_, restarted, _ = killed
    assert [status for status, *_ in restarted] == [0, 0], restarted
    assert _records(workdir / "metrics.jsonl", TRAIN_KEYS) == _records(
        reference / "metrics.jsonl", TRAIN_KEYS
    )
    assert _records(workdir / "eval.jsonl", EVAL_KEYS) == _records(
        reference / "eval.jsonl", EVAL_KEYS
    )
    for a, b in zip(_params(workdir), _params(reference), strict=True):
        np.testing.assert_array_equal(a, b)
    summary = json.loads((workdir / "summary.json").read_text())
    expected = json.loads((reference / "summary.json").read_text())
    for key in ("val_loss", "test_loss", "val_per_position", "lr_scale", "tokens"):
        assert summary[key] == expected[key], key


def test_only_process_0_writes_the_workdir_files(killed):
    workdir, *_, restarted, _ = killed
    assert [r["step"] for r in _lines(workdir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    # one event file for each of the two sessions, both of process 0
    assert len(list((workdir / "tensorboard").rglob("events.*"))) == 2
    (_, out0, _), (_, out1, _) = restarted
    assert "val loss" in out0 and "train step:" in out0
    assert "train step:" not in out1


def test_each_process_reads_only_its_own_rows(killed, byte_corpus):
    workdir, *_ = killed
    dataset = open_dataset(byte_corpus)
    seq_len = small().data.seq_len
    for i in range(2):
        rows = slice(i * GLOBAL_BATCH // 2, (i + 1) * GLOBAL_BATCH // 2)
        own = TrainBatches(
            dataset,
            seq_len=seq_len,
            global_batch=GLOBAL_BATCH,
            seed=0,
            process_index=i,
            process_count=2,
        )
        for session in "ab":
            reads = _lines(Path(f"{workdir}.{session}{i}.reads"))
            train = [r["ids"] for r in reads if r["split"] == "train"]
            assert train, session
            first = 0 if session == "a" else None
            if first is None:  # the restart: every step from its checkpoint to the end
                first = STEPS - len(train)
                assert 0 < first < STEPS
            expected = [
                own.window_ids(s)[own.rows].tolist() for s in range(first, first + len(train))
            ]
            assert train == expected, (i, session)
            for r in reads:
                if r["split"] != "train":  # evaluation: this process's slots of each batch
                    assert all(rows.start <= k % GLOBAL_BATCH < rows.stop for k in r["ids"]), r


def test_sigterm_to_one_process_stops_both_after_the_same_step(byte_corpus, reference):
    workdir = reference.parent / "stopped"
    processes = _start(workdir, byte_corpus, 2, 1)
    _wait_for(workdir, processes, 6)
    processes[1].send_signal(signal.SIGTERM)
    (status0, _, stderr0), (status1, _, stderr1) = _finish(processes, timeout=120)
    assert (status0, status1) == (4, 4), (stderr0[-2000:], stderr1[-2000:])
    step = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert f"SIGTERM received by another process: stopped after step {step} of" in stderr0
    assert f"SIGTERM received by this process: stopped after step {step} of" in stderr1
    assert _checkpoints(workdir)[-1] == step < STEPS

    # The two processes' checkpoint restores in one process of one device.
    config = override(small(str(byte_corpus)), OVERRIDES)
    summary = run(config, workdir, progress=False)
    got, want = _lines(workdir / "metrics.jsonl"), _lines(reference / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for key in ("loss", "grad_norm", "param_norm", "lr"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=RTOL)
    for a, b in zip(_params(workdir), _params(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    expected = json.loads((reference / "summary.json").read_text())
    np.testing.assert_allclose(summary["val_loss"], expected["val_loss"], rtol=RTOL)
