"""The layers against float64 references: the parallel-LMU layer (parallel-LMU eqs 18-20) in
every mode, and the implicit self-attention's hand-written gradient (LMU paper eqs 8-10)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from lmuscale import lmu
from lmuscale.layers import ImplicitSelfAttention, ParallelLMU
from lmuscale.ops import Impls
from lmuscale.ops import implicit_attention as attention_ops
from lmuscale.ops.implicit_attention import (
    gelu,
    implicit_attention,
    implicit_attention_channels_last,
)

STEPS_LAST, CHANNELS_LAST = Impls(), Impls(memory_layout="channels-last")


def reference(params, x_BxTxD, layer: ParallelLMU) -> np.ndarray:
    """Eqs 18-20 in numpy float64, one step at a time."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params.get("params", {}))
    x = np.asarray(x_BxTxD, np.float64)
    abar, bbar = lmu.discretize(layer.order, layer.theta)
    act = {"linear": lambda v: v, "tanh": np.tanh, "relu": lambda v: np.maximum(v, 0)}
    f1, f2 = act[layer.input_activation], act[layer.output_activation]
    u = f1(x @ p["encoder"]["kernel"] + p["encoder"]["bias"]) if layer.memory_dim else x
    m = np.zeros((x.shape[0], u.shape[-1], layer.order))
    out = []
    for t in range(x.shape[1]):
        m = m @ abar.T + u[:, t, :, None] * bbar
        features = m.reshape(len(m), -1)
        if layer.units:
            features = np.concatenate([features, x[:, t]], -1)
            features = f2(features @ p["readout"]["kernel"] + p["readout"]["bias"])
        out.append(features)
    return np.stack(out, 1)


LAYERS = {
    "eq18-20": dict(units=6, order=8, theta=12.0, memory_dim=2, input_activation="tanh"),
    "dn-only": dict(units=0, order=3, theta=30.0, memory_dim=0),
}


@pytest.mark.parametrize("name", LAYERS)
def test_parallel_scan_step_and_final_state_equal_the_float64_recurrence(name):
    layer = ParallelLMU(**LAYERS[name])
    x = jax.random.normal(jax.random.key(0), (2, 40, 3))
    params = layer.init(jax.random.key(1), x)
    expected = reference(params, x, layer)
    assert np.abs(expected).max() > 0.5  # large enough to show an error
    fft = jax.jit(layer.apply)(params, x)
    scan = jax.jit(layer.clone(mode="scan").apply)(params, x)
    final = jax.jit(layer.clone(return_sequences=False).apply)(params, x)
    np.testing.assert_allclose(fft, expected, atol=2e-5)
    np.testing.assert_allclose(scan, expected, atol=2e-5)
    np.testing.assert_allclose(final, expected[:, -1], atol=2e-5)

    step = jax.jit(lambda state, x_BxD: layer.apply(params, state, x_BxD, method=layer.step))
    state = layer.decode_state(2, x.shape[-1])
    steps = []
    for t in range(x.shape[1]):
        y, state = step(state, x[:, t])
        steps.append(y)
    np.testing.assert_allclose(np.stack(steps, 1), expected, atol=2e-5)


def test_parallel_lmu_is_causal():
    layer = ParallelLMU(units=5, order=6, theta=10.0, memory_dim=2)
    x = jax.random.normal(jax.random.key(0), (1, 30, 3))
    params = layer.init(jax.random.key(1), x)
    # d(sum of the outputs at t) / d(x at s), for every t and s.
    jacobian_TxTxD = jax.jit(jax.jacrev(lambda x: layer.apply(params, x)[0].sum(-1)))(x)[:, 0]
    size_TxT = np.abs(np.asarray(jacobian_TxTxD)).max(-1)
    past, future = np.tril(size_TxT), np.triu(size_TxT, 1)
    assert past.diagonal().min() > 0
    assert future.max() <= 1e-6 * past.max(), future.max()  # FFT rounding only


def test_unknown_mode_and_activation_are_named():
    x = jnp.zeros((1, 4, 1))
    with pytest.raises(ValueError, match="'fft' or 'scan'"):
        ParallelLMU(units=2, order=2, theta=2.0, mode="conv").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        ParallelLMU(units=2, order=2, theta=2.0, output_activation="swish").init(
            jax.random.key(0), x
        )


def reference_attention(q_xDxKxc, k_xDxKxc, v_xDxKxc, bias_3xK, p_K):
    """Eqs 8-10 as printed, with M' formed: ``p softmax(Q K^T / sqrt(d)) V`` per position.

    Positions on the last axis, as the memory's product writes them; the reference moves them
    in front and computes each position's q' x d matrices with jax.nn.gelu.
    """
    q, k, v = (
        jax.nn.gelu(x + jnp.broadcast_to(b, x.shape), approximate=False)
        for x, b in zip(
            (jnp.moveaxis(a, -1, -3) for a in (q_xDxKxc, k_xDxKxc, v_xDxKxc)), bias_3xK, strict=True
        )
    )
    scores = jnp.einsum("...di,...dj->...ij", q, k) / math.sqrt(q.shape[-2])
    m_prime_xKxD = jnp.einsum("...ij,...dj->...id", jax.nn.softmax(scores, -1), v)
    return jnp.moveaxis(jnp.einsum("i,...id->...d", p_K, m_prime_xKxD), -2, -1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("form", ["erfc", "erf"])
def test_gelu_is_exact_through_erfc_and_through_erf(form, dtype):
    # Both forms (Impls.gelu: erfc on a CPU, erf on a GPU) are x Phi(x) to the dtype's
    # rounding, from deep in the negative tail to the positive side, each by its own function.
    x = np.linspace(-12.0, 12.0, 4801)
    want = x * 0.5 * scipy.special.erfc(-x / math.sqrt(2.0))
    with jax.enable_x64(dtype == jnp.float64):
        program = jax.jit(lambda v: gelu(v, form)).lower(jnp.asarray(x, dtype))
        got = np.asarray(program.compile()(jnp.asarray(x, dtype)), np.float64)
    erf_ops = re.findall(r"chlo\.(erfc?) ", program.as_text())
    assert erf_ops == [form]
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=4 * eps, atol=16 * eps)


def _channels_last(*args_and_dtype):
    """``implicit_attention``'s function through ``implicit_attention_channels_last``: each
    (B, D, q', P) input written (q', P, B, D) and the three stacked, the output put back."""
    *qkv, bias_3xK, p_K, dtype = args_and_dtype
    qkv_3xKxPxBxD = jnp.stack([jnp.transpose(x, (2, 3, 0, 1)) for x in qkv])
    m_PxBxD = implicit_attention_channels_last(qkv_3xKxPxBxD, bias_3xK, p_K, dtype, "erfc")
    return jnp.transpose(m_PxBxD, (1, 2, 0))


ATTENTIONS = {"steps-last": implicit_attention, "channels-last": _channels_last}


@pytest.mark.parametrize("layout", ["steps-last", "channels-last"])
@pytest.mark.parametrize("positions", [5, 1])
def test_implicit_attention_and_its_gradient_equal_eqs_8_to_10_in_float64(positions, layout):
    # (2 sequences, 7 channels, q' = 3, positions): a chunk's steps, or one decoding step. The
    # attention in either layout: the layers' order (the CPU's), or channels last (a GPU's),
    # whose q' x q' sums are matrix products over the positions.
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        args = [jnp.asarray(rng.standard_normal((2, 7, 3, positions))) for _ in range(3)]
        args += [jnp.asarray(rng.standard_normal((3, 3))), jnp.asarray(rng.standard_normal(3))]
        cotangent = jnp.asarray(rng.standard_normal((2, 7, positions)))

        def loss(attend):
            return lambda *a: jnp.sum(attend(*a) * cotangent)

        ours = loss(lambda *a: ATTENTIONS[layout](*a, jnp.float64))
        want = jax.value_and_grad(loss(reference_attention), argnums=range(5))(*args)
        got = jax.value_and_grad(ours, argnums=range(5))(*args)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-13)
        for name, g, w in zip(("q", "k", "v", "bias", "p"), got[1], want[1], strict=True):
            assert g.dtype == jnp.float64, name
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("impls", [STEPS_LAST, CHANNELS_LAST], ids=["steps-last", "channels-last"])
@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_chunked_and_fft_memory_give_the_same_attention_and_gradients(chunk, impls):
    # 21 steps: chunk 4 leaves a ragged last chunk of 1 step, 7 divides 21, 64 exceeds it. The
    # chunked memory as here, and as on a GPU: one product, written channels last.
    x = jax.random.normal(jax.random.key(0), (3, 21, 10))
    results = []
    for mode in ("fft", "chunked"):
        layer = ImplicitSelfAttention(
            12, 3, 16.0, memory_mode=mode, memory_chunk=chunk, impls=impls
        )
        params = layer.init(jax.random.key(1), x)
        params = jax.tree.map(lambda a: a + 0.3, params)  # nonzero biases

        def loss(params, x, layer=layer):
            return jnp.sum(jnp.sin(layer.apply(params, x)))

        results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x))
    (fft_loss, fft_grads), (chunked_loss, chunked_grads) = results
    np.testing.assert_allclose(chunked_loss, fft_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(fft_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _data_moves(hlo_text: str, min_elements: int) -> list[str]:
    """Every transpose or copy in an optimised HLO module, fused or not, of at least
    ``min_elements`` elements."""
    moves = []
    for line in hlo_text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\{[^}]*\} (transpose|copy)\(", line)
        if found and math.prod(int(d) for d in found[1].split(",") if d) >= min_elements:
            moves.append(line.strip()[:160])
    return moves


def _layer_gradient_inputs(dtype: str, impls: Impls):
    """``(layer, params, x)`` of ``_lowered_layer_gradient``."""
    batch, length, width, order, reduced, chunk = 2, 64, 16, 12, 4, 16
    layer = ImplicitSelfAttention(
        order, reduced, 20.0, jnp.dtype(dtype), memory_chunk=chunk, batch_chunk=0, impls=impls
    )
    x = jax.random.normal(jax.random.key(0), (batch, length, width))
    return layer, layer.init(jax.random.key(1), x), x


def _lowered_layer_gradient(dtype: str, impls: Impls):
    """A small chunked layer's forward+backward, lowered, and the size of its Q."""
    layer, params, x = _layer_gradient_inputs(dtype, impls)

    def loss(params, x):
        return jnp.sum(jnp.sin(layer.apply(params, x).astype(jnp.float32)))

    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x)
    return lowered, x.size * layer.q_prime


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_chunked_attention_moves_nothing_the_size_of_its_q_k_or_v(dtype):
    # The chunk products write Q, K and V with each channel's steps last, and the attention
    # and its hand-written gradient read them there: the compiled forward+backward holds no
    # transpose or copy of an array that large, fused or not (the layout before this one,
    # Q, K, V in sequence order, held six per layer). Only the output, q' times smaller, is
    # put in sequence order. This is the CPU's path: compiled here, for here.
    lowered, q_size = _lowered_layer_gradient(dtype, STEPS_LAST)
    hlo = lowered.compile().as_text()
    shapes = re.findall(r"(?:f32|bf16)\[([\d,]+)\]", hlo)
    assert max(math.prod(int(d) for d in shape.split(",")) for shape in shapes) >= q_size
    assert _data_moves(hlo, q_size // 4)  # the check sees the output's moves, a quarter of Q
    assert not _data_moves(hlo, q_size)


def _lowered_results(text: str, op: str) -> list[int]:
    """The element counts of every ``op`` result in a lowered (StableHLO) program."""
    found = re.findall(rf"stablehlo\.{op}\b[^\n]*-> tensor<([\dx]*)x?[a-z]+\d*>", text)
    return [math.prod(int(d) for d in dims.split("x") if d) for dims in found]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_attention_as_on_a_gpu_forms_its_q_prime_sums_by_products_over_the_positions(dtype):
    # A GPU's layout: besides the one product of Q, K and V, written (3 q', c, B, J, d), the
    # scores (q' x q' at each of the 128 positions) and dgelu(Q), dgelu(K) (Q-sized) are three
    # matrix products batched over the positions. Those two gradients, which a batched product
    # writes positions first, are the only Q-sized arrays the program as traced transposes:
    # only the output, q' times smaller, is put in sequence order.
    lowered, q_size = _lowered_layer_gradient(dtype, CHANNELS_LAST)
    text = lowered.as_text()
    products = _lowered_results(text, "dot_general")
    scores_size = q_size * 4 // 16  # q' x q' a position, where Q has q' x 16 channels
    assert products.count(3 * q_size) == 1
    assert products.count(q_size) == 2
    assert products.count(scores_size) == 1
    moves = _lowered_results(text, "transpose")
    assert q_size // 4 in moves
    assert sorted(m for m in moves if m >= q_size) == [q_size, q_size]


def _batched_products(text: str) -> list[tuple[str, str, str]]:
    """The element types of every batched ``dot_general`` in a lowered (StableHLO) program:
    ``(left operand, right operand, result)``."""
    found = re.findall(
        r"stablehlo\.dot_general [^\n]*batching_dims[^\n]*: \(tensor<[\dx]*x(\w+)>, "
        r"tensor<[\dx]*x(\w+)>\) -> tensor<[\dx]*x(\w+)>",
        text,
    )
    return sorted(found)


@pytest.mark.parametrize(("dtype", "operands"), [("bfloat16", "bf16"), ("float32", "f32")])
def test_the_attention_s_products_over_the_positions_take_the_model_s_dtype_and_sum_in_float32(
    dtype, operands
):
    # In a bfloat16 model the scores, dgelu(Q) and dgelu(K) multiply bfloat16 operands
    # (gelu(Q), gelu(K) and the rounded dscores) and sum in float32 (measured faster on an
    # H200 than float32 operands); in a float32 model, float32 operands. Each product's result
    # is float32 either way.
    lowered, _ = _lowered_layer_gradient(dtype, CHANNELS_LAST)
    assert _batched_products(lowered.as_text()) == [(operands, operands, "f32")] * 3


def test_the_attention_as_on_a_gpu_in_bfloat16_is_the_cpu_s_to_its_rounding():
    # The same bf16 layer through either path: outputs and gradients (input, L, biases, p)
    # within bf16's rounding of each other, and not equal (each path was traced anew).
    layer = ImplicitSelfAttention(12, 3, 16.0, dtype=jnp.bfloat16, memory_chunk=8)
    x = jax.random.normal(jax.random.key(0), (2, 21, 10))
    params = jax.tree.map(lambda a: a + 0.3, layer.init(jax.random.key(1), x))
    results = []
    for impls in (STEPS_LAST, CHANNELS_LAST):
        layer = layer.clone(impls=impls)

        def loss(params, x, layer=layer):
            return jnp.sum(jnp.sin(layer.apply(params, x).astype(jnp.float32)))

        results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x))
    differences = []
    for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0]), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        differences.append(np.abs(got - want).max() / np.abs(want).max())
    assert 0 < max(differences) <= 2e-2, differences


def _library_fusions_summing_a_product(
    hlo_text: str, shape: tuple[int, ...]
) -> tuple[list[str], int]:
    """The YNNPACK fusions of an XLA:CPU module that reduce a float32 product of ``shape``
    inside them, and how many such fusions there are in all: ``(found, count)``."""
    bodies = dict(re.findall(r"\n(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo_text, re.S))
    fusions = re.findall(r"fusion\([^\n]*calls=(%[\w.\-]+)[^\n]*__ynn_fusion", hlo_text)
    product = re.escape("f32[" + ",".join(map(str, shape)) + "]")
    found = []
    for name in fusions:
        body = bodies.get(name, "")
        products = set(re.findall(r"(%[\w.\-]+) = " + product + r"\{[^}]*\} multiply\(", body))
        if any(r in products for r in re.findall(r" reduce\((%[\w.\-]+),", body)):
            found.append(name)
    return found, len(fusions)


def test_the_gradient_sums_over_channels_a_product_computed_apart_on_a_cpu():
    # XLA:CPU puts a sum over the channel axis, with the product it sums, into one YNNPACK
    # fusion, which ran about 10x slower than the two apart at lmu-1M's shapes
    # (ops.implicit_attention._apart_from_its_sum): the compiled backward pass has no such
    # fusion over a product the size of V. The shapes are large enough for XLA to use these
    # fusions at all, and without the rounding the check finds dw's.
    shape = (1, 2, 32, 4, 16)
    rng = np.random.default_rng(0)
    sizes = [shape, shape, shape, (3, shape[3]), (shape[3],), (*shape[:3], shape[4])]
    args = [jnp.asarray(rng.standard_normal(size), jnp.float32) for size in sizes]

    def forward_and_backward(*args_and_cotangent):
        *args, cotangent = args_and_cotangent
        out, vjp = jax.vjp(lambda *a: implicit_attention(*a, jnp.float32), *args)
        return out, vjp(cotangent)

    hlo = jax.jit(forward_and_backward).lower(*args).compile().as_text()
    found, fusions = _library_fusions_summing_a_product(hlo, shape)
    assert fusions, "no YNNPACK fusions here: the check (and the rounding) has nothing to do"
    assert not found


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float64])
def test_the_rounding_that_keeps_a_product_apart_changes_no_bit(dtype):
    # Random bit patterns (normals, subnormals, NaNs) and zeros of both signs, infinities,
    # the extremes: every number keeps its bits, and a NaN stays a NaN (its payload is free).
    info = jnp.finfo(dtype)
    with jax.enable_x64(dtype == jnp.float64):
        bits = np.random.default_rng(0).integers(0, 2**info.bits, 4096, dtype=np.uint64)
        unsigned = {16: np.uint16, 32: np.uint32, 64: np.uint64}[info.bits]
        x = bits.astype(unsigned).view(np.dtype(dtype))
        extremes = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, float(info.tiny), float(info.max)])
        x = np.concatenate([x, extremes.astype(np.dtype(dtype))])
        y = np.asarray(jax.jit(attention_ops._apart_from_its_sum)(jnp.asarray(x)))
    mantissa = unsigned((1 << info.nmant) - 1)
    exponent = unsigned(((1 << info.nexp) - 1) << info.nmant)

    def is_nan(a):  # from the bits: NumPy's isnan warns on bfloat16 NaNs
        bits = a.view(unsigned)
        return ((bits & exponent) == exponent) & ((bits & mantissa) != 0)

    nan = is_nan(x)
    assert nan.any() and is_nan(y[nan]).all()
    assert np.array_equal(y[~nan].view(unsigned), x[~nan].view(unsigned))


def test_unknown_memory_mode_is_named():
    x = jnp.zeros((1, 4, 2))
    with pytest.raises(ValueError, match="memory_mode must be one of"):
        ImplicitSelfAttention(4, 2, 8.0, memory_mode="scan").init(jax.random.key(0), x)


def _attention_reference(q, k, v):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[1]
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", weights, v)


@pytest.mark.parametrize("width", [13, 24, 34])
def test_causal_attention_padded_for_cudnn_equals_the_float64_softmax(width, monkeypatch):
    from lmuscale.ops.attention import causal_attention

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (2, 9, 3, width)) for key in keys)
    want = _attention_reference(q, k, v)
    np.testing.assert_allclose(causal_attention(q, k, v, "xla"), want, rtol=1e-5, atol=1e-6)

    # cuDNN needs a GPU; here XLA computes what cuDNN would be given: the padded heads.
    seen = []
    xla_attention = jax.nn.dot_product_attention

    def as_cudnn(query, *args, implementation=None, **kwargs):
        seen.append((implementation, query.shape[-1]))
        return xla_attention(query, *args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", as_cudnn)
    padded = causal_attention(q, k, v, "cudnn")
    assert seen == [("cudnn", width + (-width % 8))]
    assert padded.shape == q.shape
    np.testing.assert_allclose(padded, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", [3, 70])
def test_sums_over_the_reduced_order_equal_numpy_written_out_or_not(order):
    # q' up to 64 is summed term by term (one fused pass), beyond that by a reduction.
    from lmuscale.ops.implicit_attention import _UNROLL, _sum_of_products

    rng = np.random.default_rng(order)
    a = rng.standard_normal((2, 5, order, 4))
    b = rng.standard_normal((2, 1, order, 4))
    got = _sum_of_products(jnp.asarray(a), jnp.asarray(b), axis=-2)
    np.testing.assert_allclose(got, (a * b).sum(-2), rtol=1e-5, atol=1e-5)
    assert (order > _UNROLL) == (order == 70)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_q_prime_products_precision_changes_only_what_xla_is_asked(dtype):
    # Impls.q_prime_precision: the bf16 products over the positions ask "default" or "highest"
    # of XLA; the sums are the same (products of bf16 numbers are exact in float32, summed in
    # float32), so the layer's value and gradients agree to float32 rounding (on this CPU,
    # with jaxlib 0.10.2, bit for bit: the numbers guard the sums, the lowered precisions the
    # setting). A float32 model's products ask "highest" whatever it says.
    texts, results = {}, {}
    for precision in ("highest", "default"):
        impls = Impls(memory_layout="channels-last", q_prime_precision=precision)
        lowered, _ = _lowered_layer_gradient(dtype, impls)
        text = lowered.as_text()
        dots = re.findall(r"stablehlo\.dot_general [^\n]*batching_dims[^\n]*", text)
        texts[precision] = [("HIGHEST" in dot) for dot in dots]
        _, params, x = _layer_gradient_inputs(dtype, impls)
        outputs = jax.tree.leaves(lowered.compile()(params, x))
        results[precision] = [np.asarray(leaf, np.float64) for leaf in outputs]
    assert len(texts["highest"]) == 3 and all(texts["highest"])
    assert texts["default"] == [dtype == "float32"] * 3
    for got, want in zip(results["default"], results["highest"], strict=True):
        assert np.abs(got - want).max() <= 1e-6 * max(np.abs(want).max(), 1e-30)
