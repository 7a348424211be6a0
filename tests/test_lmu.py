"""The Legendre memory against its definitions: formulas, scipy's ZOH, and a float64 recurrence."""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.signal

from lmuscale import lmu
from lmuscale.demo import delay_nrmse, smoothed_noise

# float32 modes against the float64 recurrence: max abs error <= TOLERANCE * max|m|.
TOLERANCE = 1e-4


def random_u(rng: np.random.Generator, batch: int, n: int, channels: int) -> np.ndarray:
    return rng.standard_normal((batch, n, channels)).astype(np.float32)


def memory_modes(order: int, theta: float, n: int, l_KxQ: np.ndarray) -> dict:
    """Every mode that maps a whole input u_BxTxC to an output, by name."""
    h = lmu.impulse_response(order, theta, n)
    abar, bbar = lmu.discretize(order, theta)
    return {
        "fft": lambda u: lmu.memory_fft(u, h),
        "scan": lambda u: lmu.memory_scan(u, abar, bbar),
        "final": lambda u: lmu.memory_final(u, h),
        "reduced": lambda u: lmu.memory_reduced(u, h, l_KxQ),
        "chunked": lambda u: lmu.memory_chunked(u, order, theta, chunk=16)[0],
        "chunked_reduced": lambda u: lmu.memory_chunked(u, order, theta, l_KxQ, chunk=16)[0],
    }


def relative_error(value, reference: np.ndarray) -> float:
    reference = np.asarray(reference, np.float64)
    return float(np.abs(np.asarray(value, np.float64) - reference).max() / np.abs(reference).max())


# --- the continuous system and its discretisation -------------------------------------------


@pytest.mark.parametrize("order", [1, 2, 5, 13])
@pytest.mark.parametrize("theta", [1.0, 7.5, 350.0])
def test_legendre_ab_matches_the_formula_element_by_element(order, theta):
    a, b = lmu.legendre_ab(order, theta)
    assert a.shape == (order, order) and b.shape == (order,)
    assert a.dtype == np.float64 and b.dtype == np.float64
    for i in range(order):
        assert b[i] == (2 * i + 1) * (-1) ** i / theta
        for j in range(order):
            sign = -1 if i < j else (-1) ** (i - j + 1)
            assert a[i, j] == (2 * i + 1) / theta * sign, (i, j)


@pytest.mark.parametrize("order", [1, 4, 32, 128])
@pytest.mark.parametrize("theta", [1.0, 10.0, 350.0, 1e4])
def test_zoh_matches_scipy_cont2discrete(order, theta):
    a, b = lmu.legendre_ab(order, theta)
    system = (a, b[:, None], np.zeros((1, order)), np.zeros((1, 1)))
    abar_ref, bbar_ref, *_ = scipy.signal.cont2discrete(system, dt=1, method="zoh")
    abar, bbar = lmu.discretize(order, theta)
    assert abar.dtype == np.float64
    np.testing.assert_allclose(abar, abar_ref, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(bbar, bbar_ref[:, 0], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("order", [1, 3, 16, 40])
@pytest.mark.parametrize("theta", [2.0, 35.0, 1e3])
def test_zoh_satisfies_its_closed_form_and_the_semigroup_property(order, theta):
    # Checks independent of the block-matrix expm (which cont2discrete also uses):
    # Bbar = A^-1 (Abar - I) B, and e^{A/theta} = (e^{A/(2 theta)})^2 since A scales as 1/theta.
    a, b = lmu.legendre_ab(order, theta)
    abar, bbar = lmu.discretize(order, theta)
    np.testing.assert_allclose(
        bbar, np.linalg.solve(a, (abar - np.eye(order)) @ b), rtol=1e-9, atol=1e-12
    )
    abar_half, _ = lmu.discretize(order, 2 * theta)
    np.testing.assert_allclose(abar, abar_half @ abar_half, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("order", [1, 2, 64, 512, 1024])
@pytest.mark.parametrize("theta", [1.0, 3.5, 350.0, 1e5])
def test_zoh_is_finite_at_extreme_orders_and_windows(order, theta):
    abar, bbar = lmu.discretize(order, theta)
    abar32, bbar32 = lmu.discretize(order, theta, dtype=np.float32)
    assert abar32.dtype == np.float32
    for array in (abar, bbar, abar32, bbar32):
        assert np.isfinite(array).all()
    # The impulse response of a stable system stays bounded: no blow-up hiding in the powers.
    h = lmu.impulse_response(order, theta, 64)
    assert np.isfinite(h).all() and np.abs(h).max() < 10


def test_impulse_response_is_powers_of_abar_times_bbar():
    order, theta, n = 20, 37.0, 300
    abar, bbar = lmu.discretize(order, theta)
    h = lmu.impulse_response(order, theta, n)
    assert h.shape == (n, order)
    state = bbar.copy()
    for t in range(n):
        np.testing.assert_allclose(h[t], state, rtol=1e-10, atol=1e-14, err_msg=f"lag {t}")
        state = abar @ state
    assert np.array_equal(h[0], bbar)
    np.testing.assert_array_equal(lmu.impulse_response(order, theta, 7), h[:7])
    assert lmu.impulse_response(order, theta, n, dtype=np.float32).dtype == np.float32


# --- the five modes against the float64 recurrence ------------------------------------------

CASES = [  # batch, n, channels, order, theta
    (3, 1, 2, 4, 2.0),
    (2, 37, 1, 1, 5.0),
    (2, 300, 4, 32, 100.0),
    (1, 1000, 2, 128, 350.0),
    (1, 4096, 3, 512, 1000.0),
    (1, 4096, 1, 64, 4096.0),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "B{}-n{}-C{}-q{}-th{:g}".format(*c))
def case(request):
    batch, n, channels, order, theta = request.param
    rng = np.random.default_rng(n + order)
    u = random_u(rng, batch, n, channels)
    return {
        "u": u,
        "order": order,
        "theta": theta,
        "reference": lmu.memory_reference(u, order, theta),
        "h": lmu.impulse_response(order, theta, n),
        "ab": lmu.discretize(order, theta),
    }


def test_memory_reference_is_the_convolution_with_the_impulse_response():
    rng = np.random.default_rng(0)
    u = rng.standard_normal((2, 50, 3))
    h = lmu.impulse_response(6, 9.0, 50)
    direct = np.zeros((2, 50, 3, 6))
    for t in range(50):
        for j in range(t + 1):
            direct[:, t] += u[:, j, :, None] * h[t - j]
    np.testing.assert_allclose(lmu.memory_reference(u, 6, 9.0), direct, rtol=1e-10, atol=1e-12)


def test_fft_mode(case):
    m = jax.jit(lmu.memory_fft)(jnp.asarray(case["u"]), case["h"])
    assert m.shape == case["reference"].shape and m.dtype == jnp.float32
    assert relative_error(m, case["reference"]) <= TOLERANCE


def test_scan_mode(case):
    m = jax.jit(lmu.memory_scan)(jnp.asarray(case["u"]), *case["ab"])
    assert m.shape == case["reference"].shape and m.dtype == jnp.float32
    assert relative_error(m, case["reference"]) <= TOLERANCE


def test_step_mode(case):
    u = jnp.asarray(case["u"])
    step = jax.jit(lmu.memory_step)
    state = jnp.zeros((u.shape[0], u.shape[2], case["order"]), jnp.float32)
    worst = 0.0
    scale = np.abs(case["reference"]).max()
    for t in range(u.shape[1]):
        state = step(state, u[:, t], *case["ab"])
        worst = max(worst, float(np.abs(np.asarray(state) - case["reference"][:, t]).max()))
    assert worst / scale <= TOLERANCE


def test_final_state_mode(case):
    m = jax.jit(lmu.memory_final)(jnp.asarray(case["u"]), case["h"])
    assert m.shape == case["reference"][:, -1].shape
    assert relative_error(m, case["reference"][:, -1]) <= TOLERANCE


def test_reduced_order_mode(case):
    order = case["order"]
    l_KxQ = np.random.default_rng(order).standard_normal((max(order // 10, 1) + 2, order))
    m = jax.jit(lmu.memory_reduced)(jnp.asarray(case["u"]), case["h"], l_KxQ.astype(np.float32))
    reference = case["reference"] @ l_KxQ.T
    assert m.shape == reference.shape
    assert relative_error(m, reference) <= TOLERANCE


def test_scan_continues_from_a_carried_state():
    rng = np.random.default_rng(5)
    order, theta, n, split = 24, 40.0, 300, 123
    u = jnp.asarray(random_u(rng, 2, n, 3))
    reference = lmu.memory_reference(np.asarray(u), order, theta)
    abar, bbar = lmu.discretize(order, theta)
    carried = jnp.asarray(reference[:, split - 1], jnp.float32)
    rest = lmu.memory_scan(u[:, split:], abar, bbar, m0_BxCxQ=carried)
    assert relative_error(rest, reference[:, split:]) <= TOLERANCE


def test_reduced_order_path_never_forms_the_full_memory():
    # The largest array in the reduced path's program must scale with q', not q.
    batch, n, channels, order, reduced = 2, 256, 8, 256, 4
    u = jnp.ones((batch, n, channels), jnp.float32)
    h = lmu.impulse_response(order, 100.0, n, dtype=np.float32)
    l_KxQ = jnp.ones((reduced, order), jnp.float32)
    hlo = jax.jit(lmu.memory_reduced).lower(u, h, l_KxQ).as_text()
    full = n * channels * order
    shapes = re.findall(r"tensor<((?:\d+x)+)(?:f32|complex<f32>)>", hlo)
    sizes = [math.prod(int(d) for d in shape.rstrip("x").split("x")) for shape in shapes]
    assert sizes, "no tensor shapes found in the lowered program"
    assert max(sizes) < full // 4


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32])
def test_every_mode_computes_in_float32_for_narrow_or_integer_input(dtype):
    rng = np.random.default_rng(4)
    order, theta, n = 12, 20.0, 64
    u_narrow = jnp.asarray(rng.integers(-3, 4, (2, n, 3)), dtype)
    u32 = u_narrow.astype(jnp.float32)
    abar, bbar = lmu.discretize(order, theta)
    modes = memory_modes(order, theta, n, rng.standard_normal((3, order)).astype(np.float32))
    modes["step"] = lambda u: lmu.memory_step(
        jnp.zeros((2, 3, order), u.dtype), u[:, 0], abar, bbar
    )
    for name, run in modes.items():
        narrow, wide = run(u_narrow), run(u32)
        assert narrow.dtype == jnp.float32, name
        np.testing.assert_allclose(narrow, wide, rtol=1e-6, atol=1e-6, err_msg=name)
    assert np.abs(np.asarray(modes["fft"](u_narrow))).max() > 0.1  # not truncated to zero


def test_contractions_ask_for_full_float32_precision():
    # On GPUs the default float32 matmul is TF32 (about 1e-3 relative); these sums must not be.
    n, order = 16, 8
    u = jnp.ones((1, n, 2), jnp.float32)
    h = lmu.impulse_response(order, 10.0, n)
    abar, bbar = lmu.discretize(order, 10.0)
    l_KxQ = jnp.ones((3, order), jnp.float32)
    programs = {
        "scan": jax.jit(lmu.memory_scan).lower(u, abar, bbar),
        "step": jax.jit(lmu.memory_step).lower(jnp.ones((1, 2, order)), u[:, 0], abar, bbar),
        "final": jax.jit(lmu.memory_final).lower(u, h),
        "reduced": jax.jit(lmu.memory_reduced).lower(u, h, l_KxQ),
        "chunked": jax.jit(lambda u, proj: lmu.memory_chunked(u, order, 10.0, proj, chunk=4)).lower(
            u, l_KxQ
        ),
        "decode": jax.jit(lambda m: lmu.decode(m, 10.0, [0.0, 5.0])).lower(jnp.ones((4, order))),
    }
    # The chunk product's gradient is written by hand: its matmuls must keep the precision too.
    programs["chunked gradient"] = jax.jit(
        jax.grad(
            lambda u, proj: jnp.sum(lmu.memory_chunked(u, order, 10.0, proj, chunk=4)[0]),
            argnums=(0, 1),
        )
    ).lower(u, l_KxQ)
    for name, lowered in programs.items():
        dots = [line for line in lowered.as_text().splitlines() if "dot_general" in line]
        assert dots, f"{name}: no dot_general in the lowered program"
        for line in dots:
            assert line.count("HIGHEST") == 2, f"{name}: {line.strip()}"


# --- the chunked memory ----------------------------------------------------------------------

# "exact" chunked memory against the float64 recurrence: max abs error <= this * max|m|.
CHUNKED_TOLERANCE = 1e-5
# One bf16 pass for the output products, measured at n 1024, q 220, 3q' 66 on N(0, 1) input
# (benchmarks/lmu_precision.py on CPU): max error 2.2-3.6e-3 of max|m|, rms error 2.1e-3 of
# rms(m); an H100 gave 3.0-3.9e-3 and 2.7-2.9e-3 while the chunk states were also bf16. The
# bounds leave 1.5-2x room; the floor proves the fast path is not secretly float32.
FAST_MAX, FAST_RMS, FAST_RMS_FLOOR = 6e-3, 4.5e-3, 1e-3


@functools.cache
def chunked_case(n: int, order: int, theta: float):
    """Input, L and the float64 memory for one (n, q, theta); cached across parameters."""
    rng = np.random.default_rng(n * 1000 + order)
    u = random_u(rng, 1, n, 2)
    l_KxQ = (rng.standard_normal((6, order)) / np.sqrt(order)).astype(np.float32)
    return u, l_KxQ, lmu.memory_reference(u, order, theta)


def chunked_cases():
    """(n, chunk, order, theta): n in {1, c-1, c, c+1, 1000, 1024, 4096} for c in {16, 64}."""
    orders = {1: 8, 1000: 220, 1024: 128, 4096: 512}
    for chunk in (16, 64):
        for offset, order in ((-1, 32), (0, 50), (1, 64)):
            yield chunk + offset, chunk, order, 30.0
        for n, order in orders.items():
            yield n, chunk, order, 350.0


@pytest.mark.parametrize("n, chunk, order, theta", list(chunked_cases()))
def test_chunked_memory_equals_the_float64_recurrence(n, chunk, order, theta):
    u, l_KxQ, reference = chunked_case(n, order, theta)
    run = jax.jit(lambda u, proj: lmu.memory_chunked(u, order, theta, proj, chunk=chunk))
    full, state = jax.jit(lambda u: lmu.memory_chunked(u, order, theta, chunk=chunk))(u)
    assert full.shape == reference.shape and full.dtype == jnp.float32
    assert relative_error(full, reference) <= CHUNKED_TOLERANCE
    assert relative_error(state, reference[:, -1]) <= CHUNKED_TOLERANCE  # the state after n-1
    reduced, _ = run(u, l_KxQ)
    assert relative_error(reduced, reference @ l_KxQ.T.astype(np.float64)) <= CHUNKED_TOLERANCE


def test_chunked_memory_in_pieces_equals_the_whole_and_continues_a_scan():
    rng = np.random.default_rng(11)
    order, theta, chunk = 24, 40.0, 16
    u = jnp.asarray(random_u(rng, 2, 200, 3))
    l_KxQ = jnp.asarray(rng.standard_normal((4, order)), jnp.float32)
    whole, whole_state = lmu.memory_chunked(u, order, theta, l_KxQ, chunk=chunk)
    pieces, state = [], None
    for start, stop in ((0, 37), (37, 38), (38, 102), (102, 111), (111, 200)):
        y, state = lmu.memory_chunked(u[:, start:stop], order, theta, l_KxQ, state, chunk=chunk)
        pieces.append(y)
    reference = np.asarray(whole, np.float64)
    assert relative_error(jnp.concatenate(pieces, axis=1), reference) <= CHUNKED_TOLERANCE
    assert relative_error(state, np.asarray(whole_state, np.float64)) <= CHUNKED_TOLERANCE
    # From a nonzero carried state m0, the same as the recurrence from m0.
    abar, bbar = lmu.discretize(order, theta, dtype=np.float32)
    m0 = jnp.asarray(rng.standard_normal((2, 3, order)), jnp.float32)
    scanned = lmu.memory_scan(u, abar, bbar, m0_BxCxQ=m0)
    full, final = lmu.memory_chunked(u, order, theta, m0_BxCxQ=m0, chunk=chunk)
    assert relative_error(full, np.asarray(scanned, np.float64)) <= CHUNKED_TOLERANCE
    assert relative_error(final, np.asarray(scanned[:, -1], np.float64)) <= CHUNKED_TOLERANCE


def test_chunked_memory_of_one_step_chunks_and_of_an_empty_batch():
    rng = np.random.default_rng(14)
    u = random_u(rng, 2, 9, 3)
    reference = lmu.memory_reference(u, 6, 8.0)
    y, state = lmu.memory_chunked(jnp.asarray(u), 6, 8.0, chunk=1)
    assert relative_error(y, reference) <= CHUNKED_TOLERANCE
    assert relative_error(state, reference[:, -1]) <= CHUNKED_TOLERANCE
    y, state = lmu.memory_chunked(jnp.zeros((0, 9, 3)), 6, 8.0, np.ones((2, 6)), chunk=4)
    assert y.shape == (0, 9, 3, 2) and state.shape == (0, 3, 6)


def test_fast_precision_leaves_the_carried_state_exact():
    # Only the output products run as one bf16 pass; the state is carried at float32 accuracy.
    rng = np.random.default_rng(15)
    order, theta = 50, 100.0
    u = random_u(rng, 2, 512, 3)
    reference = lmu.memory_reference(u, order, theta)[:, -1]
    m0 = jnp.asarray(rng.standard_normal((2, 3, order)), jnp.float32)
    exact_from_m0 = lmu.memory_chunked(jnp.asarray(u), order, theta, m0_BxCxQ=m0)[1]
    for precision in lmu.PRECISIONS:
        _, state = lmu.memory_chunked(jnp.asarray(u), order, theta, precision=precision)
        assert relative_error(state, reference) <= CHUNKED_TOLERANCE, precision
        _, state = lmu.memory_chunked(
            jnp.asarray(u), order, theta, m0_BxCxQ=m0, precision=precision
        )
        np.testing.assert_allclose(state, exact_from_m0, rtol=0, atol=1e-5)


def test_a_fast_product_takes_its_operand_in_bfloat16_with_the_state_exact():
    # The operand is written in bf16 (half the bytes the product reads); rounding it there is
    # the rounding a bf16 product applies anyway. The carried state is not rounded.
    rng = np.random.default_rng(16)
    u = jnp.asarray(random_u(rng, 2, 100, 3))
    x32, state32 = lmu.chunk_operands(u, 30, 50.0, chunk=16)
    x16, state16 = lmu.chunk_operands(u, 30, 50.0, chunk=16, dtype=jnp.bfloat16)
    assert x16.dtype == jnp.bfloat16 and state16.dtype == jnp.float32
    np.testing.assert_array_equal(x16, x32.astype(jnp.bfloat16))
    np.testing.assert_array_equal(state16, state32)
    # The fast memory is built on that operand: its program holds no float32 operand at all.
    text = jax.jit(lambda u: lmu.memory_chunked(u, 30, 50.0, chunk=16, precision="fast")[0])
    operand = "x".join(str(n) for n in x32.shape)
    hlo = text.lower(u).as_text()
    assert f"tensor<{operand}xbf16>" in hlo and f"tensor<{operand}xf32>" not in hlo


@pytest.mark.parametrize("product", [lmu.chunk_product, lmu.chunk_product_channels_last])
def test_the_chunk_product_names_mismatched_shapes(product):
    x = jnp.zeros((1, 2, 3, 10))
    with pytest.raises(ValueError, match="the same Z"):
        product(x, jnp.zeros((9, 2, 4)))
    with pytest.raises(ValueError, match="precision must be one of"):
        product(x, jnp.zeros((10, 2, 4)), "float32")


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_the_channels_last_product_and_its_gradients_are_the_product_s_moved(precision):
    # (B, J, C, K, c) and (K, c, B, J, C) hold the same numbers: the values and both gradients,
    # each by its own hand-written products, agree to float64's rounding ("exact") and to the
    # float32 sums' order for bf16 operands ("fast").
    rng = np.random.default_rng(17)
    with jax.enable_x64(precision == "exact"):
        dtype = jnp.float64 if precision == "exact" else jnp.float32
        x = jnp.asarray(rng.standard_normal((2, 3, 5, 11)), dtype)
        w = jnp.asarray(rng.standard_normal((11, 4, 6)), dtype)
        dy = jnp.asarray(rng.standard_normal((2, 3, 5, 4, 6)), dtype)
        y, vjp = jax.vjp(lambda x, w: lmu.chunk_product(x, w, precision), x, w)
        y_cl, vjp_cl = jax.vjp(lambda x, w: lmu.chunk_product_channels_last(x, w, precision), x, w)
        rtol = 1e-13 if precision == "exact" else 1e-6
        np.testing.assert_allclose(jnp.transpose(y_cl, (2, 3, 4, 0, 1)), y, rtol=rtol)
        got = vjp_cl(jnp.transpose(dy, (3, 4, 0, 1, 2)))
        for name, g, want in zip(("x", "w"), got, vjp(dy), strict=True):
            assert g.dtype == dtype, name
            np.testing.assert_allclose(g, want, rtol=rtol, atol=rtol * 1e-3, err_msg=name)


def test_chunked_gradients_equal_the_fft_path_in_float64():
    rng = np.random.default_rng(12)
    n, order, theta, chunk = 150, 40, 50.0, 16
    with jax.enable_x64(True):
        u = jnp.asarray(rng.standard_normal((2, n, 3)))
        l_KxQ = jnp.asarray(rng.standard_normal((5, order)))
        weights = jnp.asarray(rng.standard_normal((2, n, 3, 5)))
        h = lmu.impulse_response(order, theta, n)

        def fft(u, l_KxQ):
            return jnp.sum(lmu.memory_reduced(u, h, l_KxQ) * weights)

        def chunked(u, l_KxQ):
            return jnp.sum(lmu.memory_chunked(u, order, theta, l_KxQ, chunk=chunk)[0] * weights)

        want = jax.grad(fft, argnums=(0, 1))(u, l_KxQ)
        got = jax.grad(chunked, argnums=(0, 1))(u, l_KxQ)
        for name, g, w in zip(("u", "L"), got, want, strict=True):
            assert g.dtype == jnp.float64, name
            assert relative_error(g, np.asarray(w)) <= 1e-8, name

        # The full memory (L = None) from a carried state m0, against the recurrence.
        abar, bbar = lmu.discretize(order, theta)
        m0 = jnp.asarray(rng.standard_normal((2, 3, order)))
        full_weights = jnp.asarray(rng.standard_normal((2, n, 3, order)))

        def scan(u, m0):
            m = lmu.memory_scan(u, abar, bbar, m0)
            return jnp.sum(m * full_weights) + jnp.sum(m[:, -1] * full_weights[:, -1])

        def full(u, m0):
            y, state = lmu.memory_chunked(u, order, theta, m0_BxCxQ=m0, chunk=chunk)
            return jnp.sum(y * full_weights) + jnp.sum(state * full_weights[:, -1])

        want = jax.grad(scan, argnums=(0, 1))(u, m0)
        got = jax.grad(full, argnums=(0, 1))(u, m0)
        for name, g, w in zip(("u", "m0"), got, want, strict=True):
            assert relative_error(g, np.asarray(w)) <= 1e-8, name


def test_fast_precision_is_one_bf16_pass_with_the_measured_error():
    n, order, theta = 1024, 220, 350.0
    rng = np.random.default_rng(13)
    u = random_u(rng, 1, n, 4)
    l_KxQ = (rng.standard_normal((66, order)) / np.sqrt(order)).astype(np.float32)
    reference = lmu.memory_reference(u, order, theta) @ l_KxQ.T.astype(np.float64)
    for precision in lmu.PRECISIONS:
        y, _ = jax.jit(
            lambda u, precision=precision: lmu.memory_chunked(
                u, order, theta, l_KxQ, precision=precision
            )
        )(u)
        diff = np.asarray(y, np.float64) - reference
        max_error = np.abs(diff).max() / np.abs(reference).max()
        rms_error = np.sqrt(np.mean(diff**2) / np.mean(reference**2))
        if precision == "exact":
            assert max_error <= CHUNKED_TOLERANCE and rms_error <= 1e-6
        else:
            assert max_error <= FAST_MAX
            assert FAST_RMS_FLOOR <= rms_error <= FAST_RMS


def test_chunked_path_never_forms_the_full_memory():
    batch, n, channels, order, reduced = 2, 256, 8, 256, 4
    u = jnp.ones((batch, n, channels), jnp.float32)
    l_KxQ = jnp.ones((reduced, order), jnp.float32)

    def loss(u, l_KxQ):
        return jnp.sum(lmu.memory_chunked(u, order, 100.0, l_KxQ)[0])

    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(u, l_KxQ).as_text()
    full = n * channels * order
    shapes = re.findall(r"tensor<((?:\d+x)+)(?:f32|bf16)>", hlo)
    sizes = [math.prod(int(d) for d in shape.rstrip("x").split("x")) for shape in shapes]
    assert sizes, "no tensor shapes found in the lowered program"
    assert max(sizes) < full // 4


# --- gradients, causality --------------------------------------------------------------------


def test_gradients_of_fft_and_scan_paths_agree_with_float64():
    rng = np.random.default_rng(7)
    batch, n, channels, order, theta = 2, 500, 3, 48, 120.0
    u = random_u(rng, batch, n, channels)
    weights = rng.standard_normal((batch, n, channels, order))
    h = lmu.impulse_response(order, theta, n)
    abar, bbar = lmu.discretize(order, theta)

    def loss(memory_fn):
        return lambda u: jnp.sum(memory_fn(u) * weights.astype(np.float32))

    grad_fft = jax.grad(loss(lambda u: lmu.memory_fft(u, h)))(jnp.asarray(u))
    grad_scan = jax.grad(loss(lambda u: lmu.memory_scan(u, abar, bbar)))(jnp.asarray(u))
    # d loss / d u_j = sum_{t >= j} weights_t . H[t - j], in float64.
    reference = np.zeros((batch, n, channels))
    for lag in range(n):
        reference[:, : n - lag] += np.einsum("btcq,q->btc", weights[:, lag:], h[lag])
    assert relative_error(grad_fft, reference) <= TOLERANCE
    assert relative_error(grad_scan, reference) <= TOLERANCE
    assert relative_error(grad_fft, np.asarray(grad_scan, np.float64)) <= TOLERANCE


def test_gradient_with_respect_to_l_matches_the_full_memory_path():
    rng = np.random.default_rng(8)
    n, order = 200, 40
    u = jnp.asarray(random_u(rng, 2, n, 3))
    l_KxQ = jnp.asarray(rng.standard_normal((5, order)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((2, n, 3, 5)), jnp.float32)
    h = lmu.impulse_response(order, 50.0, n)

    def reduced(l_KxQ):
        return jnp.sum(lmu.memory_reduced(u, h, l_KxQ) * weights)

    def full(l_KxQ):
        m = lmu.memory_fft(u, h)
        return jnp.sum(jnp.einsum("btcq,kq->btck", m, l_KxQ, precision="highest") * weights)

    grad_reduced, grad_full = jax.grad(reduced)(l_KxQ), jax.grad(full)(l_KxQ)
    assert relative_error(grad_reduced, np.asarray(grad_full, np.float64)) <= TOLERANCE


@pytest.mark.parametrize("mode", ["fft", "scan", "reduced", "chunked", "chunked_reduced"])
def test_memory_is_causal(mode):
    rng = np.random.default_rng(3)
    n, order, theta, cut = 512, 32, 64.0, 300
    run = memory_modes(order, theta, n, rng.standard_normal((4, order)).astype(np.float32))[mode]
    u = random_u(rng, 2, n, 3)
    changed = u.copy()
    changed[:, cut + 1 :] += 10 * rng.standard_normal(changed[:, cut + 1 :].shape)
    before, after = np.asarray(run(jnp.asarray(u))), np.asarray(run(jnp.asarray(changed)))
    past_change = np.abs(after[:, : cut + 1] - before[:, : cut + 1]).max()
    future_change = np.abs(after[:, cut + 1 :] - before[:, cut + 1 :]).max()
    assert future_change > 1.0  # the perturbation reached the memory
    # The FFT paths mix all frequencies, so the past moves by float32 rounding at most.
    assert past_change <= 1e-6 * future_change


# --- the decoder ----------------------------------------------------------------------------


def exact_decoder_weight(i: int, ratio: Fraction) -> Fraction:
    """(-1)^i sum_l C(i, l) C(i+l, l) (-ratio)^l in exact rationals (REFERENCE §1)."""
    total = sum(math.comb(i, k) * math.comb(i + k, k) * (-ratio) ** k for k in range(i + 1))
    return (-1) ** i * total


@pytest.mark.parametrize("delay", [0, 1, 16, 25, 49.5, 64])
def test_decoder_matches_the_binomial_formula(delay):
    order, theta = 40, 64
    weights = lmu.legendre_decoder(order, theta, delay)
    ratio = Fraction(delay).limit_denominator(1000) / theta
    exact = np.array([float(exact_decoder_weight(i, ratio)) for i in range(order)])
    np.testing.assert_allclose(weights, exact, rtol=1e-9, atol=1e-9)


def test_decoder_weights_for_several_delays_stack():
    weights = lmu.legendre_decoder(10, 20.0, [0.0, 5.0, 20.0])
    assert weights.shape == (3, 10)
    np.testing.assert_array_equal(weights[1], lmu.legendre_decoder(10, 20.0, 5.0))
    assert lmu.legendre_decoder(10, 20.0, 5.0).shape == (10,)
    m = jnp.asarray(np.random.default_rng(0).standard_normal((4, 7, 10)), jnp.float32)
    several, one = lmu.decode(m, 20.0, [0.0, 5.0, 20.0]), lmu.decode(m, 20.0, 5)
    assert several.shape == (4, 7, 3) and one.shape == (4, 7)
    np.testing.assert_allclose(several[..., 1], one, rtol=1e-6, atol=1e-6)


def test_decode_matches_float64_weights_on_a_float32_memory():
    rng = np.random.default_rng(12)
    order, theta = 64, 300.0
    m64 = rng.standard_normal((3, 50, order))
    delays = np.array([0.0, 1.5, 150.0, 299.0, 300.0])
    reference = m64 @ lmu.legendre_decoder(order, theta, delays).T
    decoded = lmu.decode(jnp.asarray(m64, jnp.float32), theta, delays)
    assert decoded.dtype == jnp.float32
    assert relative_error(decoded, reference) <= 1e-5


@pytest.mark.parametrize("delay", [0, 32, 64])
def test_delay_property(delay):
    order, theta, n = 16, 64, 4096
    signal = smoothed_noise(n, width=16, seed=11)
    h = lmu.impulse_response(order, theta, n)
    m = lmu.memory_fft(jnp.asarray(signal, jnp.float32)[None, :, None], h)[0, :, 0]
    nrmse = delay_nrmse(signal, np.asarray(lmu.decode(m, theta, delay)), delay, skip=theta)
    print(f"delay {delay}: NRMSE {nrmse:.4f}")
    assert nrmse < 0.1


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: lmu.legendre_ab(0, 10.0), "order must be an integer >= 1, got 0"),
        (lambda: lmu.legendre_ab(4.5, 10.0), "got 4.5"),
        (lambda: lmu.legendre_ab(True, 10.0), "got True"),
        (
            lambda: jax.jit(lambda theta: lmu.discretize(4, theta))(10.0),
            "known before tracing",
        ),
        (lambda: lmu.discretize(4, -1.0), "theta must be a positive, finite"),
        (lambda: lmu.discretize(4, float("nan")), "got nan"),
        (lambda: lmu.impulse_response(4, 10.0, 0), "length must be an integer >= 1, got 0"),
        (lambda: lmu.legendre_decoder(4, 10.0, 10.5), "delay must lie in [0, theta=10.0]"),
        (lambda: lmu.legendre_decoder(4, 10.0, [-1, 3]), "got [-1.0]"),
        (lambda: lmu.decode(jnp.ones((3, 4)), 10.0, [[1.0, 2.0]]), "scalar or a 1-D array"),
        (lambda: lmu.memory_fft(jnp.ones((2, 8)), np.ones((8, 4))), "(batch, time, channels)"),
        (lambda: lmu.memory_fft(jnp.ones((1, 8, 2)), np.ones((5, 4))), "time >= 8"),
        (
            lambda: lmu.memory_reduced(jnp.ones((1, 8, 2)), np.ones((8, 4)), np.ones((2, 3))),
            "order=4",
        ),
        (
            lambda: lmu.memory_scan(jnp.ones((1, 8, 2)), *lmu.discretize(4, 5.0), jnp.ones((1, 4))),
            "m0 must have shape",
        ),
        (lambda: lmu.memory_chunked(jnp.ones((1, 8, 2)), 4, 5.0, chunk=0), "chunk must be"),
        (lambda: lmu.memory_chunked(jnp.ones((1, 0, 2)), 4, 5.0), "at least one time step"),
        (
            lambda: lmu.memory_chunked(jnp.ones((1, 8, 2)), 4, 5.0, precision="tf32"),
            "precision must be one of ('exact', 'fast'), got 'tf32'",
        ),
        (
            lambda: lmu.memory_chunked(jnp.ones((1, 8, 2)), 4, 5.0, np.ones((2, 3))),
            "L must have shape (reduced order, order=4), got (2, 3)",
        ),
        (
            lambda: lmu.memory_chunked(jnp.ones((1, 8, 2)), 4, 5.0, m0_BxCxQ=jnp.ones((1, 2, 3))),
            "m0 must have shape (batch, channels, order) = (1, 2, 4)",
        ),
    ],
)
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_fft_length_is_the_smallest_5_smooth_linear_length():
    def smooth(k):
        for p in (2, 3, 5):
            while k % p == 0:
                k //= p
        return k == 1

    for n in [*range(1, 300), 1000, 1024, 4096, 5000, 8192]:
        length = lmu.fft_length(n)
        assert length >= 2 * n - 1 and smooth(length)
        assert not any(smooth(k) for k in range(2 * n - 1, length))
    assert lmu.fft_length(1024) == 2048


def test_numpy_and_jax_integers_are_accepted_as_counts():
    a_np, _ = lmu.legendre_ab(np.int64(5), 7.0)
    a_jnp, _ = lmu.legendre_ab(jnp.int32(5), 7.0)
    np.testing.assert_array_equal(a_np, lmu.legendre_ab(5, 7.0)[0])
    np.testing.assert_array_equal(a_jnp, a_np)
    assert lmu.impulse_response(5, 7.0, np.int32(9)).shape == (9, 5)
