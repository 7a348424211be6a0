"""``python -m lmuscale.analysis RESULTS --out DIR``: Figures 3, 4 and 5 and the fits table
from a sweep's results. Exit status: ``lmuscale.outcomes.Exit`` (6 for a bad table, 8 for an
``--out`` that cannot be written)."""

from __future__ import annotations

import argparse
import re

from lmuscale.analysis import analyse
from lmuscale.outcomes import Exit, run_main

SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}


def parse_size(text: str) -> float:
    """ "1M", "500k", "55000" or "1e6" -> a parameter count."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmb]?)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1M, 500k or 55000)")
    return float(match.group(1)) * SUFFIXES[match.group(2)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmuscale.analysis",
        description="Fits, Figures 3-5 and fits.csv/fits.md from a sweep's results table.",
    )
    parser.add_argument("results", help="results.jsonl or results.csv written by a sweep")
    parser.add_argument("--out", required=True, help="folder for the figures and tables")
    parser.add_argument(
        "--split",
        choices=("test", "val"),
        default="test",
        help="which loss to fit and plot (default test)",
    )
    parser.add_argument(
        "--size", type=parse_size, help="N for Figure 4 (e.g. 1M; default: the largest LMU)"
    )
    parser.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples per fit")
    parser.add_argument("--ci", type=float, default=0.95, help="confidence level of the CIs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    parser.add_argument(
        "--target-loss",
        type=float,
        help="the loss at which to compare the tokens families need (default: the lowest "
        "loss every run reaches)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    args = parser.parse_args(argv)
    if not 0 < args.ci < 1:
        parser.error(f"--ci must be between 0 and 1, got {args.ci}")
    if args.target_loss is not None and not (0 < args.target_loss < float("inf")):
        parser.error(f"--target-loss must be a positive loss, got {args.target_loss}")
    if args.n_boot < 0:
        parser.error(f"--n-boot must be >= 0, got {args.n_boot}")
    return run_main(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
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
    )
    if not args.quiet:
        results = report.results
        print(f"{len(results.runs)} runs of {', '.join(results.families)} from {results.path}")
        for note in results.skipped:
            print(f"  left out: {note}")
        for g in report.fits:
            if g.fit is None:
                print(f"  {g.name}, {g.form}: not fitted ({g.error})")
            else:
                params = ", ".join(f"{k} = {v:.4g}" for k, v in g.fit.params.items())
                print(f"  {g.name}, {g.form}: {params} (RMS log residual {g.fit.rms_residual:.4f})")
        best = report.optimal
        for frontier in best.frontiers:
            if frontier.a is not None:
                print(
                    f"  {frontier.family}: N_opt ∝ C^{frontier.a.estimate:.3f} "
                    f"[{frontier.a.lo:.3f}, {frontier.a.hi:.3f}], D_opt ∝ "
                    f"C^{frontier.b.estimate:.3f} [{frontier.b.lo:.3f}, {frontier.b.hi:.3f}]"
                )
        for eff in best.efficiency:
            if eff.ratio_geomean is not None:
                a, b = eff.families
                print(
                    f"  {b} needs {eff.ratio_geomean:.3g}x the tokens of {a} to reach "
                    f"{eff.target:.4f} ({len(eff.n)} sizes)"
                )
        for line in best.left_out:
            print(f"  left out: {line}")
        print("wrote " + ", ".join(str(p) for p in report.files))
    return Exit.FINISHED


if __name__ == "__main__":
    raise SystemExit(main())
