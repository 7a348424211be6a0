"""Checkpoints are verified on restore: a damaged one is named, set aside, and the run resumes
from the newest intact one with the same numbers as an uninterrupted run."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from small_config import small

from lmuscale.outcomes import Exit
from lmuscale.train import TrainingDiverged, run
from lmuscale.train.checkpoint import steps

SMALL = f"{Path(__file__).resolve().parent / 'small_config.py'}:small"


def _config(byte_corpus):
    config = small(str(byte_corpus))
    config.checkpoint.keep = 3  # steps 4, 8 and 12 stay
    return config


@pytest.fixture(scope="module")
def finished_run(byte_corpus, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("whole")
    run(_config(byte_corpus), workdir)
    return workdir


def _losses(workdir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").open()]


def _largest_file(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_bit(path: Path) -> None:
    """One bit in every 4 KiB of the file: a single flip in the middle can land in bytes that
    no array reads (orbax's file layout varies from save to save), and then nothing is wrong."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2 % 4096, len(data), 4096):
        data[i] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _remove_state(folder: Path) -> None:
    shutil.rmtree(folder / "state")


def _zero_a_block_unlisted(path: Path) -> None:
    """Its first 4 KiB zeroed, and no files.json: orbax reads it, fails, and left each of the
    checkpoint's other reads as a coroutine that printed a traceback when collected (66 and
    more lines, for a run that recovered)."""
    step = next(p for p in path.parents if p.name.isdigit())
    (step / "files.json").unlink()
    with path.open("r+b") as f:
        f.write(bytes(4096))


@pytest.mark.parametrize("damage", [_flip_bit, _truncate, _remove_state, _zero_a_block_unlisted])
def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_exactly(
    byte_corpus, finished_run, tmp_path, capsys, caplog, damage
):
    workdir = tmp_path / "w"
    shutil.copytree(finished_run, workdir)
    (workdir / "summary.json").unlink()
    newest = workdir / "checkpoints" / "12"
    damage(newest if damage is _remove_state else _largest_file(newest / "state"))
    capsys.readouterr()

    unraisable = []  # what Python would print as "Exception ignored in ..."
    previous, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        summary = run(_config(byte_corpus), workdir)
        gc.collect()  # orbax's failed reads' coroutines and tasks
    finally:
        sys.unraisablehook = previous
    assert not unraisable, [str(u.exc_value)[:300] for u in unraisable]

    err = capsys.readouterr().err
    assert err.startswith(f"checkpoint: {newest}: ") and len(err.splitlines()) == 1, err
    assert "cannot be read" in err or "does not match the checksums" in err
    assert f"moved to {workdir / 'checkpoints.corrupt' / '12'}" in err
    assert (workdir / "checkpoints.corrupt" / "12").is_dir()  # set aside, not deleted
    assert _losses(workdir) == _losses(finished_run)  # resumed from step 8, bit for bit
    whole = json.loads((finished_run / "summary.json").read_text())
    assert summary["val_loss"] == whole["val_loss"]
    # nothing reached asyncio's logger either: the files were checked before orbax read any
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.records


def _unverifiable(folder: Path) -> None:
    """``folder`` as a checkpoint of an older lmuscale, or one whose listing was lost: no
    files.json, and no checksums in its JSON."""
    (folder / "files.json").unlink()
    meta = json.loads((folder / "meta" / "metadata").read_text())
    del meta["checksums"]
    (folder / "meta" / "metadata").write_text(json.dumps(meta))


def test_a_checkpoint_nothing_can_verify_is_never_used_unless_accepted(
    byte_corpus, finished_run, tmp_path, capsys
):
    """It resumed from flipped bits with exit 0 and other final parameters. Now it is refused,
    named, and not set aside (it may be intact); a damaged verified checkpoint set aside does
    not hand the run to an unverified one; ``accept_unverified`` uses it, saying so."""
    from lmuscale.train.checkpoint import CheckpointError

    workdir = tmp_path / "w"
    shutil.copytree(finished_run, workdir)
    (workdir / "summary.json").unlink()
    folder = workdir / "checkpoints"
    for step in ("8", "12"):
        _unverifiable(folder / step)
    _flip_bit(_largest_file(folder / "12" / "state"))
    missing = "no files.json and no checksums in meta/metadata"
    with pytest.raises(CheckpointError) as refused:
        run(_config(byte_corpus), workdir, accept_unverified=False)
    assert str(refused.value) == (
        f"{folder / '12'}: cannot be verified ({missing}), so it is not used; run again with "
        f"--accept-unverified to use it anyway, or move it out of {folder} to resume from "
        "checkpoint 8"
    )
    assert Exit.of(refused.value) is Exit.IO
    assert sorted(p.name for p in folder.iterdir()) == ["12", "4", "8"]

    # A verified 12 whose files were damaged is set aside; the unverified 8 is still refused
    # (a command without the flag does not offer it).
    shutil.rmtree(folder / "12")
    shutil.copytree(finished_run / "checkpoints" / "12", folder / "12")
    _flip_bit(_largest_file(folder / "12" / "state"))
    capsys.readouterr()
    with pytest.raises(CheckpointError) as refused:
        run(_config(byte_corpus), workdir)
    assert f"moved to {workdir / 'checkpoints.corrupt' / '12'}" in capsys.readouterr().err
    assert str(refused.value) == (
        f"{folder / '8'}: cannot be verified ({missing}), so it is not used; move it out of "
        f"{folder} to resume from checkpoint 4"
    )

    summary = run(_config(byte_corpus), workdir, accept_unverified=True)
    err = capsys.readouterr().err
    assert f"checkpoint: {folder / '8'}: used UNVERIFIED ({missing}), as --accept-" in err
    assert err.count("UNVERIFIED") == 1
    assert _losses(workdir) == _losses(finished_run)  # 8 was intact: resumed bit for bit
    whole = json.loads((finished_run / "summary.json").read_text())
    assert summary["val_loss"] == whole["val_loss"]


def test_a_resume_names_lines_its_checkpoint_covers_that_are_gone(
    byte_corpus, finished_run, tmp_path, capsys
):
    """A power loss could leave metrics.jsonl torn at a step its checkpoint covers (lines were
    flushed, not fsynced), and the resume dropped that line in silence. Each log is now fsynced
    before each save (checked in the full-disk test below); lines gone anyway are named."""
    # The line of step 12, which checkpoint 12 covers, torn as a power loss can leave it.
    workdir = tmp_path / "w"
    shutil.copytree(finished_run, workdir)
    (workdir / "summary.json").unlink()
    lines = (workdir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (workdir / "metrics.jsonl").write_text("".join(lines[:-1]) + lines[-1][:20])
    capsys.readouterr()
    run(_config(byte_corpus), workdir)
    err = capsys.readouterr().err
    assert (
        f"warning: {workdir / 'metrics.jsonl'}: its lines after step 11 through step 12 are "
        "lost (written before checkpoint 12 was, but not on disk); the run goes on without them"
    ) in err.splitlines()
    assert "eval.jsonl" not in err  # intact: nothing said
    assert _losses(workdir) == _losses(finished_run)[:-1]


def test_a_divergence_right_after_a_restore_blames_the_checkpoint(byte_corpus, tmp_path):
    """A checkpoint that reads back whole but holds a NaN (as a bad save by another version
    would): the run names the checkpoint as suspect and writes no "diverged" summary."""
    import jax
    import jax.numpy as jnp

    from lmuscale.models import build
    from lmuscale.train import model_config, optim
    from lmuscale.train import step as step_lib
    from lmuscale.train.checkpoint import Checkpoints

    config = _config(byte_corpus)
    workdir = tmp_path / "w"
    run(config, workdir)
    (workdir / "summary.json").unlink()
    model = build(model_config(config.model))
    tx, _ = optim.optimizer(config.optim, config.train.steps)
    init = step_lib.init_fn(model, tx, optim.plateau(config.optim), 0, config.data.seq_len)
    checkpoints = Checkpoints(workdir / "checkpoints", keep=3)
    state, meta = checkpoints.restore(12, jax.eval_shape(init))
    shutil.rmtree(workdir / "checkpoints" / "12")
    checkpoints.manager.reload()
    leaves, tree = jax.tree.flatten(state["params"])
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
    state["params"] = jax.tree.unflatten(tree, leaves)
    checkpoints.save(8 + 4, state, meta)
    checkpoints.wait()
    checkpoints.close()
    for name in ("metrics.jsonl", "eval.jsonl"):  # as a run killed after its last save
        lines = (workdir / name).read_text().splitlines(keepends=True)
        (workdir / name).write_text("".join(lines[:-1]))
    config.train.steps = 16
    (workdir / "config.json").unlink()  # the same run, now 16 steps long
    with pytest.raises(TrainingDiverged, match=r"after resuming from checkpoint .*12: that"):
        run(config, workdir)
    assert not (workdir / "summary.json").exists()


def test_a_full_disk_is_named_at_the_save_and_the_rerun_resumes_exactly(
    byte_corpus, finished_run, tmp_path, monkeypatch
):
    from collections import namedtuple

    from lmuscale.train import checkpoint
    from lmuscale.train.checkpoint import CheckpointError

    usage = namedtuple("usage", "total used free")
    saves = []
    real = checkpoint.shutil.disk_usage

    def filling(path):  # room for the first checkpoint only
        saves.append(path)
        return real(path) if len(saves) == 1 else usage(10**9, 10**9, 1000)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", filling)
    workdir = tmp_path / "w"
    with pytest.raises(CheckpointError) as error:
        run(_config(byte_corpus), workdir)
    message = str(error.value)
    assert f"no room for checkpoint 8 in {workdir / 'checkpoints'}: it needs about " in message
    assert "bytes and 1,000 are free; the checkpoints before it are kept" in message
    monkeypatch.undo()
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4"]
    run(_config(byte_corpus), workdir)  # space freed: resumes from step 4
    assert _losses(workdir) == _losses(finished_run)


def test_a_full_disk_at_a_log_line_the_summary_or_the_lock_is_one_line_and_status_8(
    byte_corpus, finished_run, tmp_path, monkeypatch, capsys
):
    """Each was a traceback and status 1. The disk fills at step 6's log line, then (space
    freed, filled again) at summary.json: each time one line naming the file, status 8, and
    the run resumes to the numbers of a run never stopped."""
    from full_disk import NO_SPACE, appends_fail, fsync_fails, no_space

    from lmuscale.train.__main__ import main
    from lmuscale.train.checkpoint import Checkpoints

    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    workdir = tmp_path / "w"
    argv = ["--config", SMALL, "--workdir", str(workdir), "--quiet", "--config.checkpoint.keep=3"]
    with monkeypatch.context() as full:
        appends_fail(full, "metrics.jsonl", room=5)
        assert main(argv) == Exit.IO
    assert (
        capsys.readouterr().err
        == f"error: {workdir / 'metrics.jsonl'}: cannot be written ({NO_SPACE})\n"
    )
    assert steps(workdir / "checkpoints") == [4]
    events = []  # and the logs are on disk (fsync) before each save that covers them
    real_save = Checkpoints.save

    def save(self, step, state, meta):
        events.append(f"save {step}")
        real_save(self, step, state, meta)

    with monkeypatch.context() as full:
        fsync_fails(full, "summary.json", seen=events)
        full.setattr(Checkpoints, "save", save)
        assert main(argv) == Exit.IO
    saves = [i for i, event in enumerate(events) if event.startswith("save")]
    assert [events[i] for i in saves] == ["save 8", "save 12"]
    for before, at in zip([-1, *saves], saves, strict=False):
        assert {"metrics.jsonl", "eval.jsonl"} <= set(events[before + 1 : at]), events
    assert (
        capsys.readouterr().err
        == f"error: {workdir / 'summary.json'}: cannot be written ({NO_SPACE})\n"
    )
    assert not (workdir / "summary.json").exists()
    assert main(argv) == Exit.FINISHED
    assert _losses(workdir) == _losses(finished_run)
    assert (
        json.loads((workdir / "summary.json").read_text())["val_loss"]
        == json.loads((finished_run / "summary.json").read_text())["val_loss"]
    )

    other = tmp_path / "other"
    with monkeypatch.context() as full:
        full.setattr(os, "pwrite", no_space)  # the lock's line
        assert main(["--config", SMALL, "--workdir", str(other), "--quiet"]) == Exit.IO
    assert capsys.readouterr().err == (
        f"error: workdir {other}: cannot write in it ({other / 'lock'}: {NO_SPACE})\n"
    )
    assert not (other / "checkpoints").exists()  # nothing started

    # TensorBoard's events: tensorboardX's writer (its own thread and exit hook) made this a
    # traceback, and more of them as the process exited.
    events = tmp_path / "events"
    with monkeypatch.context() as full:
        fsync_fails(full, "events.out.tfevents.")
        assert main(["--config", SMALL, "--workdir", str(events), "--quiet"]) == Exit.IO
    assert capsys.readouterr().err == (
        f"error: {events / 'tensorboard'}: cannot be written ({NO_SPACE})\n"
    )


def test_an_unwritable_checkpoint_folder_ends_the_process_with_one_line(byte_corpus, tmp_path):
    """Today's hang: orbax's threads kept the process alive after the error."""
    import os
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / "checkpoints").write_text("a file where the folder should be")
    command = [
        sys.executable,
        "-m",
        "lmuscale.train",
        "--config",
        f"{here / 'small_config.py'}:small",
        "--workdir",
        str(workdir),
        "--quiet",
    ]
    env = {**os.environ, "LMUSCALE_TEST_DATA": str(byte_corpus), "PYTHONPATH": str(here)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == Exit.IO
    assert done.stderr.strip().splitlines() == [
        f"error: checkpoint folder {workdir / 'checkpoints'} cannot be created (FileExistsError: "
        f"[Errno 17] File exists: '{workdir / 'checkpoints'}')"
    ]


def test_no_free_inodes_is_named_at_the_save_and_the_rerun_resumes_exactly(
    byte_corpus, finished_run, tmp_path, monkeypatch
):
    from lmuscale.train import checkpoint
    from lmuscale.train.checkpoint import CheckpointError

    real = checkpoint.os.statvfs
    workdir = tmp_path / "w"

    class NoInodes:  # what statvfs reports once the inodes are used up (bytes are left)
        def __init__(self, stats):
            self.stats = stats

        def __getattr__(self, name):
            return {"f_files": 10**6, "f_favail": 3}.get(name, getattr(self.stats, name))

    def filling(path):  # inodes for the first checkpoint only
        first = not (workdir / "checkpoints" / "4").exists()
        return real(path) if first else NoInodes(real(path))

    monkeypatch.setattr(checkpoint.os, "statvfs", filling)
    with pytest.raises(CheckpointError) as error:
        run(_config(byte_corpus), workdir)
    files = 1 + sum(1 for _ in (workdir / "checkpoints" / "4").rglob("*"))
    assert str(error.value) == (
        f"no room for checkpoint 8 in {workdir / 'checkpoints'}: it needs about {files} files "
        "and the filesystem has 3 free inodes; the checkpoints before it are kept. Free some "
        "space and run again to resume"
    )
    monkeypatch.undo()
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4"]
    run(_config(byte_corpus), workdir)
    assert _losses(workdir) == _losses(finished_run)


def test_a_save_that_fails_in_the_background_is_named_at_the_next_logged_step(
    byte_corpus, tmp_path, monkeypatch
):
    """Orbax writes a checkpoint while training goes on; its failure is raised with the step
    it was writing, at the next logged step, not at the next save."""
    import orbax.checkpoint as ocp

    from lmuscale.train.checkpoint import CheckpointError, Checkpoints

    failed = []
    save = Checkpoints.save
    wait_until_finished = ocp.CheckpointManager.wait_until_finished

    def save_then_fail(self, step, state, meta):
        save(self, step, state, meta)
        if step == 8:  # what orbax's finalize thread holds when the write failed
            failed.append(OSError(28, "No space left on device"))

    def surfacing(self):
        wait_until_finished(self)
        if failed:
            raise failed.pop()

    monkeypatch.setattr(Checkpoints, "save", save_then_fail)
    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", surfacing)
    workdir = tmp_path / "w"
    with pytest.raises(CheckpointError) as error:
        run(_config(byte_corpus), workdir)
    assert str(error.value) == (
        f"writing checkpoint 8 in {workdir / 'checkpoints'} failed (OSError: [Errno 28] No "
        "space left on device); the checkpoints before it are kept"
    )
    # named once the write is over: at step 9 unless it was still going, and at the latest
    # before checkpoint 12 is saved
    last = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").open()][-1]
    assert 9 <= last <= 12
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4", "8"]


def test_orbax_tracebacks_of_failed_saves_are_kept_off_the_terminal():

    from lmuscale.train.checkpoint import _orbax_traceback

    def record(path, level, exc_info):
        return logging.LogRecord("absl", level, path, 1, "failed", None, exc_info)

    error = (OSError, OSError(28, "No space left on device"), None)
    orbax = "/venv/site-packages/orbax/checkpoint/_src/checkpointers/async_checkpointer.py"
    assert not _orbax_traceback(record(orbax, logging.ERROR, error))
    assert _orbax_traceback(record(orbax, logging.ERROR, None))  # a message alone still shows
    assert _orbax_traceback(record(orbax, logging.WARNING, error))
    assert _orbax_traceback(record("/venv/site-packages/jax/_src/api.py", logging.ERROR, error))


def test_a_filesystem_out_of_inodes_ends_the_process_with_one_line(byte_corpus, tmp_path):
    """The issue's reproduction, on a real 100-inode tmpfs: it hung, then printed 121 lines."""
    import os
    import subprocess
    import sys

    mount = tmp_path / "small"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=30m,nr_inodes=100", "tmpfs", str(mount)]
    try:
        made = subprocess.run(command, capture_output=True, check=False)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        here = Path(__file__).resolve().parent
        workdir = mount / "run"
        command = [sys.executable, "-m", "lmuscale.train", "--config"]
        command += [f"{here / 'small_config.py'}:small", "--workdir", str(workdir), "--quiet"]
        command += ["--config.train.steps=200", "--config.checkpoint.keep=100"]
        env = {**os.environ, "LMUSCALE_TEST_DATA": str(byte_corpus), "PYTHONPATH": str(here)}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == Exit.IO, done.stderr
        assert len(lines) == 1, done.stderr
        # named before the save by the inode check, or (when the newest checkpoint's file
        # count underestimated the next one) by the failed background write, or by its file
        # list after the arrays
        pattern = r"error: ((no room for|writing) checkpoint \d+ |checkpoint \d+ .* is written but)"
        assert re.match(pattern, lines[0]), lines[0]
        assert lines[0].endswith("the checkpoints before it are kept. Free some space and run "
                                 "again to resume") or lines[0].endswith(
            "; the checkpoints before it are kept") or lines[0].endswith(
            "by their CRC-32s alone. Free some space and run again to resume")  # fmt: skip
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_read_only_checkpoint_folder_ends_the_process_with_one_line(byte_corpus, tmp_path):
    """The checkpoints folder a read-only bind mount: the run named the failed write and then
    never exited (orbax's threads waited for a save that could not start)."""
    import os
    import subprocess
    import sys

    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    here = Path(__file__).resolve().parent
    train = [
        sys.executable,
        "-m",
        "lmuscale.train",
        "--config",
        f"{here / 'small_config.py'}:small",
    ]
    train += ["--workdir", str(workdir), "--quiet"]
    folder = workdir / "checkpoints"
    script = (
        f"mount --bind {folder} {folder} && mount -o remount,ro,bind {folder} || exit 99; "
        + " ".join(train)
    )
    env = {**os.environ, "LMUSCALE_TEST_DATA": str(byte_corpus), "PYTHONPATH": str(here)}
    try:
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    except FileNotFoundError:
        pytest.skip("no unshare command here")
    if done.returncode == 99 or "unshare: " in done.stderr:
        pytest.skip(f"cannot bind-mount read-only here: {done.stderr.strip()[:200]}")
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: writing checkpoint 4 in {folder} failed ("), lines[0]
    assert "Read-only file system" in lines[0], lines[0]
    assert done.returncode != 0
    assert not any(folder.iterdir())


def test_the_orbax_log_filter_lives_only_as_long_as_its_manager(tmp_path):
    import logging

    from lmuscale.train.checkpoint import Checkpoints, _orbax_traceback

    absl = logging.getLogger("absl")
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=1)
    assert _orbax_traceback in absl.filters
    assert sys.unraisablehook.drops_late_callbacks  # for the process: quiet_late_callbacks
    checkpoints.close()
    assert _orbax_traceback not in absl.filters


def test_a_save_left_unfinished_by_a_kill_is_removed_before_the_manager_returns(tmp_path):
    """Removed at once, not on a thread: a run that stops right after opening its checkpoints
    (bad data) must not exit under a clean-up still running."""
    from lmuscale.train.checkpoint import Checkpoints

    folder = tmp_path / "checkpoints"
    unfinished = folder / "7.orbax-checkpoint-tmp-1700000000000000"
    (unfinished / "state").mkdir(parents=True)
    (unfinished / "state" / "part").write_bytes(b"half a save")
    (folder / "notes.txt").write_text("kept")
    checkpoints = Checkpoints(folder, keep=1)
    try:
        assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    finally:
        checkpoints.close()


_LATE_CALLBACK = """
import asyncio, sys
import tensorstore as ts
from lmuscale.train import checkpoint

if sys.argv[1] == "quiet":
    checkpoint.quiet_late_callbacks()
promise, future = ts.Promise.new()

async def awaits():
    return await future

async def starts():  # as orbax's loop does when one write fails: the others are not awaited
    asyncio.ensure_future(awaits())
    await asyncio.sleep(0.01)

loop = asyncio.new_event_loop()
loop.run_until_complete(starts())
loop.close()
promise.set_result(1)  # tensorstore hands the result to the closed loop, from C++

class Broken:
    def __del__(self):
        raise ValueError("any other unraisable error is still shown")

Broken()
"""


@pytest.mark.parametrize("quiet", [True, False])
def test_writes_that_end_after_orbax_closed_its_loop_print_nothing_once_quieted(tmp_path, quiet):
    """The out-of-inodes run above printed "Event loop is closed" tracebacks beside its one line,
    now and then: writes of the failed save that ended after orbax stopped waiting."""
    import subprocess

    script = tmp_path / "late.py"
    script.write_text(_LATE_CALLBACK)
    argument = "quiet" if quiet else "plain"
    done = subprocess.run(
        [sys.executable, str(script), argument], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "any other unraisable error is still shown" in done.stderr
    assert ("Event loop is closed" in done.stderr) is not quiet, done.stderr


def test_a_file_list_that_cannot_be_written_is_named_and_its_arrays_are_read_back(
    tmp_path, monkeypatch
):
    """The out-of-inodes run now and then ended in a traceback: the save's arrays were
    written, then ``files.json`` found no free inode."""
    import errno

    import jax.numpy as jnp

    from lmuscale.train import checkpoint
    from lmuscale.train.checkpoint import CheckpointError, Checkpoints

    refusal = OSError(errno.ENOSPC, "No space left on device")

    def refused(path, obj):
        refusal.filename = str(path)
        raise refusal

    folder = tmp_path / "checkpoints"
    state = {"w": jnp.arange(6.0)}
    checkpoints = Checkpoints(folder, keep=2)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(checkpoint, "atomic_write_json", refused)
            checkpoints.save(3, state, {"step": 3})
            with pytest.raises(CheckpointError) as raised:
                checkpoints.wait()
            # Not for want of room: no advice to free any.
            refusal.errno, refusal.strerror = errno.EACCES, "Permission denied"
            with pytest.raises(CheckpointError, match=r"CRC-32s alone\. Run again to resume$"):
                checkpoints.wait()
    finally:
        checkpoints.close()
    assert str(raised.value) == (
        f"checkpoint 3 in {folder} is written but its files.json is not (OSError: [Errno 28] "
        f"No space left on device: '{folder / '3' / 'files.json'}'); a resume checks its arrays "
        "by their CRC-32s alone. Free some space and run again to resume"
    )
    again = Checkpoints(folder, keep=2)  # checked by the arrays' CRC-32s alone
    try:
        step, restored, meta = again.restore_latest({"w": jnp.zeros(6)})
    finally:
        again.close()
    assert step == 3 and meta["step"] == 3
    assert restored["w"].tolist() == list(range(6))


def test_only_a_callback_from_outside_python_into_a_closed_loop_is_dropped():
    import asyncio
    from types import SimpleNamespace

    from lmuscale.train.checkpoint import _late_callback

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as error:
        closed = error
    # From C++ (tensorstore's thread) the traceback starts in call_soon_threadsafe itself.
    late = SimpleNamespace(
        exc_value=closed, exc_traceback=closed.__traceback__.tb_next, object=None
    )
    assert _late_callback(late)
    assert not _late_callback(SimpleNamespace(**{**vars(late), "object": loop}))
    assert not _late_callback(SimpleNamespace(**{**vars(late), "exc_value": RuntimeError("x")}))
    # a Python caller in between: its frame comes first, and the error is shown
    assert not _late_callback(
        SimpleNamespace(**{**vars(late), "exc_traceback": closed.__traceback__})
    )
