"""The transformer baseline, GPT-2 style: learned positions, pre-LN blocks of causal multi-head
attention and a 4d gelu MLP, std 0.02 with residual projections scaled by 1/sqrt(2 n_layers).

The LMU paper's width d = sqrt(N / 24) "to facilitate a fair comparison to the transformer
models" is exactly a 2-layer transformer (N ~= 12 n_layers d^2), so the baseline has 2 layers
of the LMU's width (aspect ratio 24 .. 102, where Kaplan et al. find the loss insensitive).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax.numpy as jnp

from lmuscale import GPT2_VOCAB, ops
from lmuscale.layers import FFN, GlobalSelfAttention, kv_cache, layer_norm
from lmuscale.models import sizes
from lmuscale.models.base import LanguageModel, check_config, compute_dtype, default_heads
from lmuscale.models.family import Family, Registered, register

POSITION_INIT = nn.initializers.normal(0.01)
KERNEL_INIT = nn.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class TransformerConfig(Registered):
    """A GPT-2 style decoder. ``max_len`` is the number of learned positions."""

    d: int
    n_heads: int
    n_layers: int = 2
    mlp_ratio: int = 4
    max_len: int = 1024
    vocab_size: int = GPT2_VOCAB
    dtype: str = "float32"
    remat: bool = False
    loss_impl: str = "auto"  # "auto", "xla" or "pallas" (``ops.resolve``)

    def __post_init__(self):
        check_config(self, ("d", "n_heads", "n_layers", "mlp_ratio", "max_len", "vocab_size"))
        if self.d % self.n_heads:
            raise ValueError(f"TransformerConfig.n_heads={self.n_heads} does not divide d={self.d}")

    @property
    def mlp_dim(self) -> int:
        return self.mlp_ratio * self.d


class TransformerBlock(nn.Module):
    config: TransformerConfig
    impls: ops.Impls = ops.Impls()

    def setup(self):
        c, impls = self.config, self.impls
        dtype = compute_dtype(c.dtype)
        out_init = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layers))
        self.norm_attention = layer_norm(dtype)
        inits = {"kernel_init": KERNEL_INIT, "out_init": out_init}
        self.attention = GlobalSelfAttention(
            c.d, c.n_heads, dtype=dtype, attention=impls.attention, **inits
        )
        self.norm_mlp = layer_norm(dtype)
        self.mlp = FFN(c.mlp_dim, dtype=dtype, gelu=impls.gelu, **inits)

    def __call__(self, x_BxTxD):
        x_BxTxD = x_BxTxD + self.attention(self.norm_attention(x_BxTxD))
        return x_BxTxD + self.mlp(self.norm_mlp(x_BxTxD))

    def step(self, cache, x_BxD, index):
        h, cache = self.attention.step(cache, self.norm_attention(x_BxD), index)
        x_BxD = x_BxD + h
        return x_BxD + self.mlp(self.norm_mlp(x_BxD)), cache


class TransformerLanguageModel(LanguageModel):
    config: TransformerConfig
    block_class = TransformerBlock

    def setup(self):
        super().setup()
        c = self.config
        self.positions = self.param("positions", POSITION_INIT, (c.max_len, c.d))

    def embed_tokens(self, tokens, index):
        if index is None:
            length = tokens.shape[1]
            if length > self.config.max_len:
                raise ValueError(
                    f"sequence length {length} exceeds the transformer's "
                    f"max_len={self.config.max_len}"
                )
            positions = self.positions[:length]
        else:
            positions = self.positions[index]
        return self.embed(tokens) + positions[None].astype(self.embed.dtype)

    def decode_state(self, batch_size: int, max_len: int | None = None):
        c = self.config
        max_len = c.max_len if max_len is None else max_len
        if max_len > c.max_len:
            raise ValueError(f"max_len={max_len} exceeds the transformer's max_len={c.max_len}")
        dtype = compute_dtype(c.dtype)
        return {
            "index": jnp.zeros((), jnp.int32),
            "layers": [kv_cache(batch_size, max_len, c.d, c.n_heads, dtype)] * c.n_layers,
        }


def transformer_params(config: TransformerConfig) -> sizes.ParamCount:
    d = config.d
    per_layer = 2 * 2 * d + sizes.attention_params(d) + sizes.ffn_params(d, config.mlp_dim)
    embedding = config.vocab_size * d + config.max_len * d
    return sizes.ParamCount(config.n_layers * per_layer + 2 * d, embedding)


def transformer_flops(config: TransformerConfig, seq_len: int = 1024) -> sizes.FlopCount:
    """2 per non-embedding weight, plus 4 n d per layer for the attention scores and values over
    the full n: the forward third of the common "6N + 12 n_layers n d" training count (Kaplan
    et al. §2.1; Chowdhery et al. appendix B)."""
    d = config.d
    one_layer = dataclasses.replace(config, n_layers=1)
    per_layer = transformer_params(one_layer).non_embedding - 2 * d
    terms = {"weights": 2.0 * per_layer, "attention": 4.0 * seq_len * d}
    # The final LayerNorm's 2d weights are part of N; they are counted in no layer (negligible).
    return sizes.FlopCount(terms, config.n_layers, 2.0 * d * config.vocab_size)


def transformer_config(size: str, **overrides) -> TransformerConfig:
    """The transformer at a Table 3 grid point: 2 layers of the LMU's width, 4d MLP."""
    d = sizes.width(sizes.row(size).n)
    return dataclasses.replace(TransformerConfig(d=d, n_heads=default_heads(d)), **overrides)


register(
    Family(
        "transformer",
        TransformerConfig,
        TransformerLanguageModel,
        sized=transformer_config,
        params=transformer_params,
        flops=transformer_flops,
        shape=lambda c: {"pre": "attn", "post": c.mlp_dim, "heads": c.n_heads},
    )
)
