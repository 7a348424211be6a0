"""Flax modules on the Legendre memory: FFN, implicit and global self-attention, ParallelLMU.

Each sequence module computes one function in two modes: ``__call__(x_BxTxD)``, the whole
sequence in parallel, and ``step(state, x_BxD, ...)``, one position with a carried state. The
ops they call (``lmuscale.ops``) run as a run's ``ops.Impls`` says (``impls``: XLA's forms for
a CPU by default); a module never chooses an implementation itself. The recurrent memory stays
float32 in a bfloat16 model: a bfloat16 state would accumulate rounding over thousands of
steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmuscale import lmu
from lmuscale.ops import Impls, memory_pallas
from lmuscale.ops.attention import cached_attention, causal_attention
from lmuscale.ops.implicit_attention import (
    gelu,
    implicit_attention,
    implicit_attention_channels_last,
)

Initializer = Callable[..., jax.Array]
DEFAULT_INIT: Initializer = nn.initializers.lecun_normal()
LAYER_NORM_EPSILON = 1e-5


def layer_norm(dtype, name: str | None = None) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=LAYER_NORM_EPSILON, dtype=dtype, name=name)


class FFN(nn.Module):
    """Eq 11: ``y = gelu(x W1 + b1) W2 + b2``, position-wise, so it serves both modes;
    ``gelu``: its form (``Impls.gelu``)."""

    hidden: int
    dtype: Any = jnp.float32
    kernel_init: Initializer = DEFAULT_INIT
    out_init: Initializer = DEFAULT_INIT
    gelu: str = "erfc"

    @nn.compact
    def __call__(self, x_xD):
        width = x_xD.shape[-1]
        h = nn.Dense(self.hidden, dtype=self.dtype, kernel_init=self.kernel_init, name="up")(x_xD)
        down = nn.Dense(width, dtype=self.dtype, kernel_init=self.out_init, name="down")
        return down(gelu(h, self.gelu))


MEMORY_MODES = ("chunked", "fft")


class ImplicitSelfAttention(nn.Module):
    """The LMU memory (window ``theta``, order ``q``) of a d-channel input, read by implicit
    self-attention through three learned ``L_i`` (``q_prime`` x q) to Q, K, V. In parallel
    mode only ``L M_t`` is formed, by chunked matrix products (``memory_mode`` "chunked",
    ``memory_chunk`` steps each; one bf16 pass in a bf16 model; written as
    ``impls.memory_layout`` says; the chunks' carried states by a scan in XLA, the attention
    in XLA; or, with ``impls.memory`` "pallas", both by ``memory_pallas``'s kernels) or by FFT
    with the L_i folded into the impulse response ("fft"). In step mode the state is the
    float32 memory ``m_BxDxQ``. ``batch_chunk`` sequences (0: all) run at a time in parallel
    mode, each chunk rematerialised in the backward pass, so only one chunk's temporaries are
    alive."""

    q: int
    q_prime: int
    theta: float
    dtype: Any = jnp.float32
    memory_mode: str = "chunked"
    memory_chunk: int = lmu.DEFAULT_CHUNK
    batch_chunk: int = 0
    impls: Impls = Impls()

    def setup(self):
        if self.memory_mode not in MEMORY_MODES:
            raise ValueError(f"memory_mode must be one of {MEMORY_MODES}, got {self.memory_mode!r}")
        if self.impls.memory == "pallas" and self.memory_mode != "chunked":
            mode = self.memory_mode
            raise ValueError(f'the "pallas" memory runs the chunked memory, not "{mode}"')
        k, q = self.q_prime, self.q
        # Fan-in is the order axis, the axis each L_i contracts.
        l_init = nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=-2, batch_axis=(0,)
        )
        self.l = self.param("l", l_init, (3, k, q))
        self.bias = self.param("bias", nn.initializers.zeros, (3, k))
        self.p = self.param("p", nn.initializers.normal(1.0 / math.sqrt(k)), (k,))

    def _attend(self, x_BxTxD):
        impls, (batch, length, width) = self.impls, x_BxTxD.shape
        if self.memory_mode == "fft":
            h_TxQ = lmu.impulse_response(self.q, self.theta, length, np.float32)
            l_3KxQ = self.l.reshape(3 * self.q_prime, self.q)
            y_BxDx3KxT = lmu.memory_reduced(x_BxTxD, h_TxQ, l_3KxQ, time_last=True)
            qkv_3xBxDxKxT = jnp.split(y_BxDx3KxT, 3, axis=2)
            m_BxDxT = implicit_attention(*qkv_3xBxDxKxT, self.bias, self.p, self.dtype, impls.gelu)
            return jnp.swapaxes(m_BxDxT, 1, 2)
        # One chunk operand for the three projections.
        precision = "fast" if jnp.dtype(self.dtype) == jnp.bfloat16 else "exact"
        exact = {"exact_algorithm": impls.exact_algorithm}
        operand = {"chunk": self.memory_chunk, **exact}
        operand["dtype"] = jnp.bfloat16 if precision == "fast" else None
        u_BxTxD = x_BxTxD.astype(jnp.float32)
        if impls.memory == "pallas":  # the carried states by the state kernel
            kernels = {"interpret": impls.memory_kernels.interpret, "mesh": impls.mesh}
            x_BxJxDxZ = memory_pallas.chunk_operand(
                u_BxTxD, self.q, self.theta, **kernels, **operand
            )
        else:
            x_BxJxDxZ, _ = lmu.chunk_operands(u_BxTxD, self.q, self.theta, **operand)
        c = x_BxJxDxZ.shape[-1] - self.q
        weights = [lmu.chunk_weights(self.q, self.theta, c, l_KxQ, **exact) for l_KxQ in self.l]
        if impls.memory_layout == "channels-last":
            # One product for Q, K and V: its (3 q', c, B, J, d) output splits along its
            # major axis, and only the attention's (c, B, J, d) output is moved.
            y_3KxcxBxJxD = lmu.chunk_product_channels_last(
                x_BxJxDxZ, jnp.concatenate(weights, axis=1), precision, self.dtype, **exact
            )
            qkv_3xKxcxBxJxD = y_3KxcxBxJxD.reshape(3, self.q_prime, *y_3KxcxBxJxD.shape[1:])
            args = (qkv_3xKxcxBxJxD, self.bias, self.p, self.dtype)
            if impls.memory == "pallas":  # by the attention kernels
                m_cxBxJxD = memory_pallas.attention(*args, impls.q_prime_precision, **kernels)
            else:
                m_cxBxJxD = implicit_attention_channels_last(
                    *args, impls.gelu, impls.q_prime_precision
                )
            m_BxJxcxD = jnp.transpose(m_cxBxJxD, (1, 2, 0, 3))
            return m_BxJxcxD.reshape(batch, -1, width)[:, :length]
        # One product per projection: a single product for all three, sliced after, had XLA's
        # CPU backend copy each slice and read the whole output each.
        qkv_3xBxJxDxKxc = [
            lmu.chunk_product(x_BxJxDxZ, w_ZxKxc, precision, self.dtype, **exact)
            for w_ZxKxc in weights
        ]
        m_BxJxDxc = implicit_attention(*qkv_3xBxJxDxKxc, self.bias, self.p, self.dtype, impls.gelu)
        return lmu.sequence_from_chunks(m_BxJxDxc, length)

    def __call__(self, x_BxTxD):
        chunk = self.batch_chunk
        if chunk <= 0 or chunk >= x_BxTxD.shape[0]:
            return self._attend(x_BxTxD)
        one = jax.checkpoint(lambda x_TxD: self._attend(x_TxD[None])[0])
        return jax.lax.map(one, x_BxTxD, batch_size=chunk)

    def step(self, m_BxDxQ, x_BxD):
        """One position: returns ``(y_BxD, m_BxDxQ)`` with the updated memory."""
        abar, bbar = lmu.discretize(self.q, self.theta, dtype=np.float32)
        m_BxDxQ = lmu.memory_step(m_BxDxQ, x_BxD, abar, bbar)
        l_3xKxQ = self.l.astype(jnp.float32)
        qkv_3xBxDxKx1 = jnp.einsum(
            "bdq,hkq->hbdk", m_BxDxQ, l_3xKxQ, precision=jax.lax.Precision.HIGHEST
        )[..., None]
        y_BxDx1 = implicit_attention(*qkv_3xBxDxKx1, self.bias, self.p, self.dtype, self.impls.gelu)
        return y_BxDx1[..., 0], m_BxDxQ


def kv_cache(batch_size: int, max_len: int, width: int, n_heads: int, dtype):
    """An empty key/value cache for ``GlobalSelfAttention.step`` (``ops.attention``)."""
    shape = (batch_size, max_len, n_heads, width // n_heads)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


class GlobalSelfAttention(nn.Module):
    """Causal multi-head self-attention (``ops.attention.causal_attention``, as ``attention``,
    ``Impls.attention``, says). Step mode carries a key/value cache ``{"k", "v"}`` of shape
    (B, max_len, heads, head_dim) and the position's index."""

    features: int
    n_heads: int
    dtype: Any = jnp.float32
    kernel_init: Initializer = DEFAULT_INIT
    out_init: Initializer = DEFAULT_INIT
    attention: str = "xla"

    def setup(self):
        if self.features % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must divide the width d={self.features} "
                f"(divisors: {[h for h in range(1, self.features + 1) if self.features % h == 0]})"
            )
        self.qkv = nn.Dense(3 * self.features, dtype=self.dtype, kernel_init=self.kernel_init)
        self.out = nn.Dense(self.features, dtype=self.dtype, kernel_init=self.out_init)

    def _heads(self, x_xD):
        qkv = self.qkv(x_xD).reshape(*x_xD.shape[:-1], 3, self.n_heads, -1)
        return qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]

    def __call__(self, x_BxTxD):
        q, k, v = self._heads(x_BxTxD)
        y_BxTxHxA = causal_attention(q, k, v, self.attention)
        return self.out(y_BxTxHxA.reshape(x_BxTxD.shape))

    def step(self, cache, x_BxD, index):
        """Attend from position ``index`` to positions 0..index: returns ``(y_BxD, cache)``."""
        y, cache = cached_attention(cache, *self._heads(x_BxD[:, None]), index)
        return self.out(y.reshape(x_BxD.shape)), cache


ACTIVATIONS: dict[str, Callable] = {
    "linear": lambda x: x,
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
    "gelu": gelu,  # through erfc, as jax.nn.gelu
    "sigmoid": jax.nn.sigmoid,
}


def activation(name: str) -> Callable:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}") from None


class ParallelLMU(nn.Module):
    """The parallel LMU of papers/parallel-lmu.txt eqs 18-20, a general sequence layer.

        u_t = f1(U_x x_t + b_u)              memory_dim channels (eq 18; 0 drops it, u = x)
        m_t = Abar m_{t-1} + Bbar u_t        order q per channel, window theta (eq 19)
        o_t = f2(W_m m_t + W_x x_t + b_o)    units (eq 20; W_x x_t only if input_to_output)

    ``units`` 0 drops eq 20: the layer returns the memory, flattened to C * q features (the
    paper's "DN only" IMDB model). f1 and f2 are ``ACTIVATIONS`` by name. The same function by
    FFT (eq 26) or scan (``mode``), for the last step only (``return_sequences=False``, eq 25),
    or one position at a time (``step``).
    """

    units: int
    order: int
    theta: float
    memory_dim: int = 1
    input_activation: str = "linear"
    output_activation: str = "tanh"
    input_to_output: bool = True
    return_sequences: bool = True
    mode: str = "fft"

    def setup(self):
        if self.mode not in ("fft", "scan"):
            raise ValueError(f"ParallelLMU.mode must be 'fft' or 'scan', got {self.mode!r}")
        self.f1, self.f2 = activation(self.input_activation), activation(self.output_activation)
        if self.memory_dim:
            self.encoder = nn.Dense(self.memory_dim, name="encoder")
        if self.units:
            self.readout = nn.Dense(self.units, name="readout")

    def _encode(self, x_xD):
        return self.f1(self.encoder(x_xD)) if self.memory_dim else x_xD

    def _output(self, m_xCxQ, x_xD):
        m_xCQ = m_xCxQ.reshape(*m_xCxQ.shape[:-2], -1)
        if not self.units:
            return m_xCQ
        features = jnp.concatenate([m_xCQ, x_xD], -1) if self.input_to_output else m_xCQ
        return self.f2(self.readout(features))

    def __call__(self, x_BxTxD):
        u_BxTxC = self._encode(x_BxTxD)
        if self.return_sequences and self.mode == "scan":
            abar, bbar = lmu.discretize(self.order, self.theta, dtype=np.float32)
            return self._output(lmu.memory_scan(u_BxTxC, abar, bbar), x_BxTxD)
        h_TxQ = lmu.impulse_response(self.order, self.theta, x_BxTxD.shape[1], dtype=np.float32)
        if not self.return_sequences:
            return self._output(lmu.memory_final(u_BxTxC, h_TxQ), x_BxTxD[:, -1])
        return self._output(lmu.memory_fft(u_BxTxC, h_TxQ), x_BxTxD)

    def decode_state(self, batch_size: int, input_dim: int):
        """The zero memory before the first input (call it unbound: it needs no parameters)."""
        channels = self.memory_dim or input_dim
        return jnp.zeros((batch_size, channels, self.order), jnp.float32)

    def step(self, m_BxCxQ, x_BxD):
        """One position: ``(o_BxO, m_BxCxQ)``."""
        abar, bbar = lmu.discretize(self.order, self.theta, dtype=np.float32)
        m_BxCxQ = lmu.memory_step(m_BxCxQ, self._encode(x_BxD), abar, bbar)
        return self._output(m_BxCxQ, x_BxD), m_BxCxQ
