"""Tokenizers, sources, preparing token files once and the deterministic loader (README, "Data")."""

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
