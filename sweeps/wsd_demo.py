"""Many budgets from one run per size: cosine runs against warmup-stable-decay cooldowns.

    python -m lmuscale.sweep sweeps/wsd_demo.py          (about 7 minutes on two CPU cores)
    python -m lmuscale.sweep sweeps/wsd_demo.py --dry-run   (both designs' compute)

The byte-level LMUs and transformers of sweeps/demo.py, three widths each (N = 2.4k to 7.9k and
1.8k to 6.6k), on the embedded plays, each at three compute budgets (7.2e10, 1.08e11 and
1.44e11 training FLOPs: 300 to 600 steps of the middle LMU), trained two ways:
- cosine: one run per size and budget, from scratch, with the paper's schedule (trials
  ``cosine-FAMILY-N-C``);
- WSD: per size, one stable run at the peak rate (``FAMILY-N-stable``) and per budget a
  cooldown branched from it (``FAMILY-N-C``) whose last 20% of steps decay along 1 - sqrt
  (Hägele et al. 2024), so the stable run trains as far as the largest budget's decay starts.
Both share the warmup, the peak rate and the evaluations; reduce-on-plateau is off in both, so
that the schedules alone differ. ``after`` prints the loss difference per budget and the compute
each design spent (WSD: 56% of the cosine runs'), and analyses each design apart:
WORKDIR/analysis (the IsoFLOP and data-efficiency figures from the cooldowns, which fits.md
says) and WORKDIR/analysis-cosine. At these few hundred steps, far from convergence, the
cooldowns ended below the cosine runs at every budget (by 0.02 to 0.15 nats on a 2-core CPU,
2026-11-29): the cosine schedule's lower mean rate costs progress, and the gap shrinks as the
runs lengthen.
"""

import json
from pathlib import Path

from ml_collections import ConfigDict

from lmuscale.sweep import Trial
from lmuscale.sweep.grids import wsd_grid
from lmuscale.train.config import load_module

demo = load_module(Path(__file__).parent / "demo.py")  # the models and data of the demo

WIDTHS = {"lmu": (12, 16, 24), "transformer": (8, 12, 16)}
BUDGETS = (7.2e10, 1.08e11, 1.44e11)  # training FLOPs
DECAY = 0.2
# The peak rates: the better of 3e-3, 1e-2, 3e-2 and 1e-1 for both schedules, at 600 and 1,200
# steps of the middle sizes (a scan on the plays, 2026-11-29).
LEARNING_RATES = {"lmu": 3e-2, "transformer": 1e-2}
THROUGHPUT = demo.THROUGHPUT  # the same models on the same machine


def config(model):
    """The demo's training at its family's rate, evaluated lightly, without reduce-on-plateau
    (its scale stays 1)."""
    c = demo.config(model)
    c.optim.update(learning_rate=LEARNING_RATES[model.family], plateau_min_scale=1.0)
    c.eval.update(batches=2, final_batches=16)
    c.log.update(tensorboard=False)
    return c


def get_trials():
    models = {family: [getattr(demo, family)(d) for d in WIDTHS[family]] for family in WIDTHS}
    grid = wsd_grid(models, BUDGETS, config, decay=DECAY)
    for trial in grid:  # saved twice a run (and at the branch points): the demo's runs are short
        trial.config.checkpoint.every = max(1, trial.config.train.steps // 2)
    yield from grid
    for trial in grid:  # the same runs from scratch on the cosine schedule
        if trial.branch_from is None:
            continue
        cosine = ConfigDict(trial.config.to_dict())
        cosine.optim.update(schedule="cosine", decay_fraction=0.2, decay_shape="1-sqrt")
        yield Trial(f"cosine-{trial.name}", cosine, role="isoflop", note="from scratch")


def compare(rows: list[dict]) -> list[str]:
    """The loss difference per budget and size (WSD branch - cosine run, validation nats per
    byte) and the compute each design spent."""
    by_name = {r["trial"]: r for r in rows}
    lines = [
        "| family | budget (FLOPs) | N | steps | cosine val loss | WSD val loss | WSD - cosine |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    gaps = []
    for row in rows:
        cosine = by_name.get(f"cosine-{row['trial']}")
        if not row["branch_from"] or cosine is None:
            continue
        losses = row["val_loss"], cosine["val_loss"]
        start = f"| {row['family']} | {row['total_flops']:.3g} | {row['N']:,} | {row['steps']:,} "
        if None in losses:
            lines.append(start + "| - | - | not finished |")
            continue
        gaps.append(losses[0] - losses[1])
        lines.append(start + f"| {losses[1]:.4f} | {losses[0]:.4f} | {gaps[-1]:+.4f} |")
    wsd = sum(r["spent_flops"] for r in rows if not r["trial"].startswith("cosine-"))
    cosine = sum(r["spent_flops"] for r in rows if r["trial"].startswith("cosine-"))
    if gaps:
        lines.append(f"WSD - cosine: from {min(gaps):+.4f} to {max(gaps):+.4f} nats")
    lines.append(
        f"compute: WSD {wsd:.3g} FLOPs (stable runs and cooldowns), cosine {cosine:.3g} FLOPs: "
        f"WSD spent {wsd / cosine:.0%} of it"
    )
    return lines


def after(workdir):
    """The comparison, then each design's compute-optimal analyses."""
    from lmuscale.analysis import analyse

    rows = [json.loads(line) for line in (workdir / "results.jsonl").open()]
    print("WSD cooldowns against cosine runs of the same length:", *compare(rows), sep="\n")
    for out, trials in (
        ("analysis", ["lmu-*", "transformer-*"]),
        ("analysis-cosine", ["cosine-*"]),
    ):
        report = analyse(
            workdir / "results.jsonl",
            workdir / out,
            split="val",
            n_boot=200,
            select={"trials": trials},
        )
        print(f"{out}:", *report.lines(), sep="\n")
