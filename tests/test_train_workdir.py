"""The training workdir: locked for the life of a run, and named when it cannot be one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from small_config import small

from lmuscale.outcomes import DamagedFile, Exit, StorageError, WorkdirBusy
from lmuscale.train import ConfigError, run
from lmuscale.workdir import Lock, is_locked

HERE = Path(__file__).resolve().parent


def _command(workdir: Path) -> list[str]:
    config = f"{HERE / 'small_config.py'}:small"
    return [sys.executable, "-m", "lmuscale.train", "--config", config, "--workdir", str(workdir)]


def _env(data: Path) -> dict:
    return {**os.environ, "LMUSCALE_TEST_DATA": str(data), "PYTHONPATH": str(HERE)}


def test_a_second_process_on_a_running_workdir_stops_at_once_naming_the_holder(
    byte_corpus, tmp_path
):
    workdir = tmp_path / "w"
    first = subprocess.Popen(
        [*_command(workdir), "--config.train.steps=100000", "--quiet"],
        env=_env(byte_corpus),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not is_locked(workdir):
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.05)
        start = time.monotonic()
        second = subprocess.run(
            [*_command(workdir), "--quiet"],
            env=_env(byte_corpus),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == Exit.BUSY
        message = second.stderr.strip()
        assert f"workdir {workdir} is in use by pid {first.pid} on " in message
        assert len(message.splitlines()) == 1
        assert time.monotonic() - start < 60  # at once: nothing compiled or trained
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()
        first.stderr.close()
    assert not is_locked(workdir)  # the kernel dropped the killed holder's lock


def test_run_refuses_a_locked_workdir_in_process(byte_corpus, tmp_path):
    workdir = tmp_path / "w"
    workdir.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from lmuscale.workdir import Lock; "
            f"assert Lock({str(workdir)!r}).acquire(); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirBusy, match=f"pid {holder.pid} on .* since"):
            run(small(str(byte_corpus)), workdir)
        assert not (workdir / "config.json").exists()  # nothing written
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    # A caller that holds the lock itself (a sweep worker) says so.
    with Lock(workdir):
        config = small(str(byte_corpus))
        config.train.steps = 4
        config.eval.every = 2
        config.checkpoint.every = 2
        assert run(config, workdir, locked=True)["status"] == "finished"


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_a_workdir_that_cannot_be_one_is_named(byte_corpus, tmp_path, where):
    (tmp_path / "f").write_text("not a folder")
    workdir = tmp_path / "f" if where == "file" else tmp_path / "f" / "run"
    with pytest.raises(ConfigError, match=f"workdir {workdir}: it \\(or a folder above it\\)"):
        run(small(str(byte_corpus)), workdir)


def test_unwritable_workdirs_are_named_as_storage_errors(tmp_path, monkeypatch):
    """Not config errors (1): a read-only or full workdir is the I/O outcome (8)."""
    import errno

    from lmuscale import workdir as workdir_lib

    for code, reason in (
        (errno.EROFS, "the filesystem is read-only"),
        (errno.EACCES, "permission denied"),
        (errno.ENOSPC, "no space left on the device (or no inodes)"),
    ):

        def refuse(*args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(Path, "mkdir", refuse)
        with pytest.raises(StorageError, match=re.escape(f"cannot be created: {reason}")):
            workdir_lib.usable(tmp_path / "new")
        monkeypatch.undo()
        monkeypatch.setattr(os, "open", refuse)
        with pytest.raises(StorageError, match=re.escape(f"cannot write in it: {reason}")):
            Lock(tmp_path).acquire()
        monkeypatch.undo()
        monkeypatch.setattr(os, "pwrite", refuse)  # the lock file made, its line refused
        with pytest.raises(StorageError) as raised:
            Lock(tmp_path).acquire()
        monkeypatch.undo()
        assert str(raised.value) == (
            f"workdir {tmp_path}: cannot write in it ({tmp_path / 'lock'}: {reason})"
        )
        assert Exit.of(raised.value) is Exit.IO


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"status": "finis', "not JSON"),
        (b"\xff\xfe\x00binary", "not JSON"),
        (b"[1, 2]", "a JSON list, not an object"),
    ],
)
def test_a_corrupt_summary_is_named(byte_corpus, tmp_path, content, message):
    (tmp_path / "summary.json").write_bytes(content)
    with pytest.raises(DamagedFile, match=f"{tmp_path / 'summary.json'}: {message}"):
        run(small(str(byte_corpus)), tmp_path)


def test_runs_share_the_compilation_cache_safely_and_compute_the_same_numbers(
    tmp_path, byte_corpus
):
    # Two runs start together on an empty cache (both compile, both write the same entries);
    # then every other entry is cut in half, as a process killed while writing it leaves it,
    # and a third run reads the intact ones and compiles the torn ones afresh. All three
    # finish with the same losses: a cached executable is the compiler's own output.
    cache = tmp_path / "cache"
    env = _env(byte_corpus) | {"LMUSCALE_XLA_CACHE": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    first = [
        subprocess.Popen(
            _command(tmp_path / name), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for name in ("a", "b")
    ]
    for process in first:
        out, _ = process.communicate(timeout=600)
        assert process.returncode == 0, out.decode()[-3000:]
    entries = sorted(p for p in cache.rglob("*") if p.is_file() and p.stat().st_size > 0)
    assert len(entries) >= 2
    for entry in entries[::2]:
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    third = subprocess.run(_command(tmp_path / "c"), env=env, capture_output=True, text=True)
    assert third.returncode == 0, third.stderr[-3000:]
    losses = [
        json.loads((tmp_path / name / "summary.json").read_text()) for name in ("a", "b", "c")
    ]
    assert len({(s["val_loss"], s["test_loss"]) for s in losses}) == 1
