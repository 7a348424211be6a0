"""Batches from a prepared folder: fixed windows, a pure function of (seed, step).

A split of N tokens holds W = (N - 1) // seq_len windows; window i is
``tokens[i * seq_len : i * seq_len + seq_len + 1]``, so tokens 1 .. W * seq_len are each a
target exactly once. Windows cross document boundaries (the end-of-text ids mark them).

Training: sample k = step * global_batch + row is window ``permute(k mod W)`` of epoch k // W,
a Feistel permutation keyed by (seed, epoch): every window once per epoch, in O(1) per window,
so a resumed run needs no iterator state. Evaluation visits every window once, in order; the
last batch is padded with rows marked invalid. Each process reads only its rows of the batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lmuscale.data.format import SPLITS, fingerprint, read_meta, scan_tokens
from lmuscale.data.sources import DataError

FEISTEL_ROUNDS = 6


@dataclasses.dataclass(eq=False)
class TokenDataset:
    """A prepared folder, checked against its metadata. ``meta`` is meta.json as a dict."""

    folder: Path
    meta: dict
    _maps: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def tokenizer(self) -> str:
        return self.meta["tokenizer"]["name"]

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]  # read_meta fills it in for a folder prepared before

    @property
    def source(self) -> str | None:
        """The kind of source it was prepared from ("owt2", "text", "shakespeare", ...)."""
        return self.meta["source"].get("spec")

    def path(self, split: str) -> Path:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; splits are {', '.join(SPLITS)}")
        return self.folder / self.meta["splits"][split]["file"]

    def tokens(self, split: str) -> np.ndarray:
        """The split's token ids, memory-mapped read-only (nothing is read until indexed)."""
        if split not in self._maps:
            dtype, path = np.dtype(self.meta["dtype"]), self.path(split)
            empty = self.meta["splits"][split]["tokens"] == 0  # an empty file cannot be mapped
            self._maps[split] = np.zeros(0, dtype) if empty else np.memmap(path, dtype, mode="r")
        return self._maps[split]

    def bytes_per_token(self, split: str) -> float:
        """UTF-8 bytes of text per token (end-of-text ids included), for bits per byte."""
        s = self.meta["splits"][split]
        return s["bytes"] / s["tokens"] if s["tokens"] else float("nan")

    def windows(self, split: str, seq_len: int) -> int:
        """How many windows of seq_len + 1 tokens the split holds (at least one, or an error)."""
        path = self.path(split)
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        n = self.meta["splits"][split]["tokens"]
        count = (n - 1) // seq_len
        if count < 1:
            raise DataError(
                f"{path}: the {split} split has {n} tokens, fewer than one window "
                f"of seq_len + 1 = {seq_len + 1}; use a shorter seq_len or more data"
            )
        return count

    def read_windows(self, split: str, seq_len: int, window_ids) -> np.ndarray:
        """(len(window_ids), seq_len + 1) int32 tokens of the given windows."""
        starts = np.asarray(window_ids, np.int64) * seq_len
        return self.tokens(split)[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def open_dataset(folder: str | Path, *, verify: bool = True) -> TokenDataset:
    """Open a prepared folder. Sizes are always checked against meta.json; with ``verify``
    (the default) every file's sha256 too, and that every id is inside the vocabulary (one
    sequential read of each file)."""
    folder = Path(folder)
    meta = read_meta(folder)
    dtype = np.dtype(meta["dtype"])
    for split in SPLITS:
        entry = meta["splits"][split]
        path = folder / entry["file"]
        if not path.is_file():
            raise DataError(f"{path}: missing (listed in {folder / 'meta.json'})")
        size, expected = path.stat().st_size, entry["tokens"] * dtype.itemsize
        if size != expected:
            raise DataError(
                f"{path}: {size} bytes, but meta.json says {entry['tokens']} {dtype} tokens "
                f"({expected} bytes); the folder is damaged, prepare it again"
            )
        if verify:
            digest, position, value = scan_tokens(path, dtype, meta["vocab_size"])
            if digest != entry["sha256"]:
                raise DataError(
                    f"{path}: sha256 {digest} does not match meta.json's {entry['sha256']}; "
                    "the file changed after it was prepared, prepare it again"
                )
            if position is not None:
                raise DataError(
                    f"{path}: token {position} is {value}, out of range for the vocab of "
                    f"{meta['vocab_size']}"
                )
    if meta["fingerprint"] != (made := fingerprint(meta)):
        raise DataError(
            f"{folder / 'meta.json'}: fingerprint {meta['fingerprint']} is not that of the files "
            f"it lists ({made}); it was edited, prepare the dataset again"
        )
    return TokenDataset(folder, meta)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a strong 64-bit mixing function (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """perm(index) for a pseudo-random permutation of range(n) keyed by (seed, epoch).

    A balanced Feistel network on 2h bits (2**2h >= n) is a bijection of range(2**2h); cycle
    walking (apply it again while the result is >= n) restricts it to a bijection of range(n).
    """
    shape = np.shape(index)
    index = np.asarray(index, np.int64).reshape(-1)
    if n < 1 or (index.size and (index.min() < 0 or index.max() >= n)):
        raise ValueError(f"indices must lie in range({n})")
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    key = f"lmuscale windows {seed} {epoch}".encode()
    keys = np.frombuffer(hashlib.blake2b(key, digest_size=8 * FEISTEL_ROUNDS).digest(), np.uint64)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << np.uint64(half)) | right

    out = encrypt(index.astype(np.uint64))
    while (outside := out >= np.uint64(n)).any():
        out[outside] = encrypt(out[outside])
    return out.astype(np.int64).reshape(shape)


def _local_rows(global_batch: int, process_index: int | None, process_count: int | None) -> slice:
    """This process's rows of the global batch (by default jax's process index and count)."""
    if process_index is None or process_count is None:
        import jax  # only here: preparing and reading data never needs jax otherwise

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} is outside 0..{process_count - 1}")
    if global_batch < 1 or global_batch % process_count:
        raise DataError(
            f"the global batch of {global_batch} sequences does not split evenly over "
            f"{process_count} processes"
        )
    per_process = global_batch // process_count
    return slice(process_index * per_process, (process_index + 1) * per_process)


class TrainBatches:
    """``batches(step)`` is this process's (global_batch / processes, seq_len + 1) int32 rows
    of the global batch at ``step``; it depends only on (seed, step)."""

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        split: str = "train",
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        self.dataset, self.split, self.seq_len, self.seed = dataset, split, seq_len, seed
        self.global_batch = global_batch
        self.n_windows = dataset.windows(split, seq_len)
        self.rows = _local_rows(global_batch, process_index, process_count)

    def window_ids(self, step: int) -> np.ndarray:
        """Window ids of the whole global batch at ``step``, shape (global_batch,)."""
        step = operator.index(step)  # a Python int: no fixed-width overflow below
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        sample = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epoch, position = np.divmod(sample, self.n_windows)
        ids = np.empty_like(sample)
        for e in np.unique(epoch):  # a batch spans at most a few epochs
            where = epoch == e
            ids[where] = permute(position[where], self.n_windows, self.seed, int(e))
        return ids

    def epoch(self, step: int) -> float:
        """Epochs completed before ``step`` (fractional)."""
        return step * self.global_batch / self.n_windows

    def __call__(self, step: int) -> np.ndarray:
        ids = self.window_ids(step)[self.rows]
        return self.dataset.read_windows(self.split, self.seq_len, ids)


@dataclasses.dataclass(frozen=True)
class EvalBatch:
    """This process's rows: ``tokens`` (rows, seq_len + 1) int32, ``valid`` (rows,) bool,
    ``window_ids`` (rows,) (-1 on padding rows)."""

    tokens: np.ndarray
    valid: np.ndarray
    window_ids: np.ndarray


def eval_batches(
    dataset: TokenDataset,
    split: str,
    *,
    seq_len: int,
    global_batch: int,
    process_index: int | None = None,
    process_count: int | None = None,
) -> Iterator[EvalBatch]:
    """Every window of ``split`` exactly once, in order, ``global_batch`` at a time."""
    n_windows = dataset.windows(split, seq_len)
    rows = _local_rows(global_batch, process_index, process_count)
    for first in range(0, n_windows, global_batch):
        ids = (first + np.arange(global_batch, dtype=np.int64))[rows]
        valid = ids < n_windows
        tokens = np.zeros((ids.size, seq_len + 1), np.int32)
        tokens[valid] = dataset.read_windows(split, seq_len, ids[valid])
        yield EvalBatch(tokens, valid, np.where(valid, ids, -1))


def eval_steps(dataset: TokenDataset, split: str, *, seq_len: int, global_batch: int) -> int:
    """How many batches ``eval_batches`` yields."""
    return -(-dataset.windows(split, seq_len) // global_batch)
