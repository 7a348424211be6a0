"""The task models: the parallel LMU (or an LSTM) between an optional embedding and a head.

    [embedding] -> ParallelLMU (eqs 18-20) | LSTM layers -> [Dense(hidden)] -> Dense(outputs)

A sequence task (Mackey-Glass) predicts at every step; a classifier reads the last step (eq
25). Padding (IMDB, token 0 on the left) embeds as exactly zero, so without an encoder
(``memory_dim=0``, the paper's IMDB model) it changes nothing; otherwise it is an input.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from lmuscale.layers import ParallelLMU, activation

KINDS = ("lmu", "lstm")


@dataclasses.dataclass(frozen=True)
class TaskModelConfig:
    """One task model: ``kind`` "lmu" (the ParallelLMU's fields, see there) or "lstm"
    (``lstm_units``, ``lstm_layers``), then ``hidden`` units of one Dense layer (0: none) and
    ``outputs`` (1 for regression or a binary logit, else the classes), at every step or only
    the last (``sequence_output``). ``vocab_size`` and ``embed_dim`` put a token embedding in
    front (0: the input is already numbers)."""

    kind: str
    outputs: int
    sequence_output: bool
    units: int = 0
    order: int = 1
    theta: float = 1.0
    memory_dim: int = 0
    input_activation: str = "linear"
    output_activation: str = "tanh"
    mode: str = "fft"
    lstm_units: int = 0
    lstm_layers: int = 1
    hidden: int = 0
    hidden_activation: str = "relu"
    vocab_size: int = 0
    embed_dim: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"model.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "lstm" and self.lstm_units <= 0:
            raise ValueError(f"model.lstm_units must be > 0 for an LSTM, got {self.lstm_units}")
        if self.kind == "lmu" and (self.order <= 0 or not self.theta > 0):
            raise ValueError(
                f"model.order and model.theta must be > 0, got {self.order}, {self.theta}"
            )
        for name in ("units", "memory_dim", "hidden", "vocab_size", "embed_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if self.lstm_layers <= 0:
            raise ValueError(f"model.lstm_layers must be > 0, got {self.lstm_layers}")
        if self.mode not in ("fft", "scan"):
            raise ValueError(f"model.mode must be 'fft' or 'scan', got {self.mode!r}")
        if (self.vocab_size > 0) != (self.embed_dim > 0):
            raise ValueError("model.vocab_size and model.embed_dim must both be > 0 or both 0")
        for name in ("input_activation", "output_activation", "hidden_activation"):
            activation(getattr(self, name))


class TaskModel(nn.Module):
    config: TaskModelConfig

    @nn.compact
    def __call__(self, x):
        """``x_BxTxD`` numbers (or ``tokens_BxT``) -> ``y_BxTxO`` (``y_BxO`` for the last step)."""
        c = self.config
        if c.vocab_size:  # padding (token 0) stays exactly zero
            x = nn.Embed(c.vocab_size, c.embed_dim, name="embed")(x) * (x != 0)[..., None]
        if c.kind == "lmu":
            h = ParallelLMU(
                units=c.units,
                order=c.order,
                theta=c.theta,
                memory_dim=c.memory_dim,
                input_activation=c.input_activation,
                output_activation=c.output_activation,
                return_sequences=c.sequence_output,
                mode=c.mode,
                name="sequence",
            )(x)
        else:
            for i in range(c.lstm_layers):  # parent=None: the cell is lstm_i/cell, not a sibling
                x = nn.RNN(nn.OptimizedLSTMCell(c.lstm_units, parent=None), name=f"lstm_{i}")(x)
            h = x if c.sequence_output else x[:, -1]
        if c.hidden:
            h = activation(c.hidden_activation)(nn.Dense(c.hidden, name="dense")(h))
        return nn.Dense(c.outputs, name="head")(h)


def tree_params(params) -> int:
    """Trainable numbers in a parameter tree."""
    return int(sum(leaf.size for leaf in jax.tree.leaves(params)))
