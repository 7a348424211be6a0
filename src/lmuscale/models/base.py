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

from lmuscale import GPT2_VOCAB
from lmuscale.layers import layer_norm
from lmuscale.models import fused_loss
from lmuscale.models.family import Registered

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# GPT-2's token embedding initialisation. It is also the output projection (tied), so it must
# be small: at std 1 the initial logits would have std sqrt(d), far from the uniform ln(V).
embedding_init = nn.initializers.normal(0.02)

# Tokens per cross-entropy chunk: 1024 x 50257 float32 logits are 206 MB, alive one at a time.
LOSS_CHUNK = 1024


def compute_dtype(name: str):
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def check_config(config, positive: tuple[str, ...]) -> None:
    """The checks every family's config shares: positive ints, the dtype, the loss's
    implementation (resolved only when a model traces its loss: a config may be made on a
    machine without the devices it will run on)."""
    for name in positive:
        check_positive(config, name)
    compute_dtype(config.dtype)
    if config.loss_impl not in fused_loss.LOSS_IMPLS:
        raise ValueError(
            f"{type(config).__name__}.loss_impl must be one of {fused_loss.LOSS_IMPLS}, "
            f"got {config.loss_impl!r}"
        )


def loss_impl_of(config) -> str:
    """A model config's ``loss_impl``: "auto" for a family whose config has no such field."""
    return getattr(config, "loss_impl", "auto")


def check_positive(config, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RecurrentConfig(Registered):
    """``n_layers`` recurrent layers of width ``d`` (SRU, LSTM). ``dtype`` is the compute
    dtype, "float32" or "bfloat16" (parameters and the state are float32); ``remat``
    rematerialises each layer in the backward pass; ``loss_impl`` is "auto", "xla" or "pallas"
    (``fused_loss.resolve``)."""

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


def cross_entropy(h_BxTxD, w_VxD, targets_BxT, chunk: int = LOSS_CHUNK, impl: str = "xla"):
    """Next-token cross-entropy in nats at every position, without the full logits: float32
    ``loss_BxT = logsumexp(logits) - logits[target]``.

    ``impl`` is a config's ``loss_impl``: "pallas" (``fused_loss``), "auto"
    (``fused_loss.resolve``) or "xla", where one pass over chunks of ``chunk`` tokens computes
    each chunk's logits (in h's dtype, accumulated in float32), the loss and already the
    gradients in h and the tied w: the backward pass only scales them, and stores or recomputes
    no logits. That needs the same cotangent at every position, as for the mean or sum; for any
    other, the gradient in w is NaN, never silently wrong (the one in h stays exact).
    """
    if fused_loss.resolve(impl, h_BxTxD.dtype) == "pallas":
        return fused_loss.cross_entropy(h_BxTxD, w_VxD, targets_BxT)
    return _cross_entropy(h_BxTxD, w_VxD, targets_BxT, chunk)


def _chunked(h_BxTxD, w_VxD, targets_BxT, chunk: int, gradients: bool):
    """``loss_BxT`` by one ``lax.scan`` over chunks, and with ``gradients`` the gradients of
    its sum, ``dh_BxTxD`` (h's dtype) and ``dw_VxD`` (float32)."""
    batch, length, width = h_BxTxD.shape
    count = batch * length
    chunk = max(1, min(chunk, count))
    pad = -count % chunk  # the padding has h = 0, whose gradients are 0
    h_JxcxD = jnp.pad(h_BxTxD.reshape(count, width), ((0, pad), (0, 0))).reshape(-1, chunk, width)
    targets_Jxc = jnp.pad(targets_BxT.reshape(count), (0, pad)).reshape(-1, chunk)
    w_VxD_h = w_VxD.astype(h_BxTxD.dtype)
    vocab_1xV = lax.broadcasted_iota(jnp.int32, (1, w_VxD.shape[0]), 1)

    def one_chunk(dw_VxD, chunk_inputs):
        h_cxD, targets_c = chunk_inputs
        logits_cxV = jnp.einsum("cd,vd->cv", h_cxD, w_VxD_h, preferred_element_type=jnp.float32)
        lse_c = jax.nn.logsumexp(logits_cxV, axis=-1)
        is_target_cxV = targets_c[:, None] == vocab_1xV
        loss_c = lse_c - jnp.sum(jnp.where(is_target_cxV, logits_cxV, 0.0), axis=-1)
        if not gradients:
            return dw_VxD, (loss_c, None)
        # d loss / d logits: the softmax minus the one-hot target.
        dlogits_cxV = (jnp.exp(logits_cxV - lse_c[:, None]) - is_target_cxV).astype(h_cxD.dtype)
        dh_cxD = jnp.einsum("cv,vd->cd", dlogits_cxV, w_VxD_h, preferred_element_type=jnp.float32)
        dw_VxD += jnp.einsum("cv,cd->vd", dlogits_cxV, h_cxD, preferred_element_type=jnp.float32)
        return dw_VxD, (loss_c, dh_cxD.astype(h_cxD.dtype))

    dw_VxD = jnp.zeros(w_VxD.shape, jnp.float32) if gradients else None
    dw_VxD, (loss_Jxc, dh_JxcxD) = lax.scan(one_chunk, dw_VxD, (h_JxcxD, targets_Jxc))
    loss_BxT = loss_Jxc.reshape(-1)[:count].reshape(batch, length)
    if not gradients:
        return loss_BxT
    dh_BxTxD = dh_JxcxD.reshape(-1, width)[:count].reshape(batch, length, width)
    return loss_BxT, dh_BxTxD, dw_VxD


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(h_BxTxD, w_VxD, targets_BxT, chunk):
    return _chunked(h_BxTxD, w_VxD, targets_BxT, chunk, gradients=False)


def _cross_entropy_fwd(h_BxTxD, w_VxD, targets_BxT, chunk):
    loss_BxT, dh_BxTxD, dw_VxD = _chunked(h_BxTxD, w_VxD, targets_BxT, chunk, gradients=True)
    w_dtype = jnp.zeros((0,), w_VxD.dtype)  # residuals must be arrays
    return loss_BxT, (dh_BxTxD, dw_VxD, w_dtype)


def _cross_entropy_bwd(chunk, residuals, g_BxT):
    """Scale the gradients of the sum by the cotangent ``g_BxT``."""
    del chunk
    dh_BxTxD, dw_VxD, w_dtype = residuals
    dh = (dh_BxTxD.astype(jnp.float32) * g_BxT[..., None]).astype(dh_BxTxD.dtype)
    if g_BxT.size == 0:
        return dh, jnp.zeros(dw_VxD.shape, w_dtype.dtype), None
    g = g_BxT.reshape(-1)[0]
    dw = jnp.where(jnp.all(g_BxT == g), g * dw_VxD, jnp.nan)  # see cross_entropy
    return dh, dw.astype(w_dtype.dtype), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


class LanguageModel(nn.Module):
    """Parallel logits and loss, and the recurrent step, shared by every family."""

    block_class: ClassVar[type[nn.Module]]

    def setup(self):
        c = self.config
        dtype = compute_dtype(c.dtype)
        self.embed = nn.Embed(c.vocab_size, c.d, embedding_init=embedding_init, dtype=dtype)
        block = nn.remat(self.block_class) if c.remat else self.block_class
        self.blocks = [block(**self.block_fields(i), name=f"block_{i}") for i in range(c.n_layers)]
        self.norm = layer_norm(dtype)

    def block_fields(self, layer: int) -> dict:
        """The fields of block ``layer`` (from 0): by default the model's config."""
        del layer
        return {"config": self.config}

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
        # resolved by the config's dtype, as the run's log and summary.json name it
        impl = fused_loss.resolve(loss_impl_of(self.config), self.config.dtype)
        per_position = cross_entropy(h_BxTxD, self.embed.embedding, targets_BxT, chunk, impl)
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
