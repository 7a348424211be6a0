"""``python -m lmuscale.analysis RESULTS --out DIR``: Figures 3, 4 and 5 and the fits table
from a sweep's results. Exit status: ``lmuscale.outcomes.Exit`` (6 for a bad table, 8 for an
``--out`` that cannot be written)."""

from __future__ import annotations

import argparse

from lmuscale.analysis import analyse
from lmuscale.analysis.results import ROLES
from lmuscale.outcomes import Exit, bounded, folder, run_main
from lmuscale.scaling.__main__ import parse_size


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmuscale.analysis",
        description="Fits, Figures 3-5 and fits.csv/fits.md from a sweep's results table.",
    )
    parser.add_argument("results", help="results.jsonl or results.csv written by a sweep")
    parser.add_argument(
        "--out", required=True, type=folder, help="folder for the figures and tables"
    )
    parser.add_argument(
        "--split",
        choices=("test", "val"),
        default="test",
        help="which loss to fit and plot (default test)",
    )
    parser.add_argument(
        "--size", type=parse_size, help="N for Figure 4 (e.g. 1M; default: the largest LMU)"
    )
    parser.add_argument(
        "--n-boot", type=bounded(int, 0, 10**6), default=1000, help="bootstrap resamples per fit"
    )
    parser.add_argument("--ci", type=float, default=0.95, help="confidence level of the CIs")
    parser.add_argument(
        "--seed", type=bounded(int, 0, 2**63 - 1), default=0, help="seed of the bootstrap"
    )
    parser.add_argument(
        "--target-loss",
        type=float,
        help="the loss at which to compare the tokens families need (default: the lowest "
        "loss every run reaches)",
    )
    pick = parser.add_argument_group(
        "selecting runs", "each analysis takes the runs of its role; these narrow them first"
    )
    pick.add_argument("--role", type=_roles, help=f"comma-separated roles: {', '.join(ROLES)}")
    pick.add_argument("--family", type=_names, help="comma-separated families (lmu,transformer)")
    pick.add_argument(
        "--budget",
        type=lambda text: [parse_size(x) for x in _names(text)],
        help="comma-separated budgets: training tokens or FLOPs, within 5%% (e.g. 8e10)",
    )
    pick.add_argument("--trials", type=_names, help="comma-separated trial patterns (lmu-*)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    args = parser.parse_args(argv)
    if not 0 < args.ci < 1:
        parser.error(f"--ci must be between 0 and 1, got {args.ci}")
    if args.target_loss is not None and not (0 < args.target_loss < float("inf")):
        parser.error(f"--target-loss must be a positive loss, got {args.target_loss}")
    return run_main(lambda: _run(args))


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give one or more names, separated by commas")
    return names


def _roles(text: str) -> list[str]:
    roles = _names(text)
    for role in roles:
        if role not in ROLES:
            raise argparse.ArgumentTypeError(f"{role!r} is not a role ({', '.join(ROLES)})")
    return roles


def _run(args: argparse.Namespace) -> int:
    keys = {"role": "roles", "family": "families", "budget": "budgets", "trials": "trials"}
    select = {key: getattr(args, flag) for flag, key in keys.items() if getattr(args, flag)}
    if select:
        shown = [f"--{flag} {_show(getattr(args, flag))}" for flag in keys if getattr(args, flag)]
        select["note"] = " ".join(shown)
    report = analyse(
        args.results,
        args.out,
        split=args.split,
        size=args.size,
        n_boot=args.n_boot,
        ci=args.ci,
        seed=args.seed,
        progress=not args.quiet,
        target_loss=args.target_loss,
        select=select,
    )
    if not args.quiet:
        print(*report.lines(), sep="\n")
    return Exit.FINISHED


def _show(value) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else v for v in value)


if __name__ == "__main__":
    raise SystemExit(main())
