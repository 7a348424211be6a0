"""The LMU's chunk products and implicit attention as fused Pallas kernels.

The XLA path (``layers.ImplicitSelfAttention``, chunked mode) writes the three chunk products'
outputs ``L_i M`` (3 q' numbers per channel and position) to memory, and the attention reads
them back. Here a program holds every channel of one chunk of one sequence and walks the
chunk's c positions; at each it forms the three (channels x q') pre-activations
``[u_j; m_j]^T [T; R][:, :, t]`` on chip and reduces them at once to the attention's output:
nothing q' wide reaches memory. The operand ``[u_j; m_j]`` (``lmu.chunk_operands``: the state
passing stays in XLA) is read, the output (channels x positions) written.

The backward pass recomputes the pre-activations twice on chip: per chunk, for the operand's
gradient (``_input_grad_kernel``), and per position of the chunk with its program's share of
the chunks, for the weights' (``_weight_grad_kernel``, partial sums added in XLA). That is
five chunk-product-sized matmuls per pass where the XLA path has three, with no q'-wide
array in memory. The weights' own gradient reaches L through ``lmu.chunk_weights`` by
autodiff, as on the XLA path.

Written for Pallas's Triton lowering (NVIDIA GPUs): channels, q', c and q are zero-padded to
powers of two (at least 16, Triton's smallest matmul side), padded channels masked out of the
scores, padded q' out of the softmax. Triton has no erf, so the gelu's is written out
(``_erfc``). ``interpret=True`` runs the kernels on any backend (the tests, on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from lmuscale import kernels

MEMORY_IMPLS = kernels.IMPLS

# Device kinds where a committed GPU benchmark (benchmarks/gpu.py's ``block`` part, results under
# benchmarks/results/) measured the kernels' forward+backward faster than the XLA chunked path.
# None has been measured on a GPU yet.
FASTER_THAN_XLA: frozenset[str] = frozenset()

PRECISIONS = ("exact", "fast")
MIN_TILE = 16  # Triton's matrix products need every dimension >= 16
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


def resolve(impl: str, devices=None) -> str:
    """What a config's ``memory_impl`` runs on ``devices`` (default: this run's): "xla" or
    "pallas", by the switch every kernel shares (``kernels.resolve``)."""
    return kernels.resolve(
        impl,
        key="memory_impl",
        kernels="the fused LMU memory kernels",
        faster=FASTER_THAN_XLA,
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


# ---------------------------------------------------------------- one position on chip


def _dot(a, b, contract, precision, wide):
    return lax.dot_general(
        a, b, (contract, ((), ())), precision=precision, preferred_element_type=wide
    )


class _Position:
    """Everything at one position t of a chunk, for all channels: the pre-activations and
    gelus of Q, K, V (``pre``, ``g``: three (D', K') each), the softmax ``probs`` (K' x K',
    over its second axis) and ``w`` (K'). ``xu``/``xm`` are the operand's input and state
    parts (D' x c', D' x q'), ``wu``/``wm`` the weights' at t (three (c' x K'), (q' x K'))."""

    def __init__(self, xu, xm, wu, wm, biases, p_K, *, shape):
        self.shape = shape
        channels, reduced, precision, wide = shape
        rows = lax.broadcasted_iota(jnp.int32, (xu.shape[0], 1), 0)
        self.real_channels = (rows < channels).astype(wide)
        self.pre, self.g, self.slope = [], [], []
        for i in range(3):
            pre = _dot(xu, wu[i], ((1,), (0,)), precision, wide)
            pre = pre + _dot(xm, wm[i], ((1,), (0,)), precision, wide) + biases[i][None, :]
            g, slope = gelu_and_grad(pre)
            self.pre.append(pre)
            self.g.append(g * self.real_channels)
            self.slope.append(slope)
        gq, gk = (self._mixed(g) for g in self.g[:2])
        scores = _dot(gq, gk, ((0,), (0,)), precision, wide) * (1.0 / math.sqrt(channels))
        columns = lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(columns < reduced, scores, -jnp.inf)
        scores = jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True))
        self.probs = scores / jnp.sum(scores, axis=1, keepdims=True)
        self.p = p_K
        self.w = jnp.sum(p_K[:, None] * self.probs, axis=0)

    def _mixed(self, g):
        """The gelus as the scores' products take them: bf16 in "fast" (as the XLA path's
        bf16 gelus), else as they are."""
        return g.astype(jnp.bfloat16) if self.shape[2] is None else g

    def output(self):
        return jnp.sum(self.g[2] * self.w[None, :], axis=1)

    def pre_grads(self, dm_D):
        """The gradients of the three pre-activations for the output's cotangent ``dm_D``, and
        ``dp`` (K')."""
        _, _, precision, wide = self.shape
        dgv = dm_D[:, None] * self.w[None, :]
        dw = jnp.sum(self.g[2] * dm_D[:, None], axis=0)
        dp = jnp.sum(self.probs * dw[None, :], axis=1)
        dprobs = self.p[:, None] * dw[None, :]
        inner = jnp.sum(self.probs * dprobs, axis=1, keepdims=True)
        dscores = self.probs * (dprobs - inner) * (1.0 / math.sqrt(self.shape[0]))
        gq, gk = (self._mixed(g) for g in self.g[:2])
        dscores = self._mixed(dscores)
        dgq = _dot(gk, dscores, ((1,), (1,)), precision, wide)
        dgk = _dot(gq, dscores, ((1,), (0,)), precision, wide)
        dpre = [
            dg * slope * self.real_channels
            for dg, slope in zip((dgq, dgk, dgv), self.slope, strict=True)
        ]
        return dpre, dp


def _operand(x, precision):
    return x.astype(jnp.bfloat16) if precision is None else x


def _load_vectors(bias_ref, p_ref, wide):
    """The three biases and p, each (K',), loaded row by row (Triton slices no values)."""
    return [bias_ref[i].astype(wide) for i in range(3)], p_ref[...].astype(wide)


def _weights_at(wu_ref, wm_ref, t, precision):
    wu = [_operand(wu_ref[i, t], precision) for i in range(3)]
    wm = [_operand(wm_ref[i, t], precision) for i in range(3)]
    return wu, wm


# ---------------------------------------------------------------- the kernels


def _forward_kernel(xu_ref, xm_ref, wu_ref, wm_ref, bias_ref, p_ref, m_ref, *, shape):
    precision, wide = shape[2], shape[3]
    xu, xm = _operand(xu_ref[...], precision), _operand(xm_ref[...], precision)
    biases, p_K = _load_vectors(bias_ref, p_ref, wide)

    def one_position(t, carry):
        wu, wm = _weights_at(wu_ref, wm_ref, t, precision)
        here = _Position(xu, xm, wu, wm, biases, p_K, shape=shape)
        m_ref[pl.ds(t, 1), :] = here.output()[None, :].astype(m_ref.dtype)
        return carry

    lax.fori_loop(0, m_ref.shape[0], one_position, 0)


def _input_grad_kernel(
    xu_ref, xm_ref, wu_ref, wm_ref, bias_ref, p_ref, dm_ref, dxu_ref, dxm_ref, stats_ref, *, shape
):
    """Per chunk: the operand's gradient, and the chunk's share of the biases' (rows 0-2 of
    ``stats``) and p's (row 3) gradients."""
    precision, wide = shape[2], shape[3]
    xu, xm = _operand(xu_ref[...], precision), _operand(xm_ref[...], precision)
    biases, p_K = _load_vectors(bias_ref, p_ref, wide)

    def one_position(t, carry):
        dxu, dxm, *stats = carry
        wu, wm = _weights_at(wu_ref, wm_ref, t, precision)
        here = _Position(xu, xm, wu, wm, biases, p_K, shape=shape)
        dpre, dp = here.pre_grads(dm_ref[pl.ds(t, 1), :][0].astype(wide))
        rows = [jnp.sum(d, axis=0) for d in dpre] + [dp]
        stats = [total + row for total, row in zip(stats, rows, strict=True)]
        for i, d in enumerate(dpre):
            d = _operand(d, precision)
            dxu = dxu + _dot(d, wu[i], ((1,), (1,)), precision, wide)
            dxm = dxm + _dot(d, wm[i], ((1,), (1,)), precision, wide)
        return dxu, dxm, *stats

    zeros = (jnp.zeros(dxu_ref.shape, wide), jnp.zeros(dxm_ref.shape, wide))
    zeros += (jnp.zeros(stats_ref.shape[-1:], wide),) * 4
    dxu, dxm, *stats = lax.fori_loop(0, dm_ref.shape[0], one_position, zeros)
    dxu_ref[...] = dxu.astype(dxu_ref.dtype)
    dxm_ref[...] = dxm.astype(dxm_ref.dtype)
    for i, row in enumerate(stats):  # one row at a time: Triton stacks only two arrays
        stats_ref[pl.ds(i, 1), :] = row[None, :]


def _weight_grad_kernel(
    xu_ref, xm_ref, wu_ref, wm_ref, bias_ref, p_ref, dm_ref, *dw_refs, shape, per_group
):
    """Per position t of the chunk and group of (sequence, chunk) pairs: the group's share of
    the weights' gradient at t, ``[u_j; m_j] dpre_t`` summed over the group's pairs."""
    precision, wide = shape[2], shape[3]
    t, group = pl.program_id(0), pl.program_id(1)
    wu, wm = _weights_at(wu_ref, wm_ref, t, precision)
    biases, p_K = _load_vectors(bias_ref, p_ref, wide)

    def one_pair(r, dws):
        pair = group * per_group + r
        xu, xm = _operand(xu_ref[pair], precision), _operand(xm_ref[pair], precision)
        here = _Position(xu, xm, wu, wm, biases, p_K, shape=shape)
        dpre, _ = here.pre_grads(dm_ref[pair, pl.ds(t, 1), :][0].astype(wide))
        dpre = [_operand(d, precision) for d in dpre]
        dwu = [
            dw + _dot(xu, d, ((0,), (0,)), precision, wide)
            for dw, d in zip(dws[:3], dpre, strict=True)
        ]
        dwm = [
            dw + _dot(xm, d, ((0,), (0,)), precision, wide)
            for dw, d in zip(dws[3:], dpre, strict=True)
        ]
        return (*dwu, *dwm)

    zeros = tuple(jnp.zeros(ref.shape, wide) for ref in dw_refs)
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


def _kernel_operands(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K):
    """Zero-padded operands: the input and state parts of x, ``(B, J, D', c')`` and
    ``(B, J, D', q')``; of w by position, ``(3, c', c', K')`` and ``(3, c', q', K')``; the
    biases ``(3, K')`` and p ``(K',)``."""
    channels, reduced, c, order = _sizes(x_BxJxDxZ, w_3xZxKxc)
    d_, k_, c_, q_ = padded(channels), padded(reduced), padded(c), padded(order)
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
    return pl.BlockSpec((None, None, *shape), lambda b, j: (b, j) + (0,) * len(shape))


def _shape(channels, reduced, precision, dtype):
    """The kernels' static description: real channels and q', the products' precision
    (``lax.Precision.HIGHEST`` for "exact", None for one bf16 pass) and the wide dtype."""
    wide = jnp.promote_types(dtype, jnp.float32)
    return channels, reduced, lax.Precision.HIGHEST if precision == "exact" else None, wide


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, interpret):
    channels, reduced, c, _ = _sizes(x_BxJxDxZ, w_3xZxKxc)
    xu, xm, wu, wm, bias, p = _kernel_operands(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K)
    batch, chunks, d_, c_ = xu.shape
    shape = _shape(channels, reduced, precision, jnp.promote_types(x_BxJxDxZ.dtype, dtype))
    m_BxJxcxD = _pallas_call(
        functools.partial(_forward_kernel, shape=shape),
        grid=(batch, chunks),
        in_specs=[
            _per_chunk(d_, c_),
            _per_chunk(d_, xm.shape[-1]),
            *(_whole(a.shape) for a in (wu, wm, bias, p)),
        ],
        out_specs=_per_chunk(c_, d_),
        out_shape=jax.ShapeDtypeStruct((batch, chunks, c_, d_), dtype),
        interpret=interpret,
    )(xu, xm, wu, wm, bias, p)
    return m_BxJxcxD[:, :, :c, :channels]


def _fused_fwd(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, interpret):
    m = _fused(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, dtype, interpret)
    return m, (x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K)


def _fused_bwd(precision, dtype, interpret, residuals, dm_BxJxcxD):
    x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K = residuals
    channels, reduced, c, order = _sizes(x_BxJxDxZ, w_3xZxKxc)
    xu, xm, wu, wm, bias, p = _kernel_operands(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K)
    batch, chunks, d_, c_ = xu.shape
    q_, k_ = xm.shape[-1], bias.shape[-1]
    wide = jnp.promote_types(jnp.promote_types(x_BxJxDxZ.dtype, dtype), jnp.float32)
    shape = _shape(channels, reduced, precision, wide)
    dm = jnp.pad(dm_BxJxcxD.astype(dtype), ((0, 0), (0, 0), (0, c_ - c), (0, d_ - channels)))
    weights = (xu, xm, wu, wm, bias, p)
    dxu, dxm, stats = _pallas_call(
        functools.partial(_input_grad_kernel, shape=shape),
        grid=(batch, chunks),
        in_specs=[
            _per_chunk(d_, c_),
            _per_chunk(d_, q_),
            *(_whole(a.shape) for a in (wu, wm, bias, p)),
            _per_chunk(c_, d_),
        ],
        out_specs=[_per_chunk(d_, c_), _per_chunk(d_, q_), _per_chunk(4, k_)],
        out_shape=[
            jax.ShapeDtypeStruct(xu.shape, wide),
            jax.ShapeDtypeStruct(xm.shape, wide),
            jax.ShapeDtypeStruct((batch, chunks, 4, k_), wide),
        ],
        interpret=interpret,
    )(*weights, dm)

    pairs = batch * chunks
    groups = math.gcd(pairs, WEIGHT_GRAD_GROUPS)
    flat = [a.reshape(pairs, *a.shape[2:]) for a in (xu, xm, dm)]
    per_position = [(groups, c_, rows, k_) for rows in (c_,) * 3 + (q_,) * 3]
    dws = _pallas_call(
        functools.partial(_weight_grad_kernel, shape=shape, per_group=pairs // groups),
        grid=(c_, groups),
        in_specs=[
            *(_whole(a.shape) for a in flat[:2]),
            *(_whole(a.shape) for a in (wu, wm, bias, p)),
            _whole(flat[2].shape),
        ],
        out_specs=[
            pl.BlockSpec((None, None, *s[2:]), lambda t, g: (g, t, 0, 0)) for s in per_position
        ],
        out_shape=[jax.ShapeDtypeStruct(s, wide) for s in per_position],
        interpret=interpret,
    )(flat[0], flat[1], wu, wm, bias, p, flat[2])
    dwu = jnp.stack([dw.sum(0) for dw in dws[:3]])[:, :c, :c, :reduced]
    dwm = jnp.stack([dw.sum(0) for dw in dws[3:]])[:, :c, :order, :reduced]
    dw_3xZxKxc = jnp.transpose(jnp.concatenate([dwu, dwm], axis=2), (0, 2, 3, 1))
    dx = jnp.concatenate([dxu[..., :channels, :c], dxm[..., :channels, :order]], axis=-1)
    stats = stats.sum((0, 1))
    return (
        dx.astype(x_BxJxDxZ.dtype),
        dw_3xZxKxc.astype(w_3xZxKxc.dtype),
        stats[:3, :reduced].astype(bias_3xK.dtype),
        stats[3, :reduced].astype(p_K.dtype),
    )


_fused.defvjp(_fused_fwd, _fused_bwd)


def memory_attention(
    x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, *, precision="exact", dtype=jnp.float32, interpret=False
):
    """``layers.implicit_attention`` of the three ``lmu.chunk_product`` outputs, fused:
    ``m_BxJxcxD`` (chunk j's step t at [:, j, t]; reshape to (B, J c, D) for positions) in
    ``dtype``. ``x_BxJxDxZ`` is ``lmu.chunk_operands``'s operand, ``w_3xZxKxc`` the three
    ``lmu.chunk_weights`` stacked, ``precision`` as in ``lmu.chunk_product``: "exact" runs
    the products at the operands' precision (float32 or float64), "fast" in one bf16 pass
    (the gelus enter the scores in bf16, as the XLA path's bf16 gelus do). Gradients reach
    every argument; every sum is at least float32."""
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
    return _fused(x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, precision, jnp.dtype(dtype), interpret)
