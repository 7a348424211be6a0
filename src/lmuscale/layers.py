"""Flax modules on the Legendre memory: FFN, implicit and global self-attention, ParallelLMU.

Each sequence module computes one function in two modes: ``__call__(x_BxTxD)``, the whole
sequence in parallel, and ``step(state, x_BxD, ...)``, one position with a carried state.

Choices the paper leaves open (papers/lmu-implicit-self-attention.md §4), made here:
- gelu is the exact (erf) form everywhere.
- Eq 8 "ignores the bias vectors": each L_i gets one bias per row, shared by the d channels.
- Eq 9 has no temperature, but Q K^T sums d products of gelu outputs and saturates the
  softmax at d ~ 200, so the scores are divided by sqrt(d) as in Vaswani et al.
- The recurrent memory stays float32 in a bfloat16 model: a bfloat16 state would accumulate
  rounding over thousands of steps.
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

from lmuscale import kernels, lmu, memory_kernel

Initializer = Callable[..., jax.Array]
DEFAULT_INIT: Initializer = nn.initializers.lecun_normal()
LAYER_NORM_EPSILON = 1e-5


def gelu(x):
    """The exact gelu ``x Phi(x)``: through erf on a GPU (``gelu_through_erf``), elsewhere
    through erfc, as ``jax.nn.gelu`` computes it.

    XLA's GPU compiler split erfc's piecewise expansion over several kernels where it met
    the implicit attention's transposes (of the layers' order before
    ``channels_last_memory``), each writing float32 intermediates the size of Q, K and V:
    compiled for an H100, lmu-1M's memory read and wrote 765 GB per 64-sequence micro-batch
    through erfc, 167 GB through erf (``benchmarks/gpu_aot.py``). On a CPU, erfc
    keeps the forward pass's gelu apart from ``gelu_grad``'s erf, which XLA would otherwise
    share and keep alive (lmu-1M's step at (8, 1024): 5 GB more read, 1.2 GB more held)."""
    if gelu_through_erf():
        return x * (0.5 * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0)))))
    return nn.gelu(x, approximate=False)


def gelu_through_erf() -> bool:
    """Whether ``gelu`` goes through erf: where JAX computes on a GPU."""
    return jax.default_backend() == "gpu"


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
    # Scores, softmax, w and every sum: float32 at least (float64 under x64, for reference
    # checks); a bf16 model reads and writes its big arrays in bf16.
    return jnp.promote_types(dtype, jnp.float32)


# Sums over the reduced order (q' terms) are written out term by term up to this many terms:
# one elementwise pass that XLA fuses, where a reduction over a broadcast product had XLA's
# CPU backend write the product (q' times the array) first.
_UNROLL = 64


def _sum_of_products(a, b, axis: int):
    """``sum(a * b, axis)`` for operands of equal rank that broadcast; ``axis`` (from the front
    if positive, from the end if negative) is short: the reduced order."""
    if a.shape[axis] > _UNROLL:
        return jnp.sum(a * b, axis=axis)
    terms = (
        lax.index_in_dim(a, i, axis, keepdims=False) * lax.index_in_dim(b, i, axis, keepdims=False)
        for i in range(a.shape[axis])
    )
    return functools.reduce(jnp.add, terms)


def _apart_from_its_sum(x):
    """``x`` itself. On a CPU it passes through a rounding to its own precision, which changes
    no value, so that XLA computes it in a pass of its own before the sum that reads it.

    XLA:CPU (jaxlib 0.10) hands a sum over the channel axis of a product to a YNNPACK reduce
    fusion with the product inside, which ran about 10x slower than the product and the sum
    apart. For ``implicit_attention``'s ``dw`` at lmu-1M's (1, 1024) shapes: 28-35 ms against
    3 ms alone; in one layer's forward+backward, 50 ms of 160-185, which fell to 100-115."""
    if jax.default_backend() != "cpu":
        return x
    info = jnp.finfo(x.dtype)
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _pre_activations(inputs, bias_3xK, dtype):
    """``L_i M + b_i`` for Q, K, V in ``dtype``; each bias broadcast over channels and steps."""
    return [
        x.astype(dtype) + lax.broadcast_to_rank(b.astype(dtype)[:, None], x.ndim)
        for x, b in zip(inputs, bias_3xK, strict=True)
    ]


def _implicit_attention_fwd(q_xDxKxc, k_xDxKxc, v_xDxKxc, bias_3xK, p_K, dtype):
    """The forward pass of ``implicit_attention``: ``m_xDxc`` and the backward pass's
    residuals, the inputs and the softmax's ``weights_xKxKxc`` and ``w_xKxc``."""
    wide = _wide(dtype)
    inputs = (q_xDxKxc, k_xDxKxc, v_xDxKxc)
    gq, gk, gv = (gelu(x) for x in _pre_activations(inputs, bias_3xK, dtype))
    # scores[i, k] = sum over the d channels of gelu(Q)[d, i] gelu(K)[d, k], at every step.
    scores_xKxKxc = jnp.sum(
        gq.astype(wide)[..., :, :, None, :] * gk.astype(wide)[..., :, None, :, :], axis=-4
    )
    weights_xKxKxc = jax.nn.softmax(scores_xKxKxc / math.sqrt(q_xDxKxc.shape[-3]), axis=-2)
    p_Kx1x1 = lax.broadcast_to_rank(p_K.astype(wide)[:, None, None], weights_xKxKxc.ndim)
    w_xKxc = jnp.sum(weights_xKxKxc * p_Kx1x1, axis=-3)
    m_xDxc = _sum_of_products(gv.astype(wide), w_xKxc[..., None, :, :], axis=-2)
    return m_xDxc.astype(dtype), (*inputs, bias_3xK, p_K, weights_xKxKxc, w_xKxc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def implicit_attention(q_xDxKxc, k_xDxKxc, v_xDxKxc, bias_3xK, p_K, dtype):
    """Eqs 8-10 after the memory: ``m_xDxc = p softmax(Q K^T / sqrt(d)) V`` in ``dtype``, with
    ``Q = gelu(L1 M + b1)``, K and V likewise (``bias_3xK`` the b_i, ``p_K`` eq 10's p, every
    sum at least float32). ``w = p softmax(...)`` is a q'-vector and ``m = V^T w``, so eq 9's
    q' x d ``M'`` is never formed. The inputs ``L_i M`` are in the layout the memory writes (d,
    q', then positions), and every sum runs over d or q' in place, so nothing the size of Q, K
    or V is moved. The backward pass, by hand, keeps of the (positions x d x q') arrays only
    the inputs and recomputes the gelus (a custom VJP has no forward-mode derivative)."""
    return _implicit_attention_fwd(q_xDxKxc, k_xDxKxc, v_xDxKxc, bias_3xK, p_K, dtype)[0]


def _implicit_attention_bwd(dtype, residuals, dm_xDxc):
    *inputs, bias_3xK, p_K, weights_xKxKxc, w_xKxc = residuals
    wide = _wide(dtype)
    pre_3xxDxKxc = _pre_activations(inputs, bias_3xK, dtype)
    gq, gk, gv = (gelu(pre).astype(wide) for pre in pre_3xxDxKxc)
    dm_xDxc = dm_xDxc.astype(dtype).astype(wide)
    # m = gelu(V)^T w, w = p softmax(scores), scores = gelu(Q)^T gelu(K) / sqrt(d).
    dgv_xDxKxc = dm_xDxc[..., :, None, :] * w_xKxc[..., None, :, :]
    dw_xKxc = jnp.sum(_apart_from_its_sum(dm_xDxc[..., :, None, :] * gv), axis=-3)
    dw_x1xKxc = dw_xKxc[..., None, :, :]
    positions = (*range(weights_xKxKxc.ndim - 3), weights_xKxKxc.ndim - 1)
    dp_K = jnp.sum(weights_xKxKxc * dw_x1xKxc, axis=(*positions, -2))
    p_Kx1x1 = lax.broadcast_to_rank(p_K.astype(wide)[:, None, None], weights_xKxKxc.ndim)
    dweights_xKxKxc = p_Kx1x1 * dw_x1xKxc
    inner_xKx1xc = jnp.sum(weights_xKxKxc * dweights_xKxKxc, axis=-2, keepdims=True)
    scale = 1.0 / math.sqrt(gq.shape[-3])
    dscores_xKxKxc = weights_xKxKxc * (dweights_xKxKxc - inner_xKx1xc) * scale
    # dgelu(Q)[d, i] = sum_k dscores[i, k] gelu(K)[d, k], and dgelu(K) likewise over i.
    dgq_xDxKxc = _sum_of_products(dscores_xKxKxc[..., None, :, :, :], gk[..., :, None, :, :], -2)
    dgk_xDxKxc = _sum_of_products(dscores_xKxKxc[..., None, :, :, :], gq[..., :, :, None, :], -3)
    # On a CPU gelu goes through erfc and gelu_grad through erf: different operations, so XLA
    # does not keep the forward's transcendental results alive for this pass (``gelu``).
    dpre_3xxDxKxc = [
        (g * gelu_grad(pre.astype(wide))).astype(dtype)
        for g, pre in zip((dgq_xDxKxc, dgk_xDxKxc, dgv_xDxKxc), pre_3xxDxKxc, strict=True)
    ]
    channels_and_positions = (*range(inputs[0].ndim - 2), inputs[0].ndim - 1)
    dbias_3xK = jnp.stack([d.astype(wide).sum(channels_and_positions) for d in dpre_3xxDxKxc])
    return (
        *(d.astype(x.dtype) for d, x in zip(dpre_3xxDxKxc, inputs, strict=True)),
        dbias_3xK.astype(bias_3xK.dtype),
        dp_K.astype(p_K.dtype),
    )


implicit_attention.defvjp(_implicit_attention_fwd, _implicit_attention_bwd)


def channels_last_memory() -> bool:
    """Whether the chunked memory in XLA forms Q, K and V in one product written channels last,
    (3 q', c, B, J, d), read by ``implicit_attention_channels_last``: where JAX computes on a
    GPU. There XLA's reductions want the summed axis minor; in the order (B, J, d, q', c) an
    H200 spent 68 of lmu-1M's 171 ms per micro-batch transposing Q, K and V
    (results/gpu-nvidia-h200-2026-11-27.json). Compiled for an H100 (benchmarks/gpu_aot.py),
    lmu-1M's step then moves 203.5 GB per micro-batch of 64 x 1024 in bfloat16 against 290.9
    (the memory 75.6 against 167.0), a floor of 60.7 ms against 86.8; timed on an H100, the
    micro-batch took 150.8 ms against 178.0 (results/gpu-nvidia-h100-80gb-hbm3.json's
    profiles), and on an H200, with the attention's q' x q' sums as products, 99.1 against
    159.1 (results/gpu-nvidia-h200.json). XLA's CPU backend is faster in the other order,
    which is kept off a GPU."""
    return jax.default_backend() == "gpu"


# How ``implicit_attention_channels_last`` forms its q' x q' sums over the channels, the scores
# and, in the backward pass, dgelu(Q) and dgelu(K): "products", matrix products batched over
# the positions (q' x d by d x q', q' x q' by q' x d), or "elementwise", sums over broadcast
# products that XLA fuses in place. On an H100, lmu-1M's micro-batch of 64 x 1024 in bfloat16
# took 124.1 ms by products against 149.8 elementwise (results/q_prime_forms-h100.json): the
# elementwise backward's kernel ran a thread per output, each reading q' rows, every row so
# read q' times over (13.0 ms a layer). Products cost copies instead, of gelu(Q) and gelu(K)
# into cuBLAS's batch-major order and of the two gradients back, each element read once:
# compiled for an H100 (benchmarks/gpu_aot.py), the memory's traffic is 99.1 GB per
# micro-batch against 75.6, an estimate that counts every array read once, which the
# elementwise kernel was not. benchmarks/q_prime_forms.py times both forms.
Q_PRIME_SUMS = "products"

# Whether those products take their operands in a model's own dtype where it is narrower than
# float32 (bfloat16), summing in float32: the forward's gelu(Q) and gelu(K), already rounded
# to it, so the scores are the same sums (a product of two bfloat16 numbers is exact in
# float32), and the backward's gelu(Q), gelu(K) and dscores, which is rounded to it first, as
# every other matrix product's input is in such a model (its gradients are then rounded to it
# too). On an H200, lmu-1M's micro-batch of 64 x 1024 took 84.9 ms against 97.7 with float32
# operands, which XLA converts and multiplies at full precision, and the paper step 663.7 ms
# against 766.6 (results/q_prime_forms-h200.json, gpu-nvidia-h200.json). False: float32.
NARROW_PRODUCTS = True

# The precision those products ask of XLA when both operands are narrower than float32: a
# product of two bfloat16 numbers is exact in float32 and the sums are float32 either way, so
# "default" computes the same sums as "highest", which a GPU's compiler may instead take as
# float32 products (the H200's program from before NARROW_PRODUCTS, whose operands were
# float32, ran them as float32 GEMMs at 4.5-12.8 TFLOP/s). Not yet timed: "highest" as
# before; benchmarks/q_prime_forms.py times "default" beside it. Float32 operands always ask
# "highest" (not TF32).
NARROW_PRECISION = "highest"


def _per_position_product(subscripts: str, a, b, wide):
    """``jnp.einsum(subscripts, a, b)`` summed in ``wide``, the positions (``...``) a batch:
    at full precision, or ``NARROW_PRECISION`` where both operands are narrower than float32."""
    narrow = all(jnp.dtype(x.dtype).itemsize < 4 for x in (a, b))
    precision = lax.Precision(NARROW_PRECISION) if narrow else lax.Precision.HIGHEST
    return jnp.einsum(subscripts, a, b, precision=precision, preferred_element_type=wide)


def _channels_last_pre(qkv_3xKx___xD, bias_3xK, dtype):
    """``L_i M + b_i`` for Q, K, V in ``dtype``, each (q', positions..., d)."""
    bias___x3xK = lax.broadcast_to_rank(bias_3xK.astype(dtype), qkv_3xKx___xD.ndim)
    bias_3xKx___ = jnp.moveaxis(bias___x3xK, (-2, -1), (0, 1))
    return list(qkv_3xKx___xD.astype(dtype) + bias_3xKx___)


def _implicit_attention_channels_last_fwd(qkv_3xKx___xD, bias_3xK, p_K, dtype):
    """The forward pass of ``implicit_attention_channels_last``: ``m_x___xD`` and the
    residuals, the input and the softmax's ``weights_KxKx___`` and ``w_Kx___``."""
    wide = _wide(dtype)
    narrow = [gelu(pre) for pre in _channels_last_pre(qkv_3xKx___xD, bias_3xK, dtype)]
    gq, gk, gv = (g.astype(wide) for g in narrow)
    # scores[i, k] = sum over the d channels of gelu(Q)[i, d] gelu(K)[k, d], at every step.
    if Q_PRIME_SUMS == "products":
        a, b = narrow[:2] if NARROW_PRODUCTS else (gq, gk)
        scores_KxKx___ = _per_position_product("i...d,k...d->ik...", a, b, wide)
    else:  # a reduction along the minor axis
        scores_KxKx___ = jnp.sum(gq[:, None] * gk[None, :], axis=-1)
    weights_KxKx___ = jax.nn.softmax(scores_KxKx___ / math.sqrt(gq.shape[-1]), axis=1)
    p_Kx1x___ = jnp.moveaxis(lax.broadcast_to_rank(p_K.astype(wide), weights_KxKx___.ndim), -1, 0)
    w_Kx___ = jnp.sum(weights_KxKx___ * p_Kx1x___, axis=0)
    m_x___xD = _sum_of_products(gv, w_Kx___[..., None], axis=0)
    return m_x___xD.astype(dtype), (qkv_3xKx___xD, bias_3xK, p_K, weights_KxKx___, w_Kx___)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def implicit_attention_channels_last(qkv_3xKx___xD, bias_3xK, p_K, dtype):
    """``implicit_attention`` on Q, K and V stacked and written channels last, as
    ``lmu.chunk_product_channels_last`` writes one product of the three L_i: (3, q',
    positions..., d) in, ``m_x___xD`` (positions..., d) out. Its q' x q' sums over the channels
    are matrix products batched over the positions (``Q_PRIME_SUMS``), in a bfloat16 model on
    bfloat16 operands summed in float32 (``NARROW_PRODUCTS``); the backward pass, by
    hand, returns the three gradients stacked as the product takes them, and keeps of the
    arrays that size only the input."""
    return _implicit_attention_channels_last_fwd(qkv_3xKx___xD, bias_3xK, p_K, dtype)[0]


def _implicit_attention_channels_last_bwd(dtype, residuals, dm_x___xD):
    qkv_3xKx___xD, bias_3xK, p_K, weights_KxKx___, w_Kx___ = residuals
    wide = _wide(dtype)
    pre_3xxKx___xD = _channels_last_pre(qkv_3xKx___xD, bias_3xK, dtype)
    narrow = [gelu(pre) for pre in pre_3xxKx___xD]
    gq, gk, gv = (g.astype(wide) for g in narrow)
    dm_1x___xD = dm_x___xD.astype(dtype).astype(wide)[None]
    # m = gelu(V)^T w, w = p softmax(scores), scores = gelu(Q) gelu(K)^T / sqrt(d).
    dgv_Kx___xD = w_Kx___[..., None] * dm_1x___xD
    dw_1xKx___ = jnp.sum(dm_1x___xD * gv, axis=-1)[None]
    p_Kx1x___ = jnp.moveaxis(lax.broadcast_to_rank(p_K.astype(wide), weights_KxKx___.ndim), -1, 0)
    dp_K = jnp.sum(weights_KxKx___ * dw_1xKx___, axis=tuple(range(1, weights_KxKx___.ndim)))
    dweights_KxKx___ = p_Kx1x___ * dw_1xKx___
    inner_Kx1x___ = jnp.sum(weights_KxKx___ * dweights_KxKx___, axis=1, keepdims=True)
    scale = 1.0 / math.sqrt(gq.shape[-1])
    dscores_KxKx___ = weights_KxKx___ * (dweights_KxKx___ - inner_Kx1x___) * scale
    # dgelu(Q)[i, d] = sum_k dscores[i, k] gelu(K)[k, d], and dgelu(K) likewise over i.
    if Q_PRIME_SUMS == "products":
        if NARROW_PRODUCTS:
            ds, (nq, nk) = dscores_KxKx___.astype(dtype), narrow[:2]
        else:
            ds, nq, nk = dscores_KxKx___, gq, gk
        dgq_Kx___xD = _per_position_product("ik...,k...d->i...d", ds, nk, wide)
        dgk_Kx___xD = _per_position_product("ik...,i...d->k...d", ds, nq, wide)
    else:
        dscores_KxKx___x1 = dscores_KxKx___[..., None]
        dgq_Kx___xD = _sum_of_products(dscores_KxKx___x1, gk[None], axis=1)
        dgk_Kx___xD = _sum_of_products(dscores_KxKx___x1, gq[:, None], axis=0)
    dpre_3xxKx___xD = [
        (g * gelu_grad(pre.astype(wide))).astype(dtype)
        for g, pre in zip((dgq_Kx___xD, dgk_Kx___xD, dgv_Kx___xD), pre_3xxKx___xD, strict=True)
    ]
    # The bias gradients sum the stacked gradient as written: without the barrier XLA's GPU
    # compiler recomputed the three gradients inside the sum (lmu-1M: 3.1 GB more a layer).
    dqkv_3xKx___xD = lax.optimization_barrier(jnp.stack(dpre_3xxKx___xD))
    positions_and_channels = tuple(range(2, qkv_3xKx___xD.ndim))
    dbias_3xK = dqkv_3xKx___xD.astype(wide).sum(positions_and_channels)
    return (
        dqkv_3xKx___xD.astype(qkv_3xKx___xD.dtype),
        dbias_3xK.astype(bias_3xK.dtype),
        dp_K.astype(p_K.dtype),
    )


implicit_attention_channels_last.defvjp(
    _implicit_attention_channels_last_fwd, _implicit_attention_channels_last_bwd
)


MEMORY_MODES = ("chunked", "fft")


def check_memory_impl(memory_mode: str, memory_impl: str, owner: str = "") -> None:
    """A ``ValueError`` naming ``owner``'s key unless ``memory_impl`` is one of
    ``memory_kernel.MEMORY_IMPLS``, and "pallas" comes with the chunked memory (the fused
    kernels take the chunk products' operand; the FFT path has none)."""
    kernels.check(f"{owner}memory_impl", memory_impl)
    if memory_impl == "pallas" and memory_mode != "chunked":
        raise ValueError(
            f'{owner}memory_impl="pallas" fuses the chunked memory with the implicit attention, '
            f'but {owner}memory_mode is {memory_mode!r}: use memory_mode="chunked", or '
            f'memory_impl "auto" or "xla"'
        )


class ImplicitSelfAttention(nn.Module):
    """The LMU memory (window ``theta``, order ``q``) of a d-channel input, read by implicit
    self-attention through three learned ``L_i`` (``q_prime`` x q) to Q, K, V. In parallel
    mode only ``L M_t`` is formed, by chunked matrix products (``memory_mode`` "chunked",
    ``memory_chunk`` steps each; one bf16 pass in a bf16 model; on a GPU one product for the
    three, written channels last: ``channels_last_memory``) or by FFT with the L_i folded
    into the impulse response ("fft"). ``memory_impl`` picks how the chunked products and the
    attention run: "xla", "pallas" (``memory_kernel``: fused, nothing q' wide in memory) or
    "auto" (``memory_kernel.resolve``). In step mode the state is the float32 memory
    ``m_BxDxQ``. ``batch_chunk`` sequences (0: all) run at a time in parallel mode, each chunk
    rematerialised in the backward pass, so only one chunk's temporaries are alive."""

    q: int
    q_prime: int
    theta: float
    dtype: Any = jnp.float32
    memory_mode: str = "chunked"
    memory_chunk: int = lmu.DEFAULT_CHUNK
    batch_chunk: int = 0
    memory_impl: str = "auto"

    def setup(self):
        if self.memory_mode not in MEMORY_MODES:
            raise ValueError(f"memory_mode must be one of {MEMORY_MODES}, got {self.memory_mode!r}")
        check_memory_impl(self.memory_mode, self.memory_impl)
        k, q = self.q_prime, self.q
        # Fan-in is the order axis, the axis each L_i contracts.
        l_init = nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=-2, batch_axis=(0,)
        )
        self.l = self.param("l", l_init, (3, k, q))
        self.bias = self.param("bias", nn.initializers.zeros, (3, k))
        self.p = self.param("p", nn.initializers.normal(1.0 / math.sqrt(k)), (k,))

    def _attend(self, x_BxTxD):
        length = x_BxTxD.shape[1]
        if self.memory_mode == "fft":
            h_TxQ = lmu.impulse_response(self.q, self.theta, length, np.float32)
            l_3KxQ = self.l.reshape(3 * self.q_prime, self.q)
            y_BxDx3KxT = lmu.memory_reduced(x_BxTxD, h_TxQ, l_3KxQ, time_last=True)
            qkv_3xBxDxKxT = jnp.split(y_BxDx3KxT, 3, axis=2)
            m_BxDxT = implicit_attention(*qkv_3xBxDxKxT, self.bias, self.p, self.dtype)
            return jnp.swapaxes(m_BxDxT, 1, 2)
        # One chunk operand for the three projections.
        precision = "fast" if jnp.dtype(self.dtype) == jnp.bfloat16 else "exact"
        operand = jnp.bfloat16 if precision == "fast" else None
        x_BxJxDxZ, _ = lmu.chunk_operands(
            x_BxTxD.astype(jnp.float32), self.q, self.theta, chunk=self.memory_chunk, dtype=operand
        )
        c = x_BxJxDxZ.shape[-1] - self.q
        weights = [lmu.chunk_weights(self.q, self.theta, c, l_KxQ) for l_KxQ in self.l]
        if memory_kernel.resolve(self.memory_impl, self.dtype) == "pallas":
            m_BxJxcxD = memory_kernel.memory_attention(
                x_BxJxDxZ,
                jnp.stack(weights),
                self.bias,
                self.p,
                precision=precision,
                dtype=self.dtype,
            )
            m_BxTxD = m_BxJxcxD.reshape(x_BxTxD.shape[0], -1, x_BxTxD.shape[2])
            return m_BxTxD[:, :length]
        if channels_last_memory():
            # One product for Q, K and V: its (3 q', c, B, J, d) output splits along its
            # major axis, and only the attention's (c, B, J, d) output is moved.
            y_3KxcxBxJxD = lmu.chunk_product_channels_last(
                x_BxJxDxZ, jnp.concatenate(weights, axis=1), precision, out_dtype=self.dtype
            )
            qkv_3xKxcxBxJxD = y_3KxcxBxJxD.reshape(3, self.q_prime, *y_3KxcxBxJxD.shape[1:])
            m_cxBxJxD = implicit_attention_channels_last(
                qkv_3xKxcxBxJxD, self.bias, self.p, self.dtype
            )
            m_BxJxcxD = jnp.transpose(m_cxBxJxD, (1, 2, 0, 3))
            return m_BxJxcxD.reshape(x_BxTxD.shape[0], -1, x_BxTxD.shape[2])[:, :length]
        # Off a GPU one product per projection: a single product for all three, sliced after,
        # had XLA's CPU backend copy each slice and read the whole output each.
        qkv_3xBxJxDxKxc = [
            lmu.chunk_product(x_BxJxDxZ, w_ZxKxc, precision, out_dtype=self.dtype)
            for w_ZxKxc in weights
        ]
        m_BxJxDxc = implicit_attention(*qkv_3xBxJxDxKxc, self.bias, self.p, self.dtype)
        return lmu.sequence_from_chunks(m_BxJxDxc, length)

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
        qkv_3xBxDxKx1 = jnp.einsum(
            "bdq,hkq->hbdk", m_BxDxQ, l_3xKxQ, precision=lax.Precision.HIGHEST
        )[..., None]
        y_BxDx1 = implicit_attention(*qkv_3xBxDxKx1, self.bias, self.p, self.dtype)
        return y_BxDx1[..., 0], m_BxDxQ


def kv_cache(batch_size: int, max_len: int, width: int, n_heads: int, dtype):
    """An empty key/value cache for ``GlobalSelfAttention.step``."""
    shape = (batch_size, max_len, n_heads, width // n_heads)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def attention_implementation(dtype, device=None) -> str:
    """``"cudnn"`` (flash attention: the n x n scores are never stored) on an NVIDIA GPU of
    compute capability >= 8.0 in bfloat16 or float16; ``"xla"`` elsewhere."""
    device = device or jax.devices()[0]
    if device.platform != "gpu" or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return "xla"
    try:
        major, minor = (int(x) for x in str(device.compute_capability).split("."))
    except (AttributeError, ValueError):  # a GPU that is not NVIDIA's
        return "xla"
    return "cudnn" if (major, minor) >= (8, 0) else "xla"


def cached_attention(cache, q_Bx1xHxA, k_Bx1xHxA, v_Bx1xHxA, index):
    """Position ``index`` attends to 0..index: its k and v written into ``cache``
    (``kv_cache``), then ``(y_Bx1xHxA, cache)``."""
    cache = {
        name: lax.dynamic_update_slice_in_dim(cache[name], new.astype(cache[name].dtype), index, 1)
        for name, new in (("k", k_Bx1xHxA), ("v", v_Bx1xHxA))
    }
    visible_T = jnp.arange(cache["k"].shape[1]) <= index
    keys, values = (cache[name].astype(q_Bx1xHxA.dtype) for name in ("k", "v"))
    return jax.nn.dot_product_attention(q_Bx1xHxA, keys, values, mask=visible_T), cache


# cuDNN's flash attention wants a head width that is a multiple of 8 (Table 3's are 13 to 36).
CUDNN_HEAD_MULTIPLE = 8


def causal_attention(q_BxTxHxA, k_BxTxHxA, v_BxTxHxA, implementation: str = "xla"):
    """softmax(q k^T / sqrt(A)) v over positions <= each query's, per head. For ``"cudnn"`` A is
    zero-padded to a multiple of 8 (adding nothing to q k^T) and the padding dropped after."""
    width = q_BxTxHxA.shape[-1]
    pad = -width % CUDNN_HEAD_MULTIPLE if implementation == "cudnn" else 0
    qkv_3xBxTxHxA = (q_BxTxHxA, k_BxTxHxA, v_BxTxHxA)
    if pad:
        qkv_3xBxTxHxA = [jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad))) for x in qkv_3xBxTxHxA]
    y_BxTxHxA = jax.nn.dot_product_attention(
        *qkv_3xBxTxHxA, is_causal=True, scale=1.0 / math.sqrt(width), implementation=implementation
    )
    return y_BxTxHxA[..., :width]


class GlobalSelfAttention(nn.Module):
    """Causal multi-head self-attention (``causal_attention``). Step mode carries a key/value
    cache ``{"k", "v"}`` of shape (B, max_len, heads, head_dim) and the position's index."""

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
        y, cache = cached_attention(cache, *self._heads(x_BxD[:, None]), index)
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
