"""The LMU language model with implicit self-attention (papers/lmu-implicit-self-attention.md §4).

Tied token embedding -> n_layers x LMUBlock -> final LayerNorm -> logits; no positional
embeddings (the memory sees order through its Legendre basis). The _G variant
(``global_attention=True``) replaces each block's pre-FFN with causal multi-head attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp

from lmuscale import GPT2_VOCAB, lmu, ops
from lmuscale.layers import (
    FFN,
    MEMORY_MODES,
    GlobalSelfAttention,
    ImplicitSelfAttention,
    kv_cache,
    layer_norm,
)
from lmuscale.models import sizes
from lmuscale.models.base import (
    LanguageModel,
    check_config,
    check_positive,
    compute_dtype,
    default_heads,
)
from lmuscale.models.family import Family, Registered, register


@dataclasses.dataclass(frozen=True)
class LMUConfig(Registered):
    """Everything that fixes an LMU language model's function and parameter shapes. ``theta``
    is in tokens; ``q_prime`` is the rows of each L_i. The _G variant (``global_attention``,
    with ``n_heads``) ignores ``pre_ffn_dim``: attention replaces the pre-FFN. ``memory_mode``,
    ``memory_chunk`` and ``batch_chunk`` are as in ``layers.ImplicitSelfAttention``: batch
    chunks of 2 bound a CPU's memory; on an accelerator 0 with micro-batches is faster.
    ``memory_impl`` ("auto", "xla" or "pallas") is the memory's kernel switch, as ``loss_impl``
    the loss's (``ops.resolve``). The rest is as in ``base.RecurrentConfig``."""

    d: int
    q: int
    q_prime: int
    post_ffn_dim: int
    pre_ffn_dim: int = 0
    theta: float = 350.0
    n_layers: int = 3
    global_attention: bool = False
    n_heads: int = 1
    vocab_size: int = GPT2_VOCAB
    dtype: str = "float32"
    memory_mode: str = "chunked"
    memory_chunk: int = lmu.DEFAULT_CHUNK
    remat: bool = False
    batch_chunk: int = 2
    loss_impl: str = "auto"
    memory_impl: str = "auto"

    def __post_init__(self):
        check_config(
            self, ("d", "q", "q_prime", "post_ffn_dim", "n_layers", "n_heads", "vocab_size")
        )
        if not self.global_attention:
            check_positive(self, "pre_ffn_dim")
        if not self.theta > 0:
            raise ValueError(f"LMUConfig.theta must be > 0 tokens, got {self.theta!r}")
        if self.memory_mode not in MEMORY_MODES:
            raise ValueError(
                f"LMUConfig.memory_mode must be one of {MEMORY_MODES}, got {self.memory_mode!r}"
            )
        check_positive(self, "memory_chunk")
        if self.batch_chunk < 0:
            raise ValueError(f"LMUConfig.batch_chunk must be >= 0, got {self.batch_chunk!r}")
        if self.global_attention and self.d % self.n_heads:
            raise ValueError(f"LMUConfig.n_heads={self.n_heads} does not divide d={self.d}")


class LMUBlock(nn.Module):
    """One layer (paper Figure 2), pre-norm with residuals: ``x += pre(LN(x))`` (an FFN, or
    global attention in the _G variant); ``x += implicit_attention(memory(LN(x)))``;
    ``x += FFN_post(LN(x))``."""

    config: LMUConfig
    impls: ops.Impls = ops.Impls()
    memory_class: ClassVar[type[nn.Module]] = ImplicitSelfAttention  # a subclass may cut it down

    def setup(self):
        c, impls = self.config, self.impls
        dtype = compute_dtype(c.dtype)
        self.norm_pre = layer_norm(dtype)
        if c.global_attention:
            self.pre = GlobalSelfAttention(c.d, c.n_heads, dtype=dtype, attention=impls.attention)
        else:
            self.pre = FFN(c.pre_ffn_dim, dtype=dtype, gelu=impls.gelu)
        self.norm_memory = layer_norm(dtype)
        self.memory = self.memory_class(
            c.q, c.q_prime, c.theta, dtype, c.memory_mode, c.memory_chunk, c.batch_chunk, impls
        )
        self.norm_post = layer_norm(dtype)
        self.post = FFN(c.post_ffn_dim, dtype=dtype, gelu=impls.gelu)

    def __call__(self, x_BxTxD):
        x_BxTxD = x_BxTxD + self.pre(self.norm_pre(x_BxTxD))
        x_BxTxD = x_BxTxD + self.memory(self.norm_memory(x_BxTxD)).astype(x_BxTxD.dtype)
        return x_BxTxD + self.post(self.norm_post(x_BxTxD))

    def decode_state(self, batch_size: int, max_len: int | None = None):
        c = self.config
        state = {"memory": jnp.zeros((batch_size, c.d, c.q), jnp.float32)}
        if c.global_attention:
            if max_len is None:
                raise ValueError("the global-attention variant needs max_len for its KV cache")
            state["kv"] = kv_cache(batch_size, max_len, c.d, c.n_heads, compute_dtype(c.dtype))
        return state

    def step(self, state, x_BxD, index):
        new_state = {}
        h = self.norm_pre(x_BxD)
        if self.config.global_attention:
            h, new_state["kv"] = self.pre.step(state["kv"], h, index)
        else:
            h = self.pre(h)
        x_BxD = x_BxD + h
        y, new_state["memory"] = self.memory.step(state["memory"], self.norm_memory(x_BxD))
        x_BxD = x_BxD + y.astype(x_BxD.dtype)
        return x_BxD + self.post(self.norm_post(x_BxD)), new_state


class LMULanguageModel(LanguageModel):
    config: LMUConfig
    block_class = LMUBlock


def lmu_params(config: LMUConfig) -> sizes.ParamCount:
    d = config.d
    if config.global_attention:
        pre = sizes.attention_params(d)
    else:
        pre = sizes.ffn_params(d, config.pre_ffn_dim)
    implicit = 3 * config.q_prime * config.q + 3 * config.q_prime + config.q_prime
    per_layer = 3 * 2 * d + pre + implicit + sizes.ffn_params(d, config.post_ffn_dim)
    return sizes.ParamCount(config.n_layers * per_layer + 2 * d, config.vocab_size * d)


def lmu_flops(config: LMUConfig, seq_len: int = 1024) -> sizes.FlopCount:
    """Table 2 of the LMU paper per layer, plus the unembedding (2 d V): LMU + Q + K + V
    (reduced order, FFT) 3d[5(q'+1)(log2 n + 1) + 6q'] + 6qq'; QK^T 2dq'^2; M' 2dq'^2 + dq';
    m 2dq'; each FFN 4dd'. The _G variant's attention replaces the pre-FFN: 8d^2 for its four
    projections and 4nd for scores and values over the full n, as for the transformer."""
    d, q, k, n = config.d, config.q, config.q_prime, seq_len
    terms = {"memory_qkv": 3 * d * (5 * (k + 1) * (math.log2(n) + 1) + 6 * k) + 6 * q * k}
    terms["scores"] = 2 * d * k * k
    terms["mixing"] = 2 * d * k * k + d * k
    terms["readout"] = 2 * d * k
    if config.global_attention:
        terms["global_attention"] = 8 * d * d + 4 * n * d
    else:
        terms["pre_ffn"] = 4 * d * config.pre_ffn_dim
    terms["post_ffn"] = 4 * d * config.post_ffn_dim
    return sizes.FlopCount(terms, config.n_layers, 2.0 * d * config.vocab_size)


def lmu_config(size: str, *, global_attention: bool = False, **overrides) -> LMUConfig:
    """A Table 3 row as a config (theta = 350, 3 layers, pre-FFN 1.5 d), the post-FFN width
    solved so that N hits the row's N; ``overrides`` replace fields afterwards, unsolved."""
    row = sizes.row(size)
    d = sizes.width(row.n)
    base = LMUConfig(
        d=d,
        q=row.q,
        q_prime=row.q_prime,
        post_ffn_dim=1,
        pre_ffn_dim=0 if global_attention else math.floor(1.5 * d + 0.5),
        global_attention=global_attention,
        n_heads=default_heads(d),
    )
    per_unit = base.n_layers * (2 * d + 1)
    post = 1 + round((row.n - lmu_params(base).non_embedding) / per_unit)
    return dataclasses.replace(base, post_ffn_dim=post, **overrides)


def lmu_shape(c: LMUConfig) -> dict:
    pre = "attn" if c.global_attention else c.pre_ffn_dim
    heads = c.n_heads if c.global_attention else "-"
    return {"q": c.q, "q'": c.q_prime, "pre": pre, "post": c.post_ffn_dim, "heads": heads}


# An LMU saved before memory_mode existed computed its memory by FFT.
SAVED_BEFORE_CHUNKED = {"memory_mode": "fft", "memory_chunk": lmu.DEFAULT_CHUNK}
for _family in ("lmu", "lmu_g"):
    _global = _family == "lmu_g"
    register(
        Family(
            _family,
            LMUConfig,
            LMULanguageModel,
            sized=functools.partial(lmu_config, global_attention=_global),
            params=lmu_params,
            flops=lmu_flops,
            shape=lmu_shape,
            fixed={"global_attention": _global},
            legacy=SAVED_BEFORE_CHUNKED,
        )
    )
