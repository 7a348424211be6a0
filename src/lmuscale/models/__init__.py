"""Language models: the LMU (and its _G variant), the transformer, and the recurrent
baselines SRU, SRU++ and LSTM; importing this package registers every family."""

from __future__ import annotations

# Importing a family's module registers it; this order is the order families are listed in.
# isort: off
from lmuscale.models import lmu, transformer, sru, lstm  # noqa: F401

# isort: on
from lmuscale.models import family as families
from lmuscale.models import sizes
from lmuscale.models.base import LanguageModel, cross_entropy, decode
from lmuscale.models.family import ModelConfig
from lmuscale.models.lmu import LMUConfig, LMULanguageModel
from lmuscale.models.lstm import LSTMConfig, LSTMLanguageModel
from lmuscale.models.sizes import count_params, flops_per_token, named_config
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
    return families.of(config).model(config)


def __getattr__(name: str):
    if name == "NAMES":  # as sizes.NAMES: every family registered by now, at every size
        return sizes.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
