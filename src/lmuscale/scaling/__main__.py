"""``python -m lmuscale.scaling``: the reference curves at Table 3's sizes, as a table.
``python -m lmuscale.scaling predict FITS.json (--n N | --flops C | --target-loss L)``: the
loss at N, the compute-optimal N and D at C, or the N, D and FLOPs that reach L, each with its
prediction interval, from the fits.json an analysis wrote.

The exit status is the outcome's in ``lmuscale.outcomes.Exit``: 0, 2 for bad arguments, 6 for
a fits file that cannot be read or cannot answer.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

import numpy as np

from lmuscale.outcomes import DataError, Exit, run_main
from lmuscale.scaling.extrapolate import FORM_NAMES, load_fits
from lmuscale.scaling.fits import FORMULAS, FitError, human, interval_text
from lmuscale.scaling.reference import (
    BATCH_TOKENS,
    LMU_G_PAPER,
    LMU_PAPER,
    PAPER_STEPS,
    TABLE3_SIZES,
    reference_markdown,
    steps_to_match,
)

SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}


def parse_size(text: str) -> float:
    """ "1M", "500k", "55000" or "1e6" -> a count (of parameters, tokens or FLOPs)."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmb]?)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1M, 500k or 55000)")
    return float(match.group(1)) * SUFFIXES[match.group(2)]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["predict"]:
        return predict(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m lmuscale.scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=float, default=PAPER_STEPS, help="transformer steps")
    parser.add_argument("--batch-tokens", type=float, default=BATCH_TOKENS)
    return run_main(lambda: _run(parser.parse_args(argv)))


def _run(args: argparse.Namespace) -> int:
    table = reference_markdown(TABLE3_SIZES, args.steps, args.batch_tokens)
    print("Losses in nats per GPT-2 token; N = non-embedding parameters.", *table, sep="\n")
    sizes = np.array(TABLE3_SIZES, dtype=float)
    for label, curve in (("LMU", LMU_PAPER), ("LMU_G", LMU_G_PAPER)):
        steps = steps_to_match(curve(sizes), sizes, args.batch_tokens)
        shown = ", ".join("inf" if np.isinf(s) else f"{s:,.0f}" for s in steps)
        print(f"transformer steps to match the paper's {label} fit (eq 1.6): {shown}")
    return Exit.FINISHED


def predict(argv) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmuscale.scaling predict",
        description="Predictions with intervals for one new run, from an analysis's fits.json.",
    )
    parser.add_argument("fits", help="fits.json written by python -m lmuscale.analysis")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--n", type=parse_size, help="the loss at N parameters (e.g. 1M)")
    what.add_argument("--flops", type=parse_size, help="N_opt and D_opt at C FLOPs (e.g. 1e18)")
    what.add_argument("--target-loss", type=float, help="the N, D and FLOPs that reach a loss")
    parser.add_argument("--family", help="one family (default: every family in the file)")
    parser.add_argument("--ci", type=float, default=0.9, help="interval level (default 0.9)")
    args = parser.parse_args(argv)
    if not 0 < args.ci < 1:
        parser.error(f"--ci must be between 0 and 1, got {args.ci}")
    for name in ("n", "flops", "target_loss"):
        value = getattr(args, name)
        if value is not None and not (0 < value < math.inf):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    return run_main(lambda: _predict(args))


def _predict(args) -> int:
    fits = load_fits(args.fits)
    families = sorted({w.family for w in fits.laws} | set(fits.frontiers))
    if not families:
        raise DataError(f"{fits.path}: holds no fits and no frontiers: nothing to predict from")
    if args.family is not None and args.family not in families:
        raise DataError(
            f"{fits.path}: no family {args.family!r}; it has {', '.join(families) or 'none'}"
        )
    chosen = families if args.family is None else [args.family]
    laws = [w for w in fits.laws if w.family in chosen]
    level = f"{args.ci:.0%}"
    if args.n is not None:
        rows = [w for w in laws if w.form in ("power_law", "saturating")]
        if not rows:
            raise DataError(
                f"{fits.path}: no power-law or saturating fit for {', '.join(chosen)} (those "
                "are fitted to paper-grid runs; for IsoFLOP runs give --flops)"
            )
        print(f"Loss at N = {human(args.n)} ({level} prediction interval for one run, nats):")
        print("| fit | form | loss | interval |", "|---|---|---:|---|", sep="\n")
        for w in rows:
            loss, lo, hi = (float(v) for v in w.interval(args.n, ci=args.ci))
            shown = interval_text(lo, hi, w.why, ".4f")
            print(f"| {w.name} | {FORM_NAMES[w.form]} | {loss:.4f} | {shown} |")
    elif args.flops is not None:
        rows = [f for f in chosen if f in fits.frontiers]
        if not rows:
            raise DataError(f"{fits.path}: no IsoFLOP frontier for {', '.join(chosen)}")
        print(f"Compute-optimal at C = {args.flops:.3g} FLOPs ({level} intervals):")
        print("| family | N_opt | D_opt (tokens) | loss (Chinchilla fit) |\n|---|---|---|---|")
        for family in rows:
            lines = fits.frontiers[family]
            n, n_lo, n_hi = (float(v) for v in lines["n_opt"].interval(args.flops, ci=args.ci))
            d, d_lo, d_hi = (float(v) for v in lines["d_opt"].interval(args.flops, ci=args.ci))
            w = next((w for w in laws if w.family == family and w.form == "chinchilla"), None)
            loss = "no Chinchilla fit"
            if w is not None:
                value, lo, hi = (float(v) for v in w.interval(n, d, ci=args.ci))
                loss = f"{value:.4f} {interval_text(lo, hi, w.why, '.4f')}"
            print(
                f"| {family} | {human(n)} [{human(n_lo)}, {human(n_hi)}] | "
                f"{human(d)} [{human(d_lo)}, {human(d_hi)}] | {loss} |"
            )
    else:
        rows = [w for w in laws if w.form == "saturating"]
        if not rows:
            raise DataError(
                f"{fits.path}: no saturating fit for {', '.join(chosen)} (it is fitted to "
                "paper-grid runs of 4 or more sizes; for IsoFLOP runs give --flops)"
            )
        target = args.target_loss
        print(
            f"To reach a loss of {target:g} nats: each fit's {FORMULAS['saturating']} solved "
            f"for N ({level} intervals: the sizes whose prediction interval holds the target), "
            "at the token budget of the runs it was fitted to:"
        )
        print("| fit | N | tokens D | training FLOPs |", "|---|---|---:|---|", sep="\n")
        why_open = {
            "low": "from N = 1: the interval holds the target at every smaller size",
            "high": "unbounded above: the interval still holds the target at N = 1e18, as the "
            "floor E may be at or above it within the fit's uncertainty",
        }
        reached = 0
        for w in rows:
            try:
                n, lo, hi = w.n_for_loss(target, ci=args.ci)
            except FitError as e:
                if len(rows) == 1:
                    raise
                print(f"| {w.name} | {e} | | |")
                continue
            reached += 1
            d = w.tokens
            f = [fits.flops_per_token(w.family, v) for v in (n, lo, hi)]
            flops = "unknown (no FLOPs per token in the file)"
            if f[0] is not None and d is not None:
                flops = f"{f[0] * d:.3g} [{f[1] * d:.3g}, {f[2] * d:.3g}]"
            shown = f"[{human(lo)}, {human(hi)}]"
            if math.isnan(lo):
                shown = f"no interval ({w.why})"
            open_ends = [why_open["low"]] if lo <= 1 else []
            open_ends += [why_open["high"]] if math.isinf(hi) else []
            if open_ends:
                shown += f" ({'; '.join(open_ends)})"
            tokens = "—" if d is None else human(d)
            print(f"| {w.name}, {FORM_NAMES[w.form]} | {human(n)} {shown} | {tokens} | {flops} |")
        if not reached:
            raise DataError(f"no fit reaches a loss of {target:g}: it is at or below every E")
    return Exit.FINISHED


if __name__ == "__main__":
    raise SystemExit(main())
