"""SRU and SRU++ language models (REFERENCE §5, papers/sru-notes.txt), recurrent baselines.

token embedding (tied with the output) -> n_layers x SRU layer -> final LayerNorm -> logits.
No positional embeddings: the recurrence carries the order.

One SRU layer, for the layer input x_t (the residual stream) and x̃_t = LayerNorm(x_t):
  [W x̃_t; W_f x̃_t; W_r x̃_t] = U_t, one matmul for every position at once;
  f_t = sigmoid(W_f x̃_t + v_f ⊙ c_{t-1} + b_f);  r_t = sigmoid(W_r x̃_t + v_r ⊙ c_{t-1} + b_r);
  c_t = f_t ⊙ c_{t-1} + (1 - f_t) ⊙ W x̃_t;  h_t = r_t ⊙ c_t + (1 - r_t) ⊙ x_t.
The gates see c_{t-1}, so the recurrence is not linear in c (no FFT, no associative scan): it
runs in ``lax.scan`` over time, element-wise per channel. ``sru_cell`` is that element-wise
step, the one function both the scan and the decoding ``step`` call.

Choices the equations leave open, made here:
- Pre-LayerNorm: the matmul (or SRU++'s attention) sees x̃ = LN(x), the highway carries the
  raw x. The highway is then the layer's skip connection (no extra residual), and the final
  LayerNorm normalises the stream as in the other families.
- W x̃ has no bias; b_f and b_r are the only biases. v_f, v_r, b_f, b_r start at zero.
- No scaling correction of the highway term (the SRU paper's optional √3).
- c is float32 in every compute dtype: a bfloat16 state would accumulate rounding over
  thousands of steps. Only the matmuls run in the compute dtype.

SRU++ (``SRUPPConfig``): in the layers i with (i + 1) % attention_every == 0, U comes from
single-head causal self-attention on a reduced width d' instead of one matmul:
  Q = W1 x̃ (d -> d');  [K; V] = W2 Q (d' -> 2d');  A = softmax(Q Kᵀ / √d') V (causal);
  U = W3 LN(Q + alpha A) (d' -> 3d), alpha a learned scalar that starts at 0,
so at initialisation an attention layer is an SRU layer with a factorised (rank d')
projection. The other layers are plain SRU layers.

Decoding state per layer: ``{"c": c_BxD}`` (float32, constant size); SRU++'s attention
layers add a key/value cache of d' per position, and the model carries ``state["index"]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from lmuscale.data.tokenizer import GPT2_VOCAB
from lmuscale.layers import DEFAULT_INIT, kv_cache, layer_norm
from lmuscale.models.base import (
    LanguageModel,
    check_positive,
    compute_dtype,
    embedding_init,
)


@dataclasses.dataclass(frozen=True)
class SRUConfig:
    """An SRU language model: ``n_layers`` SRU layers of width ``d``.

    Attributes:
      d: embedding and state width. n_layers: SRU layers.
      vocab_size: tokens (GPT-2: 50257).
      dtype: compute dtype, "float32" or "bfloat16"; parameters and the state c are float32.
      remat: rematerialise each layer in the backward pass.
    """

    d: int
    n_layers: int = 8
    vocab_size: int = GPT2_VOCAB
    dtype: str = "float32"
    remat: bool = False

    def __post_init__(self):
        for name in ("d", "n_layers", "vocab_size"):
            check_positive(self, name)
        compute_dtype(self.dtype)

    @property
    def family(self) -> str:
        return "sru"

    def has_attention(self, layer: int) -> bool:
        del layer
        return False


@dataclasses.dataclass(frozen=True)
class SRUPPConfig:
    """An SRU++ language model: SRU layers, every ``attention_every``-th one with attention.

    Attributes:
      d: embedding and state width. d_prime: the attention width d'.
      n_layers: layers. attention_every: k; layer i (from 0) has attention iff (i + 1) % k == 0,
        so k = n_layers puts attention in the last layer only, k = 1 in every layer.
      vocab_size, dtype, remat: as in ``SRUConfig``.
    """

    d: int
    d_prime: int
    n_layers: int = 8
    attention_every: int = 4
    vocab_size: int = GPT2_VOCAB
    dtype: str = "float32"
    remat: bool = False

    def __post_init__(self):
        for name in ("d", "d_prime", "n_layers", "attention_every", "vocab_size"):
            check_positive(self, name)
        if self.attention_every > self.n_layers:
            raise ValueError(
                f"SRUPPConfig.attention_every={self.attention_every} exceeds "
                f"n_layers={self.n_layers}: no layer would have attention (use an SRUConfig)"
            )
        compute_dtype(self.dtype)

    @property
    def family(self) -> str:
        return "sru_pp"

    def has_attention(self, layer: int) -> bool:
        return (layer + 1) % self.attention_every == 0


def sru_cell(c_BxD, u_Bx3xD, x_BxD, v_2xD, b_2xD):
    """One SRU step, element-wise (REFERENCE §5): ``(c_BxD, h_BxD)`` at time t.

    Args:
      c_BxD: c_{t-1}, float32.
      u_Bx3xD: [W x̃_t, W_f x̃_t, W_r x̃_t] stacked on axis -2.
      x_BxD: the layer input x_t, for the highway.
      v_2xD, b_2xD: [v_f, v_r] and [b_f, b_r].
    """
    wx_BxD, fx_BxD, rx_BxD = u_Bx3xD[..., 0, :], u_Bx3xD[..., 1, :], u_Bx3xD[..., 2, :]
    f_BxD = jax.nn.sigmoid(fx_BxD + v_2xD[0] * c_BxD + b_2xD[0])
    r_BxD = jax.nn.sigmoid(rx_BxD + v_2xD[1] * c_BxD + b_2xD[1])
    c_BxD = f_BxD * c_BxD + (1.0 - f_BxD) * wx_BxD
    return c_BxD, r_BxD * c_BxD + (1.0 - r_BxD) * x_BxD


def sru_recurrence(u_BxTx3xD, x_BxTxD, v_2xD, b_2xD, c_BxD):
    """``sru_cell`` over every position with ``lax.scan``, in float32: ``(h_BxTxD, c_BxD)``.

    ``c_BxD`` is the state before the first position; the returned one is after the last.
    """
    f32 = jnp.float32
    v_2xD, b_2xD = v_2xD.astype(f32), b_2xD.astype(f32)

    def one(c, inputs):
        u, x = inputs
        return sru_cell(c, u, x, v_2xD, b_2xD)

    time_major = (
        jnp.moveaxis(u_BxTx3xD.astype(f32), 1, 0),
        jnp.moveaxis(x_BxTxD.astype(f32), 1, 0),
    )
    c_BxD, h_TxBxD = lax.scan(one, c_BxD.astype(f32), time_major)
    return jnp.moveaxis(h_TxBxD, 0, 1), c_BxD


class SRULayer(nn.Module):
    """One SRU layer; with ``d_prime > 0`` an SRU++ layer (U from attention on width d').

    Parameters: ``norm`` (pre-LN), ``v`` = [v_f; v_r] and ``b`` = [b_f; b_r] of shape (2, d), and
    either ``projection`` (kernel (d, 3d), columns [W | W_f | W_r]) or ``query`` (W1, (d, d')),
    ``key_value`` (W2, (d', 2d'), columns [K | V]), ``alpha``, ``norm_attention`` (LN on d')
    and ``output`` (W3, (d', 3d), columns [W | W_f | W_r]). No matmul has a bias.
    """

    width: int
    d_prime: int = 0
    dtype: Any = jnp.float32

    def setup(self):
        dense = dict(use_bias=False, dtype=self.dtype, kernel_init=DEFAULT_INIT)
        self.norm = layer_norm(self.dtype)
        if self.d_prime:
            self.query = nn.Dense(self.d_prime, **dense)
            self.key_value = nn.Dense(2 * self.d_prime, **dense)
            self.alpha = self.param("alpha", nn.initializers.zeros, ())
            self.norm_attention = layer_norm(self.dtype)
            self.output = nn.Dense(3 * self.width, **dense)
        else:
            self.projection = nn.Dense(3 * self.width, **dense)
        self.v = self.param("v", nn.initializers.zeros, (2, self.width))
        self.b = self.param("b", nn.initializers.zeros, (2, self.width))

    def _u(self, q_xDp, a_xDp):
        """SRU++'s U = W3 LN(Q + alpha A), split into (..., 3, d)."""
        mixed = q_xDp + self.alpha.astype(self.dtype) * a_xDp.astype(self.dtype)
        u = self.output(self.norm_attention(mixed))
        return u.reshape(*u.shape[:-1], 3, self.width)

    def __call__(self, x_BxTxD):
        xn_BxTxD = self.norm(x_BxTxD)
        if self.d_prime:
            q_BxTxDp = self.query(xn_BxTxD)
            k_BxTxDp, v_BxTxDp = jnp.split(self.key_value(q_BxTxDp), 2, axis=-1)
            # Single head: (B, T, 1, d'); the default scale is 1/sqrt(d').
            a = jax.nn.dot_product_attention(
                q_BxTxDp[:, :, None], k_BxTxDp[:, :, None], v_BxTxDp[:, :, None], is_causal=True
            )
            u_BxTx3xD = self._u(q_BxTxDp, a[:, :, 0])
        else:
            u = self.projection(xn_BxTxD)
            u_BxTx3xD = u.reshape(*u.shape[:-1], 3, self.width)
        c_BxD = jnp.zeros((x_BxTxD.shape[0], self.width), jnp.float32)
        h_BxTxD, _ = sru_recurrence(u_BxTx3xD, x_BxTxD, self.v, self.b, c_BxD)
        return h_BxTxD.astype(x_BxTxD.dtype)

    def init_state(self, batch_size: int, max_len: int | None = None):
        """The state before the first token (needs no parameters: call it unbound)."""
        state = {"c": jnp.zeros((batch_size, self.width), jnp.float32)}
        if self.d_prime:
            if max_len is None:
                raise ValueError("SRU++ attention layers need max_len for their KV cache")
            state["kv"] = kv_cache(batch_size, max_len, self.d_prime, 1, self.dtype)
        return state

    def step(self, state, x_BxD, index):
        """Position ``index``: ``(h_BxD, state)``, the same function as ``__call__``."""
        xn_BxD = self.norm(x_BxD)
        new_state = {}
        if self.d_prime:
            q_BxDp = self.query(xn_BxD)
            k_BxDp, v_BxDp = jnp.split(self.key_value(q_BxDp), 2, axis=-1)
            cache = state["kv"]
            new_state["kv"] = cache = {
                name: lax.dynamic_update_slice_in_dim(
                    cache[name], new[:, None, None].astype(cache[name].dtype), index, 1
                )
                for name, new in (("k", k_BxDp), ("v", v_BxDp))
            }
            visible_S = jnp.arange(cache["k"].shape[1]) <= index
            a = jax.nn.dot_product_attention(
                q_BxDp[:, None, None],
                cache["k"].astype(q_BxDp.dtype),
                cache["v"].astype(q_BxDp.dtype),
                mask=visible_S,
            )
            u_Bx3xD = self._u(q_BxDp, a[:, 0, 0])
        else:
            u = self.projection(xn_BxD)
            u_Bx3xD = u.reshape(*u.shape[:-1], 3, self.width)
        f32 = jnp.float32
        new_state["c"], h_BxD = sru_cell(
            state["c"],
            u_Bx3xD.astype(f32),
            x_BxD.astype(f32),
            self.v.astype(f32),
            self.b.astype(f32),
        )
        return h_BxD.astype(x_BxD.dtype), new_state


class SRULanguageModel(LanguageModel):
    """The SRU (``SRUConfig``) or SRU++ (``SRUPPConfig``) language model."""

    config: SRUConfig | SRUPPConfig

    def setup(self):
        c = self.config
        dtype = compute_dtype(c.dtype)
        self.embed = nn.Embed(c.vocab_size, c.d, embedding_init=embedding_init, dtype=dtype)
        layer = nn.remat(SRULayer) if c.remat else SRULayer
        self.blocks = [layer(**_layer_fields(c, i), name=f"block_{i}") for i in range(c.n_layers)]
        self.norm = layer_norm(dtype)

    def init_state(self, batch_size: int, max_len: int | None = None):
        c = self.config
        layers = [
            SRULayer(**_layer_fields(c, i), parent=None).init_state(batch_size, max_len)
            for i in range(c.n_layers)
        ]
        state = {"layers": layers}
        if any(c.has_attention(i) for i in range(c.n_layers)):
            state["index"] = jnp.zeros((), jnp.int32)
        return state


def _layer_fields(c: SRUConfig | SRUPPConfig, layer: int) -> dict:
    d_prime = c.d_prime if c.has_attention(layer) else 0
    return dict(width=c.d, d_prime=d_prime, dtype=compute_dtype(c.dtype))
