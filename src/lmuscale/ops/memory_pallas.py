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
- The attention's kernels (``attention``), forward and backward: one program per POSITIONS
  positions, one position at a time, its q' rows of Q, K and V held padded to a power of two
  (channels in parts, masked; nothing padded in XLA). The forward computes the gelus, the q' x
  q' scores (products), softmax, w and m, and keeps the softmax and w. The backward, in two
  kernels (in one it spilled), recomputes gelu and gelu': the first gives dV, p's gradient and
  ds, the scores' gradient; the second, from ds, dQ and dK. They write dQ, dK and dV as the
  chunk product's transpose takes them, with the biases' gradients. gelu is exact, from a
  fitted normal tail (``upper_tail``), as Triton has no erf. Run by the layer under
  ``memory_impl="pallas"``; not yet timed on a GPU. The no-GPU check
  (``benchmarks/kernel_resources.py``) puts the block at 5.39 ms against its line of 5.5,
  none of the kernels spilling.

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


def _parts(wide: int, most: int = PART) -> list[tuple[int, int]]:
    """``wide`` (a multiple of 16) as (start, size) parts of ``most``, then powers of two: 224
    as 64 + 64 + 64 + 32."""
    whole = wide - wide % most
    rest = (
        [(whole + start, size) for start, size in width_parts(wide % most)] if wide % most else []
    )
    return [(start, most) for start in range(0, whole, most)] + rest


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


def _batch_axes(mesh: Mesh, batch: int) -> tuple[str, ...]:
    """The axes of ``mesh`` (all of them, as the training step splits the batch) over which
    the kernels split ``batch`` sequences; a ``ValueError`` if they do not split evenly."""
    if batch % mesh.size:
        raise ValueError(
            f"the LMU layer's kernels split the batch over the mesh's {mesh.size} devices, and "
            f"a batch of {batch} sequences does not split evenly"
        )
    return mesh.axis_names


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
        batch = _batch_axes(mesh, u_BxTxC.shape[0])
        per_device = functools.partial(
            chunk_operand, order=order, theta=theta, interpret=interpret, **options
        )
        # Unchecked: a pallas_call's output carries no type of how it varies over the devices.
        sharded = jax.shard_map(
            per_device, mesh=mesh, in_specs=P(batch), out_specs=P(batch), check_vma=False
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


POSITIONS = 16  # positions a program of the attention kernels takes, one at a time
# One warp a program, and 16 channels of each row at a time: with more warps Triton computed the
# gelus again in each, and wider parts spilled (benchmarks/kernel_resources.py measured both).
ATTENTION_WARPS, ATTENTION_PART = 1, 16
# The gelu's upper tail P(Z > s), s >= 0, for the kernels (Pallas's Triton lowering has no erf):
# 2^G(s) for s < TAIL_END, G a polynomial fitted for this module by least squares on
# Chebyshev nodes to log2 P(Z > s) on [0, TAIL_END]; from TAIL_END on, 0 in float64 arithmetic
# and P(Z > 6) = 1e-9 in float32 (``upper_tail``).
# A fit of G is a fit of the tail to a relative error, so gelu(x) = x - |x| P(Z > |x|) (x >= 0)
# or -|x| P(Z > |x|) (x < 0) keeps its relative accuracy in the far negative tail, where 1 +
# erf(x) loses it. TAIL32 (degree 7) is as close as float32 arithmetic gets (gelu within 6.2e-6
# relative for |x| < 6); TAIL64 (degree 14) for float64, within 1.1e-9; TAIL16 (degree 6) for
# a bf16 model, whose gelus are rounded to 8 bits, within 5e-5. tests/ measures all three.
TAIL_END = 6.0
TAIL32 = (
    -0.9999943403320707,
    -1.151269147164848,
    -0.45840977680794415,
    -0.05402068711605475,
    0.008539461331918624,
    -0.0009388679332924741,
    6.268140100944492e-05,
    -1.8896262334276975e-06,
)
TAIL16 = (
    -1.0000589124035264,
    -1.1502144699979406,
    -0.46122224925301886,
    -0.05120821467095059,
    0.007200188738998913,
    -0.0006114901883541658,
    2.2999250107621074e-05,
)
TAIL64 = (
    -1.0000000015568984,
    -1.1511039768964846,
    -0.4592256945917597,
    -0.05241286391964001,
    0.006876253788997825,
    9.148860535065857e-05,
    -0.00034770010641608617,
    0.00010682484203122263,
    -1.90890352015929e-05,
    2.0520180044790938e-06,
    -8.30072110053804e-08,
    -1.0720525936776907e-08,
    1.95879683689426e-09,
    -1.3011236861151837e-10,
    3.3797757272299137e-12,
)


def _inline(asm: str, *args):
    """PTX ``asm`` on each element of ``args`` (of one shape and dtype), as Triton inlines it:
    on a GPU only (interpret mode has no PTX)."""
    letter = {jnp.dtype(jnp.float32): "f", jnp.dtype(jnp.float64): "d"}[args[0].dtype]
    (out,) = pl_triton.elementwise_inline_asm(
        asm,
        args=list(args),
        constraints=",".join([f"={letter}"] + [letter] * len(args)),
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)],
    )
    return out


def _fma(a, b, c, gpu: bool, negate: bool = False):
    """``a * b + c`` (``c - a * b`` with ``negate``): on a GPU (``gpu``) one fused multiply-add,
    where Triton's lowering rounds and issues a product and a sum apart, and negates by a
    subtraction from 0 that ptxas does not fold; in interpret mode as written."""
    if not gpu:
        return c - a * b if negate else a * b + c
    b, c = (jnp.broadcast_to(jnp.asarray(x, a.dtype), a.shape) for x in (b, c))
    kind = "f64" if a.dtype == jnp.float64 else "f32"
    if negate:  # a PTX neg, which ptxas makes an operand modifier of the FFMA
        asm = f"{{ .reg .{kind} n; neg.{kind} n, $1; fma.rn.{kind} $0, n, $2, $3; }}"
        return _inline(asm, a, b, c)
    return _inline(f"fma.rn.{kind} $0, $1, $2, $3;", a, b, c)


def _exp2(x, gpu: bool):
    """``2^x``; in float32 on a GPU by the special-function unit alone (results under 2^-126
    flushed to 0), where Triton's exp2 adds a path for them."""
    if gpu and x.dtype == jnp.float32:
        return _inline("ex2.approx.ftz.f32 $0, $1;", x)
    return jnp.exp2(x)


def tail_fit(dtype) -> tuple[float, ...]:
    """The fit of ``upper_tail`` for a model in ``dtype``: TAIL16 narrower than float32,
    TAIL32 in float32, TAIL64 in float64."""
    size = jnp.dtype(dtype).itemsize
    return TAIL16 if size < 4 else TAIL32 if size == 4 else TAIL64


def upper_tail(size, gpu: bool = False, fit=None):
    """``P(Z > size)`` for a standard normal Z and ``size >= 0``, by ``fit`` (by default
    ``tail_fit`` of size's dtype: ``TAIL32``, or ``TAIL64`` in float64 arithmetic)."""
    coefficients = fit or tail_fit(size.dtype)
    exact = size.dtype == jnp.float64
    # In float32, past TAIL_END the tail at TAIL_END (1e-9): one min, where a compare and a
    # select cost two; it changes gelu below -6 by |x| 1e-9, and above 6 nothing.
    at = size if exact else jnp.minimum(size, TAIL_END)
    exponent = jnp.full_like(size, coefficients[-1])
    for c in coefficients[-2::-1]:
        exponent = _fma(exponent, at, c, gpu)
    return jnp.where(size < TAIL_END, _exp2(exponent, gpu), 0.0) if exact else _exp2(exponent, gpu)


def gelu(x, gpu: bool = False, fit=None):
    """The exact gelu ``x Phi(x)`` from ``upper_tail``: ``max(x, 0) - |x| P(Z > |x|)``."""
    size = jnp.abs(x)
    return _fma(size, upper_tail(size, gpu, fit), jnp.maximum(x, 0.0), gpu, negate=True)


def _load(ref, mask):
    """``ref``'s elements where ``mask``, 0 elsewhere (and not read)."""
    return pl_triton.load(ref, mask=mask, other=0)


def _store(ref, value, mask):
    """``value`` into ``ref`` where ``mask``."""
    pl_triton.store(ref, value, mask=mask)


def _channels(d0: int, size: int, width: int):
    """Which of the ``size`` channels from ``d0`` on are real (below ``width``)."""
    return d0 + lax.broadcasted_iota(jnp.int32, (size,), 0) < width


def _pre_activation(qkv_ref, bias, i, t, inside, part, zero):
    """Rows (Q, K, V)[i]'s pre-activations ``L_i M + b_i`` in the model's dtype (``bias``'s)
    at position t (``inside`` the input), channels ``part`` = (start, size), q' padded to
    ``bias``'s rows, masked; and which of the part's channels are real. A padded channel's
    pre-activation is its row's bias, whose gelu is not 0: the callers zero it where it
    counts."""
    _, order, _, width = qkv_ref.shape
    (d0, d), rows = part, bias[i].shape[0]
    real_d = jnp.broadcast_to(_channels(d0, d, width), (rows, d))
    real = lax.broadcasted_iota(jnp.int32, (rows, d), 0) < order
    x = _load(
        qkv_ref.at[zero + i, pl.ds(zero, rows), t, pl.ds(zero + d0, d)], real & real_d & inside
    )
    return x.astype(bias[i].dtype) + bias[i], real_d


def _masked(value, real_d, part, width):
    """``value`` with the padded channels of a ``part`` that runs past ``width`` zeroed."""
    return jnp.where(real_d, value, 0) if sum(part) > width else value


def _attention_setup(p_ref, order):
    """What the attention kernels hold across positions: the padded rows, a traced 0, which
    rows are real, p (None without ``p_ref``), and which score columns are real."""
    rows = max(16, pl.next_power_of_2(order))
    # Traced: Pallas bounds-checks a static slice when tracing, and the last part runs past d
    # on purpose, its loads and stores masked.
    zero = pl.program_id(0) * 0
    real = lax.broadcasted_iota(jnp.int32, (rows,), 0) < order
    p_K = None if p_ref is None else _load(p_ref.at[pl.ds(zero, rows)], real)
    real_k = lax.broadcasted_iota(jnp.int32, (rows, rows), 1) < order
    return rows, zero, real, p_K, real_k


def _biases(bias_ref, zero, real, dtype):
    """The three biases in ``dtype``, as columns of the padded rows (``real`` of them)."""
    rows = real.shape[0]
    return [
        _load(bias_ref.at[zero + i, pl.ds(zero, rows)], real)[:, None].astype(dtype)
        for i in range(3)
    ]


def _attention_kernel(
    qkv_ref, bias_ref, p_ref, m_ref, weights_ref, w_ref, *, positions, dtype, precision, gpu
):
    """``POSITIONS`` positions of ``attention_forward``, one at a time: Q, K and V's q' x d rows
    (q' padded to a power of two, d in parts of ATTENTION_PART, padding masked), their gelus in
    ``dtype``, the q' x q' scores as products, their softmax over k, ``w = p softmax`` and
    ``m = gelu(V)ᵀ w``."""
    _, order, _, width = qkv_ref.shape
    rows, zero, real, p_K, real_k = _attention_setup(p_ref, order)
    bias, wide = _biases(bias_ref, zero, real, dtype), p_K.dtype
    parts = _parts(padded_width(width, split=True), ATTENTION_PART)

    def gelus(i, t, inside, part):
        pre, real_d = _pre_activation(qkv_ref, bias, i, t, inside, part, zero)
        value = gelu(pre.astype(wide), gpu, tail_fit(dtype))
        return _masked(value, real_d, part, width).astype(dtype)

    first = pl.program_id(0) * POSITIONS  # (interpret mode reads it out of a loop only)

    def position(step, carry):
        t = first + step
        inside = t < positions
        scores = functools.reduce(
            jnp.add,
            (
                lax.dot_general(
                    gelus(0, t, inside, part),
                    gelus(1, t, inside, part),
                    (((1,), (1,)), ((), ())),
                    precision=precision,
                    preferred_element_type=wide,
                )
                for part in parts
            ),
        )
        scores = jnp.where(real_k, scores * (1.0 / math.sqrt(width)), -jnp.inf)
        weights = _exp2((scores - scores.max(axis=1, keepdims=True)) * math.log2(math.e), gpu)
        weights = weights * (1.0 / weights.sum(axis=1, keepdims=True))
        w_K = jnp.sum(weights * p_K[:, None], axis=0)
        for d0, d in parts:  # gelu(V) once w is known: a part at a time on chip
            m = jnp.sum(gelus(2, t, inside, (d0, d)).astype(wide) * w_K[:, None], axis=0)
            real_d = _channels(d0, d, width)
            _store(m_ref.at[t, pl.ds(zero + d0, d)], m.astype(m_ref.dtype), real_d & inside)
        square = real[:, None] & real_k & inside
        _store(weights_ref.at[t, pl.ds(zero, rows), pl.ds(zero, rows)], weights, square)
        _store(w_ref.at[t, pl.ds(zero, rows)], w_K, real & inside)
        return carry

    lax.fori_loop(0, POSITIONS, position, 0)


def _gelu_and_slope(x, gpu: bool, fit):
    """``gelu(x)`` and its derivative ``Phi(x) + x phi(x)``, from one ``upper_tail``."""
    tail = upper_tail(jnp.abs(x), gpu, fit)
    cdf = jnp.where(x >= 0, 1.0 - tail, tail)
    # phi(x) = 2^(-x² log2(e) / 2 - log2(2 pi) / 2)
    exponent = _fma(x * x, -0.5 * math.log2(math.e), -0.5 * math.log2(2.0 * math.pi), gpu)
    return x * cdf, _fma(x, _exp2(exponent, gpu), cdf, gpu)


def _over_parts(width: int, part, sums):
    """``sums = part(d0, sums, last)`` over the channels in parts of ATTENTION_PART from d0 =
    0: the whole parts as a loop, then a last part that runs past ``width``, if any, with
    ``last``. Unrolled, the backward kernels' parts had ptxas hold too much at once: they
    spilled."""
    whole, rest = divmod(width, ATTENTION_PART)
    sums = lax.fori_loop(0, whole, lambda j, sums: part(j * ATTENTION_PART, sums), sums)
    return part(whole * ATTENTION_PART, sums, last=True) if rest else sums


def _values_backward_kernel(
    qkv_ref,
    bias_ref,
    p_ref,
    weights_ref,
    w_ref,
    dm_ref,
    dqkv_ref,
    dbias_ref,
    dp_ref,
    ds_ref,
    *,
    positions,
    dtype,
    gpu,
):
    """``POSITIONS`` positions of the attention's backward, first of its two kernels, as XLA's
    backward pass (``implicit_attention._implicit_attention_channels_last_bwd``) computes them:
    gelu(V) and gelu' give dV and dw, and then dw gives p's gradient and ds, the scores'
    gradient (in ``dtype``, as the products take it), which ``_scores_backward_kernel`` reads.
    dV is written rounded to the model's dtype; its sums over the channels (the position's part
    of V's bias gradient, of the gradients before that rounding, where XLA sums them after) and
    the position's part of p's gradient as rows of ``dbias_ref`` and ``dp_ref``."""
    _, order, _, width = qkv_ref.shape
    rows, zero, real, p_K, real_k = _attention_setup(p_ref, order)
    wide = p_K.dtype
    first = pl.program_id(0) * POSITIONS
    scale = 1.0 / math.sqrt(width)
    bias = _biases(bias_ref, zero, real, dtype)

    def position(step, carry):
        t = first + step
        inside = t < positions
        w_K = _load(w_ref.at[t, pl.ds(zero, rows)], real & inside)

        def part(d0, sums, last=False):  # no mask past d: dm is 0 there, so are the sums
            pre, real_d = _pre_activation(qkv_ref, bias, 2, t, inside, (d0, ATTENTION_PART), zero)
            value, slope = _gelu_and_slope(pre.astype(wide), gpu, tail_fit(dtype))
            channels = _channels(d0, ATTENTION_PART, width)
            dm = _load(dm_ref.at[t, pl.ds(zero + d0, ATTENTION_PART)], channels & inside)
            dm = dm.astype(dtype).astype(wide)[None, :]  # 0 in a padded channel
            dpre = w_K[:, None] * dm * slope
            at = dqkv_ref.at[zero + 2, pl.ds(zero, rows), t, pl.ds(zero + d0, ATTENTION_PART)]
            _store(at, dpre.astype(dtype), real[:, None] & real_d & inside)
            return sums[0] + dm * value.astype(dtype).astype(wide), sums[1] + dpre

        zeros = jnp.zeros((rows, ATTENTION_PART), wide)
        whole = _over_parts(width, part, (zeros, zeros))
        dw, dbias_v = (jnp.sum(x, axis=1) for x in whole)
        # w = p softmax(scores): p's gradient, and the scores'.
        square = real[:, None] & real_k & inside
        weights = _load(weights_ref.at[t, pl.ds(zero, rows), pl.ds(zero, rows)], square)
        dweights = p_K[:, None] * dw[None, :]
        inner = jnp.sum(weights * dweights, axis=1, keepdims=True)
        ds = (weights * (dweights - inner) * scale).astype(dtype)
        _store(ds_ref.at[t, pl.ds(zero, rows), pl.ds(zero, rows)], ds, square)
        _store(dbias_ref.at[t, zero + 2, pl.ds(zero, rows)], dbias_v, real & inside)
        dp = jnp.sum(weights * dw[None, :], axis=1)
        _store(dp_ref.at[t, pl.ds(zero, rows)], dp, real & inside)
        return carry

    lax.fori_loop(0, POSITIONS, position, 0)


def _scores_backward_kernel(
    qkv_ref,
    bias_ref,
    ds_ref,
    dqkv_in_ref,
    dbias_in_ref,
    dqkv_ref,
    dbias_ref,
    *,
    positions,
    dtype,
    precision,
    gpu,
):
    """``POSITIONS`` positions of the attention's backward, second of its two kernels: from ds
    (``_values_backward_kernel``'s), gelu(Q), gelu(K) and their slopes give dQ = (ds gelu(K))
    gelu'(Q) and dK = (dsᵀ gelu(Q)) gelu'(K), written into the first kernel's ``dqkv`` and
    ``dbias`` (aliased: ``dqkv_in_ref`` and ``dbias_in_ref`` are they), as it wrote dV.

    The channels' whole parts of ATTENTION_PART run as a loop, not unrolled: unrolled, ptxas
    held too much at once and spilled. Channels as rows, q' as columns: so held, Triton
    computes each tail once for the gelu (a product's operand) and the slope (multiplying the
    other product); with q' as rows it computed those of Q and K twice. A padded channel's
    gelus only reach its own rows of the products, which are not stored; the bias gradients'
    sums mask them, in the last part only, and are summed over the channels once a position."""
    del dqkv_in_ref, dbias_in_ref
    _, order, _, width = qkv_ref.shape
    rows, zero, real, _, real_k = _attention_setup(None, order)
    wide = bias_ref.dtype
    first = pl.program_id(0) * POSITIONS
    product = functools.partial(lax.dot_general, precision=precision, preferred_element_type=wide)

    def position(step, carry):
        t = first + step
        inside = t < positions
        # Read again at each position, a hit in L1, where held across the loop they spilled.
        bias = _biases(bias_ref, zero, real, dtype)
        square = real[:, None] & real_k & inside
        ds = _load(ds_ref.at[t, pl.ds(zero, rows), pl.ds(zero, rows)], square)

        def part(d0, sums, last=False):
            span = (d0, ATTENTION_PART)
            (pre_q, real_d), (pre_k, _) = (
                _pre_activation(qkv_ref, bias, i, t, inside, span, zero) for i in (0, 1)
            )
            gq, slope_q = _gelu_and_slope(pre_q.astype(wide).T, gpu, tail_fit(dtype))
            gk, slope_k = _gelu_and_slope(pre_k.astype(wide).T, gpu, tail_fit(dtype))
            mask = real[:, None] & real_d & inside
            out = []
            # (d, i) = gkᵀ dsᵀ for Q, (d, k) = gqᵀ ds for K, each stored before the next
            for i, (g, other, slope) in enumerate(((gk, 1, slope_q), (gq, 0, slope_k))):
                dpre = product(g.astype(dtype), ds, (((1,), (other,)), ((), ()))) * slope
                at = dqkv_ref.at[zero + i, pl.ds(zero, rows), t, pl.ds(zero + d0, span[1])]
                _store(at, dpre.astype(dtype).T, mask)
                out.append(sums[i] + (jnp.where(real_d.T, dpre, 0) if last else dpre))
            return tuple(out)

        zeros = jnp.zeros((ATTENTION_PART, rows), wide)
        sums = _over_parts(width, part, (zeros, zeros))
        for i, dbias in enumerate(sums):
            dbias = jnp.sum(dbias, axis=0)
            _store(dbias_ref.at[t, zero + i, pl.ds(zero, rows)], dbias, real & inside)
        return carry

    lax.fori_loop(0, POSITIONS, position, 0)


def _whole(*arrays):
    """Block specs that give a program each of ``arrays`` whole."""
    return [pl.BlockSpec(x.shape, lambda i, n=x.ndim: (0,) * n) for x in arrays]


def attention_forward(qkv_3xKxPxD, bias_3xK, p_K, dtype, precision, interpret):
    """``implicit_attention_channels_last``'s forward pass by the attention kernel, on its input
    with the positions flattened, (3, q', P, d): ``m_PxD`` in ``dtype`` and the backward pass's
    residuals, the softmax ``weights_PxKxK`` and ``w_PxK`` (float32 or wider), each
    position's a contiguous row. Nothing is padded outside the kernel."""
    _, order, positions, width = qkv_3xKxPxD.shape
    wide = implicit_attention._wide(dtype)
    kernel = functools.partial(
        _attention_kernel, positions=positions, dtype=dtype, precision=precision, gpu=not interpret
    )
    out_shape = [
        jax.ShapeDtypeStruct((positions, width), dtype),
        jax.ShapeDtypeStruct((positions, order, order), wide),
        jax.ShapeDtypeStruct((positions, order), wide),
    ]
    inputs = (qkv_3xKxPxD, bias_3xK.astype(wide), p_K.astype(wide))
    whole = _whole(*inputs, *out_shape)
    return pl.pallas_call(
        kernel,
        name="attention_forward",
        compiler_params=pl_triton.CompilerParams(num_warps=ATTENTION_WARPS, num_stages=STAGES),
        grid=(pl.cdiv(positions, POSITIONS),),
        in_specs=whole[:3],
        out_specs=whole[3:],
        out_shape=out_shape,
        interpret=interpret,
    )(*inputs)


def attention_backward(
    qkv_3xKxPxD, bias_3xK, p_K, weights_PxKxK, w_PxK, dm_PxD, dtype, precision, interpret
):
    """The gradients of ``attention_forward``'s m in its input (in ``dtype``), the biases and
    p (float32 or wider) by the attention's two backward kernels, from the forward's
    residuals: V's gradient and the scores' first, then Q's and K's (in one kernel, they
    spilled)."""
    _, order, positions, _ = qkv_3xKxPxD.shape
    wide = implicit_attention._wide(dtype)
    options = dict(positions=positions, dtype=dtype, gpu=not interpret)
    launch = dict(
        compiler_params=pl_triton.CompilerParams(num_warps=ATTENTION_WARPS, num_stages=STAGES),
        grid=(pl.cdiv(positions, POSITIONS),),
        interpret=interpret,
    )
    bias_3xK = bias_3xK.astype(wide)
    inputs = (qkv_3xKxPxD, bias_3xK, p_K.astype(wide), weights_PxKxK, w_PxK, dm_PxD)
    out_shape = [
        jax.ShapeDtypeStruct(qkv_3xKxPxD.shape, dtype),
        jax.ShapeDtypeStruct((positions, 3, order), wide),
        jax.ShapeDtypeStruct((positions, order), wide),
        jax.ShapeDtypeStruct((positions, order, order), dtype),
    ]
    whole = _whole(*inputs, *out_shape)
    dqkv, dbias, dp, ds = pl.pallas_call(
        functools.partial(_values_backward_kernel, **options),
        name="attention_backward_values",
        in_specs=whole[: len(inputs)],
        out_specs=whole[len(inputs) :],
        out_shape=out_shape,
        **launch,
    )(*inputs)
    inputs = (qkv_3xKxPxD, bias_3xK, ds, dqkv, dbias)
    whole = _whole(*inputs)
    dqkv, dbias = pl.pallas_call(
        functools.partial(_scores_backward_kernel, precision=precision, **options),
        name="attention_backward_scores",
        in_specs=whole,
        out_specs=whole[3:],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (dqkv, dbias)],
        input_output_aliases={3: 0, 4: 1},
        **launch,
    )(*inputs)
    return dqkv, dbias.sum(0), dp.sum(0)


def attention(
    qkv_3xKxcxBxJxD, bias_3xK, p_K, dtype, precision, interpret, mesh: Mesh | None = None
):
    """``implicit_attention_channels_last`` (gelu's erf form) by the attention kernels,
    forward and backward, positions (c, B, J). ``precision``: the q' x q' products' where the
    model's dtype is narrower than float32 (``Impls.q_prime_precision``); ``interpret``:
    Pallas's interpret mode. With a ``mesh`` of several devices, each runs the kernels on its
    share of the sequences (B split over all of the mesh's axes, as the training step splits
    it), the biases and p whole; their gradients are summed over the devices."""

    def attend(qkv_3xKxcxBxJxD, bias_3xK, p_K):
        return _attention(qkv_3xKxcxBxJxD, bias_3xK, p_K, dtype, precision, interpret)

    if mesh is None or mesh.size == 1:
        return attend(qkv_3xKxcxBxJxD, bias_3xK, p_K)
    batch = _batch_axes(mesh, qkv_3xKxcxBxJxD.shape[3])
    # Unchecked, as chunk_operand's; the transpose sums the gradients of the inputs that every
    # device holds whole (the biases and p) over the mesh's axes.
    sharded = jax.shard_map(
        attend,
        mesh=mesh,
        in_specs=(P(None, None, None, batch), P(), P()),
        out_specs=P(None, batch),
        check_vma=False,
    )
    return sharded(qkv_3xKxcxBxJxD, bias_3xK, p_K)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(qkv_3xKxcxBxJxD, bias_3xK, p_K, dtype, precision, interpret):
    return _attention_fwd(qkv_3xKxcxBxJxD, bias_3xK, p_K, dtype, precision, interpret)[0]


def _chosen(dtype, precision):
    narrow = jnp.dtype(dtype).itemsize < 4
    return lax.Precision(precision) if narrow else lax.Precision.HIGHEST


def _attention_fwd(qkv_3xKxcxBxJxD, bias_3xK, p_K, dtype, precision, interpret):
    _, order, *positions, width = qkv_3xKxcxBxJxD.shape
    qkv_3xKxPxD = qkv_3xKxcxBxJxD.reshape(3, order, -1, width)
    chosen = _chosen(dtype, precision)
    m_PxD, weights, w = attention_forward(qkv_3xKxPxD, bias_3xK, p_K, dtype, chosen, interpret)
    return m_PxD.reshape(*positions, width), (qkv_3xKxcxBxJxD, bias_3xK, p_K, weights, w)


def _attention_bwd(dtype, precision, interpret, residuals, dm_cxBxJxD):
    qkv_3xKxcxBxJxD, bias_3xK, p_K, weights, w = residuals
    _, order, *_, width = qkv_3xKxcxBxJxD.shape
    dqkv, dbias, dp = attention_backward(
        qkv_3xKxcxBxJxD.reshape(3, order, -1, width),
        bias_3xK,
        p_K,
        weights,
        w,
        dm_cxBxJxD.reshape(-1, width),
        dtype,
        _chosen(dtype, precision),
        interpret,
    )
    return (
        dqkv.reshape(qkv_3xKxcxBxJxD.shape).astype(qkv_3xKxcxBxJxD.dtype),
        dbias.astype(bias_3xK.dtype),
        dp.astype(p_K.dtype),
    )


_attention.defvjp(_attention_fwd, _attention_bwd)
