"""The loader: windows, a batch that is a pure function of (seed, step), slicing, bad folders."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from lmuscale.data.loader import TrainBatches, eval_batches, eval_steps, open_dataset, permute
from lmuscale.data.prepare import prepare
from lmuscale.data.sources import DataError


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A small byte-tokenised dataset (about 60k train tokens)."""
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    texts = [
        "".join(rng.choice(list("abcdefgh ij\n"), size=rng.integers(20, 200))) for _ in range(1000)
    ]
    lines = "".join(json.dumps({"text": f"{i}: {t}"}) + "\n" for i, t in enumerate(texts))
    (root / "docs.jsonl").write_text(lines)
    prepare(
        "text",
        [str(root / "docs.jsonl")],
        out=root / "data",
        tokenizer="bytes",
        workers=0,
        progress=False,
    )
    return root / "data"


def copy(prepared: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "data"))


# --- the permutation -----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 255, 1000, 4097])
def test_permute_is_a_bijection(n):
    for epoch in range(3):
        out = permute(np.arange(n), n, seed=11, epoch=epoch)
        assert sorted(out.tolist()) == list(range(n))


def test_permute_shuffles_well_and_differs_by_seed_and_epoch():
    n = 10_000
    orders = {key: permute(np.arange(n), n, *key) for key in [(0, 0), (0, 1), (1, 0)]}
    for out in orders.values():
        rank = np.corrcoef(np.arange(n), out)[0, 1]  # Spearman: the values are ranks
        assert abs(rank) < 0.05
        assert np.sum(out == np.arange(n)) < 10  # about one fixed point expected
        # Neighbours land far apart: no locality left from the Feistel's halves.
        assert np.median(np.abs(np.diff(out))) > n / 10
    a, b, c = orders.values()
    assert np.mean(a == b) < 0.01 and np.mean(a == c) < 0.01
    # The first position is uniform over many keys (chi-square, 10 bins, 2000 keys).
    first = np.array([permute(np.zeros(1, np.int64), n, s, 0)[0] for s in range(2000)])
    counts = np.bincount(first * 10 // n, minlength=10)
    assert np.sum((counts - 200) ** 2 / 200) < 27.9  # p = 0.001 for 9 degrees of freedom


def test_permute_keeps_the_shape_of_its_input():
    n = 1000
    whole = permute(np.arange(n), n, 2, 0)
    assert permute(7, n, 2, 0) == whole[7] and np.shape(permute(7, n, 2, 0)) == ()
    grid = np.arange(12).reshape(3, 4)
    assert np.array_equal(permute(grid, n, 2, 0), whole[grid])


def test_batch_of_a_numpy_step_equals_the_batch_of_the_int(prepared):
    batches = TrainBatches(
        open_dataset(prepared), seq_len=16, global_batch=8, seed=0, process_index=0, process_count=1
    )
    step = 2**31 // 8 + 5  # step * global_batch overflows int32
    assert np.array_equal(batches.window_ids(np.int32(step)), batches.window_ids(step))


def test_permute_rejects_indices_outside_the_range():
    with pytest.raises(ValueError, match=r"range\(5\)"):
        permute(np.array([5]), 5, 0, 0)


# --- windows and training batches -----------------------------------------------------------


def test_windows_tile_the_split_with_one_token_overlap(prepared):
    dataset = open_dataset(prepared)
    tokens = np.fromfile(prepared / "train.bin", np.uint16)
    seq_len = 64
    n = dataset.windows("train", seq_len)
    assert n == (tokens.size - 1) // seq_len
    windows = dataset.read_windows("train", seq_len, np.arange(n))
    assert windows.shape == (n, seq_len + 1) and windows.dtype == np.int32
    # Targets: every token after the first exactly once, in order.
    assert np.array_equal(windows[:, 1:].reshape(-1), tokens[1 : n * seq_len + 1])
    assert np.array_equal(windows[1:, 0], windows[:-1, -1])


def test_batch_is_a_pure_function_of_seed_and_step(prepared):
    make = lambda seed: TrainBatches(  # noqa: E731
        open_dataset(prepared),
        seq_len=32,
        global_batch=16,
        seed=seed,
        process_index=0,
        process_count=1,
    )
    first, again = make(0), make(0)
    forward = [first(s) for s in range(12)]
    backward = [again(s) for s in reversed(range(12))][::-1]  # any order, any instance
    assert all(np.array_equal(a, b) for a, b in zip(forward, backward, strict=True))
    assert not np.array_equal(make(1)(0), forward[0])
    # Each row is the window its id names.
    ids = first.window_ids(5)
    assert np.array_equal(forward[5], first.dataset.read_windows("train", 32, ids))


def test_every_window_once_per_epoch_and_a_new_order_each_epoch(prepared):
    batches = TrainBatches(
        open_dataset(prepared),
        seq_len=100,
        global_batch=7,  # does not divide the windows: batches straddle epochs
        seed=3,
        process_index=0,
        process_count=1,
    )
    n = batches.n_windows
    steps = -(-3 * n // 7) + 1
    ids = np.concatenate([batches.window_ids(s) for s in range(steps)])
    epochs = [ids[e * n : (e + 1) * n] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(n))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])
    assert batches.epoch(steps) > 3


@pytest.mark.parametrize("processes", [2, 4, 8])
def test_each_process_reads_its_slice_of_the_global_batch(prepared, processes):
    dataset = open_dataset(prepared)
    whole = TrainBatches(
        dataset, seq_len=16, global_batch=8, seed=5, process_index=0, process_count=1
    )
    for step in (0, 1, 50):
        parts = [
            TrainBatches(
                dataset,
                seq_len=16,
                global_batch=8,
                seed=5,
                process_index=p,
                process_count=processes,
            )(step)
            for p in range(processes)
        ]
        assert all(part.shape == (8 // processes, 17) for part in parts)
        assert np.array_equal(np.concatenate(parts), whole(step))


def test_batch_reads_only_its_rows(prepared, monkeypatch):
    """Reading is per process: the memmap is indexed with this process's windows only."""
    dataset = open_dataset(prepared)
    seen = []
    real = dataset.read_windows
    monkeypatch.setattr(
        dataset, "read_windows", lambda s, n, ids: seen.append(ids) or real(s, n, ids)
    )
    batches = TrainBatches(
        dataset, seq_len=16, global_batch=8, seed=5, process_index=1, process_count=4
    )
    batches(3)
    assert len(seen) == 1 and np.array_equal(seen[0], batches.window_ids(3)[2:4])


def test_a_batch_that_does_not_split_over_processes_is_refused(prepared):
    with pytest.raises(
        DataError, match="global batch of 10 sequences does not split evenly over 4"
    ):
        TrainBatches(
            open_dataset(prepared),
            seq_len=16,
            global_batch=10,
            seed=0,
            process_index=0,
            process_count=4,
        )


def test_default_process_comes_from_jax(prepared):
    batches = TrainBatches(open_dataset(prepared), seq_len=16, global_batch=4, seed=0)
    assert batches.rows == slice(0, 4)  # one process on this machine


# --- evaluation -----------------------------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2])
def test_evaluation_visits_every_window_once_in_order(prepared, processes):
    dataset = open_dataset(prepared)
    n = dataset.windows("val", 20)
    batch = 6 if n % 6 else 4 * processes + 2  # make the last batch partial
    seen = {p: [] for p in range(processes)}
    for p in range(processes):
        for b in eval_batches(
            dataset, "val", seq_len=20, global_batch=batch, process_index=p, process_count=processes
        ):
            assert b.tokens.shape == (batch // processes, 21)
            assert not b.tokens[~b.valid].any()
            seen[p].append(b)
    assert len(seen[0]) == eval_steps(dataset, "val", seq_len=20, global_batch=batch)
    rows = [b for step in zip(*seen.values(), strict=True) for b in step]  # global order
    ids = np.concatenate([b.window_ids[b.valid] for b in rows])
    assert np.array_equal(ids, np.arange(n))
    tokens = np.concatenate([b.tokens[b.valid] for b in rows])
    assert np.array_equal(tokens, dataset.read_windows("val", 20, np.arange(n)))
    assert sum((~b.valid).sum() for b in rows) == len(seen[0]) * batch - n


def test_a_split_smaller_than_one_window_is_named(prepared):
    dataset = open_dataset(prepared)
    tokens = dataset.meta["splits"]["test"]["tokens"]
    with pytest.raises(
        DataError,
        match=re.escape(
            f"{prepared / 'test.bin'}: the test split has {tokens} tokens, fewer than one "
            f"window of seq_len + 1 = {tokens + 1}"
        ),
    ):
        eval_batches(
            dataset, "test", seq_len=tokens, global_batch=1, process_index=0, process_count=1
        ).__next__()
    assert dataset.windows("test", tokens - 1) == 1


# --- memory ---------------------------------------------------------------------------------


def test_reading_a_batch_maps_the_file_instead_of_loading_it(tmp_path):
    """A 256 MB split: a batch touches a few pages of it, not the whole file."""
    n_tokens = 128 * 2**20
    folder = tmp_path / "big"
    folder.mkdir()
    for split in ("train", "val", "test"):
        with open(folder / f"{split}.bin", "wb") as f:
            f.truncate(2 * (n_tokens if split == "train" else 1024))  # sparse: zeros
    meta = {
        "format": "lmuscale-tokens/1",
        "source": {"spec": "test"},
        "tokenizer": {"name": "bytes", "vocab_size": 256, "eot": 0},
        "vocab_size": 256,
        "dtype": "uint16",
        "splits": {
            s: {
                "file": f"{s}.bin",
                "documents": 1,
                "tokens": n_tokens if s == "train" else 1024,
                "bytes": 0,
                "sha256": "unchecked",
            }
            for s in ("train", "val", "test")
        },
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    dataset = open_dataset(folder, verify=False)
    assert isinstance(dataset.tokens("train"), np.memmap)
    before = resident_mb()
    batch = TrainBatches(
        dataset, seq_len=1024, global_batch=64, seed=0, process_index=0, process_count=1
    )(0)
    assert batch.shape == (64, 1025)
    assert resident_mb() - before < 16  # the file is 256 MB


def resident_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


# --- bad prepared folders -------------------------------------------------------------------


def test_missing_and_unfinished_folders(tmp_path):
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'nope'}: no such folder; prepare")):
        open_dataset(tmp_path / "nope")
    with pytest.raises(
        DataError, match=re.escape(f"{tmp_path}: not a prepared dataset (no meta.json)")
    ):
        open_dataset(tmp_path)
    (tmp_path / "half.partial").mkdir()
    with pytest.raises(
        DataError, match=r"half: an unfinished prepare .* run the same prepare command again"
    ):
        open_dataset(tmp_path / "half")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.pop("dtype"), "missing key 'dtype'"),
        (lambda m: m["splits"]["val"].pop("sha256"), "missing key 'splits.val.sha256'"),
        (lambda m: m.update(vocab_size="256"), "vocab_size = '256' is not a int"),
        (lambda m: m.update(format="other/1"), "format 'other/1', expected"),
        (lambda m: m.update(dtype="float32"), "dtype 'float32' is not uint16 or uint32"),
        (
            lambda m: (m.update(vocab_size=70000), m["tokenizer"].update(vocab_size=70000)),
            "a vocab of 70000 does not fit in uint16",
        ),
        (lambda m: m["tokenizer"].update(eot=256), "disagrees with vocab_size 256"),
        (
            lambda m: m["splits"]["train"].update(tokens=m["splits"]["train"]["tokens"] + 1),
            "train.bin: .* bytes, but meta.json says",
        ),
        (lambda m: m["splits"]["test"].update(file="gone.bin"), "gone.bin: missing"),
        (lambda m: m.update(fingerprint="sha256:0"), "fingerprint sha256:0 is not that of the"),
    ],
)
def test_metadata_that_does_not_match_is_named(prepared, tmp_path, edit, message):
    folder = copy(prepared, tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=message):
        open_dataset(folder)


def test_metadata_that_is_not_json_is_named(prepared, tmp_path):
    folder = copy(prepared, tmp_path)
    (folder / "meta.json").write_text('{"format": ')
    with pytest.raises(DataError, match=re.escape(f"{folder / 'meta.json'}: not readable JSON")):
        open_dataset(folder)


def test_a_changed_token_file_fails_its_checksum(prepared, tmp_path):
    folder = copy(prepared, tmp_path)
    data = bytearray((folder / "val.bin").read_bytes())
    data[10] ^= 1
    (folder / "val.bin").write_bytes(bytes(data))
    with pytest.raises(
        DataError, match=re.escape(f"{folder / 'val.bin'}: sha256") + ".* does not match"
    ):
        open_dataset(folder)
    open_dataset(folder, verify=False)  # sizes alone cannot see it: that is what verify is for


def test_a_token_id_out_of_range_is_named(prepared, tmp_path):
    folder = copy(prepared, tmp_path)
    ids = np.fromfile(folder / "train.bin", np.uint16)
    ids[1234] = 300  # the byte tokenizer has 256 ids
    ids.tofile(folder / "train.bin")
    meta = json.loads((folder / "meta.json").read_text())
    meta["splits"]["train"]["sha256"] = hashlib.sha256(
        (folder / "train.bin").read_bytes()
    ).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        DataError,
        match=re.escape(
            f"{folder / 'train.bin'}: token 1234 is 300, out of range for the vocab of 256"
        ),
    ):
        open_dataset(folder)


def test_unknown_split_and_bad_seq_len(prepared):
    dataset = open_dataset(prepared)
    with pytest.raises(DataError, match="unknown split 'dev'"):
        dataset.windows("dev", 8)
    with pytest.raises(DataError, match="seq_len must be >= 1"):
        dataset.windows("train", 0)
