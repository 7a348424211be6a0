"""The embedded default sweep: the paper's three figures from LMUs, LMU_Gs and transformers on
the embedded Shakespeare.

    python -m lmuscale.sweep sweeps/demo.py       (what `make demo` runs)

Byte-level models (vocabulary 256, so the embedding is small next to N) on the 38 plays of the
embedded corpus, prepared into data/shakespeare-bytes on first use with no network. An LMU and
a transformer at each of four widths see the same 200 steps of 16 x 128 bytes (410k tokens):
Figure 3. LMU_G at two widths, on the same tokens: Figure 4's second panel. Transformers at two
widths on 5x the tokens: Figure 5 from measured runs. The sweep takes about five minutes on
two CPU cores; then ``after`` fits, draws Figures 3-5 into WORKDIR/analysis, and reads the
paper's three claims off these runs.
"""

import dataclasses

from lmuscale.models import LMUConfig, TransformerConfig
from lmuscale.sweep import Throughput, Trial
from lmuscale.train import base_config

STEPS = 200
WIDTHS = (16, 24, 32, 48)
# Figure 4's second panel: LMU_G at two of the widths. Figure 5: transformers on TIMES x the
# LMU's tokens, the largest multiple that keeps `make demo` within 6 minutes on two cores (the
# paper's is 10x; at 10x, transformer-d16 alone takes 50 s here).
G_WIDTHS = (16, 32)
TIMES, LONGER_WIDTHS = 5, (16, 24)

# Model FLOP/s per trial for --dry-run's estimate before any trial has run: the median, over
# three fresh-clone runs of `make demo` on a 2-core CPU (2026-11-25), of each family's median
# step speed: LMUs 13.8 GFLOP/s (13.3-18.6), transformers 16.8 (16.5-19.6); LMU_G 10 GFLOP/s
# (lmu_g-d16 and -d48, one run each, 2026-11-28). The dry run adds the CPU's per-trial
# start-up, compilation and evaluation time (plan.OVERHEAD_SECONDS).
THROUGHPUT = Throughput(
    None,
    families={"lmu": 1.38e10, "lmu_g": 1.0e10, "transformer": 1.68e10},
    source="THROUGHPUT in sweeps/demo.py, measured on a 2-core CPU",
    platform="cpu",
)


def lmu(d: int) -> LMUConfig:
    return LMUConfig(
        d=d,
        q=16,
        q_prime=4,
        theta=64.0,
        n_layers=2,
        pre_ffn_dim=d,
        post_ffn_dim=2 * d,
        vocab_size=256,
        batch_chunk=0,
    )


def lmu_g(d: int) -> LMUConfig:
    """The LMU with causal attention in place of each block's pre-FFN (the paper's LMU_G)."""
    return dataclasses.replace(
        lmu(d), global_attention=True, n_heads=max(1, d // 16), pre_ffn_dim=0
    )


def transformer(d: int) -> TransformerConfig:
    return TransformerConfig(d=d, n_heads=max(1, d // 16), n_layers=2, max_len=128, vocab_size=256)


def config(model):
    c = base_config(model)
    c.data.update(
        path="data/shakespeare-bytes", source="shakespeare", prepare=True, tokenizer="bytes"
    )
    c.data.seq_len = 128
    c.train.update(steps=STEPS, global_batch=16)
    c.optim.update(learning_rate=3e-3, warmup_steps=20)
    c.eval.update(every=50, global_batch=32, batches=4, final_batches=16)
    c.checkpoint.update(every=50, keep=1)
    # TensorBoard events in each trial's folder (log.* keys leave the trial's hash as it was).
    c.log.update(every=10, progress=False, tensorboard=True)
    return c


def longer(c, times: int):
    """``c`` trained on ``times`` x the tokens, evaluated and saved less often."""
    c.train.steps *= times
    c.eval.every *= 2
    c.checkpoint.every *= times
    return c


def get_trials():
    for d in WIDTHS:
        yield Trial(f"lmu-d{d}", config(lmu(d)))
    for d in WIDTHS:
        yield Trial(f"transformer-d{d}", config(transformer(d)))
    for d in G_WIDTHS:
        yield Trial(f"lmu_g-d{d}", config(lmu_g(d)))
    for d in LONGER_WIDTHS:
        yield Trial(f"transformer-d{d}-{TIMES}x", longer(config(transformer(d)), TIMES))


def after(workdir):
    """Once every trial is done: fits, Figures 3-5 and fits.md in WORKDIR/analysis."""
    from lmuscale.analysis import analyse

    report = analyse(workdir / "results.jsonl", workdir / "analysis", n_boot=200)
    print("analysis:", *report.lines(), sep="\n")
