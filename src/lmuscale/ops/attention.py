"""Causal self-attention over the whole sequence (XLA's, or cuDNN's flash attention:
``Impls.attention``) and one position against a key/value cache."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


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
