"""What every language model here shares: tied logits, the chunked cross-entropy, the step API.

A family subclasses ``LanguageModel`` with its ``block_class`` and, where a block takes more
than the config, ``block_fields(i)``. Each block has ``__call__(x_BxTxD)``, ``step(layer_state,
x_BxD, index)`` and ``decode_state(batch_size, max_len)``, its state before the first token,
from its fields alone (an unbound block makes it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from lmuscale import GPT2_VOCAB, ops
from lmuscale.layers import layer_norm
from lmuscale.models.family import Registered
from lmuscale.ops.cross_entropy import LOSS_CHUNK, cross_entropy

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# GPT-2's token embedding initialisation. It is also the output projection (tied), so it must
# be small: at std 1 the initial logits would have std sqrt(d), far from the uniform ln(V).
embedding_init = nn.initializers.normal(0.02)


def compute_dtype(name: str):
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def check_config(config, positive: tuple[str, ...]) -> None:
    """The checks every family's config shares: positive ints, the dtype, the kernel switches
    (resolved by ``ops.resolve`` when a run starts: a config may be made on a machine without
    the devices it will run on)."""
    for name in positive:
        check_positive(config, name)
    compute_dtype(config.dtype)
    for switch in (ops.LOSS, ops.MEMORY):
        if hasattr(config, switch.key):
            switch.check(f"{type(config).__name__}.{switch.key}", getattr(config, switch.key))


def check_positive(config, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RecurrentConfig(Registered):
    """``n_layers`` recurrent layers of width ``d`` (SRU, LSTM). ``dtype`` is the compute
    dtype, "float32" or "bfloat16" (parameters and the state are float32); ``remat``
    rematerialises each layer in the backward pass; ``loss_impl`` is "auto", "xla" or "pallas"
    (``ops.resolve``)."""

    d: int
    n_layers: int
    vocab_size: int = GPT2_VOCAB
    dtype: str = "float32"
    remat: bool = False
    loss_impl: str = "auto"

    def __post_init__(self):
        check_config(self, ("d", "n_layers", "vocab_size"))


def default_heads(width: int, head_dim: int = 32) -> int:
    """Attention heads for width d: the divisor of d whose head size is nearest ``head_dim``
    (fewer heads on a tie); Table 3's widths have few divisors, e.g. 65 -> 5 heads of 13."""
    divisors = [h for h in range(1, width + 1) if width % h == 0]
    return min(divisors, key=lambda h: (abs(width / h - head_dim), h))


def logits_from_hidden(h_xD, w_VxD):
    """Tied unembedding, accumulated in float32 whatever the compute dtype."""
    return jnp.einsum(
        "...d,vd->...v", h_xD, w_VxD.astype(h_xD.dtype), preferred_element_type=jnp.float32
    )


class LanguageModel(nn.Module):
    """Parallel logits and loss, and the recurrent step, shared by every family. ``impls``:
    what its ops run (``ops.resolve``; the default: XLA's forms for a CPU)."""

    block_class: ClassVar[type[nn.Module]]
    impls: ops.Impls = dataclasses.field(default=ops.Impls(), kw_only=True)

    def setup(self):
        c = self.config
        dtype = compute_dtype(c.dtype)
        self.embed = nn.Embed(c.vocab_size, c.d, embedding_init=embedding_init, dtype=dtype)
        block = nn.remat(self.block_class) if c.remat else self.block_class
        self.blocks = [block(**self.block_fields(i), name=f"block_{i}") for i in range(c.n_layers)]
        self.norm = layer_norm(dtype)

    def block_fields(self, layer: int) -> dict:
        """The fields of block ``layer`` (from 0): by default the model's config and impls."""
        del layer
        return {"config": self.config, "impls": self.impls}

    def embed_tokens(self, tokens, index):
        """The blocks' input: tokens at positions 0..T-1 (``index`` None) or one token at
        position ``index``. The transformer overrides this to add its learned positions."""
        del index
        return self.embed(tokens)

    def decode_state(self, batch_size: int, max_len: int | None = None):
        """The decode state before the first token, from the config alone (call it unbound):
        ``{"layers": [one per block], "index": position}``, the index only where a layer keeps
        a KV cache (``"kv"``)."""
        layers = [
            self.block_class(**self.block_fields(i), parent=None).decode_state(batch_size, max_len)
            for i in range(self.config.n_layers)
        ]
        state = {"layers": layers}
        if any("kv" in layer for layer in layers):
            state["index"] = jnp.zeros((), jnp.int32)
        return state

    def hidden(self, tokens_BxT):
        """The parallel forward up to and including the final norm: ``h_BxTxD``. A
        ``perturbations`` collection, if passed, gets the gradient with respect to the embedded
        inputs (the causality tests use it)."""
        x_BxTxD = self.embed_tokens(tokens_BxT, None)
        if not self.is_initializing():  # init returns only the params collection
            x_BxTxD = self.perturb("embedded", x_BxTxD)
        for block in self.blocks:
            x_BxTxD = block(x_BxTxD)
        return self.norm(x_BxTxD)

    def step(self, state, token_B):
        """One token of recurrent decoding: ``(logits_BxV, state)``."""
        index = state.get("index")
        x_BxD = self.embed_tokens(token_B, index)
        layers = []
        for block, layer_state in zip(self.blocks, state["layers"], strict=True):
            x_BxD, layer_state = block.step(layer_state, x_BxD, index)
            layers.append(layer_state)
        new_state = {"layers": layers}
        if index is not None:
            new_state["index"] = index + 1
        return logits_from_hidden(self.norm(x_BxD), self.embed.embedding), new_state

    def __call__(self, tokens_BxT):
        """The parallel forward: float32 ``logits_BxTxV``. Training uses ``loss`` instead."""
        return logits_from_hidden(self.hidden(tokens_BxT), self.embed.embedding)

    def loss(self, inputs_BxT, targets_BxT, chunk: int = LOSS_CHUNK):
        """Next-token cross-entropy in nats: ``(mean, per_position_BxT)``, ``targets_BxT``
        usually ``inputs`` shifted by one."""
        if inputs_BxT.shape != targets_BxT.shape:
            raise ValueError(
                f"inputs {inputs_BxT.shape} and targets {targets_BxT.shape} differ in shape"
            )
        h_BxTxD = self.hidden(inputs_BxT)
        w_VxD, impls = self.embed.embedding, self.impls
        per_position = cross_entropy(
            h_BxTxD, w_VxD, targets_BxT, chunk, impls.loss, impls.loss_kernels, impls.mesh
        )
        return per_position.mean(), per_position


@functools.partial(jax.jit, static_argnums=(0,))
def _decode_jit(model, params, state, tokens_TxB):
    def one(state, token_B):
        logits, state = model.apply(params, state, token_B, method=model.step)
        return state, logits

    state, logits_TxBxV = lax.scan(one, state, tokens_TxB)
    return jnp.swapaxes(logits_TxBxV, 0, 1), state


def decode(model: LanguageModel, params, tokens_BxT, state=None):
    """Feed ``tokens_BxT`` one at a time through ``model.step``: ``(logits_BxTxV, state)``,
    from ``state`` or the empty state sized for these tokens. Equals ``model.apply``."""
    tokens_BxT = jnp.asarray(tokens_BxT)
    if state is None:
        state = model.decode_state(tokens_BxT.shape[0], max_len=tokens_BxT.shape[1])
    return _decode_jit(model, params, state, jnp.swapaxes(tokens_BxT, 0, 1))
