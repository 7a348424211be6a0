"""Time preparing data: the embedded Shakespeare corpus, and an OpenWebText2-shaped archive.

    python benchmarks/prepare.py [--workers 0 1 2] [--copies 10] [--repeats 3] [--out FILE]

Cases (GPT-2 tokenizer throughout):
- shakespeare: ``prepare shakespeare`` exactly as a user runs it (38 plays, ~1.6M tokens),
  worker start-up included;
- owt2-shaped: the same scenes written ``--copies`` times (each copy's documents made unique
  by a prefix, so they split independently) as .jsonl.zst members of a tar, then
  ``prepare owt2`` on it: zstd, JSON, hashing and BPE together, on real English.

Each case runs --repeats times per worker count (0 = tokenise in the main process); the table
gives medians. "wall" is the whole call; "stream" is what the prepared meta.json records: the
wall time less opening the source and building the tokenizer (~1 s), but with spawning the
workers (and sending them the tokenizer) included. Tokens/s is over "stream". The JSON holds
the machine, versions and every time.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import zstandard
from common import machine, print_table, versions, write_json

from lmuscale.data import open_source
from lmuscale.data.prepare import prepare


def owt2_archive(folder: Path, copies: int) -> Path:
    scenes = [d.text for shard in open_source("shakespeare").shards() for d in shard.documents()]
    path = folder / "shakespeare-copies.jsonl.zst.tar"
    compressor = zstandard.ZstdCompressor()
    with tarfile.open(path, "w") as tar:
        for copy in range(copies):
            lines = "".join(
                json.dumps({"text": f"[{copy}] {t}", "meta": {}}) + "\n" for t in scenes
            )
            data = compressor.compress(lines.encode())
            info = tarfile.TarInfo(f"copy-{copy:03d}.jsonl.zst")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "prepare.json"
    )
    args = parser.parse_args()

    rows, records = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        archive = owt2_archive(tmp, args.copies)
        cases = {"shakespeare": ("shakespeare", []), "owt2-shaped": ("owt2", [str(archive)])}
        for case, (spec, inputs) in cases.items():
            for workers in args.workers:
                walls, streams = [], []
                for repeat in range(args.repeats):
                    out = tmp / f"{case}-{workers}-{repeat}"
                    started = time.perf_counter()
                    meta = prepare(spec, inputs, out=out, workers=workers, progress=False)
                    walls.append(time.perf_counter() - started)
                    streams.append(meta["prepared"]["seconds"])
                    shutil.rmtree(out)
                wall, stream = statistics.median(walls), statistics.median(streams)
                tokens = sum(s["tokens"] for s in meta["splits"].values())
                text = sum(s["bytes"] for s in meta["splits"].values())
                records.append(
                    {
                        "case": case,
                        "workers": workers,
                        "tokens": tokens,
                        "text_bytes": text,
                        "wall_seconds": walls,
                        "stream_seconds": streams,
                        "tokens_per_second": tokens / stream,
                        "splits": {k: v["tokens"] for k, v in meta["splits"].items()},
                    }
                )
                rows.append(
                    (
                        case,
                        workers,
                        f"{tokens:,}",
                        f"{text / 2**20:.1f}",
                        f"{wall:.2f}",
                        f"{stream:.2f}",
                        f"{tokens / stream:,.0f}",
                    )
                )
                print(f"{case} workers={workers}: {wall:.2f} s", file=sys.stderr)
    print_table(
        "prepare (GPT-2 BPE)",
        ("case", "workers", "tokens", "text MiB", "wall s", "stream s", "tokens/s"),
        rows,
    )
    write_json(
        args.out,
        {"machine": machine(), "versions": versions(), "copies": args.copies, "runs": records},
    )


if __name__ == "__main__":
    main()
