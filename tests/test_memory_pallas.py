"""The LMU layer's Pallas kernels (ops.memory_pallas) in interpret mode, on CPU: the state
kernel's carried states and their gradients against the float64 recurrence; the layer and the
models through it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from test_models import PARALLEL_VS_RECURRENT, init, jiggle, random_tokens

from lmuscale import layers, lmu, ops
from lmuscale.models import build, decode, named_config
from lmuscale.ops import implicit_attention, memory_pallas

KERNELS = ops.Impls(
    memory="pallas", memory_layout="channels-last", memory_kernels=ops.MemoryKernels(interpret=True)
)

TIGHT = 1e-8  # float64 through the attention kernel: its gelu is within 1.1e-9 of gelu
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


def odd_layer(impls, dtype=jnp.float32):
    """``layer_loss``'s layer."""
    return layers.ImplicitSelfAttention(70, 5, THETA, dtype, memory_chunk=16, impls=impls)


def layer_loss(impls, sharding=None, batch=2, dtype=jnp.float32, loss_of=None):
    """An odd-shaped layer's (40 steps in chunks of 16, the last 8 steps; 37 channels, q = 70,
    q' = 5) weighted output sum, and its gradients in the parameters (L, the biases, p) and the
    input u, in ``dtype``; with a ``sharding``, u split by it. ``loss_of(layer)``: another
    function of (params, u) for the same inputs (a reference)."""
    u = jnp.asarray(np.random.default_rng(1).standard_normal((batch, 40, 37)), dtype)
    weights = jnp.asarray(np.random.default_rng(2).standard_normal(u.shape), dtype)
    layer = odd_layer(impls, dtype)
    params = jiggle(layer.init(jax.random.key(0), u), 0.3)
    if sharding is not None:
        u = jax.device_put(u, sharding)

    def loss(params, u):
        return jnp.sum(layer.apply(params, u) * weights)

    function = loss if loss_of is None else loss_of(layer, weights)
    return jax.jit(jax.value_and_grad(function, argnums=(0, 1)))(params, u)


def recurrence_loss(layer, weights):
    """``layer_loss``'s loss by the float64 recurrence and eqs 8-10: the memory of u (rounded
    to float32, as the layer's memory takes it) a step at a time, then each position's Q, K,
    V = L_i m_t + b_i, gelu, softmax(Q Kᵀ / sqrt(d)) V and p."""
    abar, bbar = lmu.discretize(layer.q, layer.theta)

    def loss(params, u_BxTxD):
        def step(m_BxDxQ, u_BxD):
            m_BxDxQ = m_BxDxQ @ abar.T + u_BxD[..., None] * bbar[None, None]
            return m_BxDxQ, m_BxDxQ

        # The layer's memory takes u in float32: the same rounding, not in the gradient.
        rounded = u_BxTxD.astype(jnp.float32).astype(u_BxTxD.dtype)
        u_BxTxD = u_BxTxD + jax.lax.stop_gradient(rounded - u_BxTxD)
        zero = jnp.zeros((*u_BxTxD.shape[::2], layer.q), u_BxTxD.dtype)
        _, m_TxBxDxQ = jax.lax.scan(step, zero, jnp.swapaxes(u_BxTxD, 0, 1))
        p = params["params"]
        qkv = jnp.einsum("tbdq,ikq->itbkd", m_TxBxDxQ, p["l"]) + p["bias"][:, None, None, :, None]
        q, k, v = jax.nn.gelu(qkv, approximate=False)
        scores = jnp.einsum("tbid,tbjd->tbij", q, k) / np.sqrt(u_BxTxD.shape[-1])
        w = jnp.einsum("i,tbij->tbj", p["p"], jax.nn.softmax(scores, axis=-1))
        return jnp.sum(jnp.einsum("tbj,tbjd->btd", w, v) * weights)

    return loss


def largest_error(result, reference) -> float:
    """The largest error of a ``layer_loss`` result, the loss's and each gradient's, relative
    to the largest value of each in ``reference``."""
    pairs = zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True)
    return max(float(np.abs(got - want).max() / np.abs(want).max()) for got, want in pairs)


def test_the_layer_through_the_kernels_in_float64_equals_the_recurrence():
    # Values and every gradient (u, L, the biases, p) in float64. The layer's chunk weights and
    # XLA's state passing are float32 (lmu.chunk_weights, lmu.chunk_operands), so the XLA path
    # is within float32 accuracy of the recurrence (1e-6; 6.2e-7 measured), the kernels' too
    # (5.9e-7 measured); the two paths are 3.5e-7 apart.
    with jax.enable_x64():
        want = layer_loss(ops.Impls(), dtype=jnp.float64, loss_of=recurrence_loss)
        xla, got = (layer_loss(impls, dtype=jnp.float64) for impls in (ops.Impls(), KERNELS))
    assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves((want, got)))
    assert largest_error(xla, want) <= 1e-6
    assert largest_error(got, want) <= 1e-6


def test_the_layer_through_the_kernels_has_the_xla_layer_s_values_and_gradients():
    # The output and the gradients of u, L, the biases and p, in float32 (the layer's memory is
    # float32 at least; the float64 tests check the kernels): the two paths' rounding apart.
    (xla_loss, xla_grads), (got_loss, got_grads) = (
        layer_loss(impls) for impls in (ops.Impls(memory_layout="channels-last"), KERNELS)
    )
    assert float(got_loss) == pytest.approx(float(xla_loss), rel=1e-6)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(xla_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_on_eight_devices_each_runs_the_kernels_on_its_sequences():
    # The layer through the kernels on 8 CPU devices (4 x 2, 8 sequences split over both axes;
    # L, the biases and p whole on each, their gradients summed) in a subprocess (XLA_FLAGS
    # before jax is imported), against XLA's path on one device, to the bounds the kernels keep
    # against it there (the test above). Not against the kernels on one device: at batch 8 they
    # took 23 s in interpret mode, whose time grows faster than the positions a device holds.
    script = Path(__file__).resolve().parent / "sharded_states.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = json.loads(done.stdout)
    assert sharded["devices"] == 8
    # Each kernel's call in a shard_map of its own (without the attention's, the values hold).
    kernels = {"name=states_forward": 1, "name=attention_forward": 1}
    assert sharded["program"] == {"shard_map[": 2, **kernels}
    loss, grads = layer_loss(ops.Impls(memory_layout="channels-last"), batch=8)
    assert sharded["loss"] == pytest.approx(float(loss), rel=1e-6)
    for got, want in zip(sharded["grads"], jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# q' = 5, 9 and 22 (rows padded to 16, 16 and 32); d = 37 and 40 (three parts of 16, the last of
# 37 masked past 5 channels, of 40 past 8) and 32 (two whole parts: the backward's loop over
# whole parts only); 2 x 3 chunks of 7 steps: 42 positions, three programs of 16, the last 6
# short.
@pytest.mark.parametrize(("order", "width"), [(5, 37), (22, 40), (9, 32)])
def test_the_attention_kernels_values_and_gradients_equal_xla_s_in_float64(order, width):
    with jax.enable_x64():
        rng = np.random.default_rng(order)
        qkv = jnp.asarray(rng.standard_normal((3, order, 7, 2, 3, width)))
        bias = jnp.asarray(0.3 * rng.standard_normal((3, order)))
        p = jnp.asarray(rng.standard_normal(order))
        dm = jnp.asarray(rng.standard_normal((7, 2, 3, width)))
        want, (*_, want_weights, want_w) = implicit_attention._implicit_attention_channels_last_fwd(
            qkv, bias, p, jnp.float64, "erf", "highest"
        )
        got, (*_, weights, w) = jax.jit(
            lambda qkv: memory_pallas._attention_fwd(qkv, bias, p, jnp.float64, "highest", True)
        )(qkv)
        # The kernels keep each position's softmax and w as a row: positions first.
        weights, w = (
            jnp.moveaxis(x, 0, -1).reshape(y.shape)
            for x, y in ((weights, want_weights), (w, want_w))
        )
        for value, reference in ((got, want), (weights, want_weights), (w, want_w)):
            assert value.dtype == jnp.float64 and value.shape == reference.shape
            np.testing.assert_allclose(value, reference, rtol=0, atol=TIGHT)

        def gradients(attend):
            return jax.jit(lambda *args: jax.vjp(attend, *args)[1](dm))(qkv, bias, p)

        # Of Q, K and V (stacked), the biases and p; every gradient at least 1 in size here.
        xla = gradients(
            lambda *args: implicit_attention.implicit_attention_channels_last(
                *args, jnp.float64, "erf", "highest"
            )
        )
        kernels = gradients(
            lambda *args: memory_pallas.attention(*args, jnp.float64, "highest", True)
        )
        for value, reference in zip(kernels, xla, strict=True):
            assert value.dtype == jnp.float64 and value.shape == reference.shape
            assert np.abs(reference).max() >= 1
            np.testing.assert_allclose(
                value, reference, rtol=0, atol=TIGHT * np.abs(reference).max()
            )


def test_the_attention_kernels_in_bfloat16_are_as_close_to_float64_as_xla_s():
    # A bf16 model's: Q, K and V, their pre-activations and gelus in bfloat16, sums in float32.
    # The float64 reference takes the same bfloat16 pre-activations and gelus; each path's
    # error is that of its roundings (the kernel's gelu is float32, XLA's bfloat16), one bf16
    # rounding of m's largest value or so.
    rng = np.random.default_rng(4)
    qkv = jnp.asarray(rng.standard_normal((3, 22, 7, 2, 3, 204)), jnp.bfloat16)
    bias = jnp.asarray(0.3 * rng.standard_normal((3, 22)), jnp.float32)
    p = jnp.asarray(rng.standard_normal(22), jnp.float32)
    args = (qkv, bias, p, jnp.bfloat16)
    xla = implicit_attention.implicit_attention_channels_last(*args, "erf", "highest")
    got = jax.jit(lambda qkv: memory_pallas.attention(qkv, *args[1:], "highest", True))(qkv)
    assert got.dtype == jnp.bfloat16
    pre = np.asarray(qkv + bias.astype(jnp.bfloat16)[:, :, None, None, None, None], np.float64)
    gelus = jnp.asarray(pre * 0.5 * (1 + scipy.special.erf(pre / np.sqrt(2))), jnp.bfloat16)
    gq, gk, gv = np.asarray(gelus, np.float64)
    scores = np.einsum("iabcd,kabcd->ikabc", gq, gk) / np.sqrt(204)
    weights = np.exp(scores - scores.max(1, keepdims=True))
    weights /= weights.sum(1, keepdims=True)
    want = np.einsum("kabcd,kabc->abcd", gv, np.einsum("i,ikabc->kabc", p, weights))
    kernel, reference = (np.abs(np.asarray(x, np.float64) - want).max() for x in (got, xla))
    assert kernel <= 2**-7 * np.abs(want).max() and kernel <= 1.5 * reference, (kernel, reference)

    # The gradients of Q, K and V, the biases and p, against float64 (XLA's backward pass on
    # the same inputs): within about one bf16 rounding of the largest, as XLA's are (measured:
    # 3.5e-3, 5.8e-3 and 5.0e-3 of it; XLA's 4.6e-3, 5.8e-3 and 5.6e-3). At d = 40, three parts
    # of channels: d = 204's thirteen took 40 s to compile in interpret mode.
    qkv, dm = qkv[..., :40], jnp.asarray(rng.standard_normal((7, 2, 3, 40)), jnp.bfloat16)
    kernels = jax.jit(
        lambda *args: jax.vjp(
            lambda *args: memory_pallas.attention(*args, jnp.bfloat16, "highest", True), *args
        )[1](dm)
    )(qkv, bias, p)
    with jax.enable_x64():
        wide = [jnp.asarray(x, jnp.float64) for x in (qkv, bias, p, dm)]
        exact = jax.vjp(
            lambda *args: implicit_attention.implicit_attention_channels_last(
                *args, jnp.float64, "erf", "highest"
            ),
            *wide[:3],
        )[1](wide[3])
    for got, want, x in zip(kernels, exact, (qkv, bias, p), strict=True):
        assert got.dtype == x.dtype and got.shape == x.shape
        error = np.abs(np.asarray(got, np.float64) - np.asarray(want)).max()
        assert error <= 2**-7 * np.abs(np.asarray(want)).max(), error


def test_the_kernels_gelu_is_within_its_stated_bounds():
    # Each model dtype's fit, in the arithmetic its kernels use: relative error for |x| < 6
    # (TAIL_END), in the far negative tail too, where gelu(-5) is -1.4e-6; beyond, a tail of 0
    # (float64) or of P(Z > 6) = 1e-9 (float32) in place of a smaller one.
    x = np.linspace(-12, 12, 480_001)
    exact = x * 0.5 * scipy.special.erfc(-x / np.sqrt(2))
    inside = (np.abs(x) < memory_pallas.TAIL_END) & (np.abs(x) > 1e-3)
    errors = {}
    with jax.enable_x64():
        for model, arithmetic in (("float64",) * 2, ("float32",) * 2, ("bfloat16", "float32")):
            fit = memory_pallas.tail_fit(model)
            got = memory_pallas.gelu(jnp.asarray(x, arithmetic), fit=fit)
            assert got.dtype == arithmetic
            error = np.abs(np.asarray(got, np.float64) - exact)
            errors[model] = ((error[inside] / np.abs(exact)[inside]).max(), error[~inside].max())
    assert errors["float64"][0] <= 1.1e-9 and errors["float32"][0] <= 6.2e-6, errors
    assert errors["bfloat16"][0] <= 5e-5, errors  # its gelus are rounded to 2^-9 relative
    assert errors["float64"][1] <= 6e-9 and errors["float32"][1] <= 5e-7, errors
    assert errors["bfloat16"][1] <= 5e-7, errors


def test_the_pallas_memory_refuses_the_fft_mode():
    layer = layers.ImplicitSelfAttention(8, 3, THETA, memory_mode="fft", impls=KERNELS)
    with pytest.raises(ValueError, match='the "pallas" memory runs the chunked memory, not "fft"'):
        layer.init(jax.random.key(0), jnp.zeros((1, 4, 2)))


# Chunks of 16 steps, so that 40 tokens cross two chunk boundaries with the state carried.
@pytest.mark.parametrize("name", ["lmu-55k", "lmu-1M", "lmu_g-55k", "lmu_g-1M"])
def test_parallel_through_the_kernels_equals_recurrent_and_is_causal(name):
    config = named_config(name, memory_chunk=16)
    model = build(config, KERNELS)
    params = jiggle(init(model), 0.1)
    tokens = random_tokens(config, 1, 40)
    forward = jax.jit(model.apply)
    program = str(jax.make_jaxpr(model.apply)(params, tokens))
    assert "name=states_forward" in program and "name=attention_forward" in program
    parallel = forward(params, tokens)
    recurrent, _ = decode(build(config), params, tokens)
    assert float(jnp.abs(parallel).max()) > 3.0  # logits large enough to show an error
    assert float(jnp.abs(parallel - recurrent).max()) <= PARALLEL_VS_RECURRENT
    # Another token at position 20, in the second chunk: nothing before it changes.
    changed = forward(params, tokens.at[0, 20].add(1))
    past = float(jnp.abs(changed[:, :20] - parallel[:, :20]).max())
    future = float(jnp.abs(changed[:, 20:] - parallel[:, 20:]).max())
    assert future > 0 and past <= 1e-6 * future, (past, future)
