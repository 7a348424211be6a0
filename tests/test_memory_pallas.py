"""The LMU layer's Pallas kernels (ops.memory_pallas) in interpret mode, on CPU: the state
kernel's carried states and their gradients against the float64 recurrence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmuscale import lmu
from lmuscale.ops import memory_pallas

THETA = 250.0  # longer than a chunk: the carried states count


def operand(u, order, chunk, **options):
    """The chunk product's operand by the state kernel, in interpret mode."""
    return memory_pallas.chunk_operand(u, order, THETA, chunk=chunk, interpret=True, **options)


def carried_reference(u, order, chunk):
    """Each chunk's carried state by the float64 recurrence: the state after step j c - 1
    (zero before the first chunk), (B, J, C, Q)."""
    m_BxTxCxQ = lmu.memory_reference(u, order, THETA)
    starts = range(0, u.shape[1], chunk)
    zeros = np.zeros_like(m_BxTxCxQ[:, 0])
    return np.stack([zeros if t == 0 else m_BxTxCxQ[:, t - 1] for t in starts], axis=1)


# n = 150 in chunks of 32 and of 64 (the last holds 22 steps), 37 channels (three blocks of 16,
# the last holds 5); orders 40 (held as 32 + 16) and 70 (64 + 16: a whole part and a
# remainder); and 7 steps, fewer than one chunk, at order 5.
SHAPES = [(2, 150, 37, 40, 32), (1, 150, 37, 70, 64), (2, 7, 5, 5, 64)]


@pytest.mark.parametrize(("batch", "n", "channels", "order", "chunk"), SHAPES)
def test_the_state_kernel_s_states_and_gradient_equal_the_float64_recurrence(
    batch, n, channels, order, chunk
):
    with jax.enable_x64():
        rng = np.random.default_rng(order)
        u = rng.standard_normal((batch, n, channels))
        x = jax.jit(lambda u: operand(u, order, chunk))(jnp.asarray(u))
        c = min(chunk, n)
        assert x.dtype == jnp.float64 and x.shape == (batch, -(-n // c), channels, c + order)
        # The operand's first c columns are the chunk's inputs, the rest its carried state.
        np.testing.assert_array_equal(
            np.swapaxes(x[..., :c], 2, 3).reshape(batch, -1, channels)[:, :n], u
        )
        want = carried_reference(u, order, c)
        np.testing.assert_allclose(x[..., c:], want, rtol=0, atol=1e-12 * np.abs(want).max())
        # The gradient of a random weighting of the states: through the kernel run in reverse,
        # against XLA's chunked path differentiated by JAX (float64 throughout).
        weights = jnp.asarray(rng.standard_normal(x.shape))

        def weighted(make):
            return jax.jit(jax.grad(lambda u: jnp.sum(make(u) * weights)))(jnp.asarray(u))

        got = weighted(lambda u: operand(u, order, chunk))
        ref = weighted(lambda u: lmu.chunk_operands(u, order, THETA, chunk=chunk)[0])
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12 * np.abs(ref).max())


def test_three_bfloat16_passes_keep_the_states_at_float32_accuracy():
    # As on a GPU: float32 states, each product three bfloat16 passes. Against the float64
    # recurrence, within the bound XLA's BF16_BF16_F32_X3 products meet (lmu.py: 1.1e-5 of
    # max|m| at the paper's largest layer).
    rng = np.random.default_rng(3)
    u = rng.standard_normal((2, 300, 20)).astype(np.float32)
    want = carried_reference(u, 70, 64)
    for algorithm, bound in (("bf16x3", 1.1e-5), ("highest", 1e-6)):
        x = jax.jit(lambda u, a=algorithm: operand(u, 70, 64, exact_algorithm=a))(u)
        assert x.dtype == jnp.float32
        error = np.abs(np.asarray(x[..., 64:], np.float64) - want).max() / np.abs(want).max()
        assert error <= bound, (algorithm, error)
