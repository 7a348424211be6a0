"""The cross-entropy as flash attention over the vocabulary: Mosaic GPU kernels for Hopper.

With q = h and k = v = w, attention's output ``softmax(h wᵀ) w`` is each token's expected
embedding ``E_p[w]``, and its log-sum-exp is the loss's: ``loss = lse - h·w_target`` (the target
logit by a gather-dot) and ``dh = g (E_p[w] - w_target)`` need no kernel of their own. Two
kernels, four logits-sized products, no atomics:

- the forward, per 2 x ``block_q`` tokens (two compute warpgroups; a third loads the
  vocabulary's tiles by TMA into one shared buffer that serves as both k and v): an online
  log-sum-exp in base 2 (log2 e folded into one multiply-add), ``E_p[w]`` accumulated by the
  tensor cores; it writes each token's log-sum-exp and ``E_p[w] - w_target`` in h's dtype;
- dw, per 2 x ``block_v`` rows of the vocabulary, looping over tiles of tokens (flash
  attention's dK kernel): ``Sᵀ = w hᵀ``, ``dSᵀ = g exp(Sᵀ - lse)``, ``dw += dSᵀ h``; the one-hot
  part, ``-g h`` on each target's row, is a scatter-add outside.

The width is padded to a multiple of 16 (a product's K step; 204 as 208, whose rows take a
32-byte swizzle, not 256 with a 128-byte one) with one extra column that
replaces a mask on every logit: h's is 1, w's is 0 on real rows and half the dtype's most
negative number (``PAD_LOGIT``) on the rows that pad the vocabulary to whole tiles. Tokens
are padded with h = 0 and a zero cotangent.

``mode``: "gpu" compiles the kernels for an NVIDIA GPU (Hopper: they use its ``wgmma``
products and TMA copies); "interpret" runs them on a CPU in Pallas's Mosaic GPU interpreter
(the tests): the same kernels, copies, barriers and pipeline, but for two things that
interpreter lacks in jax 0.10.2, a product with a transposed operand and accumulating into a
product's registers, so there each tensor-core product is a ``dot_general`` on the same
shared-memory tiles; "blocked" runs the same tiles and steps as plain JAX loops, on any
backend and any number of devices (that interpreter cannot run several devices' kernels at
once).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lmuscale.ops import check_operands

LOG2E = math.log2(math.e)
# A padded row's logit, as a fraction of the dtype's largest number: finite (0 times it is 0,
# not inf's NaN), and times log2 e still finite in float32; its exp is 0.
PAD_LOGIT = -0.5
COMPUTE_WGS = 2  # compute warpgroups a program; one more loads
ROW = 16  # the width is padded to a multiple of this: a product's K step, 32 bytes of bf16
MEMORY_REGISTERS = 40  # the loading warpgroup's registers, as JAX's own Hopper kernels give it
MODES = ("gpu", "interpret", "blocked")


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The kernels' tiles: the forward's ``block_q`` tokens per compute warpgroup and
    ``block_kv`` vocabulary rows a step; dw's ``block_v`` rows per compute warpgroup and
    ``block_t`` tokens a step; ``stages``, the tiles in flight. Multiples of 64 (the smallest
    Hopper product is 64 rows; the vocabulary product wants N >= 64)."""

    block_q: int = 64
    block_kv: int = 64
    block_v: int = 64
    block_t: int = 64
    stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_kv", "block_v", "block_t"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 64 or value % 64:
                raise ValueError(f"blocks.{name} must be a multiple of 64, got {value!r}")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"blocks.stages must be at least 2, got {self.stages!r}")

    @property
    def token_multiple(self) -> int:
        return math.lcm(COMPUTE_WGS * self.block_q, self.block_t)

    @property
    def vocab_multiple(self) -> int:
        return math.lcm(self.block_kv, COMPUTE_WGS * self.block_v)


def padded_width(width: int) -> int:
    """d and the padding column, rounded up to a multiple of ROW: 204 -> 208, 48 -> 64."""
    return -(-(width + 1) // ROW) * ROW


def _tiles(dtype, wide: int):
    """Shared-memory tiles of rows of ``wide`` elements, as the tensor cores read them: swizzled
    by the largest of 128, 64 or 32 bytes that divides a row."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = next(size for size in (128, 64, 32) if wide * itemsize % size == 0)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _product(a, b_ref, *, transpose_b: bool, interpret, acc=None):
    """``a @ b`` (``a @ bᵀ`` with ``transpose_b``) in float32, plus ``acc`` if given: ``a`` is a
    shared-memory ref or an array in registers, ``b_ref`` a shared-memory tile."""
    if interpret:
        a = a if isinstance(a, jax.Array) else a[...]
        dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
        out = lax.dot_general(a, b_ref[...], dims, preferred_element_type=jnp.float32)
        return out if acc is None else acc + out
    b_ref = plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, a, b_ref)
        return acc_ref[...]

    if acc is None:
        return pl.run_scoped(accumulate, plgpu.ACC((a.shape[0], b_ref.shape[1]), jnp.float32))
    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b_ref))(plgpu.ACC.init(acc))


def _row_vector(ref, interpret):
    """A step's per-token floats, laid out to broadcast along a product's rows."""
    return ref[...] if interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0))


def forward_call(h_NxD, w_VxD, w_target_NxD, blocks: Blocks, interpret=None):
    """The forward kernel on padded operands: (``E_p[w] - w_target``, (N', D') in h's dtype;
    ``lse``, (N',) float32, natural log)."""
    (n, wide), vocab, dtype = h_NxD.shape, w_VxD.shape[0], h_NxD.dtype
    block_q, block_kv, tiles = blocks.block_q, blocks.block_kv, _tiles(dtype, wide)

    def kernel(h_ref, w_ref, w_target_ref, out_ref, lse_ref, h_smem2, lse_smem2, loaded):
        wg = lax.axis_index("wg")
        first = lax.axis_index("tokens") * (COMPUTE_WGS * block_q) + wg * block_q

        def compute(pipeline):
            h_smem, lse_smem, barrier = h_smem2.at[wg], lse_smem2.at[wg], loaded.at[wg]
            plgpu.copy_gmem_to_smem(h_ref.at[pl.ds(first, block_q)], h_smem, barrier)
            plgpu.barrier_wait(barrier)
            per_token = plgpu.Layout.WGMMA.reduce(1)
            start = (
                plgpu.layout_cast(jnp.zeros((block_q, wide), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), per_token),
                plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), per_token),
            )
            expected, max2, total = pipeline(start)
            # h is read no more: its buffer takes the target rows, then the output.
            plgpu.copy_gmem_to_smem(w_target_ref.at[pl.ds(first, block_q)], h_smem, barrier)
            plgpu.barrier_wait(barrier)
            expected = expected / lax.broadcast_in_dim(total, expected.shape, [0])
            h_smem[...] = (expected - h_smem[...].astype(jnp.float32)).astype(dtype)
            lse_smem[...] = (max2 + jnp.log2(total)) / LOG2E
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(h_smem, out_ref.at[pl.ds(first, block_q)])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[pl.ds(first, block_q)])
            plgpu.wait_smem_to_gmem(0)

        def step(_, w_smem, carry):
            expected, max2, total = carry
            scores = _product(h_smem2.at[wg], w_smem, transpose_b=True, interpret=interpret)
            new_max2 = jnp.maximum(max2, scores.max(axis=1) * LOG2E)
            rescale = jnp.exp2(max2 - new_max2)
            p = jnp.exp2(scores * LOG2E - lax.broadcast_in_dim(new_max2, scores.shape, [0]))
            total = total * rescale + p.sum(axis=1)
            expected = expected * lax.broadcast_in_dim(rescale, expected.shape, [0])
            expected = _product(
                p.astype(dtype), w_smem, transpose_b=False, interpret=interpret, acc=expected
            )
            return expected, new_max2, total

        plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(vocab // block_kv,),
            memory_registers=MEMORY_REGISTERS,
            max_concurrent_steps=blocks.stages,
            num_compute_wgs=COMPUTE_WGS,
            wg_axis="wg",
            compute_context=compute,
            in_specs=[plgpu.BlockSpec((block_kv, wide), lambda i: (i, 0), transforms=tiles)],
        )(w_ref)

    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((n, wide), dtype),
            jax.ShapeDtypeStruct((n,), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM((COMPUTE_WGS, block_q, wide), dtype, transforms=tiles),
            plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
        ],
        grid=(n // (COMPUTE_WGS * block_q),),
        grid_names=("tokens",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(h_NxD, w_VxD, w_target_NxD)


def dw_call(w_VxD, h_NxD, lse2_N, g_N, blocks: Blocks, interpret=None):
    """The dw kernel on padded operands: ``sum_t g_t softmax_t[v] h_t``, (V', D') float32
    (``lse2_N``: the log-sum-exp in base 2)."""
    (vocab, wide), n, dtype = w_VxD.shape, h_NxD.shape[0], h_NxD.dtype
    block_v, block_t, tiles = blocks.block_v, blocks.block_t, _tiles(dtype, wide)
    columns = next(size for size in (64, 32, 16) if wide % size == 0)
    out_tiles = _tiles(jnp.float32, columns)

    def kernel(w_ref, h_ref, lse2_ref, g_ref, dw_ref, w_smem2, out_smem2, loaded):
        wg = lax.axis_index("wg")
        first = lax.axis_index("vocab") * (COMPUTE_WGS * block_v) + wg * block_v

        def compute(pipeline):
            w_smem, out_smem, barrier = w_smem2.at[wg], out_smem2.at[wg], loaded.at[wg]
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(first, block_v)], w_smem, barrier)
            plgpu.barrier_wait(barrier)
            dw = pipeline(
                plgpu.layout_cast(jnp.zeros((block_v, wide), jnp.float32), plgpu.Layout.WGMMA)
            )
            # Written ``columns`` at a time, through one small float32 buffer.
            for start in range(0, wide, columns):
                out_smem[...] = dw[:, start : start + columns]
                plgpu.commit_smem()
                target = dw_ref.at[pl.ds(first, block_v), pl.ds(start, columns)]
                plgpu.copy_smem_to_gmem(out_smem, target)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.wait_smem_to_gmem(0)

        def step(_, h_smem, lse2_smem, g_smem, dw):
            w_smem = w_smem2.at[wg]
            scores_t = _product(w_smem, h_smem, transpose_b=True, interpret=interpret)
            lse2 = lax.broadcast_in_dim(_row_vector(lse2_smem, interpret), scores_t.shape, [1])
            g = lax.broadcast_in_dim(_row_vector(g_smem, interpret), scores_t.shape, [1])
            dscores_t = (jnp.exp2(scores_t * LOG2E - lse2) * g).astype(dtype)
            return _product(dscores_t, h_smem, transpose_b=False, interpret=interpret, acc=dw)

        per_token = plgpu.BlockSpec((block_t,), lambda i: (i,))
        plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(n // block_t,),
            memory_registers=MEMORY_REGISTERS,
            max_concurrent_steps=blocks.stages,
            num_compute_wgs=COMPUTE_WGS,
            wg_axis="wg",
            compute_context=compute,
            in_specs=[
                plgpu.BlockSpec((block_t, wide), lambda i: (i, 0), transforms=tiles),
                per_token,
                per_token,
            ],
        )(h_ref, lse2_ref, g_ref)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((vocab, wide), jnp.float32),
        scratch_types=[
            plgpu.SMEM((COMPUTE_WGS, block_v, wide), dtype, transforms=tiles),
            plgpu.SMEM((COMPUTE_WGS, block_v, columns), jnp.float32, transforms=out_tiles),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
        ],
        grid=(vocab // (COMPUTE_WGS * block_v),),
        grid_names=("vocab",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(w_VxD, h_NxD, lse2_N, g_N)


def _interpreter(mode: str):
    """In the "interpret" mode Pallas's Mosaic GPU interpreter's parameters, else None. That
    interpreter (jax 0.10.2) has no CPU rule for ``layout_cast``, a layout hint that leaves the
    values as they are: it gets the identity."""
    if mode != "interpret":
        return None
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    return InterpretGPUParams()


def _blocked_forward(h_NxD, w_VxD, w_target_NxD, blocks: Blocks, interpret=None):
    """``forward_call``'s steps as plain JAX: the same tiles of the vocabulary, the same
    base-2 online log-sum-exp and products (all of the tokens at once)."""
    del interpret
    dtype, wide = h_NxD.dtype, h_NxD.shape[1]

    def step(carry, w_kxD):
        expected, max2, total = carry
        scores = jnp.einsum("nd,kd->nk", h_NxD, w_kxD, preferred_element_type=jnp.float32)
        new_max2 = jnp.maximum(max2, scores.max(axis=1) * LOG2E)
        rescale = jnp.exp2(max2 - new_max2)
        p = jnp.exp2(scores * LOG2E - new_max2[:, None])
        total = total * rescale + p.sum(axis=1)
        mixed = jnp.einsum("nk,kd->nd", p.astype(dtype), w_kxD, preferred_element_type=jnp.float32)
        return (expected * rescale[:, None] + mixed, new_max2, total), None

    # Carries made like h, so that under shard_map they vary over the devices as h does.
    zeros_N = jnp.zeros_like(h_NxD[:, 0], jnp.float32)
    start = (jnp.zeros_like(h_NxD, jnp.float32), zeros_N - jnp.inf, zeros_N)
    tiles = w_VxD.reshape(-1, blocks.block_kv, wide)
    (expected, max2, total), _ = lax.scan(step, start, tiles)
    diff = expected / total[:, None] - w_target_NxD.astype(jnp.float32)
    return diff.astype(dtype), (max2 + jnp.log2(total)) / LOG2E


def _blocked_dw(w_VxD, h_NxD, lse2_N, g_N, blocks: Blocks, interpret=None):
    """``dw_call``'s steps as plain JAX: the same tiles of tokens, the same products."""
    del interpret
    dtype, wide = h_NxD.dtype, h_NxD.shape[1]

    def step(dw, tile):
        h_txD, lse2_t, g_t = tile
        scores_t = jnp.einsum("vd,td->vt", w_VxD, h_txD, preferred_element_type=jnp.float32)
        dscores_t = (jnp.exp2(scores_t * LOG2E - lse2_t[None]) * g_t[None]).astype(dtype)
        return dw + jnp.einsum(
            "vt,td->vd", dscores_t, h_txD, preferred_element_type=jnp.float32
        ), None

    tiles = (
        h_NxD.reshape(-1, blocks.block_t, wide),
        lse2_N.reshape(-1, blocks.block_t),
        g_N.reshape(-1, blocks.block_t),
    )
    return lax.scan(step, jnp.zeros_like(w_VxD, jnp.float32), tiles)[0]


def operands(h_BxTxD, w_VxD, targets_BxT, blocks: Blocks):
    """``(h (N', D'), w (V', D'), w_target (N', D'))`` in h's dtype, padded as the module says;
    a target outside the vocabulary takes a zero row (its target logit is 0, as in XLA's
    path)."""
    count, width = targets_BxT.size, h_BxTxD.shape[-1]
    (vocab, _), wide, dtype = w_VxD.shape, padded_width(width), h_BxTxD.dtype
    ones_N = jnp.ones((count, 1), dtype)
    h_NxD = jnp.concatenate([h_BxTxD.reshape(count, width), ones_N], axis=1)
    h_NxD = jnp.pad(h_NxD, ((0, -count % blocks.token_multiple), (0, wide - width - 1)))
    rows = vocab + -vocab % blocks.vocab_multiple
    pad_logit = PAD_LOGIT * float(jnp.finfo(dtype).max)
    pad_V = jnp.where(jnp.arange(rows) < vocab, 0.0, pad_logit).astype(dtype)[:, None]
    w_VxD = jnp.pad(w_VxD.astype(dtype), ((0, rows - vocab), (0, 0)))
    w_VxD = jnp.pad(jnp.concatenate([w_VxD, pad_V], axis=1), ((0, 0), (0, wide - width - 1)))
    targets_N = targets_BxT.reshape(count).astype(jnp.int32)
    real_N = (targets_N >= 0) & (targets_N < vocab)
    w_target_NxD = jnp.where(real_N[:, None], w_VxD[jnp.where(real_N, targets_N, 0)], 0)
    w_target_NxD = jnp.pad(w_target_NxD, ((0, h_NxD.shape[0] - count), (0, 0)))
    return h_NxD, w_VxD, w_target_NxD


def cross_entropy(
    h_BxTxD,
    w_VxD,
    targets_BxT,
    *,
    blocks: Blocks | None = None,
    mode: str = "gpu",
    mesh: Mesh | None = None,
    batch_axes: Sequence[str] = (),
):
    """``cross_entropy.cross_entropy`` by the flash kernels: float32 ``loss_BxT``, exact
    gradients for any cotangent. On a GPU the operands are bfloat16 or float16 (the tensor cores
    would take float32 as TF32); the other ``mode``s run any float dtype. With a ``mesh``, the
    kernels run on each device's share of the batch (``batch_axes`` of the mesh split h and the
    targets' first axis), w replicated; w's gradient is summed over those axes."""
    check_operands(h_BxTxD, w_VxD, targets_BxT)
    if mode not in MODES:
        raise ValueError(f"the flash kernels' mode must be one of {MODES}, got {mode!r}")
    half = jnp.dtype(h_BxTxD.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if mode == "gpu" and not half:
        raise ValueError(f"the flash kernels take bfloat16 or float16 h, got {h_BxTxD.dtype}")
    blocks = blocks or Blocks()

    def loss(h_BxTxD, w_VxD, targets_BxT):
        return _flash(h_BxTxD, w_VxD, targets_BxT, blocks, mode)

    if mesh is None or not batch_axes:
        return loss(h_BxTxD, w_VxD, targets_BxT)
    axes = tuple(batch_axes)

    def per_device(h_BxTxD, w_VxD, targets_BxT):
        # w is the same on every device; typed as varying, its gradients are summed over axes.
        return loss(h_BxTxD, lax.pcast(w_VxD, axes, to="varying"), targets_BxT)

    batch = P(axes)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(batch, P(), batch), out_specs=batch)(
        h_BxTxD, w_VxD, targets_BxT
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(h_BxTxD, w_VxD, targets_BxT, blocks, mode):
    return _flash_fwd(h_BxTxD, w_VxD, targets_BxT, blocks, mode)[0]


def _flash_fwd(h_BxTxD, w_VxD, targets_BxT, blocks, mode):
    count, width = targets_BxT.size, h_BxTxD.shape[-1]
    if count == 0:
        return jnp.zeros(targets_BxT.shape, jnp.float32), (h_BxTxD, w_VxD, targets_BxT, None)
    h_NxD, w_pad, w_target_NxD = operands(h_BxTxD, w_VxD, targets_BxT, blocks)
    forward = _blocked_forward if mode == "blocked" else forward_call
    diff_NxD, lse_N = forward(h_NxD, w_pad, w_target_NxD, blocks, _interpreter(mode))
    # The target's logit by a gather-dot, from the same rounded operands as the kernel's.
    target_N = jnp.einsum(
        "nd,nd->n",
        h_NxD[:count, :width],
        w_target_NxD[:count, :width],
        preferred_element_type=jnp.float32,
    )
    loss_BxT = (lse_N[:count] - target_N).reshape(targets_BxT.shape)
    return loss_BxT, (h_BxTxD, w_VxD, targets_BxT, (h_NxD, w_pad, lse_N, diff_NxD[:count]))


def _flash_bwd(blocks, mode, residuals, g_BxT):
    h_BxTxD, w_VxD, targets_BxT, kept = residuals
    if kept is None:
        return jnp.zeros_like(h_BxTxD), jnp.zeros_like(w_VxD), None
    h_NxD, w_pad, lse_N, diff_NxD = kept
    count, (vocab, width) = targets_BxT.size, w_VxD.shape
    g_N = g_BxT.reshape(count).astype(jnp.float32)
    dh_NxD = g_N[:, None] * diff_NxD[:, :width].astype(jnp.float32)
    g_pad = jnp.pad(g_N, (0, h_NxD.shape[0] - count))  # padded tokens add nothing to dw
    dw = _blocked_dw if mode == "blocked" else dw_call
    dw_VxD = dw(w_pad, h_NxD, lse_N * LOG2E, g_pad, blocks, _interpreter(mode))
    # The one-hot part: -g h on each target's row; a target outside the vocabulary has none.
    targets_N = targets_BxT.reshape(count)
    rows_N = jnp.where((targets_N >= 0) & (targets_N < vocab), targets_N, vocab)
    g_h_NxD = g_N[:, None] * h_NxD[:count, :width].astype(jnp.float32)
    dw_VxD = dw_VxD[:vocab, :width].at[rows_N].add(-g_h_NxD, mode="drop")
    dh_BxTxD = dh_NxD.astype(h_BxTxD.dtype).reshape(h_BxTxD.shape)
    return dh_BxTxD, dw_VxD.astype(w_VxD.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)
