"""``python -m lmuscale.scaling``: the reference curves at Table 3's sizes, as a table.

The exit status is the outcome's in ``lmuscale.outcomes.Exit``: 0, or 2 for bad arguments.
"""

from __future__ import annotations

import argparse

import numpy as np

from lmuscale.outcomes import Exit, run_main
from lmuscale.scaling.reference import (
    BATCH_TOKENS,
    LMU_G_PAPER,
    LMU_PAPER,
    PAPER_STEPS,
    TABLE3_SIZES,
    reference_markdown,
    steps_to_match,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmuscale.scaling", description=__doc__)
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


if __name__ == "__main__":
    raise SystemExit(main())
