"""Preparing: round trip, stable splits, determinism over workers, atomic resume, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from prepared import crash_at_first_record, peak_rss_mb, run, split_documents

from lmuscale.data import prepare as prep
from lmuscale.data import tokenizer as tok
from lmuscale.data.__main__ import main
from lmuscale.data.format import SPLITS
from lmuscale.data.loader import open_dataset
from lmuscale.data.sources import DataError
from lmuscale.outcomes import Exit


def filler(datafiles) -> Path:
    """Enough documents for every split (a prepare with an empty one is refused), to go after
    a test's own few lines: 378 train, 17 val and 5 test documents."""
    return datafiles.jsonl("filler.jsonl", datafiles.texts(400, seed=99))


@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_round_trip_through_a_real_archive(datafiles, tmp_path, tokenizer):
    a, b = datafiles.texts(300, seed=1), datafiles.texts(200, seed=2)
    archive = datafiles.tar(
        "owt2.jsonl.zst.tar",
        {
            "2019-01.jsonl.zst": datafiles.zst(datafiles.jsonl_bytes(a)),
            "2019-02.jsonl.zst": datafiles.zst(datafiles.jsonl_bytes(b)),
        },
    )
    meta = run("owt2", [archive], tmp_path / "out", tokenizer=tokenizer)
    encoder = tok.get_tokenizer(tokenizer)
    got = split_documents(tmp_path / "out", encoder)
    # Each document is in the split its hash says, once, in source order.
    want = {s: [t for t in a + b if prep.split_of(t.encode(), 0) == s] for s in SPLITS}
    assert got == want
    assert all(want[s] for s in SPLITS)  # the sample is large enough to fill every split
    dtype = np.dtype(meta["dtype"])
    assert dtype == np.uint16 and meta["vocab_size"] == encoder.vocab_size
    for split in SPLITS:
        entry = meta["splits"][split]
        data = (tmp_path / "out" / entry["file"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["tokens"] == len(data) // dtype.itemsize
        assert entry["documents"] == len(want[split])
        assert entry["bytes"] == sum(len(t.encode()) for t in want[split])
    assert meta["shards"] == 2 and meta["split"]["seed"] == 0
    assert not (tmp_path / "out.partial").exists()


def test_split_rule_gives_96_3_1():
    texts = [f"document number {i}" for i in range(20000)]
    counts = {s: 0 for s in SPLITS}
    for t in texts:
        counts[prep.split_of(t.encode(), seed=0)] += 1
    for split, fraction in prep.FRACTIONS.items():
        sigma = (len(texts) * fraction * (1 - fraction)) ** 0.5
        assert abs(counts[split] - len(texts) * fraction) < 4 * sigma, counts
    # Another seed is another split.
    moved = sum(prep.split_of(t.encode(), 0) != prep.split_of(t.encode(), 1) for t in texts)
    assert moved > 0.05 * len(texts)


def test_adding_files_never_moves_a_document(datafiles, tmp_path):
    first = datafiles.jsonl("a.jsonl", datafiles.texts(400, seed=5))
    run("text", [first], tmp_path / "one")
    second = datafiles.jsonl("b.jsonl", datafiles.texts(400, seed=6))
    run("text", [second, first], tmp_path / "two")
    before = split_documents(tmp_path / "one", tok.byte_tokenizer())
    after = split_documents(tmp_path / "two", tok.byte_tokenizer())
    assert all(before[s] for s in SPLITS)
    for split in SPLITS:
        assert set(before[split]) <= set(after[split])
        others = set().union(*(after[s] for s in SPLITS if s != split))
        assert not set(before[split]) & others


def test_token_files_do_not_depend_on_the_number_of_workers(datafiles, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "CHUNK_CHARS", 2000)  # many tasks per shard, in flight together
    inputs = [
        datafiles.write(
            f"f{i}.jsonl.zst",
            datafiles.zst(datafiles.jsonl_bytes(datafiles.texts(300, seed=i)) + b"not json\n"),
        )
        for i in range(4)
    ]
    serial = run("owt2", inputs, tmp_path / "serial", workers=0, max_bad_lines=4)
    parallel = run("owt2", inputs, tmp_path / "parallel", workers=2, max_bad_lines=4)
    assert serial["splits"] == parallel["splits"]
    assert serial["bad_lines"]["examples"] == parallel["bad_lines"]["examples"]
    assert parallel["prepared"]["workers"] == 2


def test_uint32_when_the_vocabulary_needs_it(datafiles, tmp_path, monkeypatch):
    class Wide(tok.Tokenizer):
        def encode_array(self, text):
            return super().encode_array(text) + 65536

    monkeypatch.setitem(
        tok.TOKENIZERS, "wide", lambda: Wide("wide", 65536 + 257, 65536 + 256, "test")
    )
    texts = datafiles.texts(400)
    meta = run("text", [datafiles.jsonl("a.jsonl", texts)], tmp_path / "out", tokenizer="wide")
    assert meta["dtype"] == "uint32"
    ids = np.concatenate([np.fromfile(tmp_path / "out" / f"{s}.bin", np.uint32) for s in SPLITS])
    expected = [65536 + b for t in texts for b in t.encode()] + [65536 + 256] * len(texts)
    assert sorted(ids.tolist()) == sorted(expected)


def test_a_token_id_out_of_range_is_an_error_naming_the_document(datafiles, tmp_path, monkeypatch):
    class Broken(tok.Tokenizer):
        def encode_array(self, text):
            return np.array([70000 if "bad" in text else 1], np.int64)

    monkeypatch.setitem(tok.TOKENIZERS, "broken", lambda: Broken("broken", 256, 0, "test"))
    path = datafiles.jsonl("a.jsonl", ["fine", "fine too", "a bad one"])
    with pytest.raises(
        DataError, match=re.escape(f"{path.resolve()}:3: token id 70000 is out of range")
    ):
        run("text", [path], tmp_path / "out", tokenizer="broken")
    assert not (tmp_path / "out" / "meta.json").exists()


def test_bad_lines_stop_the_run_by_default_and_are_counted_when_allowed(datafiles, tmp_path):
    path = datafiles.write(
        "mixed.jsonl",
        b'{"text": "one"}\n{"text": "two"\n{"text": "three"}\n'
        b'{"txt": "four"}\n{"text": "f\\u0000ve"}\n',
    )
    where = f"{path.resolve()}:"
    with pytest.raises(DataError, match=re.escape(where + "2: not JSON")):
        run("text", [path, filler(datafiles)], tmp_path / "strict")
    with pytest.raises(
        DataError,
        match=re.escape(where + "5: text holds the end-of-text id 0")
        + ".*bad line 3, more than --max-bad-lines 2",
    ):
        run("text", [path, filler(datafiles)], tmp_path / "two", max_bad_lines=2)
    meta = run("text", [path, filler(datafiles)], tmp_path / "three", max_bad_lines=3)
    assert meta["bad_lines"]["skipped"] == 3
    assert [e.split(": ")[0] for e in meta["bad_lines"]["examples"]] == [
        where + "2",
        where + "4",
        where + "5",
    ]
    assert sum(s["documents"] for s in meta["splits"].values()) == 2 + 400


def test_skipped_lines_are_counted_once_across_a_resume(datafiles, tmp_path, monkeypatch):
    inputs = [
        datafiles.write(
            f"p{i}.jsonl", b"not json\n" + datafiles.jsonl_bytes(datafiles.texts(5, seed=i))
        )
        for i in range(3)
    ]
    undo = crash_at_first_record(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run("text", [*inputs, filler(datafiles)], tmp_path / "out", max_bad_lines=3)
    undo()
    assert json.loads((tmp_path / "out.partial" / "progress.json").read_text())["shards"] == 1
    meta = run("text", [*inputs, filler(datafiles)], tmp_path / "out", max_bad_lines=3)
    assert meta["bad_lines"]["skipped"] == 3
    assert meta["bad_lines"]["examples"] == [
        f"{p.resolve()}:1: not JSON (Expecting value at column 1)" for p in inputs
    ]


def test_bad_lines_are_met_in_file_order(datafiles, tmp_path):
    """One found by the worker (a NUL, the byte tokenizer's end-of-text) before one found by
    the reader (not JSON): the first in the file is the one reported."""
    path = datafiles.write("m.jsonl", b'{"text": "nul \\u0000"}\n{"text": "ok"}\nnot json\n')
    where = f"{path.resolve()}:"
    inputs = [path, filler(datafiles)]
    with pytest.raises(DataError, match=re.escape(where + "1: text holds the end-of-text id 0")):
        run("text", inputs, tmp_path / "strict")
    with pytest.raises(DataError, match=re.escape(where + "3: not JSON") + ".*bad line 2"):
        run("text", inputs, tmp_path / "one", max_bad_lines=1)
    meta = run("text", inputs, tmp_path / "two", max_bad_lines=2)
    assert [e.split(": ")[0] for e in meta["bad_lines"]["examples"]] == [where + "1", where + "3"]


def test_the_bad_line_limit_can_be_raised_on_resume(datafiles, tmp_path, monkeypatch):
    good = datafiles.jsonl("a.jsonl", datafiles.texts(400))
    bad = datafiles.write("b.jsonl", b"not json\n")
    undo = crash_at_first_record(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run("text", [good, bad], tmp_path / "out")
    undo()
    with pytest.raises(DataError, match="allow skipping with --max-bad-lines N"):
        run("text", [good, bad], tmp_path / "out")
    meta = run("text", [good, bad], tmp_path / "out", max_bad_lines=1)
    assert meta["bad_lines"]["skipped"] == 1 and meta["bad_lines"]["max_bad_lines"] == 1


def test_inputs_without_documents_are_an_error(datafiles, tmp_path):
    archive = datafiles.tar("wrong.tar", {"2019-01.json.zst": b"wrong suffix"})
    with pytest.raises(DataError, match="owt2: the inputs hold no documents"):
        run("owt2", [archive], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_empty_text_file_is_refused(datafiles, tmp_path, capsys):
    """An empty .txt holds no document (it gave a dataset of one end-of-text id)."""
    empty = datafiles.write("empty.txt", b"")
    out = tmp_path / "out"
    assert main(["prepare", "text", str(empty), "--out", str(out), "--quiet"]) == Exit.DATA
    error = capsys.readouterr().err
    assert error == f"error: text: the inputs hold no documents ({empty.resolve()})\n"
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize(("n", "texts_seed", "empty"), [(50, 0, "val"), (80, 2, "test")])
def test_a_split_without_documents_is_refused_by_name(datafiles, tmp_path, n, texts_seed, empty):
    """Too few documents for the hash split to put one in every split: refused, naming the
    split; nothing is left to resume, so another --seed (here one that fills them) just runs."""
    texts = datafiles.texts(n, seed=texts_seed)
    splits = {prep.split_of(t.encode(), 0) for t in texts}
    assert [s for s in SPLITS if s not in splits] == [empty]
    path = datafiles.jsonl("few.jsonl", texts)
    with pytest.raises(
        DataError,
        match=re.escape(f"text: the {empty} split has no tokens: none of the {n} documents")
        + ".*use more documents .* or another --seed",
    ):
        run("text", [path], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    if empty == "test":
        meta = run("text", [path], tmp_path / "out", seed=1)
        assert all(meta["splits"][s]["documents"] > 0 for s in SPLITS)


def test_seed_must_fit_the_hash_key(datafiles, tmp_path):
    path = datafiles.jsonl("a.jsonl", ["x"])
    for seed in (-1, 2**64):
        with pytest.raises(DataError, match=re.escape(f"--seed must be in [0, 2**64), got {seed}")):
            run("text", [path], tmp_path / "out", seed=seed)


def test_meta_json_gets_the_usual_permissions(datafiles, tmp_path):
    old = os.umask(0o022)
    try:
        run("text", [datafiles.jsonl("a.jsonl", datafiles.texts(400))], tmp_path / "out")
    finally:
        os.umask(old)
    for name in ("meta.json", "train.bin"):
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == 0o644, name


def test_an_unpaired_surrogate_is_a_bad_line(datafiles, tmp_path):
    path = datafiles.write("s.jsonl", b'{"text": "ok"}\n{"text": "half a pair \\ud800"}\n')
    with pytest.raises(
        DataError, match=re.escape(f"{path.resolve()}:2: text holds an unpaired surrogate (U+D800)")
    ):
        run("text", [path], tmp_path / "out", tokenizer="gpt2")


def test_a_finished_folder_is_left_alone_and_another_job_is_refused(datafiles, tmp_path):
    path = datafiles.jsonl("a.jsonl", datafiles.texts(400))
    run("text", [path], tmp_path / "out")
    stamp = (tmp_path / "out" / "meta.json").stat().st_mtime_ns
    run("text", [path], tmp_path / "out")
    assert (tmp_path / "out" / "meta.json").stat().st_mtime_ns == stamp
    with pytest.raises(
        DataError, match="already holds a prepared dataset of 'text' with other settings"
    ):
        run("text", [path], tmp_path / "out", seed=1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.md").write_text("mine")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'other'}: exists, is not empty")):
        run("text", [path], tmp_path / "other")


def test_killed_prepare_leaves_nothing_that_looks_complete_and_resumes_to_the_same_files(
    datafiles, tmp_path
):
    inputs = [
        datafiles.jsonl(f"part-{i:02d}.jsonl", datafiles.texts(120, seed=i, words=200))
        for i in range(60)
    ]
    reference = run("text", inputs, tmp_path / "reference", tokenizer="gpt2")
    out = tmp_path / "killed"
    work = tmp_path / "killed.partial"
    command = [
        sys.executable,
        "-m",
        "lmuscale.data",
        "prepare",
        "text",
        *map(str, inputs),
        "--out",
        str(out),
        "--workers",
        "0",
        "--quiet",
    ]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    progress = work / "progress.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        if progress.exists():  # the first record, after COMMIT_SECONDS
            break
        time.sleep(0.002)
    assert child.poll() is None, "prepare finished before it could be killed; give it more input"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    shards_done = json.loads(progress.read_text())["shards"]
    assert 1 <= shards_done < len(inputs)
    # Nothing looks complete: no folder under the name asked for, no metadata in the work.
    assert not out.exists() and not (work / "meta.json").exists()
    with pytest.raises(DataError, match="an unfinished prepare"):
        open_dataset(out)
    # Whatever was written after the last record is cut off (here, a torn tail of junk).
    with open(work / "train.bin", "ab") as partial:
        partial.write(b"\xff" * 2**20)
    resumed = run("text", inputs, out, tokenizer="gpt2")
    assert resumed["splits"] == reference["splits"]  # same counts and sha256
    assert resumed["prepared"]["seconds"] > 0
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json",
        "test.bin",
        "train.bin",
        "val.bin",
    ]
    assert not work.exists()


def _process(pid: int) -> tuple[int, str] | None:
    """(ppid, start time) of a live process; None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (name) "
    return None if fields[0] in "ZX" else (int(fields[1]), fields[19])


def _alive(pid: int, start: str | None) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs."""
    return start is not None and (_process(pid) or (0, ""))[1] == start


def _descendants(pid: int) -> dict[int, str]:
    """Live descendants of ``pid`` and their start times (to tell a reused pid)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (info := _process(int(entry.name))):
            parents[int(entry.name)] = info
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, start) in parents.items():
            if ppid == parent and child not in found:
                found[child] = start
                frontier.append(child)
    return found


def _workers(pid: int) -> list[int]:
    """The pool's worker processes among ``pid``'s children (spawned, so by their command)."""
    found = []
    for child in _descendants(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; prctl is Linux's")
@pytest.mark.parametrize("moment", ["starting", "tokenising"])
def test_workers_die_with_a_killed_prepare(datafiles, tmp_path, moment):
    """SIGKILL of ``prepare --workers 2`` leaves no worker or resource tracker behind, whether
    the workers were still starting or had tokenised. The last input is a FIFO that nobody
    writes, so the prepare waits on it for as long as the test likes: no race with its end."""
    inputs = [datafiles.jsonl(f"p{i}.jsonl", datafiles.texts(2000, seed=i)) for i in range(6)]
    fifo = datafiles.root / "never.txt"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "lmuscale.data", "prepare", "text", *map(str, inputs)]
    command += [str(fifo), "--out", str(out), "--workers", "2", "--tokenizer", "bytes", "--quiet"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    before, workers, left = {}, [], set()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.poll() is None:
            ready = len(_workers(child.pid)) == 2
            if moment == "tokenising":  # a result came back: the workers ran their initializer
                train = tmp_path / "out.partial" / "train.bin"
                ready = ready and train.exists() and train.stat().st_size > 0
            if ready:
                break
            time.sleep(0.01)
        assert child.poll() is None, "prepare ended before it could be killed"
        before, workers = _descendants(child.pid), _workers(child.pid)
        assert len(before) >= 3, before  # two workers and the resource tracker
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = {pid for pid, start in before.items() if _alive(pid, start)}
            if not left:
                break
            time.sleep(0.05)
        assert not left, f"still running after the prepare was killed: {sorted(left)}"
        assert child.stdout.read() == b""  # every holder of its stdout is gone: no hang here
    finally:  # on failure, end the orphans this test made: the workers first, so that the
        # resource tracker, leaving after them, still unlinks the pool's semaphores
        for pids in (workers, before):
            if any(_alive(pid, before.get(pid)) for pid in pids):
                time.sleep(1 if pids is before else 0)
            for pid in pids:
                if _alive(pid, before.get(pid)):
                    os.kill(pid, signal.SIGKILL)
        if child.poll() is None:
            child.kill()
        child.stdout.close()


@pytest.mark.parametrize("step", ["meta.json", "rename"])
def test_a_crash_in_the_last_steps_recovers(datafiles, tmp_path, monkeypatch, step):
    inputs = [datafiles.jsonl(f"p{i}.jsonl", datafiles.texts(100, seed=i)) for i in range(3)]
    reference = run("text", inputs, tmp_path / "reference")
    if step == "meta.json":
        real = prep.atomic_write_json

        def crash(path, obj):
            if Path(path).name == "meta.json":
                raise KeyboardInterrupt
            real(path, obj)

        monkeypatch.setattr(prep, "atomic_write_json", crash)
    else:
        monkeypatch.setattr(
            prep, "_publish", lambda work, out: (_ for _ in ()).throw(KeyboardInterrupt)
        )
    with pytest.raises(KeyboardInterrupt):
        run("text", inputs, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert (tmp_path / "out.partial" / "meta.json").exists() == (step == "rename")
    with pytest.raises(DataError, match="an unfinished prepare"):
        open_dataset(tmp_path / "out")
    monkeypatch.undo()
    if step == "rename":  # a finished work folder is published only for the same job
        with pytest.raises(DataError, match="holds a finished prepare of a different job"):
            run("text", inputs, tmp_path / "out", seed=3)
    assert run("text", inputs, tmp_path / "out")["splits"] == reference["splits"]


def test_changed_inputs_need_restart(datafiles, tmp_path, monkeypatch):
    inputs = [datafiles.jsonl(f"p{i}.jsonl", datafiles.texts(100, seed=i)) for i in range(3)]
    undo = crash_at_first_record(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run("text", inputs, tmp_path / "out")
    undo()
    with pytest.raises(DataError, match="holds an unfinished prepare of a different job"):
        run("text", inputs[:2], tmp_path / "out")
    fresh = run("text", inputs[:2], tmp_path / "out", restart=True)
    assert fresh["splits"] == run("text", inputs[:2], tmp_path / "clean")["splits"]


def test_renamed_tar_members_of_the_same_size_are_noticed_on_resume(
    datafiles, tmp_path, monkeypatch
):
    members = {f"a-{i}.jsonl": datafiles.jsonl_bytes(datafiles.texts(30, seed=i)) for i in range(3)}
    archive = datafiles.tar("owt2.tar", members)
    undo = crash_at_first_record(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run("owt2", [archive], tmp_path / "out")
    undo()
    size = archive.stat().st_size
    datafiles.tar("owt2.tar", {name.replace("a-", "b-"): data for name, data in members.items()})
    assert archive.stat().st_size == size  # the plan (files and sizes) cannot tell
    with pytest.raises(DataError, match="the inputs changed since the interrupted run"):
        run("owt2", [archive], tmp_path / "out")


def test_memory_does_not_grow_with_the_archive(datafiles, tmp_path):
    """Peak RSS of a prepare of a 10x larger archive is within a few MB of the small one's."""

    def archive(n_docs: int, name: str) -> Path:
        texts = datafiles.texts(n_docs, seed=7, words=300)
        return datafiles.tar(
            f"{name}.tar", {f"{name}.jsonl.zst": datafiles.zst(datafiles.jsonl_bytes(texts))}
        )

    small, small_mb = peak_rss_mb("owt2", [archive(2000, "small")], tmp_path / "small")
    large, large_mb = peak_rss_mb("owt2", [archive(20000, "large")], tmp_path / "large")
    assert large_mb > 9 * small_mb and large_mb > 15
    assert large - small < 10, (small, large, small_mb, large_mb)
    print(
        f"peak RSS {small:.1f} MB ({small_mb:.1f} MB of text), {large:.1f} MB ({large_mb:.1f} MB)"
    )


def test_command_line(datafiles, tmp_path, capsys):
    path = datafiles.jsonl("a.jsonl", datafiles.texts(300))
    out = tmp_path / "out"
    assert (
        main(
            [
                "prepare",
                "text",
                str(path),
                "--out",
                str(out),
                "--tokenizer",
                "bytes",
                "--workers",
                "0",
                "--quiet",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert f"{meta['splits']['train']['tokens']:,}" in printed
    assert main(["info", str(out)]) == 0
    assert "checksums: ok" in capsys.readouterr().out
    assert (
        main(["prepare", "owt2", str(tmp_path / "missing.tar"), "--out", str(tmp_path / "x")])
        == Exit.DATA
    )
    assert f"error: {tmp_path / 'missing.tar'}: no such file" in capsys.readouterr().err


def test_shakespeare_from_the_command_line(tmp_path):
    """The issue's command, as a user runs it: real GPT-2 tokens, every split usable."""
    out = tmp_path / "shakespeare"
    done = subprocess.run(
        [sys.executable, "-m", "lmuscale.data", "prepare", "shakespeare", "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "prepare shakespeare" in done.stderr  # the progress bar
    dataset = open_dataset(out)
    meta = dataset.meta
    assert meta["tokenizer"]["name"] == "gpt2" and meta["dtype"] == "uint16"
    assert meta["shards"] == 38 and sum(s["documents"] for s in meta["splits"].values()) > 760
    total = sum(s["tokens"] for s in meta["splits"].values())
    assert 1.4e6 < total < 1.9e6  # REFERENCE §4: about 1.8M GPT-2 tokens, markdown included
    for split in SPLITS:
        assert dataset.windows(split, 1024) >= 10
    gpt2 = tok.gpt2_tokenizer()
    head = gpt2.decode(dataset.tokens("train")[:2000])
    assert "**" in head and "SCENE" in head
