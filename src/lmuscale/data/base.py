"""What ``sources.py`` and ``columnar.py`` share: documents, shards, sources, path helpers."""

from __future__ import annotations

import dataclasses
import glob
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from lmuscale.outcomes import DataError

TABLE_SUFFIXES = (".parquet", ".arrow")  # the parquet source's files (columnar.py)


@dataclasses.dataclass(frozen=True)
class Document:
    text: str
    where: str  # "file:line", for messages


@dataclasses.dataclass(frozen=True)
class BadLine:
    where: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Shard:
    """A unit of work: ``documents()`` must be consumed before the next shard is drawn."""

    name: str
    documents: Callable[[], Iterator[Document | BadLine]]


@dataclasses.dataclass(frozen=True)
class Source:
    """``spec`` as the user wrote it, what it resolved to (files with their sizes in bytes, or
    tfds splits with their example counts), its shards, the text column (None: the JSON
    sources' default), and the files in the folders given that it does not read."""

    spec: str
    files: tuple[tuple[str, int], ...]
    shards: Callable[[], Iterator[Shard]]
    text_column: str | None = None
    skipped: tuple[Path, ...] = ()

    @property
    def nbytes(self) -> int | None:
        """Input size in bytes, where it is known before reading (not for tfds)."""
        return None if self.spec.startswith("tfds:") else sum(size for _, size in self.files)

    def describe(self) -> dict:
        """What a prepared folder records of its source (and a resumed prepare compares)."""
        described = {"spec": self.spec, "files": [list(f) for f in self.files]}
        if self.text_column is not None:  # absent when default: older folders still match
            described["text_column"] = self.text_column
        return described


def utf8_error(data: bytes, error: UnicodeDecodeError) -> str:
    """Where ``data`` stops being UTF-8: its byte, line and column (in bytes, from 1)."""
    line = data.count(b"\n", 0, error.start) + 1
    column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
    return f"not valid UTF-8 (byte 0x{data[error.start]:02x} at line {line}, column {column})"


def existing_paths(path_or_glob: str) -> list[Path]:
    """The paths a path or glob (``**`` included) names; none is an error."""
    if glob.has_magic(path_or_glob):
        matches = sorted(glob.glob(path_or_glob, recursive=True))
        if not matches:
            raise DataError(f"{path_or_glob}: the pattern matches no files")
        return [Path(m) for m in matches]
    path = Path(path_or_glob)
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    return [path]


def folder_files(
    folder: Path, suffixes: tuple[str, ...], hint: str = ""
) -> tuple[list[Path], list[Path]]:
    """The files under ``folder`` (searched recursively, sorted by path) whose names end with one
    of ``suffixes``, resolved; and the others, which the caller reports as skipped. None found is
    an error, its message ending with ``hint``."""
    found, skipped = [], []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        (found if path.name.endswith(suffixes) else skipped).append(path.resolve())
    if not found:
        raise DataError(f"{folder}: the folder holds no {' or '.join(suffixes)} files{hint}")
    return found, skipped


def file_source(
    spec: str, inputs: list[str], no_paths: str, files_of, shards_of, text_column: str | None
) -> Source:
    """The source of the files that ``files_of(path) -> (found, others)`` finds for each path or
    glob in ``inputs`` (each once, in order), with the shards ``shards_of(file)``; ``others`` are
    the files in the folders given that it does not read. No inputs is the error ``no_paths``."""
    if not inputs:
        raise DataError(no_paths)
    files: dict[Path, None] = {}
    skipped: dict[Path, None] = {}
    for given in inputs:
        for path in existing_paths(given):
            found, others = files_of(path)
            files.update(dict.fromkeys(found))
            skipped.update(dict.fromkeys(others))
    return Source(
        spec,
        sized(files),
        lambda: (shard for path in files for shard in shards_of(path)),
        text_column,
        tuple(p for p in skipped if p not in files),
    )


def sized(paths: Iterable[Path]) -> tuple[tuple[str, int], ...]:
    return tuple((str(p), p.stat().st_size) for p in paths)


def read_json_object(path: Path) -> dict:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}: not a JSON object")
    return record
