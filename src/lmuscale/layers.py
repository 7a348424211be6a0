"""Flax modules on the Legendre memory: FFN, implicit and global self-attention, ParallelLMU.

Every sequence module has two modes that compute the same function:
- ``__call__(x_BxTxD)``: the whole sequence in parallel (training, evaluation);
- ``step(state, x_BxD, ...)``: one position with an explicit carried state (decoding).
Parameters live in the usual ``params`` collection; the frozen LMU constants (H, Abar, Bbar)
are not parameters but float64 numpy constants from ``lmuscale.lmu``, cast at trace time.

Choices the paper leaves open (papers/lmu-implicit-self-attention.md §4), made here:
- gelu is the exact (erf) form everywhere.
- Eq 8 "ignores the bias vectors": each L_i gets one bias per reduced-order row (q' values),
  broadcast over the d channels.
- Eq 9 prints softmax(Q K^T) with no temperature. Q K^T sums d products of gelu outputs, which
  saturates the softmax at d ~ 200, so the scores are divided by sqrt(d) as in Vaswani et al.
- The recurrent memory is kept in float32 even when the model computes in bfloat16: a
  bfloat16 state would accumulate rounding over thousands of steps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lmuscale import lmu

Initializer = Callable[..., jax.Array]
DEFAULT_INIT: Initializer = nn.initializers.lecun_normal()
LAYER_NORM_EPSILON = 1e-5


def gelu(x):
    return nn.gelu(x, approximate=False)


def layer_norm(dtype, name: str | None = None) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=LAYER_NORM_EPSILON, dtype=dtype, name=name)


class FFN(nn.Module):
    """Eq 11: ``y = gelu(x W1 + b1) W2 + b2``, position-wise, so it serves both modes."""

    hidden: int
    dtype: Any = jnp.float32
    kernel_init: Initializer = DEFAULT_INIT
    out_init: Initializer = DEFAULT_INIT

    @nn.compact
    def __call__(self, x_xD):
        width = x_xD.shape[-1]
        h = nn.Dense(self.hidden, dtype=self.dtype, kernel_init=self.kernel_init, name="up")(x_xD)
        return nn.Dense(width, dtype=self.dtype, kernel_init=self.out_init, name="down")(gelu(h))


def gelu_grad(x):
    """d gelu / dx for the exact gelu ``x Phi(x)``: ``Phi(x) + x phi(x)``."""
    cdf = 0.5 * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0))))
    pdf = jnp.exp(-0.5 * jnp.square(x)) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + x * pdf


def _wide(dtype):
    # Scores, softmax and w: float32 at least (float64 under x64, for reference checks).
    return jnp.promote_types(dtype, jnp.float32)


def _attend(q_xDxK, k_xDxK, v_xDxK, bias_3xK, p_K, dtype):
    """The forward pass of ``implicit_attention``: ``(m_xD, (weights_xKxK, w_xK))``."""
    gq_xDxK, gk_xDxK, gv_xDxK = (
        gelu(x.astype(dtype) + lax.broadcast_to_rank(b.astype(dtype), x.ndim))
        for x, b in zip((q_xDxK, k_xDxK, v_xDxK), bias_3xK, strict=True)
    )
    scores_xKxK = jnp.einsum(
        "...di,...dj->...ij", gq_xDxK, gk_xDxK, preferred_element_type=_wide(dtype)
    )
    weights_xKxK = jax.nn.softmax(scores_xKxK / math.sqrt(q_xDxK.shape[-2]), axis=-1)
    w_xK = jnp.einsum("...ij,i->...j", weights_xKxK, p_K.astype(_wide(dtype)))
    return jnp.einsum("...dj,...j->...d", gv_xDxK, w_xK.astype(dtype)), (weights_xKxK, w_xK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def implicit_attention(q_xDxK, k_xDxK, v_xDxK, bias_3xK, p_K, dtype):
    """Eqs 8-10 after the memory: ``m = p softmax(Q K^T / sqrt(d)) V`` for every position.

    ``Q = gelu(L1 M + b1)``, and K, V likewise. The read-out is collapsed:
    ``w = p softmax(Q K^T / sqrt(d))`` is a q'-vector and ``m = V^T w``, so the q' x d matrix
    ``M' = softmax(...) V`` of eq 9 is never formed. The backward pass is written by hand: of
    the (positions x d x q')-sized arrays it keeps only the inputs (the memory's outputs, which
    exist anyway), with the (q' x q') softmax weights and w, and recomputes gelu(Q), gelu(K),
    gelu(V) where their gradients are formed. (A custom VJP has no forward-mode derivative.)

    Args:
      q_xDxK, k_xDxK, v_xDxK: ``L_i M`` for each position (leading axes ...), the d channels
        on the second-to-last axis and the reduced order on the last.
      bias_3xK: one bias per row of each L_i.
      p_K: the readout p of eq 10.
      dtype: the compute dtype of Q, K, V; scores, softmax and w are float32 (or wider).

    Returns:
      ``m_xD``, one d-vector per position, in ``dtype``.
    """
    return _attend(q_xDxK, k_xDxK, v_xDxK, bias_3xK, p_K, dtype)[0]


def _implicit_attention_fwd(q_xDxK, k_xDxK, v_xDxK, bias_3xK, p_K, dtype):
    m_xD, (weights_xKxK, w_xK) = _attend(q_xDxK, k_xDxK, v_xDxK, bias_3xK, p_K, dtype)
    return m_xD, (q_xDxK, k_xDxK, v_xDxK, bias_3xK, p_K, weights_xKxK, w_xK)


def _implicit_attention_bwd(dtype, residuals, dm_xD):
    *inputs, bias_3xK, p_K, weights_xKxK, w_xK = residuals
    pairs = zip(inputs, bias_3xK.astype(dtype), strict=True)
    pre_3xxDxK = [x.astype(dtype) + lax.broadcast_to_rank(b, x.ndim) for x, b in pairs]
    gq_xDxK, gk_xDxK, gv_xDxK = (gelu(pre) for pre in pre_3xxDxK)
    dm_xD = dm_xD.astype(dtype)
    # m = gelu(V)^T w, w = p softmax(scores), scores = gelu(Q)^T gelu(K) / sqrt(d).
    dgv_xDxK = dm_xD[..., :, None] * w_xK.astype(dtype)[..., None, :]
    dw_xK = jnp.einsum("...d,...dj->...j", dm_xD, gv_xDxK, preferred_element_type=_wide(dtype))
    positions = tuple(range(weights_xKxK.ndim - 2))
    dp_K = jnp.einsum("...ij,...j->...i", weights_xKxK, dw_xK).sum(positions)
    p_xKx1 = lax.broadcast_to_rank(p_K.astype(_wide(dtype))[:, None], dw_xK.ndim + 1)
    dweights_xKxK = p_xKx1 * dw_xK[..., None, :]
    inner_xKx1 = jnp.sum(weights_xKxK * dweights_xKxK, axis=-1, keepdims=True)
    scale = 1.0 / math.sqrt(gq_xDxK.shape[-2])
    dscores_xKxK = (weights_xKxK * (dweights_xKxK - inner_xKx1) * scale).astype(dtype)
    dgq_xDxK = jnp.einsum("...ij,...dj->...di", dscores_xKxK, gk_xDxK)
    dgk_xDxK = jnp.einsum("...ij,...di->...dj", dscores_xKxK, gq_xDxK)
    dpre_3xxDxK = [
        g * gelu_grad(pre)
        for g, pre in zip((dgq_xDxK, dgk_xDxK, dgv_xDxK), pre_3xxDxK, strict=True)
    ]
    dbias_3xK = jnp.stack(
        [d.astype(_wide(dtype)).sum(tuple(range(d.ndim - 1))) for d in dpre_3xxDxK]
    )
    return (
        *(d.astype(x.dtype) for d, x in zip(dpre_3xxDxK, inputs, strict=True)),
        dbias_3xK.astype(bias_3xK.dtype),
        dp_K.astype(p_K.dtype),
    )


implicit_attention.defvjp(_implicit_attention_fwd, _implicit_attention_bwd)


MEMORY_MODES = ("chunked", "fft")


class ImplicitSelfAttention(nn.Module):
    """The LMU memory (theta, q) of a d-channel input, read by implicit self-attention.

    Each position's memory M_t (q x d) is reduced along the order axis by three learned
    ``L_i`` (q' x q) to Q, K, V (q' x d); then eqs 9-10 give one d-vector. In parallel mode the
    (batch, n, d, q) memory is never formed: only ``L M_t`` is computed, either in chunks of
    matrix products (``lmu.memory_chunked``, the default) or by FFT with the L_i folded into
    the impulse response (appendix A.1, ``lmu.memory_reduced``). In step mode the state is the
    memory itself, ``m_BxDxQ`` in float32, whose size does not depend on how many tokens came
    before.

    Attributes:
      q, q_prime, theta: the order q, the reduced order q' and the window θ in tokens.
      memory_mode: "chunked" or "fft" (the same function; see ``lmu``).
      memory_chunk: steps per chunk in "chunked" mode. The chunked memory runs at float32
        accuracy in a float32 model and as one bf16 pass in a bf16 one (its state stays
        float32 in both).
      batch_chunk: sequences per chunk in parallel mode; 0 means the whole batch at once.
        Chunks are rematerialised in the backward pass, so the temporaries of only one chunk
        are alive at a time.
    """

    q: int
    q_prime: int
    theta: float
    dtype: Any = jnp.float32
    memory_mode: str = "chunked"
    memory_chunk: int = lmu.DEFAULT_CHUNK
    batch_chunk: int = 0

    def setup(self):
        if self.memory_mode not in MEMORY_MODES:
            raise ValueError(f"memory_mode must be one of {MEMORY_MODES}, got {self.memory_mode!r}")
        k, q = self.q_prime, self.q
        # Fan-in is the order axis, the axis each L_i contracts.
        l_init = nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=-2, batch_axis=(0,)
        )
        self.l = self.param("l", l_init, (3, k, q))
        self.bias = self.param("bias", nn.initializers.zeros, (3, k))
        self.p = self.param("p", nn.initializers.normal(1.0 / math.sqrt(k)), (k,))

    def _attend(self, x_BxTxD):
        """Q, K, V pre-activations of the whole sequence, then the attention."""
        if self.memory_mode == "fft":
            h_TxQ = lmu.impulse_response(self.q, self.theta, x_BxTxD.shape[1], np.float32)
            l_3KxQ = self.l.reshape(3 * self.q_prime, self.q)
            qkv_3xBxTxDxK = jnp.split(lmu.memory_reduced(x_BxTxD, h_TxQ, l_3KxQ), 3, axis=-1)
        else:
            # One chunk operand for the three projections; one product each, so Q, K and V
            # are separate arrays rather than slices of one.
            precision = "fast" if jnp.dtype(self.dtype) == jnp.bfloat16 else "exact"
            x_BxJxDxZ, _ = lmu.chunk_operands(
                x_BxTxD.astype(jnp.float32), self.q, self.theta, chunk=self.memory_chunk
            )
            c = x_BxJxDxZ.shape[-1] - self.q
            # The attention computes in self.dtype, so a bf16 model takes bf16 outputs.
            qkv_3xBxTxDxK = [
                lmu.chunk_product(
                    x_BxJxDxZ,
                    lmu.chunk_weights(self.q, self.theta, c, l_KxQ),
                    x_BxTxD.shape[1],
                    precision,
                    out_dtype=self.dtype,
                )
                for l_KxQ in self.l
            ]
        return implicit_attention(*qkv_3xBxTxDxK, self.bias, self.p, self.dtype)

    def __call__(self, x_BxTxD):
        chunk = self.batch_chunk
        if chunk <= 0 or chunk >= x_BxTxD.shape[0]:
            return self._attend(x_BxTxD)
        one = jax.checkpoint(lambda x_TxD: self._attend(x_TxD[None])[0])
        return lax.map(one, x_BxTxD, batch_size=chunk)

    def step(self, m_BxDxQ, x_BxD):
        """One position: returns ``(y_BxD, m_BxDxQ)`` with the updated memory."""
        abar, bbar = lmu.discretize(self.q, self.theta, dtype=np.float32)
        m_BxDxQ = lmu.memory_step(m_BxDxQ, x_BxD, abar, bbar)
        l_3xKxQ = self.l.astype(jnp.float32)
        qkv = jnp.einsum("bdq,hkq->hbdk", m_BxDxQ, l_3xKxQ, precision=lax.Precision.HIGHEST)
        y = implicit_attention(*qkv, self.bias, self.p, self.dtype)
        return y, m_BxDxQ


def kv_cache(batch_size: int, max_len: int, width: int, n_heads: int, dtype):
    """An empty key/value cache for ``GlobalSelfAttention.step``."""
    shape = (batch_size, max_len, n_heads, width // n_heads)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def attention_implementation(dtype, device=None) -> str:
    """``"cudnn"`` (cuDNN's flash attention: the n x n scores are never stored) on an NVIDIA
    GPU of compute capability 8.0 or later computing in bfloat16 or float16; ``"xla"``
    elsewhere (CPU, TPU, float32, older or non-NVIDIA GPUs)."""
    device = device or jax.devices()[0]
    if device.platform != "gpu" or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return "xla"
    try:
        major, minor = (int(x) for x in str(device.compute_capability).split("."))
    except (AttributeError, ValueError):  # a GPU that is not NVIDIA's
        return "xla"
    return "cudnn" if (major, minor) >= (8, 0) else "xla"


# cuDNN's flash attention wants a head width that is a multiple of 8 (Table 3's are 13 to 36).
CUDNN_HEAD_MULTIPLE = 8


def causal_attention(q_BxTxHxA, k_BxTxHxA, v_BxTxHxA, implementation: str = "xla"):
    """softmax(q k^T / sqrt(A)) v over positions <= each query's, per head.

    For ``"cudnn"`` the head width A is padded with zeros up to a multiple of 8: zero columns
    add nothing to q k^T, the scale stays 1/sqrt(A), and the padded output columns are dropped.
    """
    width = q_BxTxHxA.shape[-1]
    pad = -width % CUDNN_HEAD_MULTIPLE if implementation == "cudnn" else 0
    if pad:
        widths = ((0, 0), (0, 0), (0, 0), (0, pad))
        q_BxTxHxA, k_BxTxHxA, v_BxTxHxA = (
            jnp.pad(x, widths) for x in (q_BxTxHxA, k_BxTxHxA, v_BxTxHxA)
        )
    y_BxTxHxA = jax.nn.dot_product_attention(
        q_BxTxHxA,
        k_BxTxHxA,
        v_BxTxHxA,
        is_causal=True,
        scale=1.0 / math.sqrt(width),
        implementation=implementation,
    )
    return y_BxTxHxA[..., :width]


class GlobalSelfAttention(nn.Module):
    """Causal multi-head self-attention over the whole sequence (``causal_attention``: cuDNN's
    flash attention on a recent NVIDIA GPU in bfloat16, XLA's elsewhere).

    Step mode carries a key/value cache ``{"k", "v"}`` of shape (B, max_len, heads, head_dim)
    and the index of the position being written.
    """

    features: int
    n_heads: int
    dtype: Any = jnp.float32
    kernel_init: Initializer = DEFAULT_INIT
    out_init: Initializer = DEFAULT_INIT

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
        y_BxTxHxA = causal_attention(q, k, v, attention_implementation(self.dtype))
        return self.out(y_BxTxHxA.reshape(x_BxTxD.shape))

    def step(self, cache, x_BxD, index):
        """Attend from position ``index`` to positions 0..index: returns ``(y_BxD, cache)``."""
        q, k, v = self._heads(x_BxD[:, None])
        cache = {
            "k": lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), index, 1),
            "v": lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), index, 1),
        }
        visible_T = jnp.arange(cache["k"].shape[1]) <= index
        y = jax.nn.dot_product_attention(
            q, cache["k"].astype(q.dtype), cache["v"].astype(q.dtype), mask=visible_T
        )
        return self.out(y.reshape(x_BxD.shape)), cache


ACTIVATIONS: dict[str, Callable] = {
    "linear": lambda x: x,
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
    "gelu": gelu,
    "sigmoid": jax.nn.sigmoid,
}


def activation(name: str) -> Callable:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}") from None


class ParallelLMU(nn.Module):
    """The parallel LMU of papers/parallel-lmu.txt eqs 18-20, a general sequence layer.

        u_t = f1(U_x x_t + b_u)              memory_dim channels (eq 18)
        m_t = Abar m_{t-1} + Bbar u_t        order q per channel, window theta (eq 19)
        o_t = f2(W_m m_t + W_x x_t + b_o)    units (eq 20)

    Modes, all the same function:
    - ``mode="fft"``: every m_t at once by FFT convolution with the impulse response (eq 26);
    - ``mode="scan"``: the recurrence in ``lax.scan`` (the paper's "LTI version");
    - ``return_sequences=False``: only the last step, from one contraction of the input with
      the reversed impulse response (eq 25), whatever the mode;
    - ``step(m_BxCxQ, x_BxD)``: one position at a time (inference).

    Attributes:
      units: width of o. 0 drops eq 20: the layer returns the memory itself, flattened to
        C * q features (the paper's "DN only" IMDB model).
      order, theta: q and the window θ in steps.
      memory_dim: channels of u. 0 drops eq 18: u = x (d_u = d_x).
      input_activation, output_activation: f1 and f2, by name (``ACTIVATIONS``).
      input_to_output: include the W_x x_t term of eq 20.
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
        """``o_BxTxO`` (``o_BxO``, the last step, when return_sequences is False)."""
        u_BxTxC = self._encode(x_BxTxD)
        length = x_BxTxD.shape[1]
        if not self.return_sequences:
            h_TxQ = lmu.impulse_response(self.order, self.theta, length, dtype=np.float32)
            return self._output(lmu.memory_final(u_BxTxC, h_TxQ), x_BxTxD[:, -1])
        if self.mode == "fft":
            h_TxQ = lmu.impulse_response(self.order, self.theta, length, dtype=np.float32)
            m_BxTxCxQ = lmu.memory_fft(u_BxTxC, h_TxQ)
        else:
            abar, bbar = lmu.discretize(self.order, self.theta, dtype=np.float32)
            m_BxTxCxQ = lmu.memory_scan(u_BxTxC, abar, bbar)
        return self._output(m_BxTxCxQ, x_BxTxD)

    def decode_state(self, batch_size: int, input_dim: int):
        """The zero memory before the first input (call it unbound: it needs no parameters)."""
        channels = self.memory_dim or input_dim
        return jnp.zeros((batch_size, channels, self.order), jnp.float32)

    def step(self, m_BxCxQ, x_BxD):
        """One position: ``(o_BxO, m_BxCxQ)``."""
        abar, bbar = lmu.discretize(self.order, self.theta, dtype=np.float32)
        m_BxCxQ = lmu.memory_step(m_BxCxQ, self._encode(x_BxD), abar, bbar)
        return self._output(m_BxCxQ, x_BxD), m_BxCxQ
