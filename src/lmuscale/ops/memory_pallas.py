"""The LMU layer's fused Pallas kernels (Triton lowering): what lies between its chunk products.

The chunk products stay matrix products in XLA (``lmu.chunk_product``); these kernels replace
the small operations around them (``../shared/PERF.md`` §4, "M1").

- The state kernel (``linear_recurrence``), run by ``memory_impl="pallas"``: the state
  passing ``m_{j+1} = Abar^c m_j + e_j`` from ``m_0 = 0`` over the J chunks, with the state on
  chip in float32, one program per (sequence, block of ``CHANNEL_BLOCK`` channels), writing
  every carried state ``m_j``, the rows of the chunk product's operand that read the past
  (``chunk_operand``). The chunk ends ``e_j = sum_s H[c-1-s] u_{j,s}`` are one matrix product
  in XLA before it. Its gradient is the same kernel run backwards with ``Abar^cᵀ``: ``g_j =
  dm_j + Abar^cᵀ g_{j+1}``, ``de_j = g_{j+1}``. The order is padded to a multiple of 16 and
  held in parts of at most ``PART`` (220 as 64 + 64 + 64 + 32; Triton's arrays are powers of
  two), channels to whole blocks, with zeros, which change no state. A bf16 model's exact
  products ("bf16x3") run as three bfloat16 passes, float32 products ("highest") as one.
- The attention's forward kernel (``attention``): written and tested, not run by the layer,
  whose no-GPU check predicts it slower than XLA's (``benchmarks/kernel_resources.py``).

``interpret=True`` runs the kernels on any backend (the tests, on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lmuscale import lmu
from lmuscale.ops import implicit_attention
from lmuscale.ops.cross_entropy_pallas import padded_width, width_parts

CHANNEL_BLOCK = 16  # channels a program holds: its state is 16 x q float32
PART = 64  # the most of the order one product takes: a 128-wide tile of power spills
WARPS = 8
STAGES = 1


def _split(x_f32):
    """``(high, low)`` in bfloat16 with ``high + low`` = x to about 17 bits: high is x rounded
    to its top 16 bits (a bfloat16 exactly), low the rest. By bit masks, which no compiler
    removes, where XLA may remove a round trip through bfloat16 as excess precision (PERF.md §8:
    on a GPU it did); power is split so in XLA, outside the kernel."""
    bits = lax.bitcast_convert_type(x_f32, jnp.uint32) + jnp.uint32(0x8000)
    bits = bits & jnp.uint32(0xFFFF0000)
    high = lax.bitcast_convert_type(bits, jnp.float32)
    return high.astype(jnp.bfloat16), (x_f32 - high).astype(jnp.bfloat16)


def _tile_product(state, power_ref, rows, columns, split: bool):
    """``state @ power[rows, columns]`` in float32 or wider: with ``split``, power is stacked
    (hi, lo) in bfloat16 and the product is three bfloat16 passes (hi hi + hi lo + lo hi, as
    XLA's BF16_BF16_F32_X3), else one at the highest precision."""
    product = functools.partial(
        lax.dot_general,
        dimension_numbers=(((1,), (0,)), ((), ())),
        preferred_element_type=state.dtype,
    )
    if not split:
        return product(state, power_ref[0, rows, columns], precision=lax.Precision.HIGHEST)
    high, low = _split(state)
    power_high, power_low = power_ref[0, rows, columns], power_ref[1, rows, columns]
    return product(high, power_high) + product(high, power_low) + product(low, power_high)


def _recurrence_kernel(x_ref, power_ref, zero_ref, out_ref, *, parts, split, reverse):
    """One (sequence, channel block) of ``linear_recurrence``: the state, a row per channel in
    ``parts``, goes ``out[j] = s; s <- s power + x[j]`` over the chunks j, in reverse with
    ``reverse``. ``power``'s tiles are loaded where they are used, from row ``zero_ref[0] *
    j``: 0, but not known to the compiler to be, so that it keeps none of ``power`` on chip
    across the loop (from row 0, ptxas spilled 32-40 bytes at lmu-1M's order)."""
    chunks = x_ref.shape[0]

    def chunk(i, state_parts):
        j = chunks - 1 - i if reverse else i
        row = zero_ref[0] * i
        for value, (p0, p) in zip(state_parts, parts, strict=True):
            out_ref[j, :, pl.ds(p0, p)] = value.astype(out_ref.dtype)
        return [
            functools.reduce(
                jnp.add,
                (
                    _tile_product(state, power_ref, pl.ds(row + k0, k), pl.ds(p0, p), split)
                    for state, (k0, k) in zip(state_parts, parts, strict=True)
                ),
                x_ref[j, :, pl.ds(p0, p)].astype(state_parts[0].dtype),
            )
            for p0, p in parts
        ]

    start = [jnp.zeros((x_ref.shape[1], p), out_ref.dtype) for _, p in parts]
    lax.fori_loop(0, chunks, chunk, start)


def _parts(wide: int) -> list[tuple[int, int]]:
    """``wide`` (a multiple of 16) as (start, size) parts of PART, then powers of two: 224 as
    64 + 64 + 64 + 32."""
    whole = wide - wide % PART
    rest = (
        [(whole + start, size) for start, size in width_parts(wide % PART)] if wide % PART else []
    )
    return [(start, PART) for start in range(0, whole, PART)] + rest


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def linear_recurrence(x_BxJxCxQ, power_QxQ, reverse: bool, split: bool, interpret: bool):
    """``out_j = s_j`` with ``s_0 = 0``, ``s_{j+1} = s_j power + x_j`` (row vectors), for every
    sequence and channel, over the J chunks (from the last with ``reverse``), by the state
    kernel: one program per (sequence, CHANNEL_BLOCK channels), the state on chip. C a
    multiple of CHANNEL_BLOCK, Q a multiple of 16. Its transpose is itself, reversed, with
    ``powerᵀ``; ``power`` is a constant (no gradient). ``split``: each product in three
    bfloat16 passes (float32 accuracy on the tensor cores), else one at the highest
    precision."""
    batch, chunks, channels, order = x_BxJxCxQ.shape
    zero = jnp.zeros((1,), jnp.int32)
    block = pl.BlockSpec((None, chunks, CHANNEL_BLOCK, order), lambda b, k: (b, 0, k, 0))
    if split:
        power = jnp.stack(_split(power_QxQ.astype(jnp.float32)))
    else:
        power = power_QxQ.astype(x_BxJxCxQ.dtype)[None]
    whole = [pl.BlockSpec(x.shape, lambda b, k, n=x.ndim: (0,) * n) for x in (power, zero)]
    kernel = functools.partial(
        _recurrence_kernel, parts=_parts(order), split=split, reverse=reverse
    )
    return pl.pallas_call(
        kernel,
        name="states_reverse" if reverse else "states_forward",
        compiler_params=pl_triton.CompilerParams(num_warps=WARPS, num_stages=STAGES),
        grid=(batch, channels // CHANNEL_BLOCK),
        in_specs=[block, *whole],
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct(x_BxJxCxQ.shape, x_BxJxCxQ.dtype),
        interpret=interpret,
    )(x_BxJxCxQ, power, zero)


def _recurrence_fwd(x_BxJxCxQ, power_QxQ, reverse, split, interpret):
    return linear_recurrence(x_BxJxCxQ, power_QxQ, reverse, split, interpret), power_QxQ


def _recurrence_bwd(reverse, split, interpret, power_QxQ, dout_BxJxCxQ):
    transposed = linear_recurrence(dout_BxJxCxQ, power_QxQ.T, not reverse, split, interpret)
    return transposed, None


linear_recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


def chunk_operand(
    u_BxTxC,
    order: int,
    theta: float,
    *,
    chunk: int = lmu.DEFAULT_CHUNK,
    dtype=None,
    exact_algorithm: str = "highest",
    interpret: bool = False,
    mesh: Mesh | None = None,
):
    """``lmu.chunk_operands``'s operand ``x_BxJxCxZ`` (not the final state), its carried states
    from the state kernel: the same numbers, to float32 rounding. ``dtype`` and
    ``exact_algorithm`` as there (float64 states take one product at the highest precision);
    ``interpret``: Pallas's interpret mode. With a ``mesh`` of several devices, each runs the
    kernel on its share of the sequences (the batch split over all of the mesh's axes, as the
    training step splits it)."""
    lmu._check_input(u_BxTxC)
    options = {"chunk": chunk, "dtype": dtype, "exact_algorithm": exact_algorithm}
    if mesh is not None and mesh.size > 1:
        if u_BxTxC.shape[0] % mesh.size:
            raise ValueError(
                f"the state kernel splits the batch over the mesh's {mesh.size} devices, and a "
                f"batch of {u_BxTxC.shape[0]} sequences does not split evenly"
            )
        batch = P(mesh.axis_names)
        per_device = functools.partial(
            chunk_operand, order=order, theta=theta, interpret=interpret, **options
        )
        # Unchecked: a pallas_call's output carries no type of how it varies over the devices.
        sharded = jax.shard_map(
            per_device, mesh=mesh, in_specs=batch, out_specs=batch, check_vma=False
        )
        return sharded(u_BxTxC)
    u_BxJxcxC = lmu.chunked(u_BxTxC, chunk)
    c, channels, state_dtype = u_BxJxcxC.shape[2], u_BxJxcxC.shape[3], u_BxJxcxC.dtype
    # Each chunk's end, a product in XLA (the last chunk's feeds no carried state), padded as
    # the state kernel holds it.
    hrev_cxQ = jnp.asarray(lmu.impulse_response(order, theta, c)[::-1].copy(), state_dtype)
    ends_BxJxCxQ = lmu._exact("bjsc,sq->bjcq", u_BxJxcxC, hrev_cxQ, exact_algorithm)
    wide = padded_width(order, split=True)
    pad = ((0, 0), (0, 0), (0, -channels % CHANNEL_BLOCK), (0, wide - order))
    ends_BxJxCxQ = jnp.pad(ends_BxJxCxQ, pad)
    power_QxQ = np.zeros((wide, wide))
    power_QxQ[:order, :order] = lmu._abar_power(order, theta, c).T  # row states: s Abar^cᵀ
    split = exact_algorithm == "bf16x3" and state_dtype != jnp.float64
    power_QxQ = jnp.asarray(power_QxQ, state_dtype)
    m_BxJxCxQ = linear_recurrence(ends_BxJxCxQ, power_QxQ, False, split, interpret)
    parts = (jnp.swapaxes(u_BxJxcxC, 2, 3), m_BxJxCxQ[:, :, :channels, :order])
    operand_dtype = state_dtype if dtype is None else jnp.dtype(dtype)
    return jnp.concatenate([part.astype(operand_dtype) for part in parts], axis=-1)


POSITIONS = 16  # positions a program of the attention's forward takes, one at a time
# erf for the kernels (Pallas's Triton lowering has none), least-squares fits made for this
# module on Chebyshev nodes: erf(x) = x P(x²) for |x| <= 1, and for |x| > 1 erf(x) = 1 -
# exp(-x²) R(1/x), R fitted to scipy's erfcx. Within 1.4e-9 of erf in float64 arithmetic,
# 2.5e-7 in float32 (XLA's float32 erf: 3.1e-7); tests/test_memory_pallas.py measures both.
ERF_SMALL = (
    1.128379166592773,
    -0.37612629875446457,
    0.11283625697525618,
    -0.026855398166712275,
    0.00519121566069019,
    -0.0008034820284519399,
    7.933398432749978e-05,
)
ERF_LARGE = (
    -4.209694361075675e-09,
    0.5641909568735591,
    -7.26240145612867e-05,
    -0.28064635931699594,
    -0.013845244787391305,
    0.4880905589608699,
    -0.08348602387944229,
    -1.6967058459039346,
    3.643766036416441,
    -3.9458242731128,
    2.5044229566262044,
    -0.889631123547609,
    0.13732456982060612,
)


def _polynomial(coefficients, x):
    """``sum_i coefficients[i] x^i`` by Horner's rule."""
    return functools.reduce(lambda total, c: total * x + c, coefficients[::-1], jnp.zeros_like(x))


def erf(x):
    """erf by ``ERF_SMALL`` and ``ERF_LARGE``, from the operations a Triton kernel has."""
    size = jnp.abs(x)
    small = size * _polynomial(ERF_SMALL, size * size)
    large = 1.0 - jnp.exp(-size * size) * _polynomial(ERF_LARGE, 1.0 / jnp.maximum(size, 1.0))
    return jnp.sign(x) * jnp.where(size <= 1.0, small, large)


def _gelu(x):
    """The exact gelu ``x Phi(x)``, by this module's ``erf``."""
    return x * (0.5 * (1.0 + erf(x * (1.0 / math.sqrt(2.0)))))


def _attention_kernel(
    qkv_ref, bias_ref, p_ref, m_ref, weights_ref, w_ref, *, order, width, dtype, precision
):
    """``POSITIONS`` positions of ``attention_forward``, one at a time: the q' x d rows of Q, K
    and V (padded to powers of two, zeros), their gelus in ``dtype``, the q' x q' scores as
    one product, their softmax over k, ``w = p softmax`` and ``m = gelu(V)ᵀ w``."""
    rows = qkv_ref.shape[1]
    bias = [bias_ref[i][:, None].astype(dtype) for i in range(3)]
    p_K = p_ref[...]
    real_k = lax.broadcasted_iota(jnp.int32, (rows, rows), 1) < order
    # A padded channel's gelu(0 + bias) is not 0: zeroed, it adds nothing to the scores.
    real_d = lax.broadcasted_iota(jnp.int32, (rows, qkv_ref.shape[3]), 1) < width
    wide = p_K.dtype

    def position(t, carry):
        pre = [qkv_ref[i, :, t, :].astype(dtype) + bias[i] for i in range(3)]
        gq, gk, gv = (jnp.where(real_d, _gelu(x.astype(wide)), 0).astype(dtype) for x in pre)
        scores = lax.dot_general(
            gq, gk, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=wide
        )
        scores = jnp.where(real_k, scores / math.sqrt(width), -jnp.inf)
        weights = jnp.exp(scores - scores.max(axis=1, keepdims=True))
        weights = weights / weights.sum(axis=1, keepdims=True)
        w_K = jnp.sum(weights * p_K[:, None], axis=0)
        m_ref[t, :] = jnp.sum(gv.astype(wide) * w_K[:, None], axis=0).astype(m_ref.dtype)
        weights_ref[:, :, t] = weights
        w_ref[:, t] = w_K
        return carry

    lax.fori_loop(0, qkv_ref.shape[2], position, 0)


def attention_forward(qkv_3xKxPxD, bias_3xK, p_K, dtype, precision, interpret):
    """``implicit_attention_channels_last``'s forward pass by the attention kernel, on its input
    with the positions flattened, (3, q', P, d): ``m_PxD`` in ``dtype`` and the backward
    pass's residuals, the softmax ``weights_KxKxP`` and ``w_KxP`` (float32 or wider)."""
    _, order, positions, width = qkv_3xKxPxD.shape
    rows, wide_d = max(16, pl.next_power_of_2(order)), pl.next_power_of_2(width)
    padded = -(-positions // POSITIONS) * POSITIONS
    pad = ((0, 0), (0, rows - order), (0, padded - positions), (0, wide_d - width))
    qkv = jnp.pad(qkv_3xKxPxD, pad)
    wide = implicit_attention._wide(dtype)
    bias = jnp.pad(bias_3xK.astype(wide), ((0, 0), (0, rows - order)))
    p_pad = jnp.pad(p_K.astype(wide), (0, rows - order))
    kernel = functools.partial(
        _attention_kernel, order=order, width=width, dtype=dtype, precision=precision
    )
    m, weights, w = pl.pallas_call(
        kernel,
        name="attention_forward",
        compiler_params=pl_triton.CompilerParams(num_warps=WARPS, num_stages=STAGES),
        grid=(padded // POSITIONS,),
        in_specs=[
            pl.BlockSpec((3, rows, POSITIONS, wide_d), lambda i: (0, 0, i, 0)),
            pl.BlockSpec((3, rows), lambda i: (0, 0)),
            pl.BlockSpec((rows,), lambda i: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((POSITIONS, wide_d), lambda i: (i, 0)),
            pl.BlockSpec((rows, rows, POSITIONS), lambda i: (0, 0, i)),
            pl.BlockSpec((rows, POSITIONS), lambda i: (0, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((padded, wide_d), dtype),
            jax.ShapeDtypeStruct((rows, rows, padded), wide),
            jax.ShapeDtypeStruct((rows, padded), wide),
        ],
        interpret=interpret,
    )(qkv, bias, p_pad)
    real = slice(None, order), slice(None, order), slice(None, positions)
    return m[:positions, :width], weights[real], w[:order, :positions]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def attention(qkv_3xKxcxBxJxD, bias_3xK, p_K, dtype, form, precision, interpret):
    """``implicit_attention_channels_last`` with its forward pass by the attention kernel,
    positions (c, B, J). Its backward pass is XLA's, from the same residuals, whose gelu' takes
    XLA's erf where the kernel's gelu takes this module's (the two 3e-7 apart in float32, at
    most)."""
    return _attention_fwd(qkv_3xKxcxBxJxD, bias_3xK, p_K, dtype, form, precision, interpret)[0]


def _attention_fwd(qkv_3xKxcxBxJxD, bias_3xK, p_K, dtype, form, precision, interpret):
    _, order, *positions, width = qkv_3xKxcxBxJxD.shape
    narrow = jnp.dtype(dtype).itemsize < 4
    chosen = lax.Precision(precision) if narrow else lax.Precision.HIGHEST
    qkv_3xKxPxD = qkv_3xKxcxBxJxD.reshape(3, order, -1, width)
    m_PxD, weights, w = attention_forward(qkv_3xKxPxD, bias_3xK, p_K, dtype, chosen, interpret)
    residuals = (qkv_3xKxcxBxJxD, bias_3xK, p_K)
    residuals += (weights.reshape(order, order, *positions), w.reshape(order, *positions))
    return m_PxD.reshape(*positions, width), residuals


def _attention_bwd(dtype, form, precision, interpret, residuals, dm_cxBxJxD):
    del interpret
    backward = implicit_attention._implicit_attention_channels_last_bwd
    return backward(dtype, form, precision, residuals, dm_cxBxJxD)


attention.defvjp(_attention_fwd, _attention_bwd)
