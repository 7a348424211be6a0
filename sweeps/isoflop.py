"""Compute-optimal LMU, LMU_G and transformer on OpenWebText2: an IsoFLOP study.

    python -m lmuscale.sweep sweeps/isoflop_lr.py                 # 1. a learning rate per size
    python -m lmuscale.sweep sweeps/isoflop.py --dry-run          # 2. the grid and its cost
    python -m lmuscale.sweep sweeps/isoflop.py --executor slurm   #    ... and run it
    python -m lmuscale.analysis runs/isoflop/results.jsonl --out runs/isoflop/analysis

Five compute budgets from 1e15 to 1e18 training FLOPs, a factor 10^0.75 apart. At each, each
family trains the 7 sizes of its sizing rule (Table 3's, extended beyond its rows: d =
sqrt(N / 24), q and q' as the table's ratios) whose tokens per parameter lie nearest 20,
each for the steps the budget buys at its own FLOPs per token (the GPT-2 unembedding
included). The paper's training otherwise: Adam, warmup then cosine, scaled to each run.

Learning rates: each size trains at the rate the analysis of sweeps/isoflop_lr.py chose for it
(``runs/isoflop_lr/analysis/learning_rates.json``, interpolated in log N between the sizes
swept). Until that file exists every trial waits for it: ``--dry-run`` lists them and their
cost, and running the sweep runs none of them and says why.
"""

import dataclasses
from pathlib import Path

from lmuscale.models import families
from lmuscale.sweep import from_benchmarks
from lmuscale.sweep.grids import isoflop_grid
from lmuscale.train.config import load_module

HERE = Path(__file__).parent
owt2 = load_module(HERE.parent / "experiments" / "owt2.py")

FAMILIES = ("lmu", "lmu_g", "transformer")
BUDGETS = tuple(10 ** (15 + 0.75 * k) for k in range(5))  # 1e15 ... 1e18
# Candidate sizes: N from 20k to 200M non-embedding parameters, 6 per decade.
CANDIDATES = tuple(round(2e4 * 10 ** (k / 6)) for k in range(25))
LEARNING_RATES = HERE.parent / "runs" / "isoflop_lr" / "analysis" / "learning_rates.json"
THROUGHPUT = from_benchmarks(HERE.parent / "benchmarks" / "results", default=1e14)
SLURM = {"timeout_min": 24 * 60, "gpus_per_node": 1, "cpus_per_task": 8}


def models():
    return {f: [families.get(f).sized(n) for n in CANDIDATES] for f in FAMILIES}


def get_trials():
    from lmuscale.analysis.learning_rate import read_learning_rates

    ready = LEARNING_RATES.exists()
    where = LEARNING_RATES.relative_to(HERE.parent)
    trials = isoflop_grid(
        models(),
        BUDGETS,
        owt2.paper_training,
        per_budget=7,
        tokens_per_param=20.0,
        learning_rate=read_learning_rates(LEARNING_RATES).interpolate if ready else None,
        learning_rate_from=f"{where} (interpolated in log N)",
    )
    if ready:
        return trials
    waits = f"its learning rate from {where}: run sweeps/isoflop_lr.py first"
    return [dataclasses.replace(t, waits=waits) for t in trials]
