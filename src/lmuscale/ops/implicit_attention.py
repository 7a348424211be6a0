"""The LMU's implicit self-attention (LMU paper eqs 8-10) in XLA, with hand-written gradients, in
the two layouts the chunk products can write Q, K and V in (``Impls.memory_layout``), and gelu.

Choices the paper leaves open (papers/lmu-implicit-self-attention.md §4), made here:
- gelu is the exact (erf) form everywhere.
- Eq 8 "ignores the bias vectors": each L_i gets one bias per row, shared by the d channels.
- Eq 9 has no temperature, but Q K^T sums d products of gelu outputs and saturates the
  softmax at d ~ 200, so the scores are divided by sqrt(d) as in Vaswani et al.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax


def gelu(x, form: str = "erfc"):
    """The exact gelu ``x Phi(x)``, by ``form`` (``Impls.gelu``): "erfc", as ``jax.nn.gelu``
    computes it, or "erf"."""
    if form == "erf":
        return x * (0.5 * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0)))))
    return jax.nn.gelu(x, approximate=False)


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
    """``x`` itself, through a rounding to its own precision, which changes no value, so that
    XLA computes it in a pass of its own before the sum that reads it: XLA:CPU (jaxlib 0.10)
    hands a sum over the channel axis of a product to a YNNPACK reduce fusion with the product
    inside, which ran about 10x slower than the two apart."""
    info = jnp.finfo(x.dtype)
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _pre_activations(inputs, bias_3xK, dtype):
    """``L_i M + b_i`` for Q, K, V in ``dtype``; each bias broadcast over channels and steps."""
    return [
        x.astype(dtype) + lax.broadcast_to_rank(b.astype(dtype)[:, None], x.ndim)
        for x, b in zip(inputs, bias_3xK, strict=True)
    ]


def _implicit_attention_fwd(q_xDxKxc, k_xDxKxc, v_xDxKxc, bias_3xK, p_K, dtype, form):
    """The forward pass of ``implicit_attention``: ``m_xDxc`` and the backward pass's
    residuals, the inputs and the softmax's ``weights_xKxKxc`` and ``w_xKxc``."""
    wide = _wide(dtype)
    inputs = (q_xDxKxc, k_xDxKxc, v_xDxKxc)
    gq, gk, gv = (gelu(x, form) for x in _pre_activations(inputs, bias_3xK, dtype))
    # scores[i, k] = sum over the d channels of gelu(Q)[d, i] gelu(K)[d, k], at every step.
    scores_xKxKxc = jnp.sum(
        gq.astype(wide)[..., :, :, None, :] * gk.astype(wide)[..., :, None, :, :], axis=-4
    )
    weights_xKxKxc = jax.nn.softmax(scores_xKxKxc / math.sqrt(q_xDxKxc.shape[-3]), axis=-2)
    p_Kx1x1 = lax.broadcast_to_rank(p_K.astype(wide)[:, None, None], weights_xKxKxc.ndim)
    w_xKxc = jnp.sum(weights_xKxKxc * p_Kx1x1, axis=-3)
    m_xDxc = _sum_of_products(gv.astype(wide), w_xKxc[..., None, :, :], axis=-2)
    return m_xDxc.astype(dtype), (*inputs, bias_3xK, p_K, weights_xKxKxc, w_xKxc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def implicit_attention(q_xDxKxc, k_xDxKxc, v_xDxKxc, bias_3xK, p_K, dtype, form="erfc"):
    """Eqs 8-10 after the memory: ``m_xDxc = p softmax(Q K^T / sqrt(d)) V`` in ``dtype``, with
    ``Q = gelu(L1 M + b1)``, K and V likewise (``bias_3xK`` the b_i, ``p_K`` eq 10's p, every
    sum at least float32). ``w = p softmax(...)`` is a q'-vector and ``m = V^T w``, so eq 9's
    q' x d ``M'`` is never formed. The inputs ``L_i M`` are in the layout the memory writes (d,
    q', then positions), and every sum runs over d or q' in place, so nothing the size of Q, K
    or V is moved. The backward pass, by hand, keeps of the (positions x d x q') arrays only
    the inputs and recomputes the gelus (a custom VJP has no forward-mode derivative).
    ``form``: gelu's (``Impls.gelu``). The layout of a CPU's chunked memory, of the FFT memory
    and of a decoding step."""
    return _implicit_attention_fwd(q_xDxKxc, k_xDxKxc, v_xDxKxc, bias_3xK, p_K, dtype, form)[0]


def _implicit_attention_bwd(dtype, form, residuals, dm_xDxc):
    *inputs, bias_3xK, p_K, weights_xKxKxc, w_xKxc = residuals
    wide = _wide(dtype)
    pre_3xxDxKxc = _pre_activations(inputs, bias_3xK, dtype)
    gq, gk, gv = (gelu(pre, form).astype(wide) for pre in pre_3xxDxKxc)
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
    # With gelu through erfc (a CPU's), gelu_grad's erf is another operation: XLA does not
    # keep the forward's transcendental results alive for this pass.
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


def _per_position_product(subscripts: str, a, b, wide, precision: str):
    """``jnp.einsum(subscripts, a, b)`` summed in ``wide``, the positions (``...``) a batch:
    at ``precision`` (``Impls.q_prime_precision``) where both operands are narrower than
    float32, at XLA's highest otherwise."""
    narrow = all(jnp.dtype(x.dtype).itemsize < 4 for x in (a, b))
    chosen = lax.Precision(precision) if narrow else lax.Precision.HIGHEST
    return jnp.einsum(subscripts, a, b, precision=chosen, preferred_element_type=wide)


def _channels_last_gelus(qkv_3xKx___xD, bias_3xK, dtype, form):
    """``L_i M + b_i`` for Q, K, V in ``dtype``, each (q', positions..., d), and their gelus."""
    bias___x3xK = lax.broadcast_to_rank(bias_3xK.astype(dtype), qkv_3xKx___xD.ndim)
    pre_3xxKx___xD = list(qkv_3xKx___xD.astype(dtype) + jnp.moveaxis(bias___x3xK, (-2, -1), (0, 1)))
    return pre_3xxKx___xD, [gelu(pre, form) for pre in pre_3xxKx___xD]


def _implicit_attention_channels_last_fwd(qkv_3xKx___xD, bias_3xK, p_K, dtype, form, precision):
    """The forward pass of ``implicit_attention_channels_last``: ``m_x___xD`` and the
    residuals, the input and the softmax's ``weights_KxKx___`` and ``w_Kx___``."""
    wide = _wide(dtype)
    _, (gq, gk, gv) = _channels_last_gelus(qkv_3xKx___xD, bias_3xK, dtype, form)
    # scores[i, k] = sum over the d channels of gelu(Q)[i, d] gelu(K)[k, d], at every step.
    scores_KxKx___ = _per_position_product("i...d,k...d->ik...", gq, gk, wide, precision)
    weights_KxKx___ = jax.nn.softmax(scores_KxKx___ / math.sqrt(gq.shape[-1]), axis=1)
    p_Kx1x___ = jnp.moveaxis(lax.broadcast_to_rank(p_K.astype(wide), weights_KxKx___.ndim), -1, 0)
    w_Kx___ = jnp.sum(weights_KxKx___ * p_Kx1x___, axis=0)
    m_x___xD = _sum_of_products(gv.astype(wide), w_Kx___[..., None], axis=0)
    return m_x___xD.astype(dtype), (qkv_3xKx___xD, bias_3xK, p_K, weights_KxKx___, w_Kx___)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def implicit_attention_channels_last(
    qkv_3xKx___xD, bias_3xK, p_K, dtype, form="erf", precision="highest"
):
    """``implicit_attention`` on Q, K and V stacked and written channels last, as
    ``lmu.chunk_product_channels_last`` writes one product of the three L_i: (3, q',
    positions..., d) in, ``m_x___xD`` (positions..., d) out: a GPU's layout, whose reductions
    want the summed axis minor. Its q' x q' sums over the channels are matrix products batched
    over the positions, on operands in the model's dtype summed in float32 (at ``precision``,
    ``Impls.q_prime_precision``, where that is bf16); a sum over broadcast products read each
    row q' times. The backward pass, by hand, returns the three gradients stacked as the
    product takes them, and keeps of the arrays that size only the input."""
    args = (qkv_3xKx___xD, bias_3xK, p_K, dtype, form, precision)
    return _implicit_attention_channels_last_fwd(*args)[0]


def _implicit_attention_channels_last_bwd(dtype, form, precision, residuals, dm_x___xD):
    qkv_3xKx___xD, bias_3xK, p_K, weights_KxKx___, w_Kx___ = residuals
    wide = _wide(dtype)
    pre_3xxKx___xD, (nq, nk, nv) = _channels_last_gelus(qkv_3xKx___xD, bias_3xK, dtype, form)
    dm_1x___xD = dm_x___xD.astype(dtype).astype(wide)[None]
    # m = gelu(V)^T w, w = p softmax(scores), scores = gelu(Q) gelu(K)^T / sqrt(d).
    dgv_Kx___xD = w_Kx___[..., None] * dm_1x___xD
    dw_1xKx___ = jnp.sum(dm_1x___xD * nv.astype(wide), axis=-1)[None]
    p_Kx1x___ = jnp.moveaxis(lax.broadcast_to_rank(p_K.astype(wide), weights_KxKx___.ndim), -1, 0)
    dp_K = jnp.sum(weights_KxKx___ * dw_1xKx___, axis=tuple(range(1, weights_KxKx___.ndim)))
    dweights_KxKx___ = p_Kx1x___ * dw_1xKx___
    inner_Kx1x___ = jnp.sum(weights_KxKx___ * dweights_KxKx___, axis=1, keepdims=True)
    scale = 1.0 / math.sqrt(nq.shape[-1])
    # Rounded to the model's dtype, as every other product's input is in such a model.
    ds_KxKx___ = (weights_KxKx___ * (dweights_KxKx___ - inner_Kx1x___) * scale).astype(dtype)
    # dgelu(Q)[i, d] = sum_k dscores[i, k] gelu(K)[k, d], and dgelu(K) likewise over i.
    dgq_Kx___xD = _per_position_product("ik...,k...d->i...d", ds_KxKx___, nk, wide, precision)
    dgk_Kx___xD = _per_position_product("ik...,i...d->k...d", ds_KxKx___, nq, wide, precision)
    dpre_3xxKx___xD = [
        (g * gelu_grad(pre.astype(wide))).astype(dtype)
        for g, pre in zip((dgq_Kx___xD, dgk_Kx___xD, dgv_Kx___xD), pre_3xxKx___xD, strict=True)
    ]
    # The bias gradients sum the stacked gradient as written: without the barrier XLA's GPU
    # compiler recomputed the three gradients inside the sum.
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
