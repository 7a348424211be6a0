"""A compute-optimal comparison small enough for a laptop: LMU vs transformer at 3 budgets.

    python -m lmuscale.sweep sweeps/isoflop_demo.py      (about 16 minutes on two CPU cores)

The byte-level models of sweeps/demo.py (widths 4 to 64) on the embedded plays, in two stages.
First a learning-rate grid: two sizes per family, each at three rates half a decade apart, for
400 steps (about the median length of the IsoFLOP runs). Then, once those have ended, the
IsoFLOP grid at the rates they chose (the analysis's parabola in log LR, interpolated in log N
between the two sizes): 3 compute budgets a factor 2 apart (4.5e10 to 1.8e11 FLOPs), 5 sizes
per family each, every run trained for the steps its budget buys at its own FLOPs per token,
with the warmup, cosine and evaluations scaled to its steps, and at least 150 of them (shorter
runs of these models trained badly at these rates). The window of sizes is centred on 250
tokens per parameter for the LMU and 300 for the transformer, where their optima lay.
``after`` then runs the analysis: the IsoFLOP parabolas (Chinchilla's approach 2) and
N_opt(C), the lower envelope of the evaluation curves (approach 1), the tokens each family
needs to reach a loss, and the learning-rate figure, into WORKDIR/analysis.
"""

import dataclasses
from pathlib import Path

from lmuscale.sweep import Throughput
from lmuscale.sweep.grids import chosen_learning_rates, isoflop_grid, learning_rate_grid
from lmuscale.train.config import load_module

demo = load_module(Path(__file__).parent / "demo.py")  # the models and training of the demo

BUDGETS = (4.5e10, 9e10, 1.8e11)  # training FLOPs
WIDTHS = (4, 6, 8, 12, 16, 24, 32, 48, 64)
# The learning-rate stage: three rates per family around the best of a wider grid (0.01-0.3 for
# the LMUs, 0.003-0.1 for the transformers, these sizes and steps), which were 0.1 for both
# LMUs and 0.03 for both transformers.
LR_WIDTHS = (8, 16)
LEARNING_RATES = {"lmu": (3e-2, 1e-1, 3e-1), "transformer": (1e-2, 3e-2, 1e-1)}
LR_STEPS = 400
# Model FLOP/s per trial for --dry-run's estimate before any trial has run: the median over each
# family's trials of their median step speed, in a fresh clone's run of an earlier version of
# this sweep (46 trials, budgets 6e10-2.4e11) on a 2-core CPU, 2026-11-25: these narrow models
# run slower per FLOP than the demo's.
THROUGHPUT = Throughput(
    None,
    families={"lmu": 1.06e10, "transformer": 8.9e9},
    source="THROUGHPUT in sweeps/isoflop_demo.py, measured on a 2-core CPU",
    platform="cpu",
)


def config(model):
    """The demo's training, with lighter evaluations: every run is evaluated 10 times."""
    c = demo.config(model)
    c.eval.update(batches=2, final_batches=8)
    return c


def get_trials(done):
    """The learning-rate trials first; the IsoFLOP trials wait for the rates they choose."""
    small = {"lmu": demo.lmu, "transformer": demo.transformer}
    rate_trials = [
        trial
        for family, model in small.items()
        for trial in learning_rate_grid(
            {family: [model(d) for d in LR_WIDTHS]}, LEARNING_RATES[family], config, steps=LR_STEPS
        )
    ]
    chosen = chosen_learning_rates(done, rate_trials)
    if chosen:
        rates, choices = chosen
        edges = [f"{c.family} N={c.n:.3g}" for c in choices if not c.bracketed]
        source = "the learning-rate trials, interpolated in log N" + (
            f"; NOT bracketed (best at the grid's edge) for {', '.join(edges)}" if edges else ""
        )
    models = {
        "lmu": [demo.lmu(d) for d in WIDTHS],
        "transformer": [demo.transformer(d) for d in WIDTHS],
    }
    grid = isoflop_grid(
        models,
        BUDGETS,
        config,
        per_budget=5,
        tokens_per_param={"lmu": 250.0, "transformer": 300.0},
        min_steps=150,
        learning_rate=rates.interpolate if chosen else None,
        learning_rate_from=source if chosen else "",
    )
    if not chosen:
        waits = "its learning rate, which the learning-rate trials choose"
        grid = [dataclasses.replace(t, waits=waits) for t in grid]
    return rate_trials + grid


def after(workdir):
    """Once every trial is done: the compute-optimal analyses and their figures."""
    from lmuscale.analysis import analyse

    report = analyse(workdir / "results.jsonl", workdir / "analysis", split="val", n_boot=200)
    print("analysis:", *report.lines(), sep="\n")
