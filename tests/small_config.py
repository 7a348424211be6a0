"""A training config small enough for tests: a 1-layer byte-level LMU on a test corpus.

Used in-process (``small(data_path)``) and by subprocess runs as a config file
(``tests/small_config.py:small`` with the data folder in ``$LMUSCALE_TEST_DATA``).
"""

import os

from lmuscale.models import LMUConfig
from lmuscale.train import base_config


def small(data_path: str = ""):
    model = LMUConfig(
        d=16,
        q=8,
        q_prime=2,
        theta=16.0,
        n_layers=1,
        pre_ffn_dim=16,
        post_ffn_dim=16,
        vocab_size=256,
        batch_chunk=0,
    )
    config = base_config(model)
    config.name = "small"
    config.data.update(path=data_path, tokenizer="bytes", seq_len=32)
    config.train.update(steps=12, global_batch=8)
    config.optim.update(learning_rate=1e-2, warmup_steps=2)
    config.eval.update(every=4, global_batch=8, batches=2)
    config.checkpoint.update(every=4, keep=2)
    config.log.update(every=1, progress=False)
    return config


def get_config(name):
    if name != "small":
        raise ValueError(f"unknown config {name!r}")
    return small(os.environ.get("LMUSCALE_TEST_DATA", ""))
