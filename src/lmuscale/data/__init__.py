"""Data: tokenizers, sources, preparing token files once, and the deterministic loader.

python -m lmuscale.data prepare shakespeare --out data/shakespeare
dataset = open_dataset("data/shakespeare")
batches = TrainBatches(dataset, seq_len=1024, global_batch=512, seed=0)
tokens_BxT1 = batches(step)  # this process's rows; inputs [:, :-1], targets [:, 1:]
"""

from lmuscale.data.loader import (
    EvalBatch,
    TokenDataset,
    TrainBatches,
    eval_batches,
    eval_steps,
    open_dataset,
    permute,
)
from lmuscale.data.prepare import prepare_embedded
from lmuscale.data.sources import EMBEDDED_SOURCES, DataError, open_source
from lmuscale.data.tokenizer import Tokenizer, byte_tokenizer, get_tokenizer, gpt2_tokenizer

__all__ = [
    "EMBEDDED_SOURCES",
    "DataError",
    "EvalBatch",
    "TokenDataset",
    "Tokenizer",
    "TrainBatches",
    "byte_tokenizer",
    "eval_batches",
    "eval_steps",
    "get_tokenizer",
    "gpt2_tokenizer",
    "open_dataset",
    "open_source",
    "permute",
    "prepare_embedded",
]
