"""A compute-optimal comparison small enough for a laptop: LMU vs transformer at 3 budgets.

    python -m lmuscale.sweep sweeps/isoflop_demo.py      (about 15 minutes on two CPU cores)

The byte-level models of sweeps/demo.py on the embedded plays, at 3 compute budgets a factor 2
apart. Each budget trains the 5 sizes per family whose tokens per parameter lie nearest 100
(where these tiny models' optima lie: a first run centred on 10 found every optimum at or
below its smallest size), each for the steps the budget buys at its own FLOPs per token, with
the warmup, cosine and evaluations scaled to its steps. ``after`` then runs the analysis: the
IsoFLOP parabolas (Chinchilla's approach 2) and N_opt(C), the lower envelope of the evaluation
curves (approach 1), and the tokens each family needs to reach a loss, into WORKDIR/analysis."""

from pathlib import Path

from lmuscale.sweep.grids import isoflop_grid
from lmuscale.train.config import load_module

demo = load_module(Path(__file__).parent / "demo.py")  # the models and training of the demo

BUDGETS = (8e10, 1.6e11, 3.2e11)  # training FLOPs
WIDTHS = (8, 12, 16, 24, 32, 48, 64, 96, 128)
THROUGHPUT = demo.THROUGHPUT


def get_trials():
    models = {
        "lmu": [demo.lmu(d) for d in WIDTHS],
        "transformer": [demo.transformer(d) for d in WIDTHS],
    }
    return isoflop_grid(
        models, BUDGETS, demo.config, per_budget=5, tokens_per_param=100.0, min_steps=40
    )


def after(workdir):
    """Once every trial is done: the compute-optimal analyses and their figures."""
    from lmuscale.analysis import analyse

    report = analyse(workdir / "results.jsonl", workdir / "analysis", split="val", n_boot=200)
    print(f"analysis: {', '.join(str(p) for p in report.files)}")
