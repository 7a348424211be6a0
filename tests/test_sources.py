"""Sources: every input form yields its documents in order; every bad input is named."""

from __future__ import annotations

import ast
import random
import re
import sys
import types
from pathlib import Path

import pytest

from lmuscale.data import sources
from lmuscale.data.sources import BadLine, DataError, Document, open_source


def items(spec, inputs, text_column="text"):
    source = open_source(spec, inputs, text_column)
    return [item for shard in source.shards() for item in shard.documents()]


def texts(spec, inputs, text_column="text"):
    found = items(spec, inputs, text_column)
    assert all(isinstance(item, Document) for item in found), found
    return [item.text for item in found]


def test_owt2_archive_streams_every_member_in_order(datafiles):
    a, b = datafiles.texts(50, seed=1), datafiles.texts(70, seed=2)
    archive = datafiles.tar(
        "owt2.jsonl.zst.tar",
        {
            "2019-01.jsonl.zst": datafiles.zst(datafiles.jsonl_bytes(a)),
            "README": b"not a data member",
            "2019-02.jsonl.zst": datafiles.zst(datafiles.jsonl_bytes(b), frames=3),
        },
    )
    shards = [s.name for s in open_source("owt2", [str(archive)]).shards()]
    assert shards == [
        f"{archive.resolve()}/2019-01.jsonl.zst",
        f"{archive.resolve()}/2019-02.jsonl.zst",
    ]
    found = items("owt2", [str(archive)])
    assert [d.text for d in found] == a + b
    assert found[0].where.endswith("owt2.jsonl.zst.tar/2019-01.jsonl.zst:1")
    assert found[-1].where.endswith("2019-02.jsonl.zst:70")


def test_owt2_folder_and_single_files(datafiles):
    a, b = datafiles.texts(5, seed=3), datafiles.texts(6, seed=4)
    datafiles.jsonl_zst("release/2020-02.jsonl.zst", b)
    datafiles.jsonl_zst("release/2020-01.jsonl.zst", a)
    notes = datafiles.write("release/notes.txt", b"ignored")
    assert texts("owt2", [str(datafiles.root / "release")]) == a + b  # sorted by name
    # prepare names the files it skipped (test_columnar checks the line it prints)
    assert open_source("owt2", [str(datafiles.root / "release")]).skipped == (notes.resolve(),)
    single = datafiles.root / "release/2020-02.jsonl.zst"
    assert texts("owt2", [str(single)]) == b


def test_text_source_reads_txt_jsonl_and_globs(datafiles):
    datafiles.write("t/b.txt", "second file\nwith two lines ünïcode\n".encode())
    datafiles.write("t/a.txt", b"first file")
    datafiles.jsonl("t/c.jsonl", ["one", "two"])
    datafiles.jsonl_zst("t/d.jsonl.zst", ["three"])
    found = texts(
        "text",
        [
            str(datafiles.root / "t/*.txt"),
            str(datafiles.root / "t/c.jsonl"),
            str(datafiles.root / "t/d.jsonl.zst"),
        ],
    )
    assert found == ["first file", "second file\nwith two lines ünïcode\n", "one", "two", "three"]
    # A file named twice (here by a glob and by name) is read once.
    assert texts("text", [str(datafiles.root / "t/a.txt"), str(datafiles.root / "t/*.txt")]) == [
        "first file",
        "second file\nwith two lines ünïcode\n",
    ]


def test_jsonl_gz_is_streamed_and_a_truncated_one_is_named(datafiles):
    docs = datafiles.texts(3000, seed=11)
    path = datafiles.jsonl_gz("t/a.jsonl.gz", docs, members=3)  # as `cat a.gz b.gz` makes
    assert texts("text", [str(datafiles.root / "t/*.jsonl.gz")]) == docs
    pieces = [len(c) for c in sources._gzip_chunks(path)]
    assert sum(pieces) == len(datafiles.jsonl_bytes(docs)) and max(pieces) <= sources.READ_BYTES
    whole = path.read_bytes()
    for name, data, error in [
        ("cut.jsonl.gz", whole[: len(whole) // 2], "truncated gzip stream"),
        ("end.jsonl.gz", whole[:-4], "truncated gzip stream"),  # no length in its trailer
        ("plain.jsonl.gz", datafiles.jsonl_bytes(["not gzip"]), "not a gzip file"),
        ("empty.jsonl.gz", b"", "empty file, not a gzip stream"),
    ]:
        bad = datafiles.write(name, data).resolve()
        with pytest.raises(DataError, match=re.escape(f"{bad}: {error}")):
            items("text", [str(bad)])


def test_text_column_names_the_json_field(datafiles):
    path = datafiles.write("c.jsonl", b'{"content": "one", "text": "no"}\n{"text": "two"}\n')
    where = f"{path.resolve()}:"
    assert items("text", [str(path)], "content") == [
        Document("one", where + "1"),
        BadLine(where + "2", 'not a JSON object with a "content" field'),
    ]
    assert open_source("owt2", [str(path)], "content").describe()["text_column"] == "content"
    # The default is not recorded: folders prepared before the option still match their plan.
    assert "text_column" not in open_source("text", [str(path)]).describe()
    with pytest.raises(DataError, match="shakespeare has no columns to choose from"):
        open_source("shakespeare", [], "content")


def test_blank_lines_are_not_documents(datafiles):
    path = datafiles.write("blank.jsonl", b'{"text": "a"}\n\n   \n{"text": "b"}\n')
    found = items("text", [str(path)])
    assert [d.text for d in found] == ["a", "b"]
    assert found[1].where == f"{path.resolve()}:4"


def test_an_empty_text_file_is_no_document(datafiles):
    empty = datafiles.write("empty.txt", b"")
    blank = datafiles.write("blank.txt", b"\n")  # a line break is text, like any other
    assert texts("text", [str(empty), str(blank)]) == ["\n"]


def test_shakespeare_is_38_plays_of_whole_scenes():
    source = open_source("shakespeare")
    plays = list(source.shards())
    assert len(plays) == 38 == len(source.files)
    scenes = 0
    for play in plays:
        docs = list(play.documents())
        scenes += len(docs)
        lines = Path(play.name).read_text(encoding="utf-8").splitlines()
        # Every non-blank line of the play is in exactly one document, in order.
        kept = [line for doc in docs for line in doc.text.split("\n") if line.strip()]
        assert kept == [line.rstrip() for line in lines if line.strip()], play.name
        for doc in docs:  # an act heading goes with the scene after it, never before
            assert not doc.text.rstrip().split("\n")[-1].startswith("#"), doc.where
        for doc in docs[1:]:  # each document begins at a heading: an act or the scene itself
            assert doc.text.startswith("#"), doc.where
            first = int(doc.where.rsplit(":", 1)[1])
            assert lines[first - 1].rstrip() == doc.text.split("\n")[0]
        titled = [
            d
            for d in docs
            if re.search(r"^#+\s*(SCENE|PROLOGUE|EPILOGUE|INTERMISSION)", d.text, re.M | re.I)
        ]
        assert len(titled) == len(docs), play.name
    assert 760 <= scenes <= 800  # "about 775" scenes (the issue); the headings give 783


# --- bad input ----------------------------------------------------------------------------


def test_missing_paths_and_empty_globs_are_named(tmp_path):
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}/nope.jsonl.zst: no such file")):
        open_source("owt2", [str(tmp_path / "nope.jsonl.zst")])
    with pytest.raises(DataError, match=r"\*\.txt: the pattern matches no files"):
        open_source("text", [str(tmp_path / "*.txt")])
    with pytest.raises(DataError, match="owt2 needs at least one path"):
        open_source("owt2", [])
    with pytest.raises(DataError, match="unknown source 'owt3'"):
        open_source("owt3", [])


def test_wrong_file_kinds_are_named(datafiles):
    csv = datafiles.write("x.csv", b"a,b\n")
    with pytest.raises(DataError, match=re.escape(f"{csv}: text reads")):
        open_source("text", [str(csv)])
    table = datafiles.write("x.parquet", b"PAR1")
    with pytest.raises(DataError, match=re.escape("not this (prepare parquet reads those)")):
        open_source("text", [str(table)])
    empty = datafiles.root / "empty"
    empty.mkdir(parents=True)
    with pytest.raises(DataError, match=re.escape(f"{empty}: the folder holds no")):
        open_source("owt2", [str(empty)])


def test_a_file_that_is_not_zstd_is_named(datafiles):
    fake = datafiles.write("fake.jsonl.zst", datafiles.jsonl_bytes(["plain text, not zstd"]))
    with pytest.raises(DataError, match=re.escape(f"{fake.resolve()}: not a zstd file")):
        items("owt2", [str(fake)])


def test_a_file_that_is_not_a_tar_is_named(datafiles):
    fake = datafiles.write("fake.tar", datafiles.zst(datafiles.jsonl_bytes(["x"])))
    with pytest.raises(DataError, match=re.escape(f"{fake.resolve()}: not a tar archive")):
        items("owt2", [str(fake)])


def test_a_zstd_stream_cut_inside_a_frame_is_an_error_not_fewer_documents(datafiles):
    whole = datafiles.zst(datafiles.jsonl_bytes(datafiles.texts(2000)))
    cut = datafiles.write("cut.jsonl.zst", whole[: len(whole) // 2])
    with pytest.raises(DataError, match=re.escape(f"{cut.resolve()}: truncated zstd stream")):
        items("owt2", [str(cut)])


@pytest.mark.parametrize("where", ["inside a member", "between members"])
def test_a_truncated_archive_is_an_error(datafiles, where):
    members = {
        f"{month}.jsonl.zst": datafiles.zst(datafiles.jsonl_bytes(datafiles.texts(300, seed=i)))
        for i, month in enumerate(["2019-01", "2019-02"])
    }
    archive = datafiles.tar("whole.tar", members)
    data = archive.read_bytes()
    first = 512 + len(members["2019-01.jsonl.zst"])
    end = first + (-first % 512)  # the second member's header starts here
    cut = end + 512 + 100 if where == "inside a member" else end
    truncated = datafiles.write("cut.tar", data[:cut])
    with pytest.raises(DataError, match=re.escape(f"{truncated.resolve()}") + ".*truncated"):
        items("owt2", [str(truncated)])


def test_bad_lines_name_their_file_and_line(datafiles):
    lines = [
        b'{"text": "good"}',
        b'{"text": "broken',
        b'{"meta": {}}',
        b'["text"]',
        b'{"text": 42}',
        b'{"text": "caf\xe9 in Latin-1"}',
        b'{"text": "also good"}',
    ]
    path = datafiles.write("mixed.jsonl.zst", datafiles.zst(b"\n".join(lines) + b"\n"))
    found = items("owt2", [str(path)])
    where = f"{path.resolve()}:"
    assert found[0] == Document("good", where + "1") and found[-1] == Document(
        "also good", where + "7"
    )
    bad = {item.where: item.reason for item in found if isinstance(item, BadLine)}
    assert set(bad) == {where + str(n) for n in range(2, 7)}
    assert bad[where + "2"].startswith("not JSON")
    assert "text" in bad[where + "3"] and "text" in bad[where + "4"]
    assert bad[where + "5"] == '"text" must be a string, not int'
    assert bad[where + "6"] == "not valid UTF-8 (byte 0xe9 at column 14)"


def test_non_utf8_text_file_names_the_line(datafiles):
    path = datafiles.write("latin1.txt", "line one\nline two\nna\xefve\n".encode("latin-1"))
    (bad,) = items("text", [str(path)])
    assert bad == BadLine(f"{path.resolve()}:3", "not valid UTF-8 (byte 0xef at line 3, column 3)")


def test_tfds_without_tensorflow_datasets_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
    with pytest.raises(DataError, match=r"tfds:wikitext needs tensorflow-datasets: pip install"):
        open_source("tfds:wikitext")


class Text:  # tfds names its text feature class "Text"
    pass


class FakeBuilder:
    """The part of tfds.core.DatasetBuilder the source uses; tensorflow-datasets is not a
    test dependency, so this checks our side of the seam only."""

    data_dir = "/nowhere/tfds"

    def __init__(self, prepared: bool, examples: dict):
        self.prepared, self.examples = prepared, examples
        self.info = types.SimpleNamespace(
            features={"label": object(), "text": Text()},
            splits={s: types.SimpleNamespace(num_examples=len(e)) for s, e in examples.items()},
        )

    def is_prepared(self):
        return self.prepared

    def as_dataset(self, split, shuffle_files):
        assert shuffle_files is False
        return [{"text": t, "label": 0} for t in self.examples[split]]


def fake_tfds(monkeypatch, prepared=True):
    examples = {"train": [b"first", b"second"], "test": [b"third", b"caf\xe9"]}
    module = types.ModuleType("tensorflow_datasets")
    module.builder = lambda name: FakeBuilder(prepared, examples)
    module.as_numpy = lambda dataset: iter(dataset)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", module)


def test_tfds_reads_every_split_in_order(monkeypatch):
    fake_tfds(monkeypatch)
    source = open_source("tfds:toy")
    assert [s.name for s in source.shards()] == ["tfds:toy/test", "tfds:toy/train"]
    found = items("tfds:toy", [])
    assert found[:2] == [
        Document("third", "tfds:toy/test:1"),
        BadLine("tfds:toy/test:2", "not valid UTF-8 (byte 0xe9 at line 1, column 4)"),
    ]
    assert [d.text for d in found[2:]] == ["first", "second"]


def test_tfds_never_downloads(monkeypatch):
    fake_tfds(monkeypatch, prepared=False)
    with pytest.raises(
        DataError, match="tfds:toy is not prepared in /nowhere/tfds; lmuscale never downloads"
    ):
        open_source("tfds:toy")


def test_lines_do_not_depend_on_how_the_stream_is_cut():
    rng = random.Random(0)
    data = b"".join(
        rng.choice([b"a", b"bc", b"\n", b"\n\n", b"long line " * 50]) for _ in range(400)
    )
    want = data.split(b"\n")
    if want[-1] == b"":
        want.pop()  # a final newline ends the last line; it does not start another
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, 40)))
        chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert list(sources._lines(chunks)) == list(enumerate(want, start=1))


def test_an_empty_zstd_file_is_an_error(datafiles):
    empty = datafiles.write("empty.jsonl.zst", b"")
    with pytest.raises(
        DataError, match=re.escape(f"{empty.resolve()}: empty file, not a zstd stream")
    ):
        items("owt2", [str(empty)])


def test_zstd_reader_is_bounded_by_its_chunks(datafiles):
    """The decompressor yields pieces, never the whole stream at once."""
    data = datafiles.jsonl_bytes(datafiles.texts(20000, words=60))
    path = datafiles.write("big.jsonl.zst", datafiles.zst(data))
    with open(path, "rb") as raw:
        pieces = [len(c) for c in sources._zstd_chunks(raw, str(path))]
    assert sum(pieces) == len(data) and len(pieces) > 10
    assert max(pieces) < len(data) / 5


def data_imports() -> dict[str, set[str]]:
    """Each module of lmuscale.data (its package file aside) and the modules of lmuscale.data
    that it imports, at its top or inside a function."""
    folder = Path(sources.__file__).parent
    graph = {}
    for path in folder.glob("*.py"):
        if path.stem == "__init__":
            continue
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "lmuscale.data":
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.removeprefix("lmuscale.data."))
            elif isinstance(node, ast.Import):
                imported.update(a.name.removeprefix("lmuscale.data.") for a in node.names)
        graph[path.stem] = imported
    return {module: imported & graph.keys() for module, imported in graph.items()}


def test_data_modules_import_one_another_without_a_cycle():
    """sources.py opens columnar.py for ``parquet``; what both need comes from data/base.py."""
    graph = data_imports()
    assert "columnar" in graph["sources"]  # the deferred import is seen

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for module in graph[start] - seen:
            seen.add(module)
            if module == target or reaches(module, target, seen):
                return True
        return False

    cycles = [module for module in graph if reaches(module, module, set())]
    assert not cycles, {module: sorted(graph[module]) for module in cycles}
