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

from lmuscale import GPT2_VOCAB
from lmuscale.layers import DEFAULT_INIT, kv_cache, layer_norm
from lmuscale.models import sizes
from lmuscale.models.base import (
    LanguageModel,
    RecurrentConfig,
    check_config,
    compute_dtype,
)
from lmuscale.models.family import Family, Registered, register

# Per-channel element-wise FLOPs of one step (each multiply, add, sigmoid or tanh counts 1):
# f and r 4 each (v c, two adds, sigmoid), c 4, h 4.
SRU_ELEMENTWISE = 16
ATTENTION_EVERY = 4  # SRU++: 2 attention layers of 8; attention is needed in few layers


@dataclasses.dataclass(frozen=True)
class SRUConfig(RecurrentConfig):
    """An SRU language model: ``n_layers`` SRU layers of width ``d``."""

    n_layers: int = 8

    def has_attention(self, layer: int) -> bool:
        del layer
        return False


@dataclasses.dataclass(frozen=True)
class SRUPPConfig(Registered):
    """An SRU++ language model: SRU layers, every ``attention_every``-th one with attention.

    Attributes:
      d: embedding and state width. d_prime: the attention width d'.
      n_layers: layers. attention_every: k; layer i (from 0) has attention iff (i + 1) % k == 0,
        so k = n_layers puts attention in the last layer only, k = 1 in every layer.
      vocab_size, dtype, remat, loss_impl: as in ``SRUConfig``.
    """

    d: int
    d_prime: int
    n_layers: int = 8
    attention_every: int = 4
    vocab_size: int = GPT2_VOCAB
    dtype: str = "float32"
    remat: bool = False
    loss_impl: str = "auto"

    def __post_init__(self):
        check_config(self, ("d", "d_prime", "n_layers", "attention_every", "vocab_size"))
        if self.attention_every > self.n_layers:
            raise ValueError(
                f"SRUPPConfig.attention_every={self.attention_every} exceeds "
                f"n_layers={self.n_layers}: no layer would have attention (use an SRUConfig)"
            )

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
    f_BxD = jax.nn.sigmoid(fx_BxD + v_2xD[0][None] * c_BxD + b_2xD[0][None])
    r_BxD = jax.nn.sigmoid(rx_BxD + v_2xD[1][None] * c_BxD + b_2xD[1][None])
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

    d: int
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
            self.output = nn.Dense(3 * self.d, **dense)
        else:
            self.projection = nn.Dense(3 * self.d, **dense)
        self.v = self.param("v", nn.initializers.zeros, (2, self.d))
        self.b = self.param("b", nn.initializers.zeros, (2, self.d))

    def _u(self, q_xDp, a_xDp):
        """SRU++'s U = W3 LN(Q + alpha A), split into (..., 3, d)."""
        mixed = q_xDp + self.alpha.astype(self.dtype) * a_xDp.astype(self.dtype)
        u = self.output(self.norm_attention(mixed))
        return u.reshape(*u.shape[:-1], 3, self.d)

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
            u_BxTx3xD = u.reshape(*u.shape[:-1], 3, self.d)
        c_BxD = jnp.zeros((x_BxTxD.shape[0], self.d), jnp.float32)
        h_BxTxD, _ = sru_recurrence(u_BxTx3xD, x_BxTxD, self.v, self.b, c_BxD)
        return h_BxTxD.astype(x_BxTxD.dtype)

    def decode_state(self, batch_size: int, max_len: int | None = None):
        """The state before the first token (needs no parameters: call it unbound)."""
        state = {"c": jnp.zeros((batch_size, self.d), jnp.float32)}
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
            visible_T = jnp.arange(cache["k"].shape[1]) <= index
            a = jax.nn.dot_product_attention(
                q_BxDp[:, None, None],
                cache["k"].astype(q_BxDp.dtype),
                cache["v"].astype(q_BxDp.dtype),
                mask=visible_T,
            )
            u_Bx3xD = self._u(q_BxDp, a[:, 0, 0])
        else:
            u = self.projection(xn_BxD)
            u_Bx3xD = u.reshape(*u.shape[:-1], 3, self.d)
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
    block_class = SRULayer

    def block_fields(self, layer: int) -> dict:
        return _layer_fields(self.config, layer)

    def decode_state(self, batch_size: int, max_len: int | None = None):
        c = self.config
        layers = [
            SRULayer(**_layer_fields(c, i), parent=None).decode_state(batch_size, max_len)
            for i in range(c.n_layers)
        ]
        state = {"layers": layers}
        if any(c.has_attention(i) for i in range(c.n_layers)):
            state["index"] = jnp.zeros((), jnp.int32)
        return state


def _layer_fields(c: SRUConfig | SRUPPConfig, layer: int) -> dict:
    d_prime = c.d_prime if c.has_attention(layer) else 0
    return dict(d=c.d, d_prime=d_prime, dtype=compute_dtype(c.dtype))


def sru_layer_params(d: int, d_prime: int = 0) -> int:
    """One SRU layer (pre-LN 2d, v and b 4d, no matmul bias); with d' > 0 an SRU++ layer,
    whose projection is W1 (d d'), W2 (2 d'^2), alpha (1), its LN (2 d') and W3 (3 d' d)."""
    if d_prime:
        projection = d * d_prime + 2 * d_prime * d_prime + 1 + 2 * d_prime + 3 * d_prime * d
    else:
        projection = 3 * d * d
    return 2 * d + projection + 4 * d


def sru_params(config: SRUConfig | SRUPPConfig) -> sizes.ParamCount:
    d = config.d
    layers = sum(
        sru_layer_params(d, _layer_fields(config, i)["d_prime"]) for i in range(config.n_layers)
    )
    return sizes.ParamCount(layers + 2 * d, config.vocab_size * d)


def sru_flops(config: SRUConfig | SRUPPConfig, seq_len: int = 1024) -> sizes.FlopCount:
    """2 per weight of each matmul, plus the element-wise recurrence (16 d per layer).

    A plain layer's matmul is [W, W_f, W_r]: 6 d^2. An SRU++ attention layer has W1, W2, W3
    (2 d d' + 4 d'^2 + 6 d d'), scores and values 4 n d' over the full n as the transformer
    counter does, and Q + alpha A (2 d'). LayerNorms are not counted (as in ``lmu_flops``).
    The layers of SRU++ differ, so ``per_layer`` holds the mean over its layers: ``layers``
    is exactly the sum.
    """
    d, n_layers = config.d, config.n_layers
    attention = sum(config.has_attention(i) for i in range(n_layers))
    terms = {"projection": 6.0 * d * d * (n_layers - attention) / n_layers}
    if attention:
        k = config.d_prime
        share = attention / n_layers
        terms["attention_projections"] = (2 * d * k + 4 * k * k + 6 * k * d) * share
        terms["attention"] = (4 * seq_len * k + 2 * k) * share
    terms["recurrence"] = float(SRU_ELEMENTWISE * d)
    return sizes.FlopCount(terms, n_layers, 2.0 * d * config.vocab_size)


def sru_config(size: str, **overrides) -> SRUConfig:
    """SRU at a Table 3 grid point: the LMU's width, the number of layers (3d^2 + 6d each)
    solved for N: 8 at every row, N +4.9%, +4.7%, +1.6%, +2.2%, +1.0%, +0.9% off the row
    (the small rows lose to the 6d terms)."""
    return dataclasses.replace(sizes.deepened(SRUConfig, size), **overrides)


def sru_pp_config(size: str, **overrides) -> SRUPPConfig:
    """SRU++ at a Table 3 grid point: the SRU's width and depth, attention in every 4th layer,
    the attention width d' solved for N: d' = 23, 32, 50, 60, 81, 115 (0.48-0.56 d), N within
    0.2% of every row."""
    sru = sru_config(size)

    def config(d_prime: int) -> SRUPPConfig:
        return SRUPPConfig(
            d=sru.d, d_prime=d_prime, n_layers=sru.n_layers, attention_every=ATTENTION_EVERY
        )

    d_prime = sizes.nearest(
        lambda k: sru_params(config(k)).non_embedding, sizes.row(size).n, range(1, 4 * sru.d + 1)
    )
    return dataclasses.replace(config(d_prime), **overrides)


register(
    Family("sru", SRUConfig, SRULanguageModel, sru_config, sru_params, sru_flops, lambda c: {})
)
register(
    Family(
        "sru_pp",
        SRUPPConfig,
        SRULanguageModel,
        sru_pp_config,
        sru_params,
        sru_flops,
        shape=lambda c: {"d'": c.d_prime, "pre": "attn", "heads": 1},
    )
)
