"""IMDB sentiment (Maas et al. 2011): 25k training and 25k test reviews, positive or negative.

``data.path`` is a local copy: Keras's ``imdb.npz`` (word ranks, the set the paper used) or the
original ``aclImdb`` folder (lower-case words ranked by frequency in the training reviews).
Both become Keras's encoding (``index_from=3``, 0 pads, 1 starts, 2 is out of ``vocab``), and
reviews keep their last ``maxlen`` tokens, left-padded. ``data.val`` training reviews, chosen
by ``data.seed``, are held out to pick the epoch.
"""

from __future__ import annotations

import collections
import pickle
import re
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from lmuscale.outcomes import ConfigError
from lmuscale.tasks.base import Split, Splits, Task, TaskDataError

START, OOV, INDEX_FROM = 1, 2, 3
WORD = re.compile(r"[a-z0-9']+")
MISSING = (
    "IMDB needs a local copy, and none was found at {path!r}; give --config.data.path=PATH: "
    "Keras's imdb.npz (x_train, y_train, x_test, y_test) or the aclImdb folder of the "
    "original release (train/pos, train/neg, test/pos, test/neg). lmuscale never downloads data."
)
# What np.load raises on a damaged .npz.
NPZ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError, zlib.error)


def encode(ranks, vocab: int) -> list[int]:
    """Word ranks (1 = most frequent) -> tokens: START, then rank + 3, or OOV from vocab up."""
    return [START] + [r + INDEX_FROM if r + INDEX_FROM < vocab else OOV for r in ranks]


def pad(reviews: list[list[int]], maxlen: int) -> np.ndarray:
    """The last ``maxlen`` tokens of each review, left-padded with 0: ``tokens_BxT`` int32."""
    out = np.zeros((len(reviews), maxlen), np.int32)
    for i, review in enumerate(reviews):
        kept = review[-maxlen:]
        out[i, maxlen - len(kept) :] = kept
    return out


def _from_npz(path: Path):
    # An .npz is a zip; anything else np.load would try to unpickle (allow_pickle is needed
    # for the ragged review lists), so refuse it before loading.
    if not zipfile.is_zipfile(path):
        raise TaskDataError(f"{path}: not an .npz (zip) file")
    try:
        with np.load(path, allow_pickle=True) as f:
            missing = {"x_train", "y_train", "x_test", "y_test"} - set(f.files)
            if missing:
                raise TaskDataError(f"{path}: no {', '.join(sorted(missing))} (has {f.files})")
            parts = [
                (list(map(list, f[f"x_{s}"])), np.asarray(f[f"y_{s}"])) for s in ("train", "test")
            ]
    except NPZ_ERRORS as error:
        if isinstance(error, TaskDataError):
            raise
        raise TaskDataError(
            f"{path}: not a readable .npz ({type(error).__name__}: {error})"
        ) from None
    for (x, y), name in zip(parts, ("train", "test"), strict=True):
        if len(x) != len(y):
            raise TaskDataError(f"{path}: x_{name} has {len(x)} reviews but y_{name} {len(y)}")
    return parts


def words(text: str) -> list[str]:
    return WORD.findall(text.replace("<br />", " ").lower())


def _from_folder(folder: Path):
    texts = {}
    for split in ("train", "test"):
        reviews, labels = [], []
        for label, name in ((0, "neg"), (1, "pos")):
            files = sorted((folder / split / name).glob("*.txt"))
            if not files:
                raise TaskDataError(f"{folder / split / name}: no review .txt files")
            reviews += [words(f.read_text(encoding="utf-8", errors="replace")) for f in files]
            labels += [label] * len(files)
        texts[split] = (reviews, np.asarray(labels))
    counts = collections.Counter(w for review in texts["train"][0] for w in review)
    rank = {
        w: r for r, (w, _) in enumerate(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])), 1)
    }
    unseen = sys.maxsize  # a test word never seen in training: always out of vocabulary
    return [
        ([[rank.get(w, unseen) for w in review] for review in reviews], labels)
        for reviews, labels in (texts["train"], texts["test"])
    ]


def load(data: ConfigDict) -> Splits:
    path = Path(data.path)
    if path.is_file() and path.suffix == ".npz":
        (train_x, train_y), (test_x, test_y) = _from_npz(path)
    elif path.is_dir() and (path / "train").is_dir():
        (train_x, train_y), (test_x, test_y) = _from_folder(path)
    else:
        raise TaskDataError(MISSING.format(path=data.path))
    if data.maxlen <= 0 or data.vocab <= INDEX_FROM or data.seed < 0:
        raise ConfigError(
            f"data.maxlen must be > 0, data.vocab > {INDEX_FROM} and data.seed >= 0; got "
            f"{data.maxlen}, {data.vocab}, {data.seed}"
        )
    if not 0 < data.val < len(train_x):
        raise ConfigError(f"data.val must be in 1..{len(train_x) - 1}, got {data.val}")
    for name, y in (("train", train_y), ("test", test_y)):
        if not set(np.unique(y)) <= {0, 1}:
            raise TaskDataError(f"{path}: {name} labels must be 0 or 1, got {np.unique(y)[:5]}")

    def split(reviews, labels) -> Split:
        tokens = pad([encode(r, data.vocab) for r in reviews], data.maxlen)
        return Split(tokens, np.asarray(labels, np.float32))

    held = np.random.default_rng(data.seed).permutation(len(train_x))
    val, train = held[: data.val], held[data.val :]
    return Splits(
        split([train_x[i] for i in train], train_y[train]),
        split([train_x[i] for i in val], train_y[val]),
        split(test_x, test_y),
        source=f"IMDB from {path}: {len(train)}/{len(val)}/{len(test_x)} reviews, vocabulary "
        f"{data.vocab}, last {data.maxlen} tokens",
    )


TASK = Task(
    name="imdb",
    loss="sigmoid",
    metric="accuracy",
    outputs=1,
    sequence_output=False,
    data={"path": "data/imdb.npz", "vocab": 20_000, "maxlen": 500, "val": 2_500, "seed": 0},
    load=load,
    paper={"LSTM": 87.29, "parallel LMU (DN only, GloVe)": 89.10},
)
