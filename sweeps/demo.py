"""The embedded default sweep: LMUs and transformers at four sizes each on Shakespeare.

    python -m lmuscale.sweep sweeps/demo.py       (what `make demo` runs)

Byte-level models (vocabulary 256, so the embedding is small next to N) on the 38 plays of the
embedded corpus, prepared into data/shakespeare-bytes on first use with no network. Every
trial sees the same 200 steps of 16 x 128 bytes (410k tokens), so at these sizes the loss
should fall as N grows. The whole sweep takes about three and a half minutes on two CPU cores;
then ``after`` fits and draws Figures 3-5 into WORKDIR/analysis.
"""

from lmuscale.models import LMUConfig, TransformerConfig
from lmuscale.sweep import Throughput, Trial
from lmuscale.train import base_config

STEPS = 200
WIDTHS = (16, 24, 32, 48)

# Model FLOP/s per trial for --dry-run's estimate before any trial has run: the median, over
# three fresh-clone runs of `make demo` on a 2-core CPU (2026-11-25), of each family's median
# step speed: LMUs 13.8 GFLOP/s (13.3-18.6), transformers 16.8 (16.5-19.6). The dry run adds
# the CPU's per-trial start-up, compilation and evaluation time (plan.OVERHEAD_SECONDS).
THROUGHPUT = Throughput(
    None,
    families={"lmu": 1.38e10, "transformer": 1.68e10},
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


def get_trials():
    for d in WIDTHS:
        yield Trial(f"lmu-d{d}", config(lmu(d)))
    for d in WIDTHS:
        yield Trial(f"transformer-d{d}", config(transformer(d)))


def after(workdir):
    """Once every trial is done: fits, Figures 3-5 and fits.md in WORKDIR/analysis."""
    from lmuscale.analysis import analyse

    report = analyse(workdir / "results.jsonl", workdir / "analysis", n_boot=200)
    print("analysis:", *report.lines(), sep="\n")
