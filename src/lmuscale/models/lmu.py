"""The LMU language model with implicit self-attention (papers/lmu-implicit-self-attention.md §4).

token embedding (tied with the output) -> n_layers x LMUBlock -> final LayerNorm -> logits.
No positional embeddings: the memory sees order through its Legendre basis. The _G variant
(``global_attention=True``) replaces each block's pre-FFN with causal multi-head attention.

Decoding carries, per layer, the memory ``m_BxDxQ`` (and, in the _G variant only, a KV cache
and the position index), so the plain LMU's state has the same size after any number of tokens.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from lmuscale import lmu
from lmuscale.data.tokenizer import GPT2_VOCAB
from lmuscale.layers import MEMORY_MODES, LMUBlock, layer_norm
from lmuscale.models.base import (
    LanguageModel,
    check_positive,
    compute_dtype,
    embedding_init,
)


@dataclasses.dataclass(frozen=True)
class LMUConfig:
    """Everything that fixes an LMU language model's function and parameter shapes.

    Attributes:
      d: embedding width. q: memory order. q_prime: reduced order of each L_i.
      theta: memory window, in tokens. n_layers: LMU blocks.
      pre_ffn_dim, post_ffn_dim: inner widths of the two FFNs (the _G variant has no pre-FFN:
        global attention replaces it, and pre_ffn_dim is ignored).
      global_attention: the LMU_G variant. n_heads: its attention heads.
      vocab_size: tokens (GPT-2: 50257).
      dtype: compute dtype, "float32" or "bfloat16"; parameters are always float32.
      memory_mode: how the parallel mode computes the memory: "chunked" (matrix products in
        chunks of ``memory_chunk`` steps, on tensor cores) or "fft" (FFT convolution). Both are
        the same function; a bf16 model runs the chunked products as one bf16 pass.
      memory_chunk: steps per chunk of the chunked memory.
      remat: rematerialise each block in the backward pass (less memory, ~1/3 more compute).
      batch_chunk: sequences per chunk of the implicit attention in parallel mode (0 = the
        whole batch at once), each chunk rematerialised in the backward pass. XLA's buffers
        for a (16, 1024) Adam step of lmu-1M on CPU are 2.1 GB with chunks of 2 and 7.7 GB
        without. On an accelerator, 0 with micro-batches is faster: the chunks run one after
        another.
    """

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

    def __post_init__(self):
        for name in ("d", "q", "q_prime", "post_ffn_dim", "n_layers", "n_heads", "vocab_size"):
            check_positive(self, name)
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
        compute_dtype(self.dtype)

    @property
    def family(self) -> str:
        return "lmu_g" if self.global_attention else "lmu"


class LMULanguageModel(LanguageModel):
    config: LMUConfig

    def setup(self):
        c = self.config
        dtype = compute_dtype(c.dtype)
        self.embed = nn.Embed(c.vocab_size, c.d, embedding_init=embedding_init, dtype=dtype)
        block = nn.remat(LMUBlock) if c.remat else LMUBlock
        self.blocks = [block(**_block_fields(c), name=f"block_{i}") for i in range(c.n_layers)]
        self.norm = layer_norm(dtype)

    def init_state(self, batch_size: int, max_len: int | None = None):
        block = LMUBlock(**_block_fields(self.config), parent=None)
        state = {
            "layers": [block.init_state(batch_size, max_len) for _ in range(self.config.n_layers)]
        }
        if self.config.global_attention:
            state["index"] = jnp.zeros((), jnp.int32)
        return state


def _block_fields(c: LMUConfig) -> dict:
    return dict(
        width=c.d,
        order=c.q,
        reduced_order=c.q_prime,
        theta=c.theta,
        pre_ffn_dim=c.pre_ffn_dim,
        post_ffn_dim=c.post_ffn_dim,
        global_attention=c.global_attention,
        n_heads=c.n_heads,
        dtype=compute_dtype(c.dtype),
        memory_mode=c.memory_mode,
        memory_chunk=c.memory_chunk,
        batch_chunk=c.batch_chunk,
    )
