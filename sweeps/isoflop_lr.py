"""Step 1 of sweeps/isoflop.py: a learning rate for each size of each family.

    python -m lmuscale.sweep sweeps/isoflop_lr.py
    (after: the analysis picks each size's rate into runs/isoflop_lr/analysis/learning_rates.json,
    which sweeps/isoflop.py reads)

Every second candidate size of sweeps/isoflop.py up to 20M (N from 20k, 3 per decade), each at
five learning rates half a decade apart, for 500 steps of the paper's batch (262M tokens):
Porian et al. (2024) found a rate, warmup and batch tuned per size necessary for a trustworthy
frontier. The analysis fits a parabola in log LR around the best rate of each size and says
where the best lies at the edge of the grid (extend it there). Larger sizes of the grid take
the rate of the largest size swept.
"""

from pathlib import Path

from lmuscale.models import count_params
from lmuscale.sweep.grids import learning_rate_grid
from lmuscale.train.config import load_module

HERE = Path(__file__).parent
isoflop = load_module(HERE / "isoflop.py")

LEARNING_RATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
STEPS = 500
LARGEST = 20e6  # non-embedding parameters
THROUGHPUT = isoflop.THROUGHPUT
SLURM = isoflop.SLURM


def get_trials():
    models = {
        family: [m for m in sizes[::2] if count_params(m).non_embedding <= LARGEST]
        for family, sizes in isoflop.models().items()
    }
    return learning_rate_grid(models, LEARNING_RATES, isoflop.owt2.paper_training, steps=STEPS)


def after(workdir):
    """Once every trial is done: the learning rate of each size, and the figure."""
    from lmuscale.analysis import analyse

    report = analyse(workdir / "results.jsonl", workdir / "analysis", split="val")
    print("analysis:", *report.lines(), sep="\n")
