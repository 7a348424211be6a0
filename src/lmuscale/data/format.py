"""The on-disk format of a prepared folder (README, "Data"), shared by prepare and the loader:
``meta.json`` and ``{train,val,test}.bin``, flat token ids with an end-of-text id after each
document."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from lmuscale.data.base import DataError, read_json_object

FORMAT = "lmuscale-tokens/1"
META = "meta.json"
SPLITS = ("train", "val", "test")
READ_BYTES = 1 << 22


def work_folder(out: Path) -> Path:
    """Where a prepare of ``out`` keeps its unfinished work."""
    return out.with_name(out.name + ".partial")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise DataError(f"vocab size {vocab_size} does not fit in uint32 token files")


def scan_tokens(path: Path, dtype: np.dtype, vocab_size: int) -> tuple[str, int | None, int]:
    """(sha256, position of the first id >= vocab_size or None, that id) of a token file."""
    digest, position, value, offset = hashlib.sha256(), None, -1, 0
    with open(path, "rb") as f:
        while data := f.read(READ_BYTES):
            digest.update(data)
            if position is None:
                ids = np.frombuffer(data, dtype)
                if ids.size and ids.max() >= vocab_size:
                    wrong = np.flatnonzero(ids >= vocab_size)
                    position, value = offset + int(wrong[0]), int(ids[wrong[0]])
                offset += ids.size
    return digest.hexdigest(), position, value


_SPLIT_KEYS = {"file": str, "documents": int, "tokens": int, "bytes": int, "sha256": str}
_REQUIRED = {
    "format": str,
    "source": dict,
    "tokenizer": dict,
    "tokenizer.name": str,
    "tokenizer.vocab_size": int,
    "tokenizer.eot": int,
    "vocab_size": int,
    "dtype": str,
    "splits": dict,
    **{f"splits.{s}.{key}": kind for s in SPLITS for key, kind in _SPLIT_KEYS.items()},
}


def fingerprint(meta: dict) -> str:
    """The dataset's identity, ``sha256:`` and 16 hex digits: a hash of what fixes its token
    files (each split's sha256 and token count), its tokenizer (name, vocabulary, end-of-text id)
    and its source's kind; not where it lies or when it was prepared. The same corpus prepared
    anywhere gets the same fingerprint; another corpus under the same path gets another."""
    tokenizer = {key: meta["tokenizer"][key] for key in ("name", "vocab_size", "eot")}
    splits = {s: [meta["splits"][s]["sha256"], meta["splits"][s]["tokens"]] for s in SPLITS}
    identity = {"source": meta["source"].get("spec"), "tokenizer": tokenizer, "splits": splits}
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def read_meta(folder: Path) -> dict:
    """meta.json of a prepared folder, checked for every key the loader relies on."""
    path = folder / META
    if not path.exists() and work_folder(folder).exists():
        raise DataError(
            f"{folder}: an unfinished prepare (in {work_folder(folder)}); run the same prepare "
            "command again to finish it"
        )
    if not folder.is_dir():
        raise DataError(
            f"{folder}: no such folder; prepare a dataset there first, e.g. "
            f"python -m lmuscale.data prepare shakespeare --out {folder}"
        )
    if not path.exists():
        raise DataError(f"{folder}: not a prepared dataset (no {META})")
    meta = read_json_object(path)
    for dotted, kind in _REQUIRED.items():
        value = meta
        for key in dotted.split("."):
            if not isinstance(value, dict) or key not in value:
                raise DataError(f"{path}: missing key {dotted!r}")
            value = value[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise DataError(f"{path}: {dotted} = {value!r} is not a {kind.__name__}")
    if meta["format"] != FORMAT:
        raise DataError(f"{path}: format {meta['format']!r}, expected {FORMAT!r}")
    vocab = meta["vocab_size"]
    if meta["tokenizer"]["vocab_size"] != vocab or not 0 <= meta["tokenizer"]["eot"] < vocab:
        raise DataError(f"{path}: tokenizer {meta['tokenizer']} disagrees with vocab_size {vocab}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{path}: dtype {meta['dtype']!r} is not uint16 or uint32")
    if vocab < 1 or vocab - 1 > np.iinfo(meta["dtype"]).max:
        raise DataError(f"{path}: a vocab of {vocab} does not fit in {meta['dtype']} token ids")
    meta.setdefault("fingerprint", fingerprint(meta))  # prepared before fingerprints: made here
    return meta
