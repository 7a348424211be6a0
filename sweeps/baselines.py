"""The recurrent baselines on the paper's grid: SRU, SRU++ and LSTM at Table 3's six sizes.

    python -m lmuscale.sweep sweeps/baselines.py --dry-run
    python -m lmuscale.sweep sweeps/baselines.py --executor slurm --slurm slurm_partition=gpu

Each trial is ``experiments/owt2.py``'s paper config of that name (``paper(name)``): the
model sized on the grid by ``lmuscale.models.sizes`` (the LMU's width, depth or d' solved for
N), trained as the paper trains the LMU, 25,000 steps of 512 x 1024 tokens (13.1B tokens). Its
results table sits beside sweeps/owt2.py's; the LSTM points are the measured counterpart of
the LSTM reference curve in Figure 3.
"""

from pathlib import Path

from lmuscale.models.sizes import BASELINE_FAMILIES, SIZES
from lmuscale.sweep import Trial, from_benchmarks

EXPERIMENT = "../experiments/owt2.py"  # relative to this file

# As sweeps/owt2.py: the GPU benchmark's speed of each model (or its family's median) in
# benchmarks/results, for --dry-run's estimate until the trials have measured their own. Only
# until such a JSON exists is 1e14 used, a guess of ~10% of an H100's dense bf16 peak; a scan
# over 1024 positions is latency-bound, so these recurrent models may well fall short of it.
THROUGHPUT = from_benchmarks(Path(__file__).parent.parent / "benchmarks" / "results", default=1e14)

SLURM = {"gpus_per_node": 1, "tasks_per_node": 1, "cpus_per_task": 8, "timeout_min": 24 * 60}


def get_trials():
    for family in BASELINE_FAMILIES:
        for size in SIZES:
            yield Trial(f"{family}-{size}", f"{EXPERIMENT}:{family}-{size}")
