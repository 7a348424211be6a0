"""Parquet and Arrow: rows in order across row groups, files and save_to_disk folders; every bad
row and bad file named; and prepare's guarantees for them (the token files of the same documents
as JSON lines, for any number of workers; resume at a row group; memory flat in the file size)."""

from __future__ import annotations

import json
import random
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prepared import crash_at_first_record, peak_rss_mb, run, split_documents

from lmuscale.data import prepare as prep
from lmuscale.data import tokenizer as tok
from lmuscale.data.__main__ import main
from lmuscale.data.format import SPLITS
from lmuscale.data.sources import BadLine, DataError, Document, open_source
from lmuscale.outcomes import Exit


def items(inputs, text_column="text"):
    source = open_source("parquet", [str(p) for p in inputs], text_column)
    return [item for shard in source.shards() for item in shard.documents()]


def texts(inputs, text_column="text"):
    found = items(inputs, text_column)
    assert all(isinstance(item, Document) for item in found), found[:3]
    return [item.text for item in found]


def test_parquet_rows_come_out_in_order_across_row_groups_and_files(datafiles):
    a, b = datafiles.texts(50, seed=1), datafiles.texts(23, seed=2)
    columns = {"id": list(range(23)), "text": b, "url": [f"https://{i}" for i in range(23)]}
    second = datafiles.parquet("fineweb/CC-2024/001.parquet", columns, row_group_size=10)
    first = datafiles.parquet("fineweb/CC-2023/000.parquet", a, row_group_size=7)
    pattern = str(datafiles.root / "fineweb/**/*.parquet")
    source = open_source("parquet", [pattern])
    assert [s.name for s in source.shards()] == [
        *(f"{first.resolve()}:row_group {g}" for g in range(8)),
        *(f"{second.resolve()}:row_group {g}" for g in range(3)),
    ]
    assert source.describe() == {
        "spec": "parquet",
        "files": [[str(p.resolve()), p.stat().st_size] for p in (first, second)],
        "text_column": "text",
    }
    found = items([pattern])
    assert [d.text for d in found] == a + b
    # Rows are counted through the whole file, across its row groups.
    assert found[10].where == f"{first.resolve()}:row 10"
    assert found[-1].where == f"{second.resolve()}:row 22"
    # A folder gives its parquet files sorted by path, as the glob does.
    assert texts([datafiles.root / "fineweb"]) == a + b


def test_a_save_to_disk_folder_is_read_in_the_order_state_json_lists(datafiles):
    docs = datafiles.texts(2500, seed=3)  # two files of 1,250 rows: two record batches each
    folder = datafiles.saved_dataset("saved", docs, files=2)
    assert texts([folder]) == docs
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"].reverse()  # the listed order is the dataset's, not the names' order
    (folder / "state.json").write_text(json.dumps(state))
    datafiles.arrow_stream("saved/cache-0123abcd.arrow", ["a map() cache, not a row"])
    found = items([folder])
    assert [d.text for d in found] == docs[1250:] + docs[:1250]
    files = [(folder / f"data-0000{i}-of-00002.arrow").resolve() for i in range(2)]
    assert found[0].where == f"{files[1]}:row 0"
    assert found[1250 + 1100].where == f"{files[0]}:row 1100"  # in its second record batch
    assert [s.name for s in open_source("parquet", [str(folder)]).shards()] == [
        str(files[1]),
        str(files[0]),
    ]


def test_a_dataset_dict_folder_and_arrow_files(datafiles):
    train, test = datafiles.texts(30, seed=4), datafiles.texts(20, seed=5)
    datafiles.saved_dataset("dict/train", train, files=1)
    datafiles.saved_dataset("dict/test", test, files=2)
    datafiles.write("dict/dataset_dict.json", json.dumps({"splits": ["train", "test"]}).encode())
    assert texts([datafiles.root / "dict"]) == train + test  # the listed order of the splits
    # .arrow files named directly: an IPC stream (as datasets writes) and an IPC file.
    stream = datafiles.arrow_stream("one.arrow", train, batch_rows=7)
    table = pa.table({"text": test})
    with pa.ipc.new_file(str(datafiles.root / "two.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=6):
            writer.write_batch(batch)
    assert texts([stream, datafiles.root / "two.arrow"]) == train + test


def test_bad_rows_are_named_by_file_and_row(datafiles):
    offsets = pa.array([0, 2, 6, 8], pa.int32()).buffers()[1]
    not_utf8 = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(b"okcaf\xe9ok")])
    columns = {
        "text": ["first", None, "third"],
        "n": [1, 2, 3],
        "raw": pa.array([b"bytes as text", b"caf\xe9", b"ok"]),  # BYTE_ARRAY not marked UTF-8
        "latin": not_utf8,
    }
    path = datafiles.parquet("rows.parquet", columns, row_group_size=2).resolve()
    assert items([path]) == [
        Document("first", f"{path}:row 0"),
        BadLine(f"{path}:row 1", 'column "text" is null'),
        Document("third", f"{path}:row 2"),  # the first row of row group 1
    ]
    assert items([path], "n") == [
        BadLine(f"{path}:row {i}", 'column "n" is int64, not a string') for i in range(3)
    ]
    latin = BadLine(f"{path}:row 1", "not valid UTF-8 (byte 0xe9 at line 1, column 4)")
    assert items([path], "raw") == [
        Document("bytes as text", f"{path}:row 0"),
        latin,
        Document("ok", f"{path}:row 2"),
    ]
    assert items([path], "latin") == [
        Document("ok", f"{path}:row 0"),
        latin,
        Document("ok", f"{path}:row 2"),
    ]
    with pytest.raises(
        DataError,
        match=re.escape(f'{path}: no column "body" (it has "text", "n", "raw", "latin")'),
    ):
        items([path], "body")
    twice = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"])
    pq.write_table(twice, datafiles.root / "twice.parquet")
    with pytest.raises(DataError, match='2 columns are named "text"; cannot tell which'):
        items([datafiles.root / "twice.parquet"])
    arrow = datafiles.arrow_stream("rows.arrow", {"n": [1, 2], "text": ["a", None]}).resolve()
    assert items([arrow])[1] == BadLine(f"{arrow}:row 1", 'column "text" is null')
    with pytest.raises(
        DataError, match=re.escape(f'{arrow}: no column "body" (it has "n", "text")')
    ):
        items([arrow], "body")


def test_truncated_and_corrupt_files_are_named(datafiles):
    whole = datafiles.parquet("whole.parquet", datafiles.texts(300), row_group_size=100)
    data = whole.read_bytes()
    cut = datafiles.write("cut.parquet", data[: len(data) // 2]).resolve()
    with pytest.raises(DataError, match=re.escape(f"{cut}: not a parquet file, or truncated")):
        items([cut])
    chunk = pq.ParquetFile(whole).metadata.row_group(1).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    damaged = bytearray(data)
    for i in range(start, start + chunk.total_compressed_size):
        damaged[i] ^= 0x55
    damaged = datafiles.write("damaged.parquet", bytes(damaged)).resolve()
    found = []
    with pytest.raises(DataError, match=re.escape(f"{damaged}: row group 1 is corrupt")):
        for shard in open_source("parquet", [str(damaged)]).shards():
            found += shard.documents()
    assert len(found) == 100  # row group 0 was whole

    stream = datafiles.arrow_stream("whole.arrow", datafiles.texts(300), batch_rows=100)
    data = stream.read_bytes()
    end_of_batches = len(data) - 8  # the end-of-stream marker is 8 bytes
    for length in (len(data) // 2, end_of_batches):  # inside a batch, and between two
        cut = datafiles.write(f"cut-{length}.arrow", data[:length]).resolve()
        with pytest.raises(DataError, match=re.escape(f"{cut}: truncated Arrow stream")):
            items([cut])
    fake = datafiles.write("fake.parquet", b'{"text": "JSON, not parquet"}\n').resolve()
    with pytest.raises(DataError, match=re.escape(f"{fake}: not a parquet file")):
        items([fake])

    folder = datafiles.saved_dataset("saved", datafiles.texts(10), files=2)
    (folder / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(
        DataError,
        match=re.escape(f"{folder / 'data-00001-of-00002.arrow'}: listed in {folder}/state.json"),
    ):
        open_source("parquet", [str(folder)])
    (datafiles.root / "nothing").mkdir()
    with pytest.raises(DataError, match=re.escape("holds no .parquet files, and is not a save")):
        open_source("parquet", [str(datafiles.root / "nothing")])


def test_prepare_parquet_gives_the_token_files_of_the_same_json_lines(
    datafiles, tmp_path, monkeypatch
):
    """The same documents as JSON lines, parquet (1 and 2 workers) and a save_to_disk folder:
    byte-identical token files, each document in the split its hash says, in order."""
    monkeypatch.setattr(prep, "CHUNK_CHARS", 2000)  # many tasks per row group, in flight together
    a, b = datafiles.texts(300, seed=1), datafiles.texts(200, seed=2)
    jsonl = run(
        "text", [datafiles.jsonl("a.jsonl", a), datafiles.jsonl("b.jsonl", b)], tmp_path / "jsonl"
    )
    tables = [
        datafiles.parquet("p/a.parquet", a, row_group_size=64),
        datafiles.parquet("p/b.parquet", b, row_group_size=64),
    ]
    one = run("parquet", tables, tmp_path / "one", workers=1)
    two = run("parquet", tables, tmp_path / "two", workers=2)
    saved = run("parquet", [datafiles.saved_dataset("saved", a + b, files=3)], tmp_path / "saved")
    for meta in (one, two, saved):
        assert meta["splits"] == jsonl["splits"]  # counts, and the sha256 of each file
    for split in SPLITS:
        data = (tmp_path / "one" / f"{split}.bin").read_bytes()
        assert data == (tmp_path / "two" / f"{split}.bin").read_bytes()
    assert (one["shards"], two["prepared"]["workers"], saved["shards"]) == (5 + 4, 2, 3)
    want = {s: [t for t in a + b if prep.split_of(t.encode(), 0) == s] for s in SPLITS}
    assert all(want.values())
    assert split_documents(tmp_path / "two", tok.byte_tokenizer()) == want


def test_an_interrupted_prepare_resumes_at_the_next_row_group(datafiles, tmp_path, monkeypatch):
    path = datafiles.parquet("big.parquet", datafiles.texts(400, seed=8), row_group_size=50)
    reference = run("parquet", [path], tmp_path / "reference")
    undo = crash_at_first_record(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run("parquet", [path], tmp_path / "out")
    undo()
    progress = json.loads((tmp_path / "out.partial" / "progress.json").read_text())
    assert progress["shards"] == 1 and progress["last_shard"] == f"{path.resolve()}:row_group 0"
    assert sum(progress["documents"].values()) == 50
    resumed = run("parquet", [path], tmp_path / "out")
    assert resumed["splits"] == reference["splits"]  # no row read twice, none left out
    assert resumed["shards"] == 8


def test_text_column_and_bad_rows_from_the_command_line(datafiles, tmp_path, capsys):
    docs = datafiles.texts(400, seed=9)
    columns = {"id": list(range(401)), "body": [*docs[:100], None, *docs[100:]]}
    path = datafiles.parquet("rows.parquet", columns, row_group_size=64).resolve()
    command = ["prepare", "parquet", str(path), "--tokenizer", "bytes", "--workers", "0"]
    command.append("--quiet")
    assert main([*command, "--out", str(tmp_path / "a")]) == Exit.DATA
    assert capsys.readouterr().err == (
        f'error: {path}: no column "text" (it has "id", "body"); choose one with --text-column\n'
    )
    assert main([*command, "--text-column", "body", "--out", str(tmp_path / "b")]) == Exit.DATA
    assert capsys.readouterr().err == (
        f'error: {path}:row 100: column "body" is null (allow skipping with --max-bad-lines N)\n'
    )
    skip = ["--text-column", "body", "--max-bad-lines", "1", "--out", str(tmp_path / "c")]
    assert main([*command, *skip]) == 0
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert meta["bad_lines"]["examples"] == [f'{path}:row 100: column "body" is null']
    assert sum(s["documents"] for s in meta["splits"].values()) == 400
    assert meta["source"]["text_column"] == "body"


def test_a_folder_of_parquet_says_which_of_its_other_files_it_skipped(datafiles, tmp_path, capsys):
    """``prepare parquet DIR`` reads DIR's .parquet files only; the .arrow (read when named),
    .jsonl and .txt files beside them are named on stderr, not passed over in silence."""
    docs = datafiles.texts(400, seed=9)
    datafiles.parquet("mixed/a.parquet", docs[:300], row_group_size=64)
    datafiles.parquet("mixed/sub/b.parquet", docs[300:], row_group_size=64)
    others = [
        datafiles.arrow_stream("mixed/c.arrow", ["not read"]),
        datafiles.jsonl("mixed/d.jsonl", ["not read"]),
        datafiles.write("mixed/sub/e.txt", b"not read"),
        datafiles.write("mixed/sub/f.txt", b"not read either"),
    ]
    folder = datafiles.root / "mixed"
    command = ["prepare", "parquet", str(folder), "--tokenizer", "bytes", "--workers", "0"]
    assert main([*command, "--quiet", "--out", str(tmp_path / "out")]) == 0
    shown = ", ".join(str(p.resolve()) for p in others[:3])
    assert capsys.readouterr().err == (
        "note: parquet skipped 4 files in the folders given that it does not read "
        f"(1 .arrow, 1 .jsonl, 2 .txt): {shown}, ...\n"
    )
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert sum(s["documents"] for s in meta["splits"].values()) == 400
    # A file named as well as found in a folder is read, not reported; nothing else is said.
    assert texts([folder, others[0]]) == [*docs, "not read"]
    assert open_source("parquet", [str(folder), str(others[0])]).skipped == tuple(
        p.resolve() for p in others[1:]
    )
    assert open_source("parquet", [str(datafiles.root / "mixed/a.parquet")]).skipped == ()


@pytest.mark.parametrize("form", ["parquet", "save_to_disk"])
def test_memory_does_not_grow_with_the_file(datafiles, tmp_path, form):
    """Peak RSS of a prepare of a 10x larger table is within a few MB of the small one's."""

    def table(n_docs: int, name: str):
        rng = random.Random(n_docs)  # hex digits: text that compresses only about 2x
        docs = [f"doc {i}: {rng.randbytes(650).hex()}" for i in range(n_docs)]
        if form == "parquet":
            # Two row groups: the large one's are 13 MB of text each, streamed a page at a time.
            return datafiles.parquet(f"{name}.parquet", docs, row_group_size=n_docs // 2)
        return datafiles.saved_dataset(name, docs, files=1)

    small, small_mb = peak_rss_mb("parquet", [table(2000, "small")], tmp_path / "small")
    large, large_mb = peak_rss_mb("parquet", [table(20000, "large")], tmp_path / "large")
    assert large_mb > 9 * small_mb and large_mb > 15
    assert large - small < 10, (small, large, small_mb, large_mb)
    print(
        f"peak RSS {small:.1f} MB ({small_mb:.1f} MB of text), {large:.1f} MB ({large_mb:.1f} MB)"
    )
