"""The LSTM language model: the recurrent baseline of Kaplan et al.'s LSTM curve (Figure 7).

One layer, pre-norm with a residual as in every family here (so depth means the same thing
across families), for x̃_t = LayerNorm(x_t):
  [z_i; z_f; z_g; z_o] = W x̃_t + b + U h_{t-1};  i, f, o = sigmoid(z_i, z_f, z_o);  g = tanh(z_g);
  c_t = f ⊙ c_{t-1} + i ⊙ g;  h_t = o ⊙ tanh(c_t);  layer output x_t + h_t.
W x̃_t + b is one matmul for every position; only U h_{t-1} is inside the scan (``lstm_cell``).
W is lecun-normal, U orthogonal, b zero but for the forget gate's 1 (Gers et al. 2000;
Jozefowicz et al. 2015). The state (h, c) is float32 in every compute dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from lmuscale.layers import DEFAULT_INIT, layer_norm
from lmuscale.models import sizes
from lmuscale.models.base import LanguageModel, RecurrentConfig, compute_dtype
from lmuscale.models.family import Family, register


@dataclasses.dataclass(frozen=True)
class LSTMConfig(RecurrentConfig):
    """An LSTM language model: ``n_layers`` LSTM layers of width ``d`` (state h and c of d)."""

    n_layers: int = 3


def forget_bias_init(key, shape, dtype=jnp.float32):
    """Zero biases for the gates [i, f, g, o] except the forget gate's, which are 1."""
    del key
    width = shape[-1] // 4
    return jnp.zeros(shape, dtype).at[..., width : 2 * width].set(1.0)


def lstm_cell(carry, zx_Bx4D, u_Dx4D, dtype):
    """One LSTM step from ``carry`` = (h_{t-1}, c_{t-1}) and ``zx_Bx4D`` = W x̃_t + b (float32),
    with U in ``dtype`` accumulated in float32: ``((h_BxD, c_BxD), h_BxD)``."""
    h_BxD, c_BxD = carry
    z_Bx4D = zx_Bx4D + jnp.dot(
        h_BxD.astype(dtype), u_Dx4D.astype(dtype), preferred_element_type=jnp.float32
    )
    zi, zf, zg, zo = jnp.split(z_Bx4D, 4, axis=-1)
    c_BxD = jax.nn.sigmoid(zf) * c_BxD + jax.nn.sigmoid(zi) * jnp.tanh(zg)
    h_BxD = jax.nn.sigmoid(zo) * jnp.tanh(c_BxD)
    return (h_BxD, c_BxD), h_BxD


class LSTMLayer(nn.Module):
    """``x + LSTM(LN(x))``. Parameters: ``norm``, ``input`` (kernel W (d, 4d) and bias b, gates
    [i, f, g, o] in that order along the 4d axis) and ``recurrent`` (U, (d, 4d))."""

    d: int
    dtype: Any = jnp.float32

    def setup(self):
        self.norm = layer_norm(self.dtype)
        self.input = nn.Dense(
            4 * self.d, dtype=self.dtype, kernel_init=DEFAULT_INIT, bias_init=forget_bias_init
        )
        self.recurrent = self.param("recurrent", nn.initializers.orthogonal(), (self.d, 4 * self.d))

    def __call__(self, x_BxTxD):
        zx_TxBx4D = jnp.moveaxis(self.input(self.norm(x_BxTxD)).astype(jnp.float32), 1, 0)
        u_Dx4D = self.recurrent.astype(self.dtype)  # once, not at every step

        def one(carry, zx_Bx4D):
            return lstm_cell(carry, zx_Bx4D, u_Dx4D, self.dtype)

        zeros = jnp.zeros((x_BxTxD.shape[0], self.d), jnp.float32)
        _, h_TxBxD = lax.scan(one, (zeros, zeros), zx_TxBx4D)
        return x_BxTxD + jnp.moveaxis(h_TxBxD, 0, 1).astype(x_BxTxD.dtype)

    def decode_state(self, batch_size: int, max_len: int | None = None):
        del max_len  # constant size
        zeros = jnp.zeros((batch_size, self.d), jnp.float32)
        return {"h": zeros, "c": zeros}

    def step(self, state, x_BxD, index):
        del index
        zx_Bx4D = self.input(self.norm(x_BxD)).astype(jnp.float32)
        (h_BxD, c_BxD), _ = lstm_cell((state["h"], state["c"]), zx_Bx4D, self.recurrent, self.dtype)
        return x_BxD + h_BxD.astype(x_BxD.dtype), {"h": h_BxD, "c": c_BxD}


class LSTMLanguageModel(LanguageModel):
    config: LSTMConfig
    block_class = LSTMLayer

    def block_fields(self, layer: int) -> dict:
        del layer
        return {"d": self.config.d, "dtype": compute_dtype(self.config.dtype)}


def lstm_params(config: LSTMConfig) -> sizes.ParamCount:
    d = config.d
    per_layer = 2 * d + 4 * d * d + 4 * d + 4 * d * d  # pre-LN 2d, W (4d^2) with bias 4d, U (4d^2)
    return sizes.ParamCount(config.n_layers * per_layer + 2 * d, config.vocab_size * d)


def lstm_flops(config: LSTMConfig, seq_len: int = 1024) -> sizes.FlopCount:
    """2 per weight of W (all positions at once) and of U (inside the scan), plus 18 d
    element-wise per layer (b 4, U h add 4, four gate nonlinearities, c 3, tanh(c) 1, h 1, the
    residual add 1). ``seq_len`` changes nothing: the recurrence is O(1) per token."""
    del seq_len
    d = config.d
    terms = {
        "input_projection": 8.0 * d * d,
        "recurrent_projection": 8.0 * d * d,
        "recurrence": float(18 * d),
    }
    return sizes.FlopCount(terms, config.n_layers, 2.0 * d * config.vocab_size)


def lstm_config(size: str, **overrides) -> LSTMConfig:
    """LSTM at a Table 3 grid point: the LMU's width, the number of layers (8d^2 + 6d each)
    solved for N: 3 at every row, N +2.3%, +2.7%, +0.3%, +1.1%, +0.1%, +0.3% off the row."""
    return dataclasses.replace(sizes.deepened(LSTMConfig, size), **overrides)


register(Family("lstm", LSTMConfig, LSTMLanguageModel, lstm_config, lstm_params, lstm_flops))
