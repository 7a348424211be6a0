"""Permuted sequential MNIST: each 28 x 28 image as 784 pixels in one fixed, seeded order.

``data.path`` is a local MNIST copy: LeCun's four idx files (optionally ``.gz``) or a
TensorFlow Datasets data_dir with ``mnist`` prepared. The last ``data.val`` training images
validate; pixels are scaled to [0, 1]. The permutation is not the paper's (Chandar et al. 2019),
so accuracies compare in distribution, not digit for digit.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from lmuscale.outcomes import ConfigError
from lmuscale.tasks.base import Split, Splits, Task, TaskDataError

PIXELS = 784
IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# idx magic numbers: 0x08 = unsigned bytes, then the number of dimensions.
IDX_MAGIC = {1: 0x00000801, 3: 0x00000803}
MISSING = (
    "psMNIST needs a local copy of MNIST, and none was found at {path!r}; give "
    f"--config.data.path=DIR: a folder of the four idx files {', '.join(IDX_FILES.values())} "
    "(optionally .gz), or a TensorFlow Datasets data_dir with mnist prepared (pip install "
    "tensorflow-datasets). lmuscale never downloads data."
)


def read_idx(path: Path, dims: int) -> np.ndarray:
    """One idx file (optionally gzipped) as a uint8 array; errors name the file."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as error:
        raise TaskDataError(f"{path}: cannot read ({error})") from None
    magic = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    if magic != IDX_MAGIC[dims]:
        raise TaskDataError(
            f"{path}: not an idx file of {dims}-d unsigned bytes (magic {magic!r}, "
            f"expected {IDX_MAGIC[dims]:#010x})"
        )
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    body = np.frombuffer(raw, np.uint8, offset=4 + 4 * dims)
    if body.size != np.prod(shape):
        raise TaskDataError(f"{path}: header says {shape} but holds {body.size} bytes of data")
    return body.reshape(shape)


def _from_idx(folder: Path) -> dict[str, np.ndarray] | None:
    paths = {
        key: next((p for p in (folder / stem, folder / f"{stem}.gz") if p.is_file()), None)
        for key, stem in IDX_FILES.items()
    }
    if not any(paths.values()):
        return None
    missing = [IDX_FILES[key] for key, path in paths.items() if path is None]
    if missing:
        raise TaskDataError(f"{folder}: has some MNIST idx files but not {', '.join(missing)}")
    return {key: read_idx(path, 3 if "images" in key else 1) for key, path in paths.items()}


def _from_tfds(folder: Path) -> dict[str, np.ndarray] | None:
    if not (folder / "mnist").is_dir():
        return None
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise TaskDataError(
            f"{folder}/mnist looks like a TensorFlow Datasets copy, but tensorflow-datasets is "
            "not installed (pip install tensorflow-datasets), or give the idx files instead"
        ) from None
    out = {}
    for split in ("train", "test"):
        try:
            batch = tfds.as_numpy(
                tfds.load("mnist", split=split, data_dir=str(folder), download=False, batch_size=-1)
            )
        except Exception as error:  # tfds raises its own types for a missing or old copy
            raise TaskDataError(
                f"{folder}/mnist: not a prepared TFDS mnist ({type(error).__name__}: {error})"
            ) from None
        out[f"{split}_images"], out[f"{split}_labels"] = batch["image"][..., 0], batch["label"]
    return out


def load(data: ConfigDict) -> Splits:
    folder = Path(data.path)
    arrays = (_from_idx(folder) or _from_tfds(folder)) if folder.is_dir() else None
    if arrays is None:
        raise TaskDataError(MISSING.format(path=data.path))
    train_x, train_y = arrays["train_images"], arrays["train_labels"]
    test_x, test_y = arrays["test_images"], arrays["test_labels"]
    for name, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
        if x.shape[1:] != (28, 28) or len(x) != len(y):
            raise TaskDataError(
                f"{folder}: {name} images have shape {x.shape} and labels {y.shape}; "
                "expected (N, 28, 28) images and N labels"
            )
    if data.permutation_seed < 0:
        raise ConfigError(f"data.permutation_seed must be >= 0, got {data.permutation_seed}")
    if not 0 < data.val < len(train_x):
        raise ConfigError(f"data.val must be in 1..{len(train_x) - 1}, got {data.val}")
    order = np.random.default_rng(data.permutation_seed).permutation(PIXELS)

    def split(x, y) -> Split:
        pixels = x.reshape(len(x), PIXELS)[:, order].astype(np.float32) / 255.0
        return Split(pixels[..., None], y.astype(np.int32))

    cut = len(train_x) - data.val
    return Splits(
        split(train_x[:cut], train_y[:cut]),
        split(train_x[cut:], train_y[cut:]),
        split(test_x, test_y),
        source=f"MNIST from {folder}: {cut}/{data.val}/{len(test_x)} images, permutation seed "
        f"{data.permutation_seed}",
    )


TASK = Task(
    name="psmnist",
    loss="softmax",
    metric="accuracy",
    outputs=10,
    sequence_output=False,
    data={"path": "data/mnist", "val": 10_000, "permutation_seed": 0},
    load=load,
    paper={"LSTM": 89.86, "LMU": 97.15, "HiPPO-LegS": 98.3, "parallel LMU": 98.49},
)
