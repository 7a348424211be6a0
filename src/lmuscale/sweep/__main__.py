"""``python -m lmuscale.sweep SWEEP_FILE``: run (or resume) every trial of a sweep file, each in
``WORKDIR/trials/NAME-HASH``, and write ``WORKDIR/results.jsonl`` and ``results.csv`` (the
sweep folder: ``lmuscale.sweepdir``). Exit status: ``lmuscale.outcomes.Exit`` (130 also for
SIGTERM and SIGHUP).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from lmuscale.outcomes import ConfigError, Exit, bounded, folder, run_main
from lmuscale.train.config import split_overrides


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lmuscale.sweep",
        description="Run (or resume) the trials of a sweep file and collect their results.",
        epilog="Override a config key of every trial with --config.KEY=VALUE, e.g. "
        "--config.train.steps=100 (the trials' folders change with it).",
    )
    parser.add_argument("sweep", help="a sweep file, e.g. sweeps/owt2.py")
    parser.add_argument(
        "--workdir", type=folder, help="folder of the sweep (default: runs/SWEEP_NAME)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print sizes, tokens, FLOPs and estimated times, and run nothing",
    )
    parser.add_argument(
        "--only",
        metavar="PATTERN",
        help="trials whose name matches these globs (a,b*,...) (default: every trial)",
    )
    parser.add_argument(
        "--executor",
        choices=("local", "slurm"),
        default="local",
        help="where the trials run (default: local)",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        metavar="K",
        help="trials at a time (local: default 1, each on its own GPUs; slurm: array limit)",
    )
    parser.add_argument(
        "--detach", action="store_true", help="slurm: submit and return without waiting"
    )
    parser.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a submitit parameter for --executor slurm, e.g. slurm_partition=gpu (repeatable)",
    )
    parser.add_argument(
        "--throughput",
        type=bounded(float, 0, sys.float_info.max, above=True, says="a finite number > 0"),
        metavar="FLOPS",
        help="model FLOP/s per trial for --dry-run's estimate, instead of the sweep's "
        "THROUGHPUT (a number or a GPU benchmark)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar: a line at least once a minute"
    )
    parser.add_argument(
        "--accept-unverified",
        action="store_true",
        help="resume trials from checkpoints with no files.json and no checksums (of an older "
        "lmuscale), which are otherwise refused",
    )
    parser.add_argument(
        "--after",
        action="store_true",
        help="run the sweep file's after() again even if it has run on these results",
    )
    try:
        overrides, rest = split_overrides(argv)
    except ConfigError as error:
        parser.error(str(error))
    args = parser.parse_args(rest)
    args.overrides = overrides
    if args.parallel is not None and args.parallel < 1:
        parser.error("--parallel must be at least 1")
    if args.detach and args.executor != "slurm":
        parser.error("--detach needs --executor slurm")
    try:
        args.slurm = slurm_params(args.slurm)
    except ValueError as error:
        parser.error(str(error))
    return args


def slurm_params(items: list[str]) -> dict:
    params = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--slurm {item!r}: expected KEY=VALUE")
        params[key] = {"true": True, "false": False, "none": None}.get(text.lower(), text)
        for kind in (int, float):
            with contextlib.suppress(ValueError):
                params[key] = kind(text)
                break
    return params


def main(argv: list[str] | None = None) -> int:
    return run_main(
        lambda: _run(parse(sys.argv[1:] if argv is None else argv)),
        interrupted="interrupted; run the same command again to resume",
    )


def _run(args: argparse.Namespace) -> int:
    # A runner told to stop (Ctrl-C, SIGTERM, a closed terminal) stops its workers cleanly: each
    # writes a checkpoint at its current step (run_main takes SIGINT and SIGTERM).
    signal.signal(signal.SIGHUP, signal.default_int_handler)
    from lmuscale.sweep.runner import run_sweep, select
    from lmuscale.sweep.worker import ACCEPT_UNVERIFIED

    if args.accept_unverified:  # the workers' environment is this process's
        os.environ[ACCEPT_UNVERIFIED] = "1"
    from lmuscale.sweep.spec import load_sweep, twins
    from lmuscale.sweep.throughput import Throughput

    workdir = Path(args.workdir or Path("runs") / Path(args.sweep).stem)
    sweep = load_sweep(args.sweep, workdir, args.overrides)
    if args.overrides:
        print(f"overrides for every trial: {' '.join(args.overrides)}", flush=True)
        for names in twins(select(sweep, args.only)):
            print(
                f"warning: with these overrides, trials {', '.join(names)} differ only in "
                "name: they would train the same model",
                file=sys.stderr,
                flush=True,
            )
    if args.dry_run:
        from lmuscale.sweep.plan import missing_data, plan, table

        throughput = sweep.throughput
        if args.throughput:  # for every trial, on the device kind the sweep's figures are for
            throughput = Throughput(
                args.throughput,
                source=f"--throughput {args.throughput:g}",
                platform=throughput.platform,
                overhead=throughput.overhead,
            )
        trials = select(sweep, args.only)
        for warning in missing_data(trials):
            print(warning, file=sys.stderr)
        print(table(plan(trials, workdir, throughput)))
        print(f"FLOP/s for trials not yet measured: {throughput.source}")
        return Exit.FINISHED
    return run_sweep(
        sweep,
        workdir,
        only=args.only,
        executor=args.executor,
        parallel=args.parallel or (1 if args.executor == "local" else None),
        detach=args.detach,
        slurm=args.slurm,
        show=False if args.quiet else None,
        after=args.after,
    )


if __name__ == "__main__":
    sys.exit(main())
