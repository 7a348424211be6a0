"""The cross-entropy as fused Pallas kernels: the logits live only in on-chip tiles.

Unlike ``cross_entropy.cross_entropy``'s XLA path, no kernel writes logits to memory. The forward
walks the vocabulary per tile of tokens with an online log-sum-exp and writes two floats per
token; dh (per tile of tokens) and dw (per tile of the vocabulary) recompute each logits tile
and form ``g * (softmax - onehot)`` on chip: 5 logits-sized products against the XLA path's 3,
but nothing V-sized is written but dw, and the per-token cotangent ``g`` enters exactly, so
any weighting of the losses has exact gradients. With ``dh_from_forward`` the forward also
writes each token's expected embedding under its softmax (D' floats, kept for the backward
pass) and dh needs no kernel: 4 products, the dh kernel's logits recomputed no more.

Written for Pallas's Triton lowering (NVIDIA GPUs): d is zero-padded to a power of two (or,
with ``Tiling.split_width``, to a multiple of 16 held as power-of-two parts, each product a
sum over them), the vocabulary to whole tiles (padded logits masked) and the tokens to whole
tiles with a zero cotangent. ``interpret=True`` runs the kernels on any backend (the tests, on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from lmuscale.ops import check_operands

# Tiles on a GPU (``default_tiling``), not yet tuned on a device: one tile of an operand is at
# most TILE_BYTES. At d = 204 (padded to 256) in bf16 that is 64 x 256, whose float32
# accumulators are 64 registers a thread over 8 warps, as flash attention takes at head width
# 256; in float32 the tiles halve, so two pipelined stages fit the smallest Ampere/Ada shared
# memory. ``benchmarks/cross_entropy.py --part loss-tiles`` times each kernel's other tiles.
TILE_BYTES = 32 * 1024
MAX_TILE = 64
MIN_TILE = 16  # Triton's matrix products need every dimension >= 16


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel's tiles and Triton launch. ``rows``: the rows of the operand its grid walks
    that one program holds (tokens in the forward and dh kernels, vocabulary rows in dw);
    ``step``: the rows of the other operand one iteration of the program's loop takes;
    ``warps`` per program and ``stages``, the software pipelining of that loop (Triton's
    ``num_warps`` and ``num_stages``; interpret mode ignores both)."""

    rows: int
    step: int
    warps: int = 8
    stages: int = 2


KERNELS = ("forward", "dh", "dw")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The three kernels' launches: the forward and dh kernels walk tiles of tokens and loop
    over the vocabulary, dw walks tiles of the vocabulary and loops over the tokens.
    ``split_width``: d is held in parts (``width_parts``), 204 as 128 + 64 + 16 rather than
    padded to 256, so each product does 208/256 of the work, in two more, narrower products."""

    forward: Launch
    dh: Launch
    dw: Launch
    split_width: bool = False

    @classmethod
    def shared(
        cls,
        token_tile: int,
        vocab_tile: int,
        warps: int = 8,
        stages: int = 2,
        split_width: bool = False,
    ) -> Tiling:
        """One tile of tokens and one of the vocabulary for all three kernels."""
        by_tokens = Launch(token_tile, vocab_tile, warps, stages)
        by_vocab = Launch(vocab_tile, token_tile, warps, stages)
        return cls(by_tokens, by_tokens, by_vocab, split_width)

    @classmethod
    def from_dict(cls, launches: dict) -> Tiling:
        """The tiling that ``dataclasses.asdict`` wrote as ``launches`` (a benchmark's JSON):
        ``{"forward": {"rows": ..., "step": ..., "warps": ..., "stages": ...}, "dh": ...,
        "dw": ..., "split_width": ...}`` (no ``split_width``: false, as before it existed); a
        ValueError naming what is missing or unknown."""
        fields = {f.name for f in dataclasses.fields(Launch)}
        if not isinstance(launches, dict) or not set(KERNELS) <= set(launches) <= {
            *KERNELS,
            "split_width",
        }:
            got = sorted(launches) if isinstance(launches, dict) else type(launches).__name__
            raise ValueError(f"a tiling has the launches {list(KERNELS)}, got {got}")
        for kernel in KERNELS:
            launch = launches[kernel]
            if not isinstance(launch, dict) or not {"rows", "step"} <= set(launch) <= fields:
                raise ValueError(
                    f"tiling.{kernel} must be an object with rows, step and optionally warps "
                    f"and stages, got {launch!r}"
                )
        split = launches.get("split_width", False)
        if not isinstance(split, bool):
            raise ValueError(f"tiling.split_width must be true or false, got {split!r}")
        return cls(*(Launch(**launches[kernel]) for kernel in KERNELS), split)

    @property
    def token_multiple(self) -> int:
        """The tokens are padded to a multiple of this: every kernel's tile of them."""
        return max(self.forward.rows, self.dh.rows, self.dw.step)

    @property
    def vocab_multiple(self) -> int:
        """The vocabulary is padded to a multiple of this: every kernel's tile of it."""
        return max(self.forward.step, self.dh.step, self.dw.rows)

    def check(self, interpret: bool = False) -> None:
        """A ValueError naming the first setting that cannot run: tiles are powers of two (at
        least MIN_TILE on a GPU, any in interpret mode), warps a power of two up to 32, at
        least one stage."""
        smallest = 1 if interpret else MIN_TILE
        if not isinstance(self.split_width, bool):
            raise ValueError(f"tiling.split_width must be a bool, got {self.split_width!r}")
        for kernel in KERNELS:
            launch = getattr(self, kernel)
            for name in ("rows", "step"):
                tile = getattr(launch, name)
                if not _power_of_two(tile) or tile < smallest:
                    raise ValueError(
                        f"tiling.{kernel}.{name} must be a power of two >= {smallest}, got {tile!r}"
                    )
            if not _power_of_two(launch.warps) or launch.warps > 32:
                raise ValueError(
                    f"tiling.{kernel}.warps must be a power of two <= 32, got {launch.warps!r}"
                )
            if not _whole_number(launch.stages) or launch.stages < 1:
                raise ValueError(
                    f"tiling.{kernel}.stages must be a whole number >= 1, got {launch.stages!r}"
                )


def _whole_number(n) -> bool:
    """An int of any kind (numpy's too), not a bool."""
    return isinstance(n, numbers.Integral) and not isinstance(n, bool)


def _power_of_two(n) -> bool:
    return _whole_number(n) and n >= 1 and not n & (n - 1)


def _pallas_call(kernel, launch: Launch, **kwargs):
    """``pl.pallas_call`` with ``launch``'s warps and stages. Naming Triton's parameters picks
    the Triton lowering on a GPU (the default may be Mosaic GPU, which lowers no transposed
    product)."""
    params = pl_triton.CompilerParams(num_warps=launch.warps, num_stages=launch.stages)
    return pl.pallas_call(kernel, compiler_params=params, **kwargs)


def _tile_logits(h_parts, w_parts):
    """One tile of logits, ``h wᵀ`` summed over the width's parts, accumulated in float32."""
    products = (
        lax.dot_general(h, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        for h, w in zip(h_parts, w_parts, strict=True)
    )
    return functools.reduce(jnp.add, products)


def _load(ref, rows, parts):
    """``ref[rows]``'s width parts (``parts``: static (start, size) pairs), each its own load of a
    power-of-two width."""
    return [ref[rows, pl.ds(start, size)] for start, size in parts]


def _store(ref, values, parts):
    for value, (start, size) in zip(values, parts, strict=True):
        ref[:, pl.ds(start, size)] = value.astype(ref.dtype)


def _dlogits(h_parts, w_parts, lse_t, targets_t, g_t, first_column, vocab):
    """One tile's ``g * (softmax - onehot)``, logits recomputed, in h's dtype for the next
    product; zero in padded columns (whose exp(0 - lse) could overflow where lse is very low)."""
    logits_txv = _tile_logits(h_parts, w_parts)
    columns_txv = first_column + lax.broadcasted_iota(jnp.int32, logits_txv.shape, 1)
    p_txv = jnp.where(columns_txv < vocab, jnp.exp(logits_txv - lse_t[:, None]), 0.0)
    p_txv = jnp.where(columns_txv == targets_t[:, None], p_txv - 1.0, p_txv)
    return (p_txv * g_t[:, None]).astype(h_parts[0].dtype)


def _forward_kernel(
    h_ref, w_ref, targets_ref, lse_ref, target_logit_ref, *expected, vocab, tile, parts
):
    """Each token's log-sum-exp and target logit, by an online log-sum-exp over the vocabulary;
    with a third output (``expected``), also its expected embedding under its softmax,
    ``E_p[w] = sum_v p_v w_v``, whose running sum is rescaled as the max grows (as flash
    attention's output is)."""
    h_parts = _load(h_ref, slice(None), parts)
    targets_t = targets_ref[...]
    rows = h_parts[0].shape[0]

    def one_tile(j, carry):
        max_t, sum_t, target_t, expected_parts = carry
        first = j * tile
        w_parts = _load(w_ref, pl.ds(first, tile), parts)
        logits_txv = _tile_logits(h_parts, w_parts)
        columns_txv = first + lax.broadcasted_iota(jnp.int32, logits_txv.shape, 1)
        # The target's logit before masking: a target outside the vocabulary picks 0, as in
        # the XLA path.
        hit_txv = columns_txv == targets_t[:, None]
        target_t += jnp.sum(jnp.where(hit_txv, logits_txv, 0.0), axis=1)
        logits_txv = jnp.where(columns_txv < vocab, logits_txv, -jnp.inf)
        new_max_t = jnp.maximum(max_t, jnp.max(logits_txv, axis=1))
        rescale_t = jnp.exp(max_t - new_max_t)
        p_txv = jnp.exp(logits_txv - new_max_t[:, None])
        sum_t = sum_t * rescale_t + jnp.sum(p_txv, axis=1)
        if expected:
            p_txv = p_txv.astype(h_parts[0].dtype)
            expected_parts = [
                running * rescale_t[:, None] + jnp.dot(p_txv, w, preferred_element_type=jnp.float32)
                for running, w in zip(expected_parts, w_parts, strict=True)
            ]
        return new_max_t, sum_t, target_t, expected_parts

    zeros_t = jnp.zeros((rows,), jnp.float32)
    start = (jnp.full((rows,), -jnp.inf, jnp.float32), zeros_t, zeros_t)
    start += ([jnp.zeros(h.shape, jnp.float32) for h in h_parts] if expected else [],)
    # The first tile holds real columns, so the max is finite after it: a later tile wholly of
    # padding (the vocabulary is padded to every kernel's tile) rescales by exp(0) and adds 0.
    max_t, sum_t, target_t, expected_parts = lax.fori_loop(
        0, w_ref.shape[0] // tile, one_tile, start
    )
    lse_ref[...] = max_t + jnp.log(sum_t)
    target_logit_ref[...] = target_t
    if expected:
        _store(expected[0], [e / sum_t[:, None] for e in expected_parts], parts)


def _dh_kernel(h_ref, w_ref, targets_ref, lse_ref, g_ref, dh_ref, *, vocab, tile, parts):
    h_parts = _load(h_ref, slice(None), parts)
    targets_t, lse_t, g_t = targets_ref[...], lse_ref[...], g_ref[...]

    def one_tile(j, dh_parts):
        first = j * tile
        w_parts = _load(w_ref, pl.ds(first, tile), parts)
        dlogits_txv = _dlogits(h_parts, w_parts, lse_t, targets_t, g_t, first, vocab)
        return [
            dh + jnp.dot(dlogits_txv, w, preferred_element_type=jnp.float32)
            for dh, w in zip(dh_parts, w_parts, strict=True)
        ]

    start = [jnp.zeros(h.shape, jnp.float32) for h in h_parts]
    _store(dh_ref, lax.fori_loop(0, w_ref.shape[0] // tile, one_tile, start), parts)


def _dw_kernel(h_ref, w_ref, targets_ref, lse_ref, g_ref, dw_ref, *, vocab, tile, parts):
    w_parts = _load(w_ref, slice(None), parts)
    first = pl.program_id(0) * w_parts[0].shape[0]

    def one_tile(i, dw_parts):
        rows = pl.ds(i * tile, tile)
        h_parts = _load(h_ref, rows, parts)
        dlogits_txv = _dlogits(
            h_parts, w_parts, lse_ref[rows], targets_ref[rows], g_ref[rows], first, vocab
        )
        return [
            dw
            + lax.dot_general(
                dlogits_txv, h, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            for dw, h in zip(dw_parts, h_parts, strict=True)
        ]

    start = [jnp.zeros(w.shape, jnp.float32) for w in w_parts]
    _store(dw_ref, lax.fori_loop(0, h_ref.shape[0] // tile, one_tile, start), parts)


def padded_width(width: int, split: bool = False) -> int:
    """d as the kernels hold it: the next power of two (204: 256), or with ``split`` the next
    multiple of MIN_TILE (204: 208), held in parts (``width_parts``); at least MIN_TILE."""
    if split:
        return max(MIN_TILE, -(-width // MIN_TILE) * MIN_TILE)
    return max(MIN_TILE, pl.next_power_of_2(width))


def width_parts(wide: int) -> tuple[tuple[int, int], ...]:
    """A padded width as the parts the kernels load and multiply, (start, size) each, sizes
    powers of two (Triton's arrays are), largest first: 256 is one, 208 is 128 + 64 + 16."""
    sizes = [1 << bit for bit in reversed(range(wide.bit_length())) if wide >> bit & 1]
    starts = (0, *itertools.accumulate(sizes[:-1]))
    return tuple(zip(starts, sizes, strict=True))


def _whole(shape):
    return pl.BlockSpec(shape, lambda i: (0,) * len(shape))


def _rows(tile, width=None):
    if width is None:
        return pl.BlockSpec((tile,), lambda i: (i,))
    return pl.BlockSpec((tile, width), lambda i: (i, 0))


def operands(h_BxTxD, w_VxD, targets_BxT, tiling: Tiling):
    """h as (N', D') and w as (V', D') in h's dtype, zero-padded to whole tiles of every kernel
    and the padded width (``padded_width``, split as the tiling says); targets as (N',) int32."""
    count, width = targets_BxT.size, h_BxTxD.shape[-1]
    wide = padded_width(width, tiling.split_width)
    h_NxD = h_BxTxD.reshape(count, width)
    h_NxD = jnp.pad(h_NxD, ((0, -count % tiling.token_multiple), (0, wide - width)))
    vocab = w_VxD.shape[0]
    w_VxD = w_VxD.astype(h_BxTxD.dtype)
    w_VxD = jnp.pad(w_VxD, ((0, -vocab % tiling.vocab_multiple), (0, wide - width)))
    targets_N = jnp.pad(targets_BxT.reshape(count).astype(jnp.int32), (0, h_NxD.shape[0] - count))
    return h_NxD, w_VxD, targets_N


def default_tiling(width: int, dtype) -> Tiling:
    """The tiling on a GPU for d = ``width`` in ``dtype``: one tile of tokens and one of the
    vocabulary, each the largest power of two up to MAX_TILE whose tile of an operand, at the
    padded width, fits in TILE_BYTES (and at least MIN_TILE); 8 warps, 2 stages."""
    row_bytes = padded_width(width) * jnp.dtype(dtype).itemsize
    tile = max(MIN_TILE, min(MAX_TILE, pl.next_power_of_2(TILE_BYTES // row_bytes + 1) // 2))
    return Tiling.shared(tile, tile)


def cross_entropy(
    h_BxTxD,
    w_VxD,
    targets_BxT,
    *,
    tiling: Tiling | None = None,
    dh_from_forward: bool = False,
    interpret: bool = False,
):
    """``cross_entropy.cross_entropy`` by the fused kernels, exact gradients for any cotangent;
    ``tiling``: the kernels' tiles and launches (None: ``default_tiling``); ``dh_from_forward``:
    dh from the forward's expected embeddings, without the dh kernel (``tiling.dh`` then
    launches nothing, though it is checked and counts in the padding)."""
    check_operands(h_BxTxD, w_VxD, targets_BxT)
    if tiling is None:
        tiling = default_tiling(h_BxTxD.shape[-1], h_BxTxD.dtype)
    tiling.check(interpret)
    return _fused(h_BxTxD, w_VxD, targets_BxT, tiling, bool(dh_from_forward), interpret)


def forward_call(
    h_NxD,
    w_pad,
    targets_N,
    vocab: int,
    launch: Launch,
    interpret: bool = False,
    expected: bool = False,
):
    """The forward kernel on padded operands (``operands``): each token's log-sum-exp over the
    ``vocab`` real columns and its target's logit, (N',) float32 each; ``expected``: also its
    expected embedding under its softmax, (N', D') float32."""
    n, wide = h_NxD.shape
    per_token = jax.ShapeDtypeStruct((n,), jnp.float32)
    out_specs, out_shape = [_rows(launch.rows)] * 2, [per_token] * 2
    if expected:
        out_specs.append(_rows(launch.rows, wide))
        out_shape.append(jax.ShapeDtypeStruct((n, wide), jnp.float32))
    return _pallas_call(
        functools.partial(_forward_kernel, vocab=vocab, tile=launch.step, parts=width_parts(wide)),
        launch,
        grid=(n // launch.rows,),
        in_specs=[_rows(launch.rows, wide), _whole(w_pad.shape), _rows(launch.rows)],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
    )(h_NxD, w_pad, targets_N)


def dh_call(h_NxD, w_pad, targets_N, lse_N, g_N, vocab: int, launch, interpret: bool = False):
    """The dh kernel on padded operands: ``sum_v g (softmax - onehot) w``, (N', D') in h's
    dtype."""
    n, wide = h_NxD.shape
    return _pallas_call(
        functools.partial(_dh_kernel, vocab=vocab, tile=launch.step, parts=width_parts(wide)),
        launch,
        grid=(n // launch.rows,),
        in_specs=[_rows(launch.rows, wide), _whole(w_pad.shape), *[_rows(launch.rows)] * 3],
        out_specs=_rows(launch.rows, wide),
        out_shape=jax.ShapeDtypeStruct(h_NxD.shape, h_NxD.dtype),
        interpret=interpret,
    )(h_NxD, w_pad, targets_N, lse_N, g_N)


def dw_call(h_NxD, w_pad, targets_N, lse_N, g_N, vocab: int, launch, interpret: bool = False):
    """The dw kernel on padded operands: ``sum_t g (softmax - onehot)ᵀ h``, (V', D') float32."""
    n, wide = h_NxD.shape
    return _pallas_call(
        functools.partial(_dw_kernel, vocab=vocab, tile=launch.step, parts=width_parts(wide)),
        launch,
        grid=(w_pad.shape[0] // launch.rows,),
        in_specs=[_whole(h_NxD.shape), _rows(launch.rows, wide), *[_whole((n,))] * 3],
        out_specs=_rows(launch.rows, wide),
        out_shape=jax.ShapeDtypeStruct(w_pad.shape, jnp.float32),
        interpret=interpret,
    )(h_NxD, w_pad, targets_N, lse_N, g_N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(h_BxTxD, w_VxD, targets_BxT, tiling, dh_from_forward, interpret):
    # The losses alone (no gradient: an evaluation): the expected embeddings would go unused.
    return _fused_fwd(h_BxTxD, w_VxD, targets_BxT, tiling, False, interpret)[0]


def _fused_fwd(h_BxTxD, w_VxD, targets_BxT, tiling, dh_from_forward, interpret):
    count = targets_BxT.size
    if count == 0:
        empty = (h_BxTxD, w_VxD, targets_BxT, None, None)
        return jnp.zeros(targets_BxT.shape, jnp.float32), empty
    h_NxD, w_pad, targets_N = operands(h_BxTxD, w_VxD, targets_BxT, tiling)
    vocab = w_VxD.shape[0]
    lse_N, target_N, *expected = forward_call(
        h_NxD, w_pad, targets_N, vocab, tiling.forward, interpret, expected=dh_from_forward
    )
    loss_BxT = (lse_N - target_N)[:count].reshape(targets_BxT.shape)
    expected_NxD = expected[0][:count] if expected else None
    return loss_BxT, (h_BxTxD, w_VxD, targets_BxT, lse_N, expected_NxD)


def _fused_bwd(tiling, dh_from_forward, interpret, residuals, g_BxT):
    h_BxTxD, w_VxD, targets_BxT, lse_N, expected_NxD = residuals
    if lse_N is None:
        return jnp.zeros_like(h_BxTxD), jnp.zeros_like(w_VxD), None
    count, (vocab, width) = targets_BxT.size, w_VxD.shape
    h_NxD, w_pad, targets_N = operands(h_BxTxD, w_VxD, targets_BxT, tiling)
    # The padded tokens get a zero cotangent: they add nothing to dw.
    g_N = jnp.pad(g_BxT.reshape(count).astype(jnp.float32), (0, lse_N.shape[0] - count))
    args = (h_NxD, w_pad, targets_N, lse_N, g_N, vocab)
    if dh_from_forward:
        dh_NxD = _dh_from_expected(expected_NxD, w_pad, targets_N[:count], g_N[:count])
    else:
        dh_NxD = dh_call(*args, tiling.dh, interpret)[:count]
    dw_VxD = dw_call(*args, tiling.dw, interpret)
    dh_BxTxD = dh_NxD[:, :width].astype(h_BxTxD.dtype).reshape(h_BxTxD.shape)
    return dh_BxTxD, dw_VxD[:vocab, :width].astype(w_VxD.dtype), None


def _dh_from_expected(expected_NxD, w_pad, targets_N, g_N):
    """``dh = g (E_p[w] - w_target)``: the dh kernel's ``sum_v g (p_v - onehot_v) w_v`` with
    its sum over the vocabulary done by the forward, float32 (w in h's dtype, as the kernels
    read it; a target outside the vocabulary picks a zero row, as in the kernels)."""
    real = (targets_N >= 0) & (targets_N < w_pad.shape[0])
    w_target_NxD = jnp.take(w_pad, jnp.clip(targets_N, 0, w_pad.shape[0] - 1), axis=0)
    w_target_NxD = jnp.where(real[:, None], w_target_NxD.astype(jnp.float32), 0.0)
    return g_N[:, None] * (expected_NxD - w_target_NxD)


_fused.defvjp(_fused_fwd, _fused_bwd)
