"""SRU and SRU++ language models (REFERENCE §5, papers/sru-notes.txt), recurrent baselines.

One SRU layer, for the layer input x_t and x̃_t = LayerNorm(x_t):
  U_t = [W x̃_t; W_f x̃_t; W_r x̃_t], one matmul for every position at once;
  f_t = sigmoid(W_f x̃_t + v_f ⊙ c_{t-1} + b_f);  r_t = sigmoid(W_r x̃_t + v_r ⊙ c_{t-1} + b_r);
  c_t = f_t ⊙ c_{t-1} + (1 - f_t) ⊙ W x̃_t;  h_t = r_t ⊙ c_t + (1 - r_t) ⊙ x_t.
The gates see c_{t-1}, so the recurrence is not linear in c: it runs in ``lax.scan`` over
``sru_cell``, the element-wise step that decoding calls too.

Choices the equations leave open, made here:
- Pre-LayerNorm: the matmul (or attention) sees LN(x), the highway the raw x, so the highway
  is the layer's skip connection (no extra residual).
- W x̃ has no bias; v_f, v_r, b_f, b_r start at zero. The highway has no √3 scaling correction.
- c is float32 in every compute dtype (a bfloat16 state would accumulate rounding over
  thousands of steps); only the matmuls run in the compute dtype.

SRU++ (``SRUPPConfig``): in layers i with (i + 1) % attention_every == 0, U comes from
single-head causal attention on a reduced width d' instead of one matmul:
  Q = W1 x̃ (d -> d');  [K; V] = W2 Q (d' -> 2d');  A = softmax(Q Kᵀ / √d') V;
  U = W3 LN(Q + alpha A) (d' -> 3d), alpha a learned scalar starting at 0,
so at initialisation an attention layer is an SRU layer with a rank-d' projection.
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
from lmuscale.models.base import LanguageModel, RecurrentConfig, check_config, compute_dtype
from lmuscale.models.family import Family, Registered, register
from lmuscale.ops.attention import cached_attention


@dataclasses.dataclass(frozen=True)
class SRUConfig(RecurrentConfig):
    """An SRU language model: ``n_layers`` SRU layers of width ``d``."""

    n_layers: int = 8

    def has_attention(self, layer: int) -> bool:
        del layer
        return False


@dataclasses.dataclass(frozen=True)
class SRUPPConfig(Registered):
    """SRU layers, every ``attention_every``-th one (k = n_layers: the last only) with
    attention of width ``d_prime``; the other fields as in ``SRUConfig``."""

    d: int
    d_prime: int
    n_layers: int = 8
    attention_every: int = 4  # 2 attention layers of 8: attention is needed in few layers
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
    """One SRU step, element-wise: ``(c_BxD, h_BxD)`` at time t from c_{t-1} (float32),
    ``u_Bx3xD`` = [W x̃_t, W_f x̃_t, W_r x̃_t], the highway's x_t, [v_f, v_r] and [b_f, b_r]."""
    wx_BxD, fx_BxD, rx_BxD = u_Bx3xD[..., 0, :], u_Bx3xD[..., 1, :], u_Bx3xD[..., 2, :]
    f_BxD = jax.nn.sigmoid(fx_BxD + v_2xD[0][None] * c_BxD + b_2xD[0][None])
    r_BxD = jax.nn.sigmoid(rx_BxD + v_2xD[1][None] * c_BxD + b_2xD[1][None])
    c_BxD = f_BxD * c_BxD + (1.0 - f_BxD) * wx_BxD
    return c_BxD, r_BxD * c_BxD + (1.0 - r_BxD) * x_BxD


class SRULayer(nn.Module):
    """One SRU layer; with ``d_prime > 0`` an SRU++ layer. Parameters: ``norm``, ``v`` and
    ``b`` ([v_f; v_r], [b_f; b_r]), and ``projection`` ([W | W_f | W_r]) or ``query`` (W1),
    ``key_value`` (W2, [K | V]), ``alpha``, ``norm_attention`` and ``output`` (W3)."""

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

    def _u(self, xn_xD, index=None, cache=None):
        """U split into (..., 3, d): the projection, or SRU++'s W3 LN(Q + alpha A) with the
        attention over the whole sequence (``index`` None) or from position ``index``, which
        also returns the updated KV ``cache``."""
        if not self.d_prime:
            u = self.projection(xn_xD)
            return u.reshape(*u.shape[:-1], 3, self.d), cache
        q_xDp = self.query(xn_xD)
        k_xDp, v_xDp = jnp.split(self.key_value(q_xDp), 2, axis=-1)
        if index is None:  # single head: (B, T, 1, d'); the default scale is 1/sqrt(d')
            qkv_BxTx1xDp = (x[:, :, None] for x in (q_xDp, k_xDp, v_xDp))
            a_xDp = jax.nn.dot_product_attention(*qkv_BxTx1xDp, is_causal=True)[:, :, 0]
        else:
            qkv_Bx1x1xDp = (x[:, None, None] for x in (q_xDp, k_xDp, v_xDp))
            a_Bx1x1xDp, cache = cached_attention(cache, *qkv_Bx1x1xDp, index)
            a_xDp = a_Bx1x1xDp[:, 0, 0]
        mixed = q_xDp + self.alpha.astype(self.dtype) * a_xDp.astype(self.dtype)
        u = self.output(self.norm_attention(mixed))
        return u.reshape(*u.shape[:-1], 3, self.d), cache

    def __call__(self, x_BxTxD):
        u_BxTx3xD, _ = self._u(self.norm(x_BxTxD))
        f32 = jnp.float32
        v_2xD, b_2xD = self.v.astype(f32), self.b.astype(f32)

        def one(c_BxD, u_and_x):
            return sru_cell(c_BxD, *u_and_x, v_2xD, b_2xD)

        time_major = tuple(jnp.moveaxis(a.astype(f32), 1, 0) for a in (u_BxTx3xD, x_BxTxD))
        _, h_TxBxD = lax.scan(one, jnp.zeros((x_BxTxD.shape[0], self.d), f32), time_major)
        return jnp.moveaxis(h_TxBxD, 0, 1).astype(x_BxTxD.dtype)

    def decode_state(self, batch_size: int, max_len: int | None = None):
        state = {"c": jnp.zeros((batch_size, self.d), jnp.float32)}
        if self.d_prime:
            if max_len is None:
                raise ValueError("SRU++ attention layers need max_len for their KV cache")
            state["kv"] = kv_cache(batch_size, max_len, self.d_prime, 1, self.dtype)
        return state

    def step(self, state, x_BxD, index):
        """Position ``index``: ``(h_BxD, state)``, the same function as ``__call__``."""
        u_Bx3xD, cache = self._u(self.norm(x_BxD), index, state.get("kv"))
        inputs = (u_Bx3xD, x_BxD, self.v, self.b)
        c_BxD, h_BxD = sru_cell(state["c"], *(a.astype(jnp.float32) for a in inputs))
        new_state = {"c": c_BxD}
        if self.d_prime:
            new_state["kv"] = cache
        return h_BxD.astype(x_BxD.dtype), new_state


class SRULanguageModel(LanguageModel):
    """The SRU (``SRUConfig``) or SRU++ (``SRUPPConfig``) language model."""

    config: SRUConfig | SRUPPConfig
    block_class = SRULayer

    def block_fields(self, layer: int) -> dict:
        c = self.config
        d_prime = c.d_prime if c.has_attention(layer) else 0
        return dict(d=c.d, d_prime=d_prime, dtype=compute_dtype(c.dtype))


def sru_params(config: SRUConfig | SRUPPConfig) -> sizes.ParamCount:
    """Per layer: pre-LN 2d, v and b 4d (no matmul bias) and the projection, 3 d^2, or in an
    SRU++ attention layer W1 (d d'), W2 (2 d'^2), alpha (1), its LN (2 d') and W3 (3 d' d)."""
    d, n_layers = config.d, config.n_layers
    attention = sum(config.has_attention(i) for i in range(n_layers))
    projections = 3 * d * d * (n_layers - attention)
    if attention:
        k = config.d_prime
        projections += (d * k + 2 * k * k + 1 + 2 * k + 3 * k * d) * attention
    return sizes.ParamCount(n_layers * 6 * d + projections + 2 * d, config.vocab_size * d)


def sru_flops(config: SRUConfig | SRUPPConfig, seq_len: int = 1024) -> sizes.FlopCount:
    """2 per weight of each matmul (6 d^2; in an SRU++ attention layer 2 d d' + 4 d'^2 + 6 d d',
    plus 4 n d' for scores and values over the full n, and 2 d' for Q + alpha A), plus 16 d
    element-wise (f, r 4 each; c 4; h 4), no LayerNorms. ``per_layer`` averages SRU++'s layers."""
    d, n_layers = config.d, config.n_layers
    attention = sum(config.has_attention(i) for i in range(n_layers))
    terms = {"projection": 6.0 * d * d * (n_layers - attention) / n_layers}
    if attention:
        k = config.d_prime
        share = attention / n_layers
        terms["attention_projections"] = (2 * d * k + 4 * k * k + 6 * k * d) * share
        terms["attention"] = (4 * seq_len * k + 2 * k) * share
    terms["recurrence"] = float(16 * d)
    return sizes.FlopCount(terms, n_layers, 2.0 * d * config.vocab_size)


def sru_config(size: str, **overrides) -> SRUConfig:
    """SRU at a Table 3 grid point: the LMU's width, the number of layers (3d^2 + 6d each)
    solved for N: 8 at every row, N 0.9-4.9% over the row (the small rows lose to the 6d terms)."""
    return dataclasses.replace(sizes.deepened(SRUConfig, size), **overrides)


def sru_pp_config(size: str, **overrides) -> SRUPPConfig:
    """SRU++ at a Table 3 grid point: the SRU's width and depth, attention in every 4th layer,
    the attention width d' solved for N: d' = 23 .. 115 (0.48-0.56 d), N within 0.2% of the row."""
    sru = sru_config(size)

    def config(d_prime: int) -> SRUPPConfig:
        return SRUPPConfig(d=sru.d, d_prime=d_prime, n_layers=sru.n_layers)

    d_prime = sizes.nearest(
        lambda k: sru_params(config(k)).non_embedding, sizes.row(size).n, range(1, 4 * sru.d + 1)
    )
    return dataclasses.replace(config(d_prime), **overrides)


register(Family("sru", SRUConfig, SRULanguageModel, sru_config, sru_params, sru_flops))
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
