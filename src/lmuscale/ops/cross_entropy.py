"""The next-token cross-entropy without the (batch, n, vocab) logits: XLA's chunked form, whose
forward pass computes the gradients too, and the dispatch to the fused kernels
(``cross_entropy_pallas``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lmuscale.ops import LossKernels, cross_entropy_flash, cross_entropy_pallas

# Tokens per chunk: 1024 x 50257 float32 logits are 206 MB, alive one at a time.
LOSS_CHUNK = 1024


def cross_entropy(
    h_BxTxD,
    w_VxD,
    targets_BxT,
    chunk: int = LOSS_CHUNK,
    impl: str = "xla",
    kernels: LossKernels | None = None,
    mesh=None,
):
    """Next-token cross-entropy in nats at every position, without the full logits: float32
    ``loss_BxT = logsumexp(logits) - logits[target]``, the logits ``h wᵀ`` (w tied).

    ``impl`` (``Impls.loss``): "pallas", the fused kernels run as ``kernels`` (a
    ``LossKernels``; None: the defaults) says; "flash", the flash kernels, on each device's
    share of the batch where ``mesh`` has several devices; or "xla", where one pass over chunks of
    ``chunk`` tokens computes each chunk's logits (in h's dtype, accumulated in float32), the
    loss and already the gradients in h and w: the backward pass only scales them, and stores
    or recomputes no logits. That needs the same cotangent at every position, as for the mean
    or sum; for any other, the gradient in w is NaN, never silently wrong (the one in h stays
    exact)."""
    kernels = kernels or LossKernels()
    if impl == "pallas":
        options = vars(kernels)  # tiling, dh_from_forward, interpret
        return cross_entropy_pallas.cross_entropy(h_BxTxD, w_VxD, targets_BxT, **options)
    if impl == "flash":
        axes = mesh.axis_names if mesh is not None and mesh.size > 1 else ()
        mode = "interpret" if kernels.interpret else "gpu"
        return cross_entropy_flash.cross_entropy(
            h_BxTxD, w_VxD, targets_BxT, mode=mode, mesh=mesh, batch_axes=axes
        )
    if impl != "xla":
        allowed = '"xla", "pallas" or "flash"'
        raise ValueError(f"the cross-entropy's impl must be {allowed}, got {impl!r}")
    return _cross_entropy(h_BxTxD, w_VxD, targets_BxT, chunk)


def _chunked(h_BxTxD, w_VxD, targets_BxT, chunk: int, gradients: bool):
    """``loss_BxT`` by one ``lax.scan`` over chunks, and with ``gradients`` the gradients of
    its sum, ``dh_BxTxD`` (h's dtype) and ``dw_VxD`` (float32)."""
    batch, length, width = h_BxTxD.shape
    count = batch * length
    chunk = max(1, min(chunk, count))
    pad = -count % chunk  # the padding has h = 0, whose gradients are 0
    h_JxcxD = jnp.pad(h_BxTxD.reshape(count, width), ((0, pad), (0, 0))).reshape(-1, chunk, width)
    targets_Jxc = jnp.pad(targets_BxT.reshape(count), (0, pad)).reshape(-1, chunk)
    w_VxD_h = w_VxD.astype(h_BxTxD.dtype)
    vocab_1xV = lax.broadcasted_iota(jnp.int32, (1, w_VxD.shape[0]), 1)

    def one_chunk(dw_VxD, chunk_inputs):
        h_cxD, targets_c = chunk_inputs
        logits_cxV = jnp.einsum("cd,vd->cv", h_cxD, w_VxD_h, preferred_element_type=jnp.float32)
        lse_c = jax.nn.logsumexp(logits_cxV, axis=-1)
        is_target_cxV = targets_c[:, None] == vocab_1xV
        loss_c = lse_c - jnp.sum(jnp.where(is_target_cxV, logits_cxV, 0.0), axis=-1)
        if not gradients:
            return dw_VxD, (loss_c, None)
        # d loss / d logits: the softmax minus the one-hot target.
        dlogits_cxV = (jnp.exp(logits_cxV - lse_c[:, None]) - is_target_cxV).astype(h_cxD.dtype)
        dh_cxD = jnp.einsum("cv,vd->cd", dlogits_cxV, w_VxD_h, preferred_element_type=jnp.float32)
        dw_VxD += jnp.einsum("cv,cd->vd", dlogits_cxV, h_cxD, preferred_element_type=jnp.float32)
        return dw_VxD, (loss_c, dh_cxD.astype(h_cxD.dtype))

    dw_VxD = jnp.zeros(w_VxD.shape, jnp.float32) if gradients else None
    dw_VxD, (loss_Jxc, dh_JxcxD) = lax.scan(one_chunk, dw_VxD, (h_JxcxD, targets_Jxc))
    loss_BxT = loss_Jxc.reshape(-1)[:count].reshape(batch, length)
    if not gradients:
        return loss_BxT
    dh_BxTxD = dh_JxcxD.reshape(-1, width)[:count].reshape(batch, length, width)
    return loss_BxT, dh_BxTxD, dw_VxD


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(h_BxTxD, w_VxD, targets_BxT, chunk):
    return _chunked(h_BxTxD, w_VxD, targets_BxT, chunk, gradients=False)


def _cross_entropy_fwd(h_BxTxD, w_VxD, targets_BxT, chunk):
    loss_BxT, dh_BxTxD, dw_VxD = _chunked(h_BxTxD, w_VxD, targets_BxT, chunk, gradients=True)
    w_dtype = jnp.zeros((0,), w_VxD.dtype)  # residuals must be arrays
    return loss_BxT, (dh_BxTxD, dw_VxD, w_dtype)


def _cross_entropy_bwd(chunk, residuals, g_BxT):
    """Scale the gradients of the sum by the cotangent ``g_BxT``."""
    del chunk
    dh_BxTxD, dw_VxD, w_dtype = residuals
    dh = (dh_BxTxD.astype(jnp.float32) * g_BxT[..., None]).astype(dh_BxTxD.dtype)
    if g_BxT.size == 0:
        return dh, jnp.zeros(dw_VxD.shape, w_dtype.dtype), None
    g = g_BxT.reshape(-1)[0]
    dw = jnp.where(jnp.all(g_BxT == g), g * dw_VxD, jnp.nan)  # see cross_entropy
    return dh, dw.astype(w_dtype.dtype), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
