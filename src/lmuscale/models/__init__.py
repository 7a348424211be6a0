"""Language models: the LMU (and its _G variant), the transformer, and the recurrent
baselines SRU, SRU++ and LSTM; importing this package registers every family."""

from __future__ import annotations

# Importing a family's module registers it; this order is the order families are listed in.
# isort: off
from lmuscale.models import lmu, transformer, sru, lstm  # noqa: F401

# isort: on
from lmuscale import ops
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


def build(config: ModelConfig, impls: ops.Impls | None = None) -> LanguageModel:
    """The model of ``config``, its ops run as ``impls`` says: what ``ops.resolve`` decided for
    a run (None: XLA's forms for a CPU). A ``ValueError`` names a switch of the config that
    ``impls`` does not follow ("pallas" asked, "xla" given, or the reverse)."""
    impls = ops.Impls() if impls is None else impls
    for switch, given in ((ops.LOSS, impls.loss), (ops.MEMORY, impls.memory)):
        asked = getattr(config, switch.key, "auto")
        if asked != "auto" and given is not None and given != asked:
            raise ValueError(f"{switch.key}={asked!r} in the config, but the impls run {given!r}")
    return families.of(config).model(config, impls=impls)


def __getattr__(name: str):
    if name == "NAMES":  # as sizes.NAMES: every family registered by now, at every size
        return sizes.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
