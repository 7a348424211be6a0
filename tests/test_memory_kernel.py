"""The fused LMU memory kernels (memory_kernel), run in Pallas's interpret mode on CPU at small
shapes, against a float64 reference that shares nothing with them (the recurrence, L m, eqs
8-10 as printed) and against the XLA chunked path."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax import lax
from small_config import small
from test_layers import reference_attention
from test_models import PARALLEL_VS_RECURRENT, jiggle, random_tokens

from lmuscale import kernels, layers, lmu, memory_kernel
from lmuscale.models import build, decode, named_config
from lmuscale.models.lmu import LMUConfig
from lmuscale.sweep.spec import config_hash
from lmuscale.train import base_config, run
from lmuscale.train import config as config_lib

THETA = 9.0


def inputs(batch, n, channels, order, reduced, dtype, seed=0):
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((batch, n, channels))
    l_3xKxQ = rng.standard_normal((3, reduced, order)) / np.sqrt(order)
    bias = 0.3 * rng.standard_normal((3, reduced))
    p = rng.standard_normal(reduced)
    return [jnp.asarray(a, dtype) for a in (u, l_3xKxQ, bias, p)]


def through_kernel(u, l_3xKxQ, bias, p, *, chunk, precision="exact", dtype=None, block=16):
    """The layer's chunked path with the fused kernels, ``block`` channels at a time:
    ``m_BxTxD``."""
    order = l_3xKxQ.shape[-1]
    operand = jnp.bfloat16 if precision == "fast" else None
    x, _ = lmu.chunk_operands(u, order, THETA, chunk=chunk, dtype=operand)
    c = x.shape[-1] - order
    w = jnp.stack([lmu.chunk_weights(order, THETA, c, l_KxQ, dtype=u.dtype) for l_KxQ in l_3xKxQ])
    dtype = u.dtype if dtype is None else dtype
    m = memory_kernel.memory_attention(
        x, w, bias, p, precision=precision, dtype=dtype, channel_block=block, interpret=True
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

    # Compiled: in interpret mode an eager call traces the kernels again at every call.
    return jax.jit(jax.value_and_grad(loss, argnums=range(4)))(*args)


# (batch, n, channels, order q, q', chunk): n is never a multiple of the chunk; 5 steps in a
# chunk of 8 give one chunk of 5 (c < the kernels' 16-wide tiles).
SHAPES = [(2, 20, 3, 6, 4, 8), (1, 37, 5, 40, 3, 16), (2, 5, 2, 8, 2, 8)]


# 40 channels are three blocks of 16, the last with 8 channels of padding.
@pytest.mark.parametrize(
    "shape", [*SHAPES, (2, 13, 40, 10, 3, 8)], ids=lambda s: "x".join(map(str, s))
)
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
        m = np.asarray(through_recurrence(*wide))
        want = value_and_grads(through_recurrence, wide, jnp.asarray(cotangent, jnp.float64))
        want = jax.tree.map(np.asarray, want)
    got, xla = jax.tree.map(np.asarray, (got, xla))
    # The value sums 120 products of either sign, which cancel to about 1% of their absolute
    # sum: float32's rounding scales with that absolute sum, not with the value (on an AVX-512
    # CPU the XLA path was 2.7e-6 of the value from the kernel, 0.2 eps of the absolute sum).
    terms = np.abs(np.asarray(cotangent, np.float64) * m).sum()
    bound = np.finfo(np.float32).eps * terms
    assert abs(got[0] - want[0]) <= bound and abs(xla[0] - want[0]) <= bound
    assert abs(got[0] - xla[0]) <= bound
    # The outputs themselves, each of them, where no cancellation widens the bound: both paths
    # to float32 rounding of max|m| (here about 3e-7 of it), against float64 and each other.
    out = np.asarray(through_kernel(*args, chunk=chunk), np.float64)
    out_xla = np.asarray(through_xla(*args, chunk=chunk), np.float64)
    peak = np.abs(m).max()
    for a, b in ((out, m), (out_xla, m), (out, out_xla)):
        assert np.abs(a - b).max() <= 2e-6 * peak
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
    forward = jax.jit(lambda u: through_kernel(u, l_3xKxQ, bias, p, chunk=chunk))
    out = forward(u)
    for s in (3, 8, 13):
        changed = forward(u.at[0, s].add(1.0))
        np.testing.assert_array_equal(changed[0, :s], out[0, :s])
        assert np.abs(changed[0, s:] - out[0, s:]).max() > 1e-3

    @jax.jit
    def grad_of_output_at(u, t):
        return jax.grad(lambda u: lax.dynamic_index_in_dim(forward(u)[0], t, 0, False).sum())(u)

    for t in (2, 9, 15):
        grad = grad_of_output_at(u, t)
        assert np.all(grad[0, t + 1 :] == 0) and np.abs(grad[0, : t + 1]).max() > 0


@pytest.mark.parametrize(("dtype", "precision"), [(jnp.bfloat16, "fast"), (jnp.float32, "exact")])
def test_the_kernels_lower_to_triton_for_an_nvidia_gpu(dtype, precision):
    # lmu-1M's layer (d 204, q 220, q' 22, chunk 64), lowered for CUDA here without a GPU:
    # every primitive of the four kernels has a Triton lowering rule and every loaded block a
    # shape Triton takes. Triton's compile for an H100 (registers, shared memory) is checked
    # by benchmarks/kernel_resources.py with the CUDA plugin; the run and its speed need the
    # GPU (benchmarks/gpu.py's block part).
    x = jax.ShapeDtypeStruct((2, 3, 204, 64 + 220), dtype)
    w = jax.ShapeDtypeStruct((3, 64 + 220, 22, 64), jnp.float32)
    bias, p = jax.ShapeDtypeStruct((3, 22), jnp.float32), jax.ShapeDtypeStruct((22,), jnp.float32)

    def loss(*args):
        m = memory_kernel.memory_attention(*args, precision=precision, dtype=dtype)
        return jnp.sum(m.astype(jnp.float32))

    step = jax.value_and_grad(loss, argnums=range(4))
    text = kernels.lowered_for_cuda(step, x, w, bias, p).as_text()
    # The forward; the scores' gradient, the operand's and the weights'.
    assert text.count("xla.gpu.triton") == 4


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
    for block in (8, 48):
        with pytest.raises(ValueError, match=rf"power of two >= 16, got {block}"):
            memory_kernel.memory_attention(x, w, bias, p, channel_block=block)


# ---------------------------------------------------------------- the switch, and the models


@pytest.fixture
def interpreted(monkeypatch):
    """The layers' "pallas" path, run in interpret mode as if this CPU could run the kernels:
    ``memory_impl="pallas"`` resolves to the kernels, anything else to XLA. Returns the
    operand shapes the kernels were traced with."""
    calls, kernels = [], memory_kernel.memory_attention

    def interpret(*args, **options):
        calls.append(args[0].shape)
        return kernels(*args, **options, interpret=True)

    monkeypatch.setattr(memory_kernel, "memory_attention", interpret)
    monkeypatch.setattr(memory_kernel, "resolve", lambda impl, dtype, devices=None: impl)
    monkeypatch.setattr(memory_kernel, "unsupported_reason", lambda devices=None: None)
    return calls


def small_lmu(family: str, **overrides) -> LMUConfig:
    """One layer; the tests run 21 tokens in chunks of 8 (the last chunk 5 steps)."""
    config = LMUConfig(
        d=8,
        q=12,
        q_prime=3,
        theta=10.0,
        pre_ffn_dim=8,
        post_ffn_dim=8,
        n_layers=1,
        global_attention=family == "lmu_g",
        n_heads=2,
        vocab_size=31,
        memory_chunk=8,
        batch_chunk=0,
    )
    return dataclasses.replace(config, **overrides)


# The LMU one sequence at a time (batch_chunk 1: a rematerialised map over the batch).
@pytest.mark.parametrize(("family", "batch_chunk"), [("lmu", 1), ("lmu_g", 0)])
def test_a_model_through_the_kernels_equals_its_recurrence_and_the_xla_path(
    family, batch_chunk, interpreted
):
    config = small_lmu(family, memory_impl="pallas", batch_chunk=batch_chunk)
    model, xla_model = build(config), build(dataclasses.replace(config, memory_impl="xla"))
    params = jiggle(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)), 0.3)
    tokens = random_tokens(config, 2, 21)
    interpreted.clear()  # init traced them too
    parallel = jax.jit(model.apply)(params, tokens)
    assert interpreted == [(batch_chunk or 2, 3, 8, 12 + 8)]  # through the kernels
    recurrent, _ = decode(model, params, tokens)
    assert float(jnp.abs(parallel).max()) > 3.0  # logits large enough to show an error
    assert float(jnp.abs(parallel - recurrent).max()) <= PARALLEL_VS_RECURRENT

    def loss(model):
        return jax.jit(
            jax.value_and_grad(
                lambda p: model.apply(p, tokens[:, :-1], tokens[:, 1:], method=model.loss)[0]
            )
        )(params)

    (got, got_grads), (want, want_grads) = loss(model), loss(xla_model)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got_grads, want_grads = (
        np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(grads)])
        for grads in (got_grads, want_grads)
    )
    # Float32 rounding of two orders of summation, against the largest gradient.
    assert np.abs(got_grads - want_grads).max() <= 1e-5 * np.abs(want_grads).max()


def test_the_switch_is_checked_and_resolved_and_training_refuses_pallas_here():
    for family in ("lmu", "lmu_g"):
        assert named_config(f"{family}-55k").memory_impl == "auto"
    with pytest.raises(ValueError, match=r"memory_impl must be one of .* got 'fused'"):
        named_config("lmu-55k", memory_impl="fused")
    with pytest.raises(ValueError, match=r'memory_impl="pallas" fuses .*memory_mode is .fft.'):
        named_config("lmu-55k", memory_impl="pallas", memory_mode="fft")
    assert config_lib.memory_implementation(named_config("lmu-55k")) == "xla"
    assert config_lib.memory_implementation(named_config("transformer-55k")) is None
    assert config_lib.kernel_implementations(named_config("lmu_g-55k")) == {
        "loss_impl": "xla",
        "memory_impl": "xla",
    }
    with pytest.raises(config_lib.ConfigError, match=r'model\.memory_impl="pallas".*cpu'):
        config_lib.kernel_implementations(named_config("lmu-55k", memory_impl="pallas"))
    # A layer made directly is checked too, and its "pallas" refused where it cannot run.
    layer = layers.ImplicitSelfAttention(8, 2, 10.0, memory_impl="pallas")
    with pytest.raises(ValueError, match=r'memory_impl="pallas": the fused LMU memory .*cpu'):
        layer.init(jax.random.key(0), jnp.zeros((1, 4, 3)))
    # A run saved before the key existed resumes as it ran, with the XLA path; the key does
    # not change a trial's folder name (the same function to rounding, as loss_impl).
    upgraded = config_lib.upgrade({"model": {"family": "lmu", "d": 8}})
    assert upgraded["model"]["memory_impl"] == "xla"
    assert "memory_impl" not in config_lib.upgrade({"model": {"family": "sru", "d": 8}})["model"]
    config = base_config(named_config("lmu-55k"))
    pallas = base_config(named_config("lmu-55k", memory_impl="pallas"))
    assert config_hash(config) == config_hash(pallas)
    assert config_lib.differences(config.to_dict(), pallas) == {}


def test_training_refuses_pallas_here_before_it_writes_anything(byte_corpus, tmp_path):
    config = small(str(byte_corpus))
    config.model.memory_impl = "pallas"
    with pytest.raises(config_lib.ConfigError, match=r'model\.memory_impl="pallas".*cpu'):
        run(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_block_benchmark_runs_the_kernels_and_compares_them_with_xla(interpreted):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import lmu_memory
    finally:
        sys.path.pop(0)
    shape = {"n": 12, "d": 48, "q": 50, "q_prime": 5, "theta": 350.0}
    bench = functools.partial(lmu_memory.bench_block, shape, 1, 1, [8], dtypes=["float32"])
    # The channels-last experiment is traced in place of the layer's attention (the calls
    # counted), and the layer is whole again afterwards.
    layer_attend, calls = layers.ImplicitSelfAttention._attend, []
    channels_last = lmu_memory.attend_channels_last
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            lmu_memory,
            "attend_channels_last",
            lambda *a, **k: calls.append(1) or channels_last(*a, **k),
        )
        rows = bench(impls=("xla", "steps-last", "channels-last", "pallas"), model="lmu-55k")
    assert len(calls) == 2 and layers.ImplicitSelfAttention._attend is layer_attend  # 2 jits
    modes = ["chunked/8", "steps-last/8", "channels-last/8", "pallas/8"]
    assert [r["mode"] for r in rows] == modes
    steps_last, channels, pallas = rows[1:]
    # Off a GPU the XLA path is in the layers' order already: the same program (on a GPU,
    # the same function to rounding).
    exact = not layers.channels_last_memory()
    assert steps_last["output_max_diff_rel_to_max"] <= (0 if exact else 1e-5)
    assert steps_last["grad_max_diff_rel_to_max"] <= (0 if exact else 1e-4)
    assert interpreted and "error" not in pallas["forward_backward"], pallas
    # Channels-last against the XLA path, both in float32: the same function to rounding.
    assert channels["output_max_diff_rel_to_max"] <= 1e-5
    assert channels["grad_max_diff_rel_to_max"] <= 1e-4
    # A layer that would not run the chunked memory in XLA is refused, not replaced.
    x = jnp.ones((1, 8, 4))
    with lmu_memory.channels_last(), pytest.raises(ValueError, match="memory_mode='fft'"):
        layers.ImplicitSelfAttention(8, 2, 10.0, memory_mode="fft").init(jax.random.key(0), x)
    # One small layer, each variant (the scores by sums, by products): output and gradients
    # (input, L, biases, p) against the layer's, to float32's and to bfloat16's rounding.
    for dtype, (out_tolerance, grad_tolerance) in (
        (jnp.float32, (1e-5, 1e-4)),
        (jnp.bfloat16, (1e-2, 2e-2)),
    ):
        layer = layers.ImplicitSelfAttention(8, 2, 10.0, dtype=dtype, memory_chunk=4)
        x = jax.random.normal(jax.random.key(1), (2, 11, 6))
        params = layer.init(jax.random.key(0), x)

        def output_and_grads(layer=layer, params=params, x=x):  # traced anew at each call
            def loss(params, x):
                return jnp.sum(jnp.square(layer.apply(params, x).astype(jnp.float32)))

            return jax.jit(layer.apply)(params, x), jax.jit(jax.grad(loss, (0, 1)))(params, x)

        want = output_and_grads()
        for scores_by_products in (False, True):
            with lmu_memory.channels_last(scores_by_products):
                got = output_and_grads()
            differences = lmu_memory._largest_differences(got, want)
            assert differences["output_max_diff_rel_to_max"] <= out_tolerance, differences
            # (above 0: the variant was traced, not a cached trace of the layer)
            assert 0 < differences["grad_max_diff_rel_to_max"] <= grad_tolerance, differences
    for row in rows:
        flops = row["forward_flops"]
        assert flops == lmu_memory.block_flops(named_config("lmu-55k"), 1, 12, 8)
        for phase, count in (("forward", flops), ("forward_backward", 3 * flops)):
            assert row[phase]["tflops_per_s"] == count / row[phase]["median_s"] / 1e12
    # The kernels' output and gradients against the XLA path's, in float32.
    assert pallas["output_max_diff_rel_to_max"] <= 1e-5
    assert pallas["grad_max_diff_rel_to_max"] <= 1e-4
    # Where the kernels cannot run, their row says why and holds no time.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory_kernel, "unsupported_reason", lambda devices=None: "no GPU here")
        (skipped,) = bench(impls=("pallas",), model="lmu-55k")
    assert skipped["skipped"].endswith("no GPU here") and "forward" not in skipped
