"""Time preparing a parquet corpus, against the same documents as .jsonl.zst.

    python benchmarks/prepare_parquet.py [--workers 0 1 2] [--copies 15] [--repeats 3]
                                         [--row-group 1000] [--out FILE]

The corpus: the embedded Shakespeare scenes written ``--copies`` times (each copy's documents
made unique by a prefix, so they split independently), ~5.1 MB of text a copy, as one parquet
file of ``--row-group`` rows per row group (zstd, as FineWeb's files are), and as one .jsonl.zst.
Cases (GPT-2 tokenizer):
- read: the parquet source's documents drawn in this process, nothing tokenised (the reader's
  own cost);
- parquet / jsonl.zst: ``prepare`` of each at every ``--workers`` count (0 = in-process).

Each case runs --repeats times, the cases interleaved (a busy spell on a shared machine then
slows them alike); the table gives medians. "stream" is what the prepared meta.json records
(the wall time less opening the source and building the tokenizer, worker start-up included);
documents/s, MB/s (of UTF-8 text) and tokens/s are over it. The JSON holds the machine, its
load average before and after, versions, sizes and every time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from common import machine, print_table, versions, write_json

from lmuscale.data import open_source
from lmuscale.data.prepare import prepare


def corpus(folder: Path, copies: int, row_group: int) -> tuple[Path, Path, int, int]:
    """(parquet, jsonl.zst, documents, UTF-8 bytes) of ``copies`` copies of the scenes."""
    scenes = [d.text for shard in open_source("shakespeare").shards() for d in shard.documents()]
    texts = [f"[{copy}] {t}" for copy in range(copies) for t in scenes]
    parquet = folder / "scenes.parquet"
    ids = list(range(len(texts)))
    table = pa.table({"id": ids, "text": texts, "url": [f"https://example.org/{i}" for i in ids]})
    pq.write_table(table, parquet, row_group_size=row_group, compression="zstd")
    jsonl = folder / "scenes.jsonl.zst"
    lines = "".join(json.dumps({"text": t, "meta": {}}) + "\n" for t in texts)
    jsonl.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    return parquet, jsonl, len(texts), sum(len(t.encode()) for t in texts)


def read_seconds(parquet: Path) -> float:
    started = time.perf_counter()
    for shard in open_source("parquet", [str(parquet)]).shards():
        for _ in shard.documents():
            pass
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--copies", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--row-group", type=int, default=1000)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "prepare_parquet-cpu.json"
    )
    args = parser.parse_args()

    rows, records = [], []
    load = os.getloadavg()

    def row(case: str, workers, seconds: list[float], tokens: int | None) -> None:
        stream = statistics.median(seconds)
        records.append(
            {
                "case": case,
                "workers": workers,
                "documents": documents,
                "text_bytes": text_bytes,
                "tokens": tokens,
                "seconds": seconds,
                "documents_per_second": documents / stream,
                "text_mb_per_second": text_bytes / 1e6 / stream,
                "tokens_per_second": tokens / stream if tokens else None,
            }
        )
        rows.append(
            (
                case,
                "-" if workers is None else workers,
                f"{stream:.2f}",
                f"{documents / stream:,.0f}",
                f"{text_bytes / 1e6 / stream:.2f}",
                "-" if tokens is None else f"{tokens / stream:,.0f}",
            )
        )
        print(f"{case} workers={workers}: {stream:.2f} s", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        parquet, jsonl, documents, text_bytes = corpus(tmp, args.copies, args.row_group)
        sizes = {"parquet_bytes": parquet.stat().st_size, "jsonl_zst_bytes": jsonl.stat().st_size}
        on_disk = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items())
        print(
            f"{documents:,} documents, {text_bytes / 1e6:.1f} MB of text; {on_disk}",
            file=sys.stderr,
        )
        row("read", None, [read_seconds(parquet) for _ in range(args.repeats)], None)
        cases = {"parquet": ("parquet", parquet), "jsonl.zst": ("text", jsonl)}
        streams = {(case, w): [] for w in args.workers for case in cases}
        tokens = {}
        for repeat in range(args.repeats):  # interleaved: a busy spell slows every case alike
            for workers in args.workers:
                for case, (spec, path) in cases.items():
                    out = tmp / f"{case}-{workers}-{repeat}"
                    meta = prepare(spec, [str(path)], out=out, workers=workers, progress=False)
                    streams[case, workers].append(meta["prepared"]["seconds"])
                    tokens[case] = sum(s["tokens"] for s in meta["splits"].values())
                    shutil.rmtree(out)
        for case in cases:
            for workers in args.workers:
                row(case, workers, streams[case, workers], tokens[case])
    print_table(
        f"prepare, GPT-2 BPE: {documents:,} documents, {text_bytes / 1e6:.1f} MB of text",
        ("case", "workers", "stream s", "documents/s", "MB/s", "tokens/s"),
        rows,
    )
    write_json(
        args.out,
        {
            "machine": machine(),
            "versions": {**versions(), "pyarrow": pa.__version__},
            "copies": args.copies,
            # the machine may be shared: what else was running, before and after
            "load_average": {"start": load, "end": os.getloadavg()},
            "row_group": args.row_group,
            **sizes,
            "runs": records,
        },
    )


if __name__ == "__main__":
    main()
