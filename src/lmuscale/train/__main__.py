"""``python -m lmuscale.train``: run or resume one training run; exit status: ``outcomes.Exit``."""

from __future__ import annotations

import argparse
import sys

from lmuscale.outcomes import ConfigError, Exit, folder, run_main


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m lmuscale.train",
        description="Train a language model from a config file, resuming from the workdir.",
        epilog="Override any config key with --config.KEY=VALUE, e.g. --config.train.steps=100.",
    )
    parser.add_argument(
        "--config", required=True, help="FILE.py[:NAME], e.g. experiments/owt2.py:tiny"
    )
    parser.add_argument(
        "--workdir", required=True, type=folder, help="folder for checkpoints, logs, summary"
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar: a line every log.every steps"
    )
    parser.add_argument(
        "--accept-unverified",
        action="store_true",
        help="resume from a checkpoint with no files.json and no checksums (of an older "
        "lmuscale), which is otherwise refused",
    )
    args, rest = parser.parse_known_args(argv)
    from lmuscale.train.config import split_overrides  # after --help: it imports JAX

    try:
        overrides, unknown = split_overrides(rest)
    except ConfigError as error:
        parser.error(str(error))
    if unknown:
        parser.error(f"unrecognized argument {unknown[0]!r} (config keys are --config.KEY=VALUE)")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    return run_main(
        lambda: _train(*parse(argv)), interrupted="SIGINT received before training began"
    )


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from lmuscale.train import load, override, run

    config = override(load(args.config), overrides)
    summary = run(
        config,
        args.workdir,
        progress=False if args.quiet else None,
        accept_unverified=args.accept_unverified,
    )
    print(
        f"val loss {summary['val_loss']:.4f} nats ({summary['val_bits_per_byte']:.4f} bits/byte), "
        f"test loss {summary['test_loss']:.4f} nats; summary in {args.workdir}/summary.json"
    )
    return Exit.FINISHED


if __name__ == "__main__":
    sys.exit(main())
