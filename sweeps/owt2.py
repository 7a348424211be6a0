"""The paper's grid on OpenWebText2 (Figures 3, 4 and 5).

    python -m lmuscale.sweep sweeps/owt2.py --dry-run
    python -m lmuscale.sweep sweeps/owt2.py --executor slurm --slurm slurm_partition=gpu

- LMU and LMU_G at the six Table 3 sizes (55k ... 1M non-embedding parameters), and the
  transformer at the same sizes: 25,000 steps of 512 x 1024 tokens each (13.1B tokens).
- The transformers again at 10x the steps (250,000; 131B tokens), for Figure 5.

The recurrent baselines (SRU, SRU++, LSTM) on the same grid are sweeps/baselines.py.

The data folder is ``$LMUSCALE_OWT2`` (default data/owt2); see experiments/owt2.py for how to
prepare it.
"""

from pathlib import Path

from lmuscale.models.sizes import PAPER_FAMILIES, SIZES
from lmuscale.sweep import Trial, from_benchmarks

EXPERIMENT = "../experiments/owt2.py"  # relative to this file

# Model FLOP/s one trial is assumed to reach, for --dry-run's estimate until trials have
# measured their own: each model's speed in the newest GPU benchmark in benchmarks/results
# (benchmarks/gpu.py; $LMUSCALE_GPU_BENCHMARK picks another device's), else its family's
# median there. Only until such a JSON exists is 1e14 used: ~10% of an H100's dense bf16 peak
# (989 TFLOP/s), a guess for models this small. Give --throughput to try another.
THROUGHPUT = from_benchmarks(Path(__file__).parent.parent / "benchmarks" / "results", default=1e14)

# submitit parameters for --executor slurm; add the partition, account, etc. of your cluster
# with --slurm KEY=VALUE.
SLURM = {"gpus_per_node": 1, "tasks_per_node": 1, "cpus_per_task": 8, "timeout_min": 24 * 60}


def get_trials():
    for family in PAPER_FAMILIES:
        for size in SIZES:
            yield Trial(f"{family}-{size}", f"{EXPERIMENT}:{family}-{size}")
    for size in SIZES:
        yield Trial(
            f"transformer-{size}-10x",
            f"{EXPERIMENT}:transformer-{size}",
            overrides={"train.steps": 250_000},
        )
