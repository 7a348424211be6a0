"""Language models: the LMU (and its _G variant), the transformer, and the recurrent
baselines SRU, SRU++ and LSTM.

``build(config)`` gives the Flax module for a config; ``sizes`` holds the named configs of
Table 3, the parameter counter and the FLOPs per token.
"""

from __future__ import annotations

from lmuscale.models.base import LanguageModel, cross_entropy, decode
from lmuscale.models.lmu import LMUConfig, LMULanguageModel
from lmuscale.models.lstm import LSTMConfig, LSTMLanguageModel
from lmuscale.models.sizes import (
    NAMES,
    ModelConfig,
    count_params,
    flops_per_token,
    named_config,
)
from lmuscale.models.sru import SRUConfig, SRULanguageModel, SRUPPConfig
from lmuscale.models.transformer import TransformerConfig, TransformerLanguageModel

__all__ = [
    "NAMES",
    "LMUConfig",
    "LMULanguageModel",
    "LSTMConfig",
    "LSTMLanguageModel",
    "LanguageModel",
    "ModelConfig",
    "SRUConfig",
    "SRULanguageModel",
    "SRUPPConfig",
    "TransformerConfig",
    "TransformerLanguageModel",
    "build",
    "count_params",
    "cross_entropy",
    "decode",
    "flops_per_token",
    "named_config",
]


def build(config: ModelConfig) -> LanguageModel:
    if isinstance(config, LMUConfig):
        return LMULanguageModel(config)
    if isinstance(config, TransformerConfig):
        return TransformerLanguageModel(config)
    if isinstance(config, SRUConfig | SRUPPConfig):
        return SRULanguageModel(config)
    if isinstance(config, LSTMConfig):
        return LSTMLanguageModel(config)
    raise TypeError(f"no model for a {type(config).__name__}")
