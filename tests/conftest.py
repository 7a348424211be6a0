"""Fixtures shared by the data tests: small input files written by the test itself."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path

import pytest
import zstandard


class DataFiles:
    """Writes inputs under one folder; every method returns the path it wrote."""

    def __init__(self, root: Path):
        self.root = root

    @staticmethod
    def texts(n: int, seed: int = 0, words: int = 30) -> list[str]:
        """``n`` distinct little documents: English-like words, unicode, code, whitespace runs."""
        rng = random.Random(seed)
        vocab = [
            "the",
            "memory",
            "Legendre",
            "naïve",
            "café",
            "日本",
            "🙂",
            "x = f(y)\n",
            "  ",
            "\t",
        ]
        return [
            f"doc {seed}-{i}: " + " ".join(rng.choice(vocab) for _ in range(rng.randint(1, words)))
            for i in range(n)
        ]

    @staticmethod
    def jsonl_bytes(texts) -> bytes:
        return b"".join(
            json.dumps({"text": t, "meta": {"i": i}}).encode() + b"\n" for i, t in enumerate(texts)
        )

    @staticmethod
    def zst(data: bytes, frames: int = 1) -> bytes:
        """zstd-compress ``data``, as several concatenated frames if asked."""
        step = max(1, -(-len(data) // frames))
        compressor = zstandard.ZstdCompressor()
        return b"".join(compressor.compress(data[i : i + step]) for i in range(0, len(data), step))

    def write(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def jsonl(self, name: str, texts) -> Path:
        return self.write(name, self.jsonl_bytes(texts))

    def jsonl_zst(self, name: str, texts, frames: int = 1) -> Path:
        return self.write(name, self.zst(self.jsonl_bytes(texts), frames))

    def tar(self, name: str, members: dict[str, bytes]) -> Path:
        """A tar of the given members, in order (like openwebtext2.jsonl.zst.tar)."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path, "w") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path


@pytest.fixture
def datafiles(tmp_path) -> DataFiles:
    return DataFiles(tmp_path / "inputs")
