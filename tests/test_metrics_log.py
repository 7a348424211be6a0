"""metrics.jsonl and eval.jsonl on resume: cut back to the restored step in place, and only a
torn last line dropped."""

from __future__ import annotations

import json
import re

import pytest

from lmuscale.outcomes import DamagedFile, Exit
from lmuscale.train.metrics import MetricsLog
from lmuscale.workdir import cut_log as _cut


def _lines(*steps: int) -> bytes:
    return b"".join(json.dumps({"step": s, "loss": 1.0 / s}).encode() + b"\n" for s in steps)


def _log(tmp_path, data: bytes):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(data)
    return path


def test_lines_after_the_restored_step_are_cut_in_place(tmp_path):
    kept = _lines(1, 2, 3, 4)
    path = _log(tmp_path, kept + _lines(5, 6, 7))
    inode = path.stat().st_ino
    _cut(path, 4)
    assert path.read_bytes() == kept  # the earlier bytes exactly
    assert path.stat().st_ino == inode  # truncated, not rewritten and renamed over
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file


def test_nothing_is_cut_when_every_line_is_at_or_before_the_step(tmp_path):
    data = _lines(10, 20, 30)
    path = _log(tmp_path, data)
    _cut(path, 30)
    assert path.read_bytes() == data
    _cut(path, 0)  # a run killed before its first checkpoint starts its log again
    assert path.read_bytes() == b""


@pytest.mark.parametrize(
    "torn",
    [
        b'{"step": 5, "lo',  # a kill during the write
        b'{"step": 5, "lo\n',
        b"\x00\x00\x00\n",  # a crash's zero-filled block
    ],
)
def test_a_torn_last_line_is_dropped(tmp_path, torn):
    kept = _lines(1, 2, 3, 4)
    path = _log(tmp_path, kept + torn)
    _cut(path, 10)
    assert path.read_bytes() == kept


def test_a_whole_last_line_without_its_newline_is_kept_and_ended(tmp_path):
    path = _log(tmp_path, _lines(1, 2) + b'{"step": 3}')
    _cut(path, 3)
    assert path.read_bytes() == _lines(1, 2) + b'{"step": 3}\n'
    path.write_bytes(_lines(1, 2) + b'{"step": 3}')
    _cut(path, 2)
    assert path.read_bytes() == _lines(1, 2)


def _refused(path, step: int, message: str) -> None:
    before = path.read_bytes()
    with pytest.raises(DamagedFile, match=message) as info:
        _cut(path, step)
    assert Exit.of(info.value) is Exit.IO  # the command line's one line and status 8
    assert path.read_bytes() == before  # the damage is left for the user to see


@pytest.mark.parametrize(
    "bad",
    [
        b'{"step": 3, "lo{"step": 4, "loss": 0.25}\n',  # a torn line a later run appended to
        b"not json\n",
        b"\n",
        b'{"loss": 0.3}\n',  # no step
        b'{"step": "3"}\n',
        b"[3]\n",
    ],
)
def test_a_bad_line_before_the_last_is_named_and_the_file_left_alone(tmp_path, bad):
    path = _log(tmp_path, _lines(1, 2) + bad + _lines(5, 6))
    _refused(path, 5, rf"^{re.escape(str(path))}:3: not a JSON log line with a step")
    # also when the bad line is among those the cut would drop anyway
    _refused(path, 1, rf"^{re.escape(str(path))}:3: not a JSON log line")


def test_the_message_says_what_to_do(tmp_path):
    path = _log(tmp_path, _lines(1) + b"{\n" + _lines(3))
    _refused(path, 2, r"move it away and the run starts a new one after step 2$")


def test_a_step_that_goes_back_is_named(tmp_path):
    # What two runs appending to one log leave behind.
    path = _log(tmp_path, _lines(1, 2, 3, 4, 2, 3))
    _refused(path, 3, rf"^{re.escape(str(path))}:5: step 2 after step 4; .*in step order")


def test_a_resumed_log_cuts_both_files_and_appends_after_the_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(_lines(1, 2, 3, 4, 5) + b'{"step": 6')
    (tmp_path / "eval.jsonl").write_bytes(_lines(2, 4))
    log = MetricsLog(tmp_path, 3, enabled=True, tensorboard=False)
    log.write("train", {"step": 4, "loss": 0.5})
    log.write("eval", {"step": 4, "val_loss": float("nan")})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == _lines(
        1, 2, 3
    ) + b'{"step": 4, "loss": 0.5}\n'
    assert (tmp_path / "eval.jsonl").read_bytes() == _lines(2) + b'{"step": 4, "val_loss": "nan"}\n'


def test_a_damaged_log_stops_the_resume_before_anything_is_written(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(_lines(1, 3, 2))
    with pytest.raises(DamagedFile, match=r"metrics\.jsonl:3: step 2 after step 3"):
        MetricsLog(tmp_path, 3, enabled=True, tensorboard=False)
    assert (tmp_path / "metrics.jsonl").read_bytes() == _lines(1, 3, 2)


def test_other_processes_leave_the_logs_alone(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b"damaged\n" + _lines(5))
    MetricsLog(tmp_path, 1, enabled=False, tensorboard=False).close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == b"damaged\n" + _lines(5)
