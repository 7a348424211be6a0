"""The LMU's chunk products and implicit attention as fused Pallas kernels.

The XLA path (``layers.ImplicitSelfAttention``, chunked mode) writes the three chunk products'
outputs ``L_i M`` (3 q' numbers per channel and position) to memory, and the attention reads
them back. Here a program takes one chunk of one sequence and walks its c steps. At each step
it forms the pre-activations ``[u_j; m_j]^T [T; R][:, :, t]`` of Q and K on chip, a block of
channels at a time, and sums their scores over the blocks; then the softmax and
``w = p softmax``; then V's pre-activations block by block, and the output. Nothing q' wide
reaches memory: the operand ``[u_j; m_j]`` (``lmu.chunk_operands``: the state passing stays in
XLA) is read, the output (positions x channels) written, and for the backward pass the
softmax and w of every step (q'^2 + q' numbers a step, against 3 q' d for the products).

The backward pass recomputes the pre-activations on chip, in three kernels:
- ``_scores_grad_kernel`` (a program per chunk): ``dw = sum over channels of gelu(V) dm``,
  then the scores' gradient of every step (written, q'^2 a step) and p's;
- ``_operand_grad_kernel`` (a program per block of channels of a chunk): Q, K, V and their
  gradients for the block, and the operand's gradient, summed over the chunk's steps;
- ``_weight_grad_kernel`` (a program per step of the chunk and group of chunks): the same for
  every block of its chunks, and the weights' gradient at its step (partial sums added in XLA).
The weights' own gradient reaches L through ``lmu.chunk_weights`` by autodiff, as on the XLA
path. Counted in forward chunk products (Q, K and V together), the kernels run 5 1/3 (the
forward 1, V again 1/3, the operand's gradient 2, the weights' 2) where the XLA path runs 3:
they trade recomputation for memory traffic.

What a program holds does not grow with d: a block of ``CHANNEL_BLOCK`` channels, the weights
of one step, and (in the operand's gradient) the block's rows of the gradient. Compiled for an
H100 (``benchmarks/kernel_resources.py``), lmu-1M's kernels need 40-184 KB of shared memory,
within the 227 KB a program may have; when a program held every channel of a chunk, they
needed 340-550 KB, and could not have run.

Written for Pallas's Triton lowering (NVIDIA GPUs): q', c and q are zero-padded to powers of
two (at least 16, Triton's smallest matmul side) and the channels to whole blocks, padded
channels masked out of the scores, padded q' out of the softmax. Triton has no erf, so the
gelu's is written out (``_erfc``). ``interpret=True`` runs the kernels on any backend (the
tests, on CPU).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from lmuscale import kernels

MEMORY_IMPLS = kernels.IMPLS

# (Device kind, compute dtype) where a committed GPU benchmark (benchmarks/gpu.py's ``block``
# part, results under benchmarks/results/) measured the kernels' forward+backward faster than
# the XLA chunked path. None yet: on the H200 (gpu-nvidia-h200-2026-11-27.json) they took 3.3x
# XLA's time in bfloat16 and 24x in float32; on the H100 (gpu-nvidia-h100-80gb-hbm3.json,
# 2026-11-28) 4.3x in bfloat16 (132.3 ms against 30.8), and lmu-1M's paper step 3.4x; on the
# H200 the same day (gpu-nvidia-h200.json), against XLA's channels-last path, 6.5x (134.7 ms
# against 20.7) and the paper step 4.6x (3,509 ms against 767).
FASTER_THAN_XLA: frozenset[tuple[str, str]] = frozenset()

PRECISIONS = ("exact", "fast")
MIN_TILE = 16  # Triton's matrix products need every dimension >= 16
# Channels a program holds at once: the attention's sums over channels are built block by block,
# so what is on chip does not grow with d. Not yet tuned on a device.
CHANNEL_BLOCK = 32
# Programs per position of the chunk in the weights' gradient: each sums its share of the
# (sequence, chunk) pairs, and XLA adds the shares. Not yet tuned on a device.
WEIGHT_GRAD_GROUPS = 8
# Warps per program and the software-pipelining depth, as for the cross-entropy kernels (naming
# Triton's parameters picks the Triton lowering on a GPU). Not yet tuned on a device.
_pallas_call = functools.partial(
    pl.pallas_call, compiler_params=pl_triton.CompilerParams(num_warps=8, num_stages=2)
)


def unsupported_reason(devices=None) -> str | None:
    """Why the kernels cannot run on ``devices`` (``kernels.unsupported_reason``), or None."""
    return kernels.unsupported_reason(devices)


def resolve(impl: str, dtype, devices=None) -> str:
    """What a config's ``memory_impl`` runs in compute ``dtype`` on ``devices`` (default: this
    run's): "xla" or "pallas", by the switch every kernel shares (``kernels.resolve``)."""
    return kernels.resolve(
        impl,
        key="memory_impl",
        kernels="the fused LMU memory kernels",
        faster=FASTER_THAN_XLA,
        dtype=dtype,
        devices=devices,
    )


# ---------------------------------------------------------------- gelu without erf


@functools.lru_cache(maxsize=2)
def _erfc_series(terms: int) -> tuple[float, ...]:
    """Chebyshev coefficients, in x = 2 t - 1 with t = 1 / (1 + z / 2), of
    ``log(exp(z^2) erfc(z) / t)`` for z >= 0: smooth on t in (0, 1], fitted in float64 at
    Chebyshev nodes."""
    x = np.cos(np.pi * (np.arange(4096) + 0.5) / 4096)
    t = 0.5 * (x + 1.0)
    z = 2.0 / t - 2.0
    series = np.polynomial.chebyshev.chebfit(x, np.log(scipy.special.erfcx(z) / t), terms - 1)
    return tuple(float(a) for a in series)


def _erfc(z):
    """erfc(z) for z >= 0 from exp and a Chebyshev series (Clenshaw's recurrence): relative
    error 1.2e-13 in float64 (21 terms), float32 rounding (13 terms: 1.4e-6 at z < 4, where
    exp(-z^2) itself carries the rounding of z^2)."""
    series = _erfc_series(21 if z.dtype == jnp.float64 else 13)
    t = 1.0 / (1.0 + 0.5 * z)
    x = 2.0 * t - 1.0
    b1, b2 = jnp.zeros_like(z), jnp.zeros_like(z)
    for a in series[:0:-1]:
        b1, b2 = 2.0 * x * b1 - b2 + a, b1
    return t * jnp.exp(x * b1 - b2 + series[0] - z * z)


def _normal_cdf(x):
    """Phi(x) = erfc(-x / sqrt 2) / 2, with the tail taken where it is small (relative
    accuracy for x < 0, where the gelu is small)."""
    tail = 0.5 * _erfc(jnp.abs(x) * (1.0 / math.sqrt(2.0)))
    return jnp.where(x < 0, tail, 1.0 - tail)


def gelu_and_grad(x):
    """The exact gelu ``x Phi(x)`` and its derivative ``Phi(x) + x phi(x)``."""
    cdf = _normal_cdf(x)
    pdf = jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return x * cdf, cdf + x * pdf


# ---------------------------------------------------------------- a block of channels, one step


class _Shape(NamedTuple):
    """The kernels' static description."""

    channels: int  # the real channels d (the rest of D' is zero padding)
    reduced: int  # the real q' (the rest of K' is zero padding)
    block: int  # channels a program holds at once: a power of two >= MIN_TILE
    precision: object  # the products': None (one bf16 pass), HIGHEST, or bf16 x3 on a GPU
    wide: object  # the dtype of every sum: float32 (float64 under x64)


def _dot(a, b, contract, shape: _Shape):
    return lax.dot_general(
        a, b, (contract, ((), ())), precision=shape.precision, preferred_element_type=shape.wide
    )


def _operand(x, shape: _Shape):
    """x as the products take it: bf16 for one bf16 pass, else as it is. The gelus enter the
    scores' products so too, as the XLA path's bf16 gelus do in a bf16 model."""
    return x.astype(jnp.bfloat16) if shape.precision is None else x


def _real(block_index, shape: _Shape):
    """1 for the block's real channels, 0 for padding: (block, 1)."""
    rows = lax.broadcasted_iota(jnp.int32, (shape.block, 1), 0) + block_index * shape.block
    return (rows < shape.channels).astype(shape.wide)


def _rows(block_index, shape: _Shape):
    return pl.ds(pl.multiple_of(block_index * shape.block, shape.block), shape.block)


def _block(xu_ref, xm_ref, block_index, shape: _Shape):
    """A chunk's operand for one block of channels: its input and state parts."""
    rows = _rows(block_index, shape)
    return _operand(xu_ref[rows, :], shape), _operand(xm_ref[rows, :], shape)


def _weights_at(wu_ref, wm_ref, i, t, shape: _Shape):
    """Projection i's weights at step t of the chunk: ``(c' x K', q' x K')``."""
    return _operand(wu_ref[i, t], shape), _operand(wm_ref[i, t], shape)


def _biases(bias_ref, shape: _Shape):
    """The three biases, each (K'), loaded row by row (Triton slices no values)."""
    return [bias_ref[i].astype(shape.wide) for i in range(3)]


def _pre(xu, xm, weights, bias, shape: _Shape):
    """``L_i M + b_i`` for a block of channels at one step: (block, K')."""
    wu, wm = weights
    pre = _dot(xu, wu, ((1,), (0,)), shape) + _dot(xm, wm, ((1,), (0,)), shape)
    return pre + bias[None, :]


def _attention_weights(scores, p, shape: _Shape):
    """The softmax of the scores over their second axis (padded q' left out), and
    ``w = p softmax``: ``(probs K' x K', w K')``."""
    columns = lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    scores = jnp.where(
        columns < shape.reduced, scores * (1.0 / math.sqrt(shape.channels)), -jnp.inf
    )
    scores = jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True))
    probs = scores / jnp.sum(scores, axis=1, keepdims=True)
    return probs, jnp.sum(p[:, None] * probs, axis=0)


def _pre_grads(xu, xm, weights, biases, dscores, w, dm, real, shape: _Shape):
    """The gradients of a block's three pre-activations at one step (each (block, K')), from
    the scores' gradient ``dscores`` (K' x K', scale included), ``w`` (K') and the output's
    cotangent ``dm`` (block): Q, K and V are recomputed, nothing of them is read."""
    pres = [_pre(xu, xm, weights[i], biases[i], shape) for i in range(3)]
    g, slopes = zip(*(gelu_and_grad(pre) for pre in pres), strict=True)
    gq, gk = (_operand(x * real, shape) for x in g[:2])
    dscores = _operand(dscores, shape)
    dgq = _dot(gk, dscores, ((1,), (1,)), shape)  # [d, i] = sum_k gk[d, k] dscores[i, k]
    dgk = _dot(gq, dscores, ((1,), (0,)), shape)  # [d, k] = sum_i gq[d, i] dscores[i, k]
    dgv = dm[:, None] * w[None, :]
    return [dg * slope * real for dg, slope in zip((dgq, dgk, dgv), slopes, strict=True)]


# ---------------------------------------------------------------- the kernels


def _forward_kernel(xu_ref, xm_ref, wu_ref, wm_ref, bias_ref, p_ref, m_ref, *saved, shape):
    """Per chunk, step by step: the scores summed over blocks of channels, the softmax and w,
    then each block's output. With ``saved`` (the backward pass's residuals), also the
    softmax and w of every step."""
    biases, p = _biases(bias_ref, shape), p_ref[...].astype(shape.wide)
    blocks = xu_ref.shape[0] // shape.block

    def one_step(t, carry):
        weights = [_weights_at(wu_ref, wm_ref, i, t, shape) for i in range(3)]

        def scores_of_block(b, scores):
            xu, xm = _block(xu_ref, xm_ref, b, shape)
            real = _real(b, shape)
            gq, gk = (
                _operand(gelu_and_grad(_pre(xu, xm, weights[i], biases[i], shape))[0] * real, shape)
                for i in range(2)
            )
            return scores + _dot(gq, gk, ((0,), (0,)), shape)

        scores = jnp.zeros((p.shape[0],) * 2, shape.wide)
        probs, w = _attention_weights(lax.fori_loop(0, blocks, scores_of_block, scores), p, shape)

        def output_of_block(b, carry):
            xu, xm = _block(xu_ref, xm_ref, b, shape)
            gv = gelu_and_grad(_pre(xu, xm, weights[2], biases[2], shape))[0]
            out = jnp.sum(gv * w[None, :], axis=1)
            m_ref[pl.ds(t, 1), _rows(b, shape)] = out[None, :].astype(m_ref.dtype)
            return carry

        lax.fori_loop(0, blocks, output_of_block, 0)
        if saved:
            probs_ref, w_ref = saved
            probs_ref[pl.ds(t, 1)] = probs[None]
            w_ref[pl.ds(t, 1)] = w[None]
        return carry

    lax.fori_loop(0, m_ref.shape[0], one_step, 0)


def _scores_grad_kernel(
    xu_ref,
    xm_ref,
    wu_ref,
    wm_ref,
    bias_ref,
    p_ref,
    probs_ref,
    dm_ref,
    dscores_ref,
    dp_ref,
    *,
    shape,
):
    """Per chunk, step by step: ``dw = sum over channels of gelu(V) dm`` (V recomputed block
    by block), then the scores' gradient (written) and the chunk's share of p's."""
    biases, p = _biases(bias_ref, shape), p_ref[...].astype(shape.wide)
    blocks = xu_ref.shape[0] // shape.block

    def one_step(t, dp):
        weights = _weights_at(wu_ref, wm_ref, 2, t, shape)

        def dw_of_block(b, dw):
            xu, xm = _block(xu_ref, xm_ref, b, shape)
            gv = gelu_and_grad(_pre(xu, xm, weights, biases[2], shape))[0] * _real(b, shape)
            dm = dm_ref[t, _rows(b, shape)].astype(shape.wide)
            return dw + jnp.sum(gv * dm[:, None], axis=0)

        dw = lax.fori_loop(0, blocks, dw_of_block, jnp.zeros(p.shape, shape.wide))
        probs = probs_ref[t]
        dprobs = p[:, None] * dw[None, :]
        inner = jnp.sum(probs * dprobs, axis=1, keepdims=True)
        scale = 1.0 / math.sqrt(shape.channels)
        dscores_ref[pl.ds(t, 1)] = (probs * (dprobs - inner) * scale)[None]
        return dp + jnp.sum(probs * dw[None, :], axis=1)

    dp_ref[...] = lax.fori_loop(0, dm_ref.shape[0], one_step, jnp.zeros(p.shape, shape.wide))


def _operand_grad_kernel(
    xu_ref,
    xm_ref,
    wu_ref,
    wm_ref,
    bias_ref,
    w_ref,
    dscores_ref,
    dm_ref,
    dxu_ref,
    dxm_ref,
    dbias_ref,
    *,
    shape,
):
    """Per block of channels of a chunk, step by step: the operand's gradient ``sum over steps
    of dpre_t [T; R][:, :, t]^T`` and the block's share of the biases' gradients."""
    biases = _biases(bias_ref, shape)
    xu, xm = _operand(xu_ref[...], shape), _operand(xm_ref[...], shape)
    real = _real(pl.program_id(2), shape)

    def one_step(t, carry):
        dxu, dxm, *dbias = carry
        weights = [_weights_at(wu_ref, wm_ref, i, t, shape) for i in range(3)]
        dm = dm_ref[t, :].astype(shape.wide)
        dpre = _pre_grads(xu, xm, weights, biases, dscores_ref[t], w_ref[t], dm, real, shape)
        for i, d in enumerate(dpre):
            dbias[i] = dbias[i] + jnp.sum(d, axis=0)
            d = _operand(d, shape)
            dxu = dxu + _dot(d, weights[i][0], ((1,), (1,)), shape)
            dxm = dxm + _dot(d, weights[i][1], ((1,), (1,)), shape)
        return dxu, dxm, *dbias

    zeros = (jnp.zeros(dxu_ref.shape, shape.wide), jnp.zeros(dxm_ref.shape, shape.wide))
    zeros += (jnp.zeros(dbias_ref.shape[-1:], shape.wide),) * 3
    dxu, dxm, *dbias = lax.fori_loop(0, dm_ref.shape[0], one_step, zeros)
    dxu_ref[...] = dxu.astype(dxu_ref.dtype)
    dxm_ref[...] = dxm.astype(dxm_ref.dtype)
    for i, row in enumerate(dbias):  # one row at a time: Triton stacks only two arrays
        dbias_ref[pl.ds(i, 1), :] = row[None, :]


def _weight_grad_kernel(
    xu_ref,
    xm_ref,
    wu_ref,
    wm_ref,
    bias_ref,
    w_ref,
    dscores_ref,
    dm_ref,
    *dw_refs,
    shape,
    per_group,
):
    """Per step t of the chunk and group of (sequence, chunk) pairs: the group's share of the
    weights' gradient at t, ``[u_j; m_j] dpre_t`` summed over its pairs, block by block."""
    t, group = pl.program_id(0), pl.program_id(1)
    biases = _biases(bias_ref, shape)
    weights = [_weights_at(wu_ref, wm_ref, i, t, shape) for i in range(3)]
    blocks = xu_ref.shape[1] // shape.block

    def one_pair(r, dws):
        pair = group * per_group + r
        scores_grad, w = dscores_ref[pair, t], w_ref[pair, t]

        def one_block(b, dws):
            rows = _rows(b, shape)
            xu, xm = (_operand(ref[pair, rows, :], shape) for ref in (xu_ref, xm_ref))
            dm = dm_ref[pair, t, rows].astype(shape.wide)
            real = _real(b, shape)
            dpre = _pre_grads(xu, xm, weights, biases, scores_grad, w, dm, real, shape)
            dpre = [_operand(d, shape) for d in dpre]
            dwu = [
                dw + _dot(xu, d, ((0,), (0,)), shape) for dw, d in zip(dws[:3], dpre, strict=True)
            ]
            dwm = [
                dw + _dot(xm, d, ((0,), (0,)), shape) for dw, d in zip(dws[3:], dpre, strict=True)
            ]
            return (*dwu, *dwm)

        return lax.fori_loop(0, blocks, one_block, dws)

    zeros = tuple(jnp.zeros(ref.shape, shape.wide) for ref in dw_refs)
    for ref, dw in zip(dw_refs, lax.fori_loop(0, per_group, one_pair, zeros), strict=True):
        ref[...] = dw


# ---------------------------------------------------------------- layout and the custom VJP


def padded(size: int) -> int:
    """A dimension as the kernels hold it: the next power of two, at least MIN_TILE."""
    return max(MIN_TILE, pl.next_power_of_2(size))


def _sizes(x_BxJxDxZ, w_3xZxKxc):
    channels, reduced, c = x_BxJxDxZ.shape[2], w_3xZxKxc.shape[2], w_3xZxKxc.shape[3]
    order = w_3xZxKxc.shape[1] - c
    return channels, reduced, c, order


def _kernel_operands(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, block: int):
    """Zero-padded operands: the input and state parts of x, ``(B, J, D', c')`` and
    ``(B, J, D', q')`` with D' whole blocks of channels; of w by step, ``(3, c', c', K')`` and
    ``(3, c', q', K')``; the biases ``(3, K')`` and p ``(K',)``."""
    channels, reduced, c, order = _sizes(x_BxJxDxZ, w_3xZxKxc)
    d_, k_, c_, q_ = -(-channels // block) * block, padded(reduced), padded(c), padded(order)
    pad_x = ((0, 0), (0, 0), (0, d_ - channels))
    xu = jnp.pad(x_BxJxDxZ[..., :c], (*pad_x, (0, c_ - c)))
    xm = jnp.pad(x_BxJxDxZ[..., c:], (*pad_x, (0, q_ - order)))
    w_3xcxZxK = jnp.transpose(w_3xZxKxc, (0, 3, 1, 2))
    pad_w = ((0, 0), (0, c_ - c))
    wu = jnp.pad(w_3xcxZxK[:, :, :c], (*pad_w, (0, c_ - c), (0, k_ - reduced)))
    wm = jnp.pad(w_3xcxZxK[:, :, c:], (*pad_w, (0, q_ - order), (0, k_ - reduced)))
    bias = jnp.pad(bias_3xK, ((0, 0), (0, k_ - reduced)))
    return xu, xm, wu, wm, bias, jnp.pad(p_K, (0, k_ - reduced))


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _per_chunk(*shape):
    return pl.BlockSpec((None, None, *shape), lambda b, j, *_: (b, j) + (0,) * len(shape))


def _shape(channels, reduced, block, precision, dtype, interpret) -> _Shape:
    """The kernels' static description. The products of "exact" run at float32 accuracy: true
    float32 (or float64) where the kernels are interpreted, three bf16 passes on a GPU, as the
    XLA path does there (``lmu._exact_precision``); those of "fast" in one bf16 pass."""
    wide = jnp.promote_types(dtype, jnp.float32)
    if precision == "fast":
        products = None
    elif interpret or wide == jnp.float64:
        products = lax.Precision.HIGHEST
    else:
        products = lax.DotAlgorithmPreset.BF16_BF16_F32_X3
    return _Shape(channels, reduced, block, products, wide)


def _forward(operands, shape: _Shape, dtype, interpret, saved: bool):
    """The forward kernel: ``m_BxJxcxD`` (padded), and with ``saved`` the softmax and w of
    every step, ``(B, J, c', K', K')`` and ``(B, J, c', K')``."""
    xu, xm, wu, wm, bias, p = operands
    batch, chunks, d_, c_ = xu.shape
    k_ = p.shape[0]
    out_specs = [_per_chunk(c_, d_)]
    out_shape = [jax.ShapeDtypeStruct((batch, chunks, c_, d_), dtype)]
    if saved:
        out_specs += [_per_chunk(c_, k_, k_), _per_chunk(c_, k_)]
        out_shape += [
            jax.ShapeDtypeStruct((batch, chunks, c_, k_, k_), shape.wide),
            jax.ShapeDtypeStruct((batch, chunks, c_, k_), shape.wide),
        ]
    return _pallas_call(
        functools.partial(_forward_kernel, shape=shape),
        grid=(batch, chunks),
        in_specs=[
            _per_chunk(d_, c_),
            _per_chunk(d_, xm.shape[-1]),
            *(_whole(a.shape) for a in (wu, wm, bias, p)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
    )(*operands)


def _forward_of(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, block, interpret, saved):
    """``(m_BxJxcxD, saved)``: the output, unpadded, and the softmax and w of every step where
    ``saved`` (else none)."""
    channels, _, c, _ = _sizes(x_BxJxDxZ, w_3xZxKxc)
    operands, shape = _setup(
        x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, block, interpret
    )
    m_BxJxcxD, *residuals = _forward(operands, shape, dtype, interpret, saved)
    return m_BxJxcxD[:, :, :c, :channels], residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, block, interpret):
    """The forward alone (no gradient taken): the softmax and w are not written."""
    args = (x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, block, interpret)
    return _forward_of(*args, saved=False)[0]


def _setup(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, block, interpret):
    channels, reduced, _, _ = _sizes(x_BxJxDxZ, w_3xZxKxc)
    operands = _kernel_operands(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, block)
    wide = jnp.promote_types(x_BxJxDxZ.dtype, dtype)
    return operands, _shape(channels, reduced, block, precision, wide, interpret)


def _fused_fwd(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, block, interpret):
    args = (x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, block, interpret)
    m_BxJxcxD, saved = _forward_of(*args, saved=True)
    return m_BxJxcxD, (x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, *saved)


def _fused_bwd(precision, dtype, block, interpret, residuals, dm_BxJxcxD):
    x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, probs, w_BxJxcxK = residuals
    channels, reduced, c, order = _sizes(x_BxJxDxZ, w_3xZxKxc)
    dtype = jnp.promote_types(x_BxJxDxZ.dtype, dtype)
    operands, shape = _setup(
        x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, block, interpret
    )
    xu, xm, wu, wm, bias, p = operands
    batch, chunks, d_, c_ = xu.shape
    q_, k_, blocks = xm.shape[-1], p.shape[0], d_ // block
    dm = jnp.pad(dm_BxJxcxD.astype(dtype), ((0, 0), (0, 0), (0, c_ - c), (0, d_ - channels)))
    weights = [_whole(a.shape) for a in (wu, wm, bias)]

    dscores, dp = _pallas_call(
        functools.partial(_scores_grad_kernel, shape=shape),
        grid=(batch, chunks),
        in_specs=[
            _per_chunk(d_, c_),
            _per_chunk(d_, q_),
            *weights,
            _whole(p.shape),
            _per_chunk(c_, k_, k_),
            _per_chunk(c_, d_),
        ],
        out_specs=[_per_chunk(c_, k_, k_), _per_chunk(k_)],
        out_shape=[
            jax.ShapeDtypeStruct(probs.shape, shape.wide),
            jax.ShapeDtypeStruct((batch, chunks, k_), shape.wide),
        ],
        interpret=interpret,
    )(xu, xm, wu, wm, bias, p, probs, dm)

    def per_block(*tail):
        return pl.BlockSpec(
            (None, None, block, *tail), lambda b, j, i: (b, j, i) + (0,) * len(tail)
        )

    dxu, dxm, dbias = _pallas_call(
        functools.partial(_operand_grad_kernel, shape=shape),
        grid=(batch, chunks, blocks),
        in_specs=[
            per_block(c_),
            per_block(q_),
            *weights,
            _per_chunk(c_, k_),
            _per_chunk(c_, k_, k_),
            pl.BlockSpec((None, None, c_, block), lambda b, j, i: (b, j, 0, i)),
        ],
        out_specs=[
            per_block(c_),
            per_block(q_),
            pl.BlockSpec((None, None, None, 4, k_), lambda b, j, i: (b, j, i, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(xu.shape, shape.wide),
            jax.ShapeDtypeStruct(xm.shape, shape.wide),
            # 4 rows, the fourth unused: a block's sides are powers of two
            jax.ShapeDtypeStruct((batch, chunks, blocks, 4, k_), shape.wide),
        ],
        interpret=interpret,
    )(xu, xm, wu, wm, bias, w_BxJxcxK, dscores, dm)

    pairs = batch * chunks
    groups = math.gcd(pairs, WEIGHT_GRAD_GROUPS)
    flat = [a.reshape(pairs, *a.shape[2:]) for a in (xu, xm, w_BxJxcxK, dscores, dm)]
    per_step = [(groups, c_, rows, k_) for rows in (c_,) * 3 + (q_,) * 3]
    dws = _pallas_call(
        functools.partial(_weight_grad_kernel, shape=shape, per_group=pairs // groups),
        grid=(c_, groups),
        in_specs=[_whole(a.shape) for a in (*flat[:2], wu, wm, bias, *flat[2:])],
        out_specs=[pl.BlockSpec((None, None, *s[2:]), lambda t, g: (g, t, 0, 0)) for s in per_step],
        out_shape=[jax.ShapeDtypeStruct(s, shape.wide) for s in per_step],
        interpret=interpret,
    )(*flat[:2], wu, wm, bias, *flat[2:])

    dwu = jnp.stack([dw.sum(0) for dw in dws[:3]])[:, :c, :c, :reduced]
    dwm = jnp.stack([dw.sum(0) for dw in dws[3:]])[:, :c, :order, :reduced]
    dw_3xZxKxc = jnp.transpose(jnp.concatenate([dwu, dwm], axis=2), (0, 2, 3, 1))
    dx = jnp.concatenate([dxu[..., :channels, :c], dxm[..., :channels, :order]], axis=-1)
    return (
        dx.astype(x_BxJxDxZ.dtype),
        dw_3xZxKxc.astype(w_3xZxKxc.dtype),
        dbias.sum((0, 1, 2))[:3, :reduced].astype(bias_3xK.dtype),
        dp.sum((0, 1))[:reduced].astype(p_K.dtype),
    )


_fused.defvjp(_fused_fwd, _fused_bwd)


def memory_attention(
    x_BxJxDxZ,
    w_3xZxKxc,
    bias_3xK,
    p_K,
    *,
    precision="exact",
    dtype=jnp.float32,
    channel_block=CHANNEL_BLOCK,
    interpret=False,
):
    """``layers.implicit_attention`` of the three ``lmu.chunk_product`` outputs, fused:
    ``m_BxJxcxD`` (chunk j's step t at [:, j, t]; reshape to (B, J c, D) for positions) in
    ``dtype``. ``x_BxJxDxZ`` is ``lmu.chunk_operands``'s operand, ``w_3xZxKxc`` the three
    ``lmu.chunk_weights`` stacked, ``precision`` as in ``lmu.chunk_product``: "exact" at
    float32 accuracy (float64 for float64 operands), "fast" in one bf16 pass (the gelus enter
    the scores in bf16, as the XLA path's bf16 gelus do). A program holds ``channel_block``
    channels at a time (a power of two >= 16). Gradients reach every argument; every sum is at
    least float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if (
        x_BxJxDxZ.ndim != 4
        or w_3xZxKxc.ndim != 4
        or w_3xZxKxc.shape[0] != 3
        or x_BxJxDxZ.shape[-1] != w_3xZxKxc.shape[1]
        or w_3xZxKxc.shape[1] <= w_3xZxKxc.shape[3]
        or bias_3xK.shape != (3, w_3xZxKxc.shape[2])
        or p_K.shape != (w_3xZxKxc.shape[2],)
    ):
        raise ValueError(
            f"the fused memory takes an operand (batch, chunks, channels, Z = c + q), weights "
            f"(3, Z, K, c), biases (3, K) and p (K,), got {x_BxJxDxZ.shape}, "
            f"{w_3xZxKxc.shape}, {jnp.shape(bias_3xK)} and {jnp.shape(p_K)}"
        )
    if channel_block < MIN_TILE or channel_block & (channel_block - 1):
        raise ValueError(f"channel_block must be a power of two >= {MIN_TILE}, got {channel_block}")
    block = min(channel_block, padded(x_BxJxDxZ.shape[2]))
    args = (x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, jnp.dtype(dtype), block, interpret)
    return _fused(*args)
