"""The fused LMU memory kernels (memory_kernel), run in Pallas's interpret mode on CPU at small
shapes, against a float64 reference that shares nothing with them (the recurrence, L m, eqs
8-10 as printed) and against the XLA chunked path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from test_layers import reference_attention

from lmuscale import layers, lmu, memory_kernel

THETA = 9.0


def inputs(batch, n, channels, order, reduced, dtype, seed=0):
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((batch, n, channels))
    l_3xKxQ = rng.standard_normal((3, reduced, order)) / np.sqrt(order)
    bias = 0.3 * rng.standard_normal((3, reduced))
    p = rng.standard_normal(reduced)
    return [jnp.asarray(a, dtype) for a in (u, l_3xKxQ, bias, p)]


def through_kernel(u, l_3xKxQ, bias, p, *, chunk, precision="exact", dtype=None):
    """The layer's chunked path with the fused kernels: ``m_BxTxD``."""
    order = l_3xKxQ.shape[-1]
    operand = jnp.bfloat16 if precision == "fast" else None
    x, _ = lmu.chunk_operands(u, order, THETA, chunk=chunk, dtype=operand)
    c = x.shape[-1] - order
    w = jnp.stack([lmu.chunk_weights(order, THETA, c, l_KxQ, dtype=u.dtype) for l_KxQ in l_3xKxQ])
    dtype = u.dtype if dtype is None else dtype
    m = memory_kernel.memory_attention(
        x, w, bias, p, precision=precision, dtype=dtype, interpret=True
    )
    return m.reshape(m.shape[0], -1, m.shape[-1])[:, : u.shape[1]]


def through_xla(u, l_3xKxQ, bias, p, *, chunk, precision="exact", dtype=None):
    """Today's XLA chunked path (``layers.ImplicitSelfAttention._attend``): ``m_BxTxD``."""
    order = l_3xKxQ.shape[-1]
    operand = jnp.bfloat16 if precision == "fast" else None
    x, _ = lmu.chunk_operands(u, order, THETA, chunk=chunk, dtype=operand)
    c = x.shape[-1] - order
    dtype = u.dtype if dtype is None else dtype
    qkv = [
        lmu.chunk_product(x, lmu.chunk_weights(order, THETA, c, l_KxQ), precision, out_dtype=dtype)
        for l_KxQ in l_3xKxQ
    ]
    m = layers.implicit_attention(*qkv, bias, p, dtype)
    return lmu.sequence_from_chunks(m, u.shape[1])


def through_recurrence(u, l_3xKxQ, bias, p):
    """The reference: the memory by its recurrence, ``L_i m_t``, eqs 8-10 as printed."""
    abar, bbar = lmu.discretize(l_3xKxQ.shape[-1], THETA)
    m_BxTxCxQ = lmu.memory_scan(u, abar, bbar)
    qkv = [jnp.einsum("btcq,kq->bckt", m_BxTxCxQ, l_KxQ) for l_KxQ in l_3xKxQ]
    return jnp.swapaxes(reference_attention(*qkv, bias, p), 1, 2)


def value_and_grads(path, args, cotangent, **options):
    def loss(*args):
        return jnp.sum(path(*args, **options).astype(cotangent.dtype) * cotangent)

    return jax.value_and_grad(loss, argnums=range(4))(*args)


# (batch, n, channels, order q, q', chunk): n is never a multiple of the chunk; 5 steps in a
# chunk of 8 give one chunk of 5 (c < the kernels' 16-wide tiles).
SHAPES = [(2, 20, 3, 6, 4, 8), (1, 37, 5, 40, 3, 16), (2, 5, 2, 8, 2, 8)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_and_gradients_equal_the_float64_recurrence(shape):
    batch, n, channels, order, reduced, chunk = shape
    with jax.enable_x64(True):
        args = inputs(batch, n, channels, order, reduced, jnp.float64)
        cotangent = jnp.asarray(np.random.default_rng(1).standard_normal((batch, n, channels)))
        want = value_and_grads(through_recurrence, args, cotangent)
        got = value_and_grads(through_kernel, args, cotangent, chunk=chunk)
    assert got[0].dtype == jnp.float64
    np.testing.assert_allclose(got[0], want[0], rtol=1e-11)
    for name, g, w in zip(("u", "L", "bias", "p"), got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11 * np.abs(w).max(), err_msg=name)


def test_float32_equals_the_xla_path_and_the_reference():
    batch, n, channels, order, reduced, chunk = SHAPES[0]
    args = inputs(batch, n, channels, order, reduced, jnp.float32)
    cotangent = jax.random.normal(jax.random.key(2), (batch, n, channels))
    got = value_and_grads(through_kernel, args, cotangent, chunk=chunk)
    xla = value_and_grads(through_xla, args, cotangent, chunk=chunk)
    with jax.enable_x64(True):
        wide = [jnp.asarray(a, jnp.float64) for a in args]
        want = value_and_grads(through_recurrence, wide, jnp.asarray(cotangent, jnp.float64))
        want = jax.tree.map(np.asarray, want)
    got, xla = jax.tree.map(np.asarray, (got, xla))
    np.testing.assert_allclose(got[0], xla[0], rtol=2e-6)
    for name, g, x, w in zip(("u", "L", "bias", "p"), got[1], xla[1], want[1], strict=True):
        scale = np.abs(w).max()
        # Float32 rounding of sums of a few hundred terms, and the same against float64.
        assert np.abs(g - x).max() <= 2e-6 * scale, name
        assert np.abs(g - w).max() <= 2e-6 * scale, name


def test_one_bf16_pass_is_as_close_to_float64_as_the_xla_path():
    # "fast" for a bf16 model: products in one bf16 pass, the output in bf16.
    batch, n, channels, order, reduced, chunk = SHAPES[1]
    args = inputs(batch, n, channels, order, reduced, jnp.float32)
    cotangent = jax.random.normal(jax.random.key(3), (batch, n, channels))
    fast = {"chunk": chunk, "precision": "fast", "dtype": jnp.bfloat16}
    got = value_and_grads(through_kernel, args, cotangent, **fast)
    xla = value_and_grads(through_xla, args, cotangent, **fast)
    with jax.enable_x64(True):
        wide = [jnp.asarray(a, jnp.float64) for a in args]
        m = np.asarray(through_recurrence(*wide))
        want = value_and_grads(through_recurrence, wide, jnp.asarray(cotangent, jnp.float64))
        want = jax.tree.map(np.asarray, want)
    got, xla = jax.tree.map(lambda a: np.asarray(a, np.float64), (got, xla))
    out = np.asarray(through_kernel(*args, **fast), np.float64)
    out_xla = np.asarray(through_xla(*args, **fast), np.float64)
    scale = np.abs(m).max()
    assert np.abs(out - m).max() <= max(1.5 * np.abs(out_xla - m).max(), 4e-3 * scale)
    assert np.abs(out - out_xla).max() <= 1e-2 * scale
    for name, g, x, w in zip(("u", "L", "bias", "p"), got[1], xla[1], want[1], strict=True):
        err, err_xla = np.abs(g - w).max(), np.abs(x - w).max()
        assert err <= max(1.5 * err_xla, 1e-2 * np.abs(w).max()), (name, err, err_xla)


def test_the_kernels_are_causal():
    # A change at step s changes no output before s; the gradient of output t reaches no
    # input after t, across chunk boundaries (chunk 8, n 20).
    _, n, channels, order, reduced, chunk = SHAPES[0]
    u, l_3xKxQ, bias, p = inputs(1, n, channels, order, reduced, jnp.float32)
    out = through_kernel(u, l_3xKxQ, bias, p, chunk=chunk)
    for s in (3, 8, 13):
        changed = through_kernel(u.at[0, s].add(1.0), l_3xKxQ, bias, p, chunk=chunk)
        np.testing.assert_array_equal(changed[0, :s], out[0, :s])
        assert np.abs(changed[0, s:] - out[0, s:]).max() > 1e-3

    def output_at(t):
        return lambda u: through_kernel(u, l_3xKxQ, bias, p, chunk=chunk)[0, t].sum()

    for t in (2, 9, 15):
        grad = jax.grad(output_at(t))(u)
        assert np.all(grad[0, t + 1 :] == 0) and np.abs(grad[0, : t + 1]).max() > 0


@pytest.mark.parametrize(("dtype", "precision"), [(jnp.bfloat16, "fast"), (jnp.float32, "exact")])
def test_the_kernels_lower_to_triton_for_an_nvidia_gpu(dtype, precision):
    # lmu-1M's layer (d 204, q 220, q' 22, chunk 64), lowered for CUDA here without a GPU:
    # every primitive of the three kernels has a Triton lowering rule and every loaded block a
    # shape Triton takes. Triton's compile (registers, shared memory), the run and its speed
    # need the GPU (benchmarks/gpu.py's block part).
    x = jax.ShapeDtypeStruct((2, 3, 204, 64 + 220), dtype)
    w = jax.ShapeDtypeStruct((3, 64 + 220, 22, 64), jnp.float32)
    bias, p = jax.ShapeDtypeStruct((3, 22), jnp.float32), jax.ShapeDtypeStruct((22,), jnp.float32)

    def loss(*args):
        m = memory_kernel.memory_attention(*args, precision=precision, dtype=dtype)
        return jnp.sum(m.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=range(4)))
    text = step.trace(x, w, bias, p).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3  # forward, the operand's and the weights' gradients


def test_the_gelu_without_erf_equals_the_exact_one():
    z = np.concatenate([np.linspace(0.0, 26.0, 5201), np.geomspace(1e-9, 1.0, 200)])
    x = np.linspace(-12.0, 12.0, 4801)
    cdf = 0.5 * scipy.special.erfc(-x / np.sqrt(2.0))
    pdf = np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)
    with jax.enable_x64(True):
        got = np.asarray(memory_kernel._erfc(jnp.asarray(z)))
        gelu, slope = memory_kernel.gelu_and_grad(jnp.asarray(x))
    np.testing.assert_allclose(gelu, x * cdf, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(slope, cdf + x * pdf, rtol=1e-12, atol=5e-14)  # 0 near x = -0.75
    want = scipy.special.erfc(z)
    assert np.max(np.abs(got - want) / want) < 2e-13
    # Float32: exp(-z^2) carries the rounding of z^2, as XLA's own erfc does (9.0e-6 and
    # 1.3e-6 of erfc on the ranges below, against our 1.1e-5 and 1.7e-6).
    normal = want > 1e-30  # float32's range
    z32 = jnp.asarray(z, jnp.float32)
    relative = [
        np.abs(np.asarray(f(z32), np.float64) - want) / np.where(normal, want, 1.0)
        for f in (memory_kernel._erfc, jax.scipy.special.erfc)
    ]
    for where in (normal, z < 4):
        ours, xla = (np.max(r[where]) for r in relative)
        assert ours <= 1.5 * xla, (ours, xla)


def test_bad_shapes_and_precisions_are_named():
    x, w = jnp.zeros((1, 2, 3, 14)), jnp.zeros((3, 14, 4, 8))
    bias, p = jnp.zeros((3, 4)), jnp.zeros(4)
    with pytest.raises(ValueError, match=r"precision must be one of .* got 'tf32'"):
        memory_kernel.memory_attention(x, w, bias, p, precision="tf32")
    with pytest.raises(ValueError, match=r"weights \(3, Z, K, c\).*\(1, 2, 3, 14\), \(3, 13, 4"):
        memory_kernel.memory_attention(x, w[:, :13], bias, p)
    with pytest.raises(ValueError, match=r"p \(K,\), got .* and \(5,\)"):
        memory_kernel.memory_attention(x, w, bias, jnp.zeros(5))
