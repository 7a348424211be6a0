"""Parquet and Arrow tables: ``parquet PATH_OR_GLOB...`` (what it reads: README, "Data").

A parquet row group is a shard, and so is an Arrow file. Memory does not grow with the file:
parquet pages stream through BUFFER_BYTES and BATCH_ROWS rows are decoded at a time; an Arrow
stream is read a record batch at a time from a plain file (a memory map's pages would count as
resident). A binary column is read as UTF-8 text. In a save_to_disk folder only the Arrow files
``state.json`` lists are the dataset (others there may be a ``map``'s caches).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq

from lmuscale.data.base import (
    TABLE_SUFFIXES,
    BadLine,
    DataError,
    Document,
    Shard,
    Source,
    file_source,
    folder_files,
    read_json_object,
    utf8_error,
)

BATCH_ROWS = 1024  # rows turned into Python strings at a time
BUFFER_BYTES = 1 << 20  # parquet read buffer: pages stream through it, not whole column chunks
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # the end-of-stream marker pyarrow >= 0.15 writes
STATE = "state.json"  # Dataset.save_to_disk
DATASET_DICT = "dataset_dict.json"  # DatasetDict.save_to_disk
_AS_BYTES = {  # the binary type with a string type's layout: a zero-copy view
    pa.string(): pa.binary(),
    pa.large_string(): pa.large_binary(),
}
if hasattr(pa, "string_view"):  # not in the oldest pyarrow this supports
    _AS_BYTES[pa.string_view()] = pa.binary_view()


def _rows(column: pa.Array, name: str, first: int, text_column: str) -> Iterator:
    """Documents (or bad rows) of ``column``, whose first row is row ``first`` of file ``name``."""
    for offset in range(0, len(column), BATCH_ROWS):
        piece = column.slice(offset, BATCH_ROWS)
        try:
            values = piece.to_pylist()
        except UnicodeDecodeError:  # read as bytes, to name each row that is not UTF-8
            if pa.types.is_dictionary(piece.type):
                piece = piece.dictionary_decode()
            values = piece.view(_AS_BYTES[piece.type]).to_pylist()
        for row, value in enumerate(values, start=first + offset):
            where = f"{name}:row {row}"
            if type(value) is str:
                yield Document(value, where)
            elif value is None:
                yield BadLine(where, f"column {json.dumps(text_column)} is null")
            elif isinstance(value, bytes):
                try:
                    yield Document(value.decode("utf-8"), where)
                except UnicodeDecodeError as e:
                    yield BadLine(where, utf8_error(value, e))
            else:
                yield BadLine(
                    where, f"column {json.dumps(text_column)} is {column.type}, not a string"
                )


def _column_index(schema: pa.Schema, path: Path, text_column: str) -> int:
    index = schema.get_field_index(text_column)  # -1 when missing, or named twice
    if schema.names.count(text_column) > 1:
        raise DataError(
            f"{path}: {schema.names.count(text_column)} columns are named "
            f"{json.dumps(text_column)}; cannot tell which holds the text"
        )
    if index < 0:
        raise DataError(
            f"{path}: no column {json.dumps(text_column)} (it has "
            f"{', '.join(map(json.dumps, schema.names)) or 'no columns'}); choose one with "
            "--text-column"
        )
    return index


def _parquet_shards(path: Path, text_column: str) -> Iterator[Shard]:
    """One shard per row group; the file stays open while its shards are drawn."""
    try:
        # Pre-buffering (pyarrow's default) would read a row group's whole column chunk at once.
        table = pq.ParquetFile(path, buffer_size=BUFFER_BYTES, pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a parquet file, or truncated ({e})") from None
    with table:
        _column_index(table.schema_arrow, path, text_column)
        first = 0
        for group in range(table.metadata.num_row_groups):
            yield Shard(
                f"{path}:row_group {group}",
                lambda group=group, first=first: _row_group(table, path, group, first, text_column),
            )
            first += table.metadata.row_group(group).num_rows


def _row_group(
    table: pq.ParquetFile, path: Path, group: int, first: int, text_column: str
) -> Iterator[Document | BadLine]:
    batches = table.iter_batches(
        batch_size=BATCH_ROWS, row_groups=[group], columns=[text_column], use_threads=False
    )
    problem = f"row group {group} is corrupt or truncated"
    return _documents(_batches(batches, path, problem), 0, path, text_column, first)


def _arrow_documents(path: Path, text_column: str) -> Iterator[Document | BadLine]:
    """The rows of an Arrow IPC stream (or file), a record batch at a time."""
    with pa.OSFile(str(path)) as raw:
        schema, batches = _open_arrow(raw, path)
        yield from _documents(batches, _column_index(schema, path, text_column), path, text_column)


def _documents(
    batches: Iterator[pa.RecordBatch], column: int, path: Path, text_column: str, first: int = 0
) -> Iterator[Document | BadLine]:
    """The rows of ``column`` of ``batches``, whose first row is row ``first`` of ``path``."""
    for batch in batches:
        yield from _rows(batch.column(column), str(path), first, text_column)
        first += batch.num_rows
        # pyarrow's default allocator (mimalloc) keeps freed pages unless told to hand them back:
        # resident memory would creep up by 10-20 MB.
        pa.default_memory_pool().release_unused()


def _open_arrow(raw: pa.OSFile, path: Path) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The schema and record batches of an IPC stream or file (told apart by the file's magic)."""
    size = raw.size()
    if size == 0:
        raise DataError(f"{path}: empty file, not an Arrow stream")
    if raw.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC:
        raw.seek(0)
        try:
            reader = pa.ipc.open_file(raw)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: truncated or corrupt Arrow IPC file ({e})") from None
        batches = map(reader.get_batch, range(reader.num_record_batches))
        return reader.schema, _batches(batches, path)
    # A stream cut exactly between two batches reads as a shorter stream without complaint:
    # the marker at its end is what tells them apart.
    raw.seek(max(size - len(ARROW_END), 0))
    if raw.read(len(ARROW_END)) != ARROW_END:
        raise DataError(f"{path}: truncated Arrow stream (no end-of-stream marker), or not Arrow")
    raw.seek(0)
    try:
        reader = pa.ipc.open_stream(raw)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not an Arrow IPC stream ({e})") from None
    return reader.schema, _batches(iter(reader.read_next_batch, None), path)


def _batches(
    batches: Iterator[pa.RecordBatch], path: Path, problem: str = "truncated or corrupt Arrow data"
) -> Iterator[pa.RecordBatch]:
    """``batches``, with a read error as a DataError that says ``problem``."""
    try:
        yield from batches
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: {problem} ({e})") from None


def _saved_dataset(folder: Path) -> list[Path]:
    """The data files of a ``Dataset.save_to_disk`` folder, in the order of ``state.json``."""
    state_path = folder / STATE
    state = read_json_object(state_path)
    listed = state.get("_data_files")
    if (
        not isinstance(listed, list)
        or not listed
        or not all(isinstance(f, dict) and isinstance(f.get("filename"), str) for f in listed)
    ):
        raise DataError(
            f'{state_path}: no "_data_files" list of {{"filename": ...}}; not a folder written '
            "by datasets' save_to_disk"
        )
    if state.get("_indices_data_files"):
        raise DataError(
            f"{state_path}: saved with an indices mapping (an older datasets), so its Arrow "
            "files are not its rows in order; save it again after dataset.flatten_indices()"
        )
    files = [folder / f["filename"] for f in listed]
    for path in files:
        if not path.is_file():
            raise DataError(f"{path}: listed in {state_path} but missing")
    return [path.resolve() for path in files]


def _saved_dataset_dict(folder: Path) -> list[Path]:
    """The data files of every split of a ``DatasetDict.save_to_disk`` folder, in its order."""
    splits = read_json_object(folder / DATASET_DICT).get("splits")
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise DataError(f'{folder / DATASET_DICT}: no "splits" list of split names')
    files = []
    for split in splits:
        if not (folder / split / STATE).is_file():
            raise DataError(f"{folder / split / STATE}: missing (split {split!r} of {folder})")
        files += _saved_dataset(folder / split)
    return files


def _table_files(path: Path) -> tuple[list[Path], list[Path]]:
    """The table files that ``path`` names, and the other files of a folder of parquet files."""
    if path.is_dir():
        if (path / DATASET_DICT).is_file():
            return _saved_dataset_dict(path), []
        if (path / STATE).is_file():
            return _saved_dataset(path), []
        hint = f", and is not a save_to_disk folder (it has no {STATE} or {DATASET_DICT})"
        return folder_files(path, (".parquet",), hint)
    if path.name.endswith(TABLE_SUFFIXES):
        return [path.resolve()], []
    raise DataError(
        f"{path}: parquet reads .parquet and .arrow files and save_to_disk folders, not this"
    )


def _table_shards(path: Path, text_column: str) -> Iterable[Shard]:
    if path.name.endswith(".parquet"):
        return _parquet_shards(path, text_column)
    return [Shard(str(path), partial(_arrow_documents, path, text_column))]


def parquet_source(inputs: list[str], text_column: str) -> Source:
    no_paths = (
        "parquet needs at least one path or glob: .parquet files, folders of them, or a "
        "folder written by datasets' save_to_disk"
    )
    shards_of = partial(_table_shards, text_column=text_column)
    return file_source("parquet", inputs, no_paths, _table_files, shards_of, text_column)
