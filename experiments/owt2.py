"""The paper's training runs on OpenWebText2, and ``tiny``, a one-minute CPU run.

    python -m lmuscale.train --config experiments/owt2.py:lmu-1M --workdir runs/lmu-1M
    python -m lmuscale.train --config experiments/owt2.py:tiny --workdir runs/tiny

Names: ``{lmu, lmu_g, transformer}-{55k, 100k, 200k, 300k, 500k, 1M}`` (Table 3), the
recurrent baselines ``{sru, sru_pp, lstm}-{55k, ..., 1M}`` on the same grid, and ``tiny``.
The paper configs compute in bfloat16 with micro-batches planned from the device's memory
(``--config.train.memory_budget_gb`` sets the budget); ``tiny`` computes in float32.
The OWT2 token folder is ``$LMUSCALE_OWT2`` (default ``data/owt2``) or
``--config.data.path=DIR``; make it with
``python -m lmuscale.data prepare owt2 openwebtext2.jsonl.zst.tar --out data/owt2``.

``tiny`` is a 2-layer byte-level LMU (d 48, q 16; 250 steps of 16 x 128 bytes) on the
embedded Shakespeare plays, prepared into ``data/shakespeare-bytes`` on first use with no
network: a check that the whole pipeline learns, in about a minute on two CPU cores.
"""

import dataclasses
import os

from lmuscale.models import NAMES, LMUConfig, named_config
from lmuscale.train import base_config


def paper(name: str):
    """A Table 3 model with the paper's training: 25,000 steps of 512 x 1024 tokens.

    The model computes in bfloat16; its parameters, the Adam state, the LMU's carried memory
    and the loss's sums stay float32. Each step takes as few micro-batches as fit in the
    device's memory (``train.microbatches = 0``: planned by compiling the step), so the
    implicit attention runs over whole micro-batches (``batch_chunk = 0``) with nothing
    rematerialised.
    """
    config = paper_training(named_config(name))
    config.name = name
    return config


def paper_training(model):
    """Any model (e.g. one of a compute-optimal grid, sweeps/isoflop.py) with the paper's
    training, computing in bfloat16 as ``paper`` describes."""
    model = dataclasses.replace(model, dtype="bfloat16")
    if hasattr(model, "batch_chunk"):
        model = dataclasses.replace(model, batch_chunk=0)
    config = base_config(model)
    config.data.path = os.environ.get("LMUSCALE_OWT2", "data/owt2")
    config.data.source = "owt2"
    config.train.microbatches = 0
    return config


def tiny():
    model = LMUConfig(
        d=48,
        q=16,
        q_prime=4,
        theta=32.0,
        n_layers=2,
        pre_ffn_dim=64,
        post_ffn_dim=96,
        vocab_size=256,
        batch_chunk=0,
    )
    config = base_config(model)
    config.name = "tiny"
    config.data.update(
        path="data/shakespeare-bytes", source="shakespeare", prepare=True, tokenizer="bytes"
    )
    config.data.seq_len = 128
    config.train.update(steps=250, global_batch=16)
    config.optim.update(learning_rate=3e-3, warmup_steps=25)
    config.eval.update(every=50, global_batch=32, batches=8)
    config.checkpoint.every = 100
    config.log.every = 10
    return config


def get_config(name):
    if name == "tiny":
        return tiny()
    if name in NAMES:
        return paper(name)
    raise ValueError(f"unknown config {name!r}; this file has tiny, {', '.join(NAMES)}")
