"""What every language model here shares: tied logits, the chunked cross-entropy, the step API.

A model subclasses ``LanguageModel``. Its ``setup`` defines ``embed`` (an ``nn.Embed``, also
the output projection), ``blocks`` and the final ``norm``; it provides
- ``embed_tokens(tokens, index)`` where the block input is more than ``embed(tokens)`` (the
  transformer adds positions): tokens at positions 0..T-1 (index None) or one token at
  position ``index`` (decoding);
- ``decode_state(batch_size, max_len) -> state``: the decode state before the first token,
  from the config alone (no parameters), so an unbound module can make it: ``{"layers": [one
  per block], "index": position}``, the index only where a block needs it.
Each block has ``__call__(x_BxTxD)`` and ``step(layer_state, x_BxD, index)``.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from lmuscale.data.tokenizer import GPT2_VOCAB
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


def check_positive(config, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RecurrentConfig(Registered):
    """A language model of ``n_layers`` recurrent layers of width ``d`` (SRU, LSTM).

    Attributes:
      d: embedding and state width. n_layers: layers (each family sets its default).
      vocab_size: tokens (GPT-2: 50257).
      dtype: compute dtype, "float32" or "bfloat16"; parameters and the state are float32.
      remat: rematerialise each layer in the backward pass.
    """

    d: int
    n_layers: int
    vocab_size: int = GPT2_VOCAB
    dtype: str = "float32"
    remat: bool = False

    def __post_init__(self):
        for name in ("d", "n_layers", "vocab_size"):
            check_positive(self, name)
        compute_dtype(self.dtype)


def default_heads(width: int, head_dim: int = 32) -> int:
    """Attention heads for width d: the divisor of d whose head size is nearest ``head_dim``.

    Table 3's widths (48, 65, 91, 112, 144, 204) have few divisors, so a fixed head size is
    impossible; e.g. 65 -> 5 heads of 13, 204 -> 6 heads of 34. Ties go to fewer heads.
    """
    divisors = [h for h in range(1, width + 1) if width % h == 0]
    return min(divisors, key=lambda h: (abs(width / h - head_dim), h))


def logits_from_hidden(h_xD, w_VxD):
    """Tied unembedding, accumulated in float32 whatever the compute dtype."""
    return jnp.einsum(
        "...d,vd->...v", h_xD, w_VxD.astype(h_xD.dtype), preferred_element_type=jnp.float32
    )


def cross_entropy(h_BxTxD, w_VxD, targets_BxT, chunk: int = LOSS_CHUNK):
    """Next-token cross-entropy in nats at every position, without the full logits.

    The (B*T) positions are cut into J chunks of c = ``chunk`` tokens; each chunk's float32
    logits (c x V) exist only inside a rematerialised ``lax.map`` body, so forward and backward
    hold one chunk of logits at a time instead of (B, T, V).

    Returns:
      ``loss_BxT`` in float32: ``logsumexp(logits) - logits[target]``.
    """
    batch, length, width = h_BxTxD.shape
    count = batch * length
    chunk = max(1, min(chunk, count))
    pad = -count % chunk
    h_JxcxD = jnp.pad(h_BxTxD.reshape(count, width), ((0, pad), (0, 0))).reshape(-1, chunk, width)
    targets_Jxc = jnp.pad(targets_BxT.reshape(count), (0, pad)).reshape(-1, chunk)

    @jax.checkpoint
    def one_chunk(args):
        h_cxD, targets_c = args
        logits_cxV = logits_from_hidden(h_cxD, w_VxD)
        picked_c = jnp.take_along_axis(logits_cxV, targets_c[:, None], axis=-1)[:, 0]
        return jax.nn.logsumexp(logits_cxV, axis=-1) - picked_c

    losses = lax.map(one_chunk, (h_JxcxD, targets_Jxc)).reshape(-1)
    return losses[:count].reshape(batch, length)


class LanguageModel(nn.Module):
    """Parallel logits and loss, and the recurrent step, shared by every family."""

    def embed_tokens(self, tokens, index):
        """The token embedding alone: the recurrent families need no positions (their state
        carries the order); the transformer overrides this to add its learned positions."""
        del index
        return self.embed(tokens)

    def output_embedding(self):
        return self.embed.embedding

    def perturb_embedded(self, x_BxTxD):
        """A no-op unless the caller passes a ``perturbations`` collection, whose gradient is
        then the gradient with respect to the embedded inputs (the causality tests use it)."""
        if self.is_initializing():  # init returns only the params collection
            return x_BxTxD
        return self.perturb("embedded", x_BxTxD)

    def hidden(self, tokens_BxT):
        """The parallel forward up to and including the final norm: ``h_BxTxD``."""
        x_BxTxD = self.perturb_embedded(self.embed_tokens(tokens_BxT, None))
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
        return logits_from_hidden(self.norm(x_BxD), self.output_embedding()), new_state

    def __call__(self, tokens_BxT):
        """The parallel forward: float32 ``logits_BxTxV``. Training uses ``loss`` instead."""
        return logits_from_hidden(self.hidden(tokens_BxT), self.output_embedding())

    def loss(self, inputs_BxT, targets_BxT, chunk: int = LOSS_CHUNK):
        """Next-token cross-entropy in nats: ``(mean, per_position_BxT)``.

        ``targets_BxT`` is usually ``inputs`` shifted by one (a window of n + 1 tokens gives
        both). The mean is over every position of every sequence.
        """
        if inputs_BxT.shape != targets_BxT.shape:
            raise ValueError(
                f"inputs {inputs_BxT.shape} and targets {targets_BxT.shape} differ in shape"
            )
        per_position = cross_entropy(
            self.hidden(inputs_BxT), self.output_embedding(), targets_BxT, chunk
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
    """Feed ``tokens_BxT`` one at a time through ``model.step``: ``(logits_BxTxV, state)``.

    With ``state=None`` it starts from the model's empty state, sized for exactly these tokens.
    This is the recurrent mode; its logits equal ``model.apply(params, tokens_BxT)``.
    """
    tokens_BxT = jnp.asarray(tokens_BxT)
    if state is None:
        state = model.decode_state(tokens_BxT.shape[0], max_len=tokens_BxT.shape[1])
    return _decode_jit(model, params, state, jnp.swapaxes(tokens_BxT, 0, 1))
