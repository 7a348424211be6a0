"""A compute-optimal comparison small enough for a laptop: LMU vs transformer at 3 budgets.

    python -m lmuscale.sweep sweeps/isoflop_demo.py      (about 15 minutes on two CPU cores)

The byte-level models of sweeps/demo.py (widths 4 to 64) on the embedded plays, at 3 compute
budgets a factor 2 apart. Each budget trains 5 sizes per family, each for the steps the
budget buys at its own FLOPs per token, with the warmup, cosine and evaluations scaled to its
steps. The window of sizes is centred on 300 tokens per parameter for the LMU and 1,000 for
the transformer: where these tiny models' optima lie (runs centred on 10, then 100, found most
optima at or below the smallest size tried). ``after`` then runs the analysis: the IsoFLOP
parabolas (Chinchilla's approach 2) and N_opt(C), the lower envelope of the evaluation curves
(approach 1), and the tokens each family needs to reach a loss, into WORKDIR/analysis. Two
sizes per family also train at 3 learning rates for 150 steps, for the learning-rate figure.
"""

import dataclasses
from pathlib import Path

from lmuscale.sweep.grids import chosen_learning_rates, isoflop_grid, learning_rate_grid
from lmuscale.train.config import load_module

demo = load_module(Path(__file__).parent / "demo.py")  # the models and training of the demo

BUDGETS = (8e10, 1.6e11, 3.2e11)  # training FLOPs
WIDTHS = (4, 6, 8, 12, 16, 24, 32, 48, 64)
# and a small learning-rate sweep, for the analysis's learning-rate figure and file
LR_WIDTHS = (8, 16)
LEARNING_RATES = (1e-3, 3e-3, 1e-2)
LR_STEPS = 150
THROUGHPUT = demo.THROUGHPUT


def config(model):
    """The demo's training, with lighter evaluations: every run is evaluated 10 times."""
    c = demo.config(model)
    c.eval.update(batches=2, final_batches=8)
    return c


def get_trials(done):
    """The learning-rate trials first; the IsoFLOP trials wait for the rates they choose."""
    small = {
        "lmu": [demo.lmu(d) for d in LR_WIDTHS],
        "transformer": [demo.transformer(d) for d in LR_WIDTHS],
    }
    rate_trials = learning_rate_grid(small, LEARNING_RATES, config, steps=LR_STEPS)
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
        tokens_per_param={"lmu": 300.0, "transformer": 1000.0},
        min_steps=40,
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
