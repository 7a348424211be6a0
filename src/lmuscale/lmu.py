"""The Legendre memory: the continuous system, its exact discretisation, the memory in every mode.

The frozen constants (A, B, Abar, Bbar, H) are computed in float64 with numpy/scipy, cached,
and cast to the compute dtype where a JAX function takes them (REFERENCE §1). ``theta`` is the
window in time steps, discretised by zero-order hold with dt = 1 (``u_t`` held over (t - 1, t]):
``m_t = Abar m_{t-1} + Bbar u_t`` with ``m_{-1} = 0``, so ``m_t = sum_{j<=t} H[t-j] u_j``,
``H[k] = Abar^k Bbar``; ``u_BxTxC`` gives ``m_BxTxCxQ``. Every mode agrees with
``memory_reference``, the float64 recurrence, to float32 rounding (tests/test_lmu.py).
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
import scipy.fft
import scipy.linalg
from jax import lax
from numpy.polynomial import legendre as np_legendre

# The recurrence and the contractions over time accumulate many terms; TF32 matmuls (the GPU
# default for float32) would cost three decimal digits. These are small matmuls, so the full
# float32 precision is nearly free.
_PRECISION = lax.Precision.HIGHEST

# A sweep uses a handful of (order, theta, length); an impulse response can reach hundreds of MB
# (length 1e5 at order 1024 is 0.8 GB), so its cache is kept small.
_ZOH_CACHE_SIZE = 32
_IMPULSE_CACHE_SIZE = 8


def _check_count(name: str, value) -> int:
    try:
        count = operator.index(value)
    except TypeError:
        count = None
    if isinstance(value, bool) or count is None or count < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return count


def _check_theta(theta) -> float:
    try:
        value = float(theta)
    except (TypeError, ValueError):
        # A traced value lands here too: the constants are built in numpy before tracing.
        raise ValueError(
            f"theta must be a positive number of time steps known before tracing (a Python or "
            f"numpy number, not a traced array), got {theta!r}"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"theta must be a positive, finite number of time steps, got {theta!r}")
    return value


def _read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def legendre_ab(order: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """The continuous Legendre delay system (REFERENCE §1, parallel-LMU eqs 8-9), float64
    ``(A_QxQ, B_Q)``: ``A[i, j] = (2i+1)/theta * (-1 if i < j else (-1)^(i-j+1))``,
    ``B[i] = (2i+1) (-1)^i / theta``."""
    order, theta = _check_count("order", order), _check_theta(theta)
    i = np.arange(order)[:, None]
    j = np.arange(order)[None, :]
    signs = np.where(i < j, -1.0, (-1.0) ** (i - j + 1))
    a_QxQ = (2 * i + 1) / theta * signs
    b_Q = (2 * np.arange(order) + 1) * (-1.0) ** np.arange(order) / theta
    return a_QxQ, b_Q


@functools.lru_cache(maxsize=_ZOH_CACHE_SIZE)
def _zoh(order: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    a_QxQ, b_Q = legendre_ab(order, theta)
    # expm of [[A, B], [0, 0]] is [[Abar, Bbar], [0, 1]]: the exact ZOH with no inverse of A.
    block = np.zeros((order + 1, order + 1))
    block[:order, :order] = a_QxQ
    block[:order, order] = b_Q
    expm = scipy.linalg.expm(block)
    abar_QxQ = np.ascontiguousarray(expm[:order, :order])
    bbar_Q = np.ascontiguousarray(expm[:order, order])
    if not (np.isfinite(abar_QxQ).all() and np.isfinite(bbar_Q).all()):
        raise FloatingPointError(
            f"ZOH discretisation of the Legendre system is not finite for order={order}, "
            f"theta={theta}"
        )
    return _read_only(abar_QxQ), _read_only(bbar_Q)


def discretize(order: int, theta: float, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Zero-order hold with dt = 1: ``(Abar_QxQ, Bbar_Q)``, ``Abar = e^A``,
    ``Bbar = A^-1 (e^A - I) B``, in float64 (cached) cast to ``dtype`` (read-only if float64)."""
    abar_QxQ, bbar_Q = _zoh(_check_count("order", order), _check_theta(theta))
    return abar_QxQ.astype(dtype, copy=False), bbar_Q.astype(dtype, copy=False)


@functools.lru_cache(maxsize=_IMPULSE_CACHE_SIZE)
def _impulse_response(order: int, theta: float, length: int) -> np.ndarray:
    abar_QxQ, bbar_Q = _zoh(order, theta)
    # Doubling: with H[:k] known, H[k:2k] = H[:k] (Abar^k)^T. log2(length) matmuls instead of
    # `length` matvecs, in float64 throughout.
    h_TxQ = bbar_Q[None, :]
    power_QxQ = abar_QxQ
    while h_TxQ.shape[0] < length:
        h_TxQ = np.concatenate([h_TxQ, h_TxQ @ power_QxQ.T])
        if h_TxQ.shape[0] < length:
            power_QxQ = power_QxQ @ power_QxQ
    # A copy, so the cache does not keep the doubling's power-of-two tail alive.
    return _read_only(h_TxQ[:length].copy())


def impulse_response(order: int, theta: float, length: int, dtype=np.float64) -> np.ndarray:
    """The impulse response ``H_TxQ``, ``H[t] = Abar^t Bbar`` for t < T = ``length`` (lag 0
    included), in float64 cast to ``dtype`` (read-only if float64)."""
    order, theta = _check_count("order", order), _check_theta(theta)
    h_TxQ = _impulse_response(order, theta, _check_count("length", length))
    return h_TxQ.astype(dtype, copy=False)


def legendre_decoder(order: int, theta: float, delay) -> np.ndarray:
    """Weights that read ``u(t - delay)`` out of the memory ``m_t`` (parallel-LMU eq 14).

    ``C_i(delay) = (-1)^i sum_l C(i, l) C(i+l, l) (-delay/theta)^l`` (the paper's C(i+l, j)
    is a misprint, REFERENCE §1), the shifted Legendre polynomial ``P_i(2 delay/theta - 1)``,
    evaluated by the three-term recurrence: the alternating sum cancels catastrophically at
    high orders. With ZOH, sample ``u_{t-k}`` is held over delays [k, k+1): its centre is
    ``delay = k + 1/2``. ``delay`` (any shape) lies in [0, theta] time steps; returns float64
    weights of shape ``delay.shape + (Q,)``.
    """
    order, theta = _check_count("order", order), _check_theta(theta)
    delay = np.asarray(delay, dtype=np.float64)
    bad = ~((delay >= 0) & (delay <= theta))
    if bad.any():
        offending = delay[bad].ravel()[:5].tolist()
        raise ValueError(f"delay must lie in [0, theta={theta}] time steps, got {offending}")
    weights = np_legendre.legvander(2.0 * delay / theta - 1.0, order - 1)
    return weights.reshape((*delay.shape, order))


def decode(m_xQ, theta: float, delay):
    """Read ``u(t - delay)`` out of a memory ``m_xQ`` of window ``theta``: ``(...)`` for a
    scalar ``delay`` (time steps), ``(..., len(delay))`` for a 1-D array."""
    weights = legendre_decoder(m_xQ.shape[-1], theta, delay)
    if weights.ndim > 2:
        raise ValueError(f"delay must be a scalar or a 1-D array, got shape {weights.shape[:-1]}")
    weights = jnp.asarray(weights, dtype=_compute_dtype(m_xQ.dtype))
    return jnp.matmul(m_xQ, weights.T if weights.ndim == 2 else weights, precision=_PRECISION)


def _compute_dtype(*dtypes) -> jnp.dtype:
    # At least float32: jnp.fft has no bf16/f16 kernels, and sums over time need the mantissa.
    # Every mode computes and returns this dtype, so an int or bf16 input is never truncated.
    return functools.reduce(jnp.promote_types, dtypes, jnp.dtype(jnp.float32))


def _check_input(u_BxTxC) -> None:
    if u_BxTxC.ndim != 3:
        raise ValueError(
            f"the memory input must have shape (batch, time, channels), got {u_BxTxC.shape}"
        )


def _kernel_for(u_BxTxC, kernel_TxK, name: str = "kernel"):
    _check_input(u_BxTxC)
    n = u_BxTxC.shape[1]
    if kernel_TxK.ndim != 2 or kernel_TxK.shape[0] < n:
        raise ValueError(
            f"{name} must have shape (time >= {n}, width) for an input of {n} steps, "
            f"got {kernel_TxK.shape}"
        )
    return jnp.asarray(kernel_TxK[:n], dtype=_compute_dtype(u_BxTxC.dtype))


def fft_length(n: int) -> int:
    """The smallest 5-smooth number (2^a 3^b 5^c) >= 2n - 1: a linear, not circular, convolution."""
    return scipy.fft.next_fast_len(max(2 * n - 1, 1), real=True)


def memory_fft(u_BxTxC, h_TxQ, *, time_last: bool = False):
    """``m_BxTxCxQ`` in parallel, ``m_t = sum_{j<=t} H[t-j] u_j``, by FFT convolution with the
    impulse response ``h_TxQ`` (at least T rows: ``impulse_response(q, theta, T)``; any kernel
    works, rows past T ignored), in the compute dtype; ``time_last`` gives ``m_BxCxQxT``, the
    layout the inverse FFT writes."""
    kernel_TxK = _kernel_for(u_BxTxC, h_TxQ)
    n = u_BxTxC.shape[1]
    nfft = fft_length(n)
    u_BxCxT = jnp.swapaxes(u_BxTxC.astype(kernel_TxK.dtype), 1, 2)
    u_BxCxF = jnp.fft.rfft(u_BxCxT, n=nfft, axis=-1)
    kernel_KxF = jnp.fft.rfft(kernel_TxK.T, n=nfft, axis=-1)
    y_BxCxKxF = u_BxCxF[:, :, None, :] * kernel_KxF[None, None, :, :]
    y_BxCxKxT = jnp.fft.irfft(y_BxCxKxF, n=nfft, axis=-1)[..., :n]
    return y_BxCxKxT if time_last else jnp.transpose(y_BxCxKxT, (0, 3, 1, 2))


def memory_reduced(u_BxTxC, h_TxQ, l_KxQ, *, time_last: bool = False):
    """The reduced-order memory of appendix A.1, ``y_BxTxCxK = L m`` as ``u * (L H)``: the FFT
    work scales with K = q', not q, and stacking projections (Q, K, V) in ``l_KxQ`` shares the
    input's FFT. ``y_BxCxKxT`` with ``time_last``."""
    h_TxQ = _kernel_for(u_BxTxC, h_TxQ, name="h_TxQ")
    l_KxQ = jnp.asarray(l_KxQ)
    if l_KxQ.ndim != 2 or l_KxQ.shape[1] != h_TxQ.shape[1]:
        raise ValueError(
            f"L must have shape (reduced order, order={h_TxQ.shape[1]}), got {l_KxQ.shape}"
        )
    kernel_TxK = jnp.matmul(h_TxQ, l_KxQ.astype(h_TxQ.dtype).T, precision=_PRECISION)
    return memory_fft(u_BxTxC, kernel_TxK, time_last=time_last)


def memory_step(m_BxCxQ, u_BxC, abar_QxQ, bbar_Q):
    """One step for every channel, ``m_t = Abar m_{t-1} + Bbar u_t``, in the compute dtype."""
    dtype = _compute_dtype(m_BxCxQ.dtype, u_BxC.dtype)
    abar_QxQ = jnp.asarray(abar_QxQ, dtype=dtype)
    bbar_Q = jnp.asarray(bbar_Q, dtype=dtype)
    decayed = jnp.matmul(m_BxCxQ.astype(dtype), abar_QxQ.T, precision=_PRECISION)
    return decayed + u_BxC.astype(dtype)[..., None] * lax.broadcast_to_rank(bbar_Q, decayed.ndim)


def _initial_state(m0_BxCxQ, shape: tuple[int, int, int], dtype):
    if m0_BxCxQ is None:
        return jnp.zeros(shape, dtype)
    if jnp.shape(m0_BxCxQ) != shape:
        raise ValueError(
            f"m0 must have shape (batch, channels, order) = {shape}, got {jnp.shape(m0_BxCxQ)}"
        )
    return jnp.asarray(m0_BxCxQ, dtype)


def memory_scan(u_BxTxC, abar_QxQ, bbar_Q, m0_BxCxQ=None):
    """``m_BxTxCxQ`` by the recurrence in ``lax.scan``, in the compute dtype, from the state
    ``m0_BxCxQ`` (default zeros); the last step is the state to carry on with."""
    _check_input(u_BxTxC)
    batch, _, channels = u_BxTxC.shape
    order = np.shape(bbar_Q)[0]
    dtype = _compute_dtype(u_BxTxC.dtype)
    m0_BxCxQ = _initial_state(m0_BxCxQ, (batch, channels, order), dtype)

    def step(m_BxCxQ, u_BxC):
        m_BxCxQ = memory_step(m_BxCxQ, u_BxC, abar_QxQ, bbar_Q)
        return m_BxCxQ, m_BxCxQ

    _, m_TxBxCxQ = lax.scan(step, m0_BxCxQ, jnp.swapaxes(u_BxTxC, 0, 1))
    return jnp.swapaxes(m_TxBxCxQ, 0, 1)


def memory_final(u_BxTxC, h_TxQ):
    """Only the last state ``m_BxCxQ = sum_j H[T-1-j] u_j``, by one contraction over time."""
    h_TxQ = _kernel_for(u_BxTxC, h_TxQ, name="h_TxQ")
    u_BxTxC = u_BxTxC.astype(h_TxQ.dtype)
    return jnp.einsum("btc,tq->bcq", u_BxTxC, h_TxQ[::-1], precision=_PRECISION)


def memory_reference(u_BxTxC, order: int, theta: float) -> np.ndarray:
    """``m_BxTxCxQ`` by the recurrence in numpy float64: the yardstick for every other mode."""
    u_BxTxC = np.asarray(u_BxTxC, dtype=np.float64)
    _check_input(u_BxTxC)
    abar_QxQ, bbar_Q = discretize(order, theta)
    batch, n, channels = u_BxTxC.shape
    m_BxTxCxQ = np.empty((batch, n, channels, abar_QxQ.shape[0]))
    m_BxCxQ = np.zeros((batch, channels, abar_QxQ.shape[0]))
    for t in range(n):
        m_BxCxQ = m_BxCxQ @ abar_QxQ.T + u_BxTxC[:, t, :, None] * bbar_Q
        m_BxTxCxQ[:, t] = m_BxCxQ
    return m_BxTxCxQ


# The chunk length c of ``memory_chunked``: as fast as 32 or 128 (the README's benchmarks),
# with half the sequential state-passing steps of 32.
DEFAULT_CHUNK = 64
PRECISIONS = ("exact", "fast")


@functools.lru_cache(maxsize=_ZOH_CACHE_SIZE)
def _abar_power(order: int, theta: float, steps: int) -> np.ndarray:
    abar_QxQ, _ = _zoh(order, theta)
    result, base = np.eye(order), abar_QxQ
    while steps:
        if steps & 1:
            result = result @ base
        base = base @ base
        steps >>= 1
    return _read_only(result)


# How products at float32 accuracy run (``exact_algorithm``; a run's is ``ops.Impls``'s):
# "highest", float32 products, or on a GPU's tensor cores, which XLA's highest would leave,
# "bf16x3", three bf16 passes (hi*hi + hi*lo + lo*hi), float32 accuracy to 1.1e-5 of max|m|
# at the paper's largest layer; "bf16x6" and "tf32" are the alternatives
# benchmarks/lmu_precision.py measures. float64 is always exact.
EXACT_ALGORITHMS = {
    "highest": lax.Precision.HIGHEST,
    "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16x6": lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
}


def _exact_precision(dtype, algorithm: str):
    if algorithm not in EXACT_ALGORITHMS:
        raise ValueError(
            f"exact_algorithm must be one of {tuple(EXACT_ALGORITHMS)}, got {algorithm!r}"
        )
    if jnp.dtype(dtype) == jnp.float64:
        return lax.Precision.HIGHEST
    return EXACT_ALGORITHMS[algorithm]


def _exact(spec: str, a, b, algorithm: str):
    """An einsum at float32 accuracy (by ``algorithm``), accumulated and returned in the
    operands' dtype, at least float32."""
    dtype = _compute_dtype(a.dtype, b.dtype)
    precision = _exact_precision(dtype, algorithm)
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=dtype)


def chunked(u_BxTxC, chunk: int):
    """``u_BxJxcxC``: the input in J chunks of c = min(chunk, T) steps, the last zero-padded, in
    the compute dtype."""
    batch, n, channels = u_BxTxC.shape
    c = min(_check_count("chunk", chunk), n)
    chunks = -(-n // c)
    u_BxTxC = jnp.pad(
        u_BxTxC.astype(_compute_dtype(u_BxTxC.dtype)), ((0, 0), (0, chunks * c - n), (0, 0))
    )
    return u_BxTxC.reshape(batch, chunks, c, channels)


def chunk_operands(
    u_BxTxC,
    order: int,
    theta: float,
    m0_BxCxQ=None,
    *,
    chunk: int = DEFAULT_CHUNK,
    dtype=None,
    exact_algorithm: str = "highest",
):
    """The operand of ``memory_chunked``, shared by any number of projections L:
    ``(x_BxJxCxZ, m_BxCxQ)``, Z = c + Q rows ``[u_{j,0..c-1}; m_j]`` for each of J chunks of
    c = min(chunk, T) steps (the last zero-padded), and the state after the last input. The
    state passing runs at float32 accuracy (by ``exact_algorithm``) whatever the product's
    ``dtype`` (default the compute dtype; bfloat16 for a "fast" product, which rounds to it
    anyway)."""
    _check_input(u_BxTxC)
    order, theta = _check_count("order", order), _check_theta(theta)
    batch, n, channels = u_BxTxC.shape
    if n == 0:
        raise ValueError(
            f"the memory input must have at least one time step, got shape {u_BxTxC.shape}"
        )
    u_BxJxcxC = chunked(u_BxTxC, chunk)
    chunks, c = u_BxJxcxC.shape[1:3]
    state_dtype = u_BxJxcxC.dtype
    operand_dtype = state_dtype if dtype is None else jnp.dtype(dtype)
    m0_BxCxQ = _initial_state(m0_BxCxQ, (batch, channels, order), state_dtype)
    h_cxQ = impulse_response(order, theta, c)  # float64, H[0..c-1]
    last = n - (chunks - 1) * c  # steps in the last chunk, 1..c

    # The state passing is sequential, but only J = T / c steps long.
    hrev_cxQ = jnp.asarray(h_cxQ[::-1].copy(), state_dtype)
    # End states of every chunk but the last (which only the final state needs).
    exact = functools.partial(_exact, algorithm=exact_algorithm)
    ends_JxBxCxQ = jnp.swapaxes(exact("bjsc,sq->bjcq", u_BxJxcxC[:, :-1], hrev_cxQ), 0, 1)
    abar_c_QxQ = jnp.asarray(_abar_power(order, theta, c), state_dtype)

    def pass_state(m_BxCxQ, end_BxCxQ):
        return exact("bcq,pq->bcp", m_BxCxQ, abar_c_QxQ) + end_BxCxQ, m_BxCxQ

    m_last_BxCxQ, carried_JxBxCxQ = lax.scan(pass_state, m0_BxCxQ, ends_JxBxCxQ)
    carried_BxJxCxQ = jnp.swapaxes(jnp.concatenate([carried_JxBxCxQ, m_last_BxCxQ[None]]), 0, 1)
    parts = (jnp.swapaxes(u_BxJxcxC, 2, 3), carried_BxJxCxQ)
    x_BxJxCxZ = jnp.concatenate([part.astype(operand_dtype) for part in parts], axis=-1)

    # The state after the last input, from the last chunk's `last` real steps.
    hlast_cxQ = np.zeros_like(h_cxQ)
    hlast_cxQ[:last] = h_cxQ[:last][::-1]
    abar_last_QxQ = jnp.asarray(_abar_power(order, theta, last), state_dtype)
    final_BxCxQ = exact("bcq,pq->bcp", m_last_BxCxQ, abar_last_QxQ) + exact(
        "bsc,sq->bcq", u_BxJxcxC[:, -1], jnp.asarray(hlast_cxQ, state_dtype)
    )
    return x_BxJxCxZ, final_BxCxQ


def chunk_weights(
    order: int,
    theta: float,
    chunk: int,
    l_KxQ=None,
    dtype=jnp.float32,
    exact_algorithm: str = "highest",
):
    """The chunk product's matrix ``w_ZxKxc = [T; R]`` for a projection L, in ``dtype``:
    ``T[s, :, t] = G[t - s]`` for s <= t (zero above), the Toeplitz matrix of ``G[k] = L H[k]``;
    ``R[:, :, t] = (L Abar^{t+1})^T`` reads out the carried state, built from ``L Abar`` by
    log2(c) doublings at float32 accuracy (by ``exact_algorithm``), so gradients reach L. The
    chunk's step is the last column axis (``chunk_product``). ``l_KxQ`` None is the full
    memory (L = I)."""
    exact = functools.partial(_exact, algorithm=exact_algorithm)
    order, theta = _check_count("order", order), _check_theta(theta)
    c = _check_count("chunk", chunk)
    h_cxQ = jnp.asarray(impulse_response(order, theta, c), dtype)
    abar_QxQ = jnp.asarray(_zoh(order, theta)[0], dtype)
    if l_KxQ is None:
        g_cxK, r_KxQ = h_cxQ, abar_QxQ
    else:
        l_KxQ = jnp.asarray(l_KxQ).astype(dtype)
        if l_KxQ.ndim != 2 or l_KxQ.shape[1] != order:
            raise ValueError(f"L must have shape (reduced order, order={order}), got {l_KxQ.shape}")
        g_cxK = exact("tq,kq->tk", h_cxQ, l_KxQ)
        r_KxQ = exact("kq,qp->kp", l_KxQ, abar_QxQ)
    r_cxKxQ, k = r_KxQ[None], 1
    while k < c:  # R[k:2k] = R[:k] Abar^k
        power_QxQ = jnp.asarray(_abar_power(order, theta, k), dtype)
        r_cxKxQ = jnp.concatenate([r_cxKxQ, exact("tkq,qp->tkp", r_cxKxQ[: c - k], power_QxQ)])
        k *= 2
    lag_cxc = np.arange(c)[None, :] - np.arange(c)[:, None]  # [s, t] -> t - s
    toeplitz_cxcxK = jnp.where(
        jnp.asarray(lag_cxc >= 0)[..., None], g_cxK[np.clip(lag_cxc, 0, None)], 0.0
    )
    return jnp.concatenate(
        [jnp.transpose(toeplitz_cxcxK, (0, 2, 1)), jnp.transpose(r_cxKxQ, (2, 1, 0))]
    )


def _product_operands(precision: str, x_BxJxCxZ, w_ZxKxc):
    """The chunk product's operands as its matmuls take them, and the matmuls' options, for
    ``precision`` "fast" or an exact algorithm."""
    if precision == "fast":
        return x_BxJxCxZ.astype(jnp.bfloat16), w_ZxKxc.astype(jnp.bfloat16), {}
    dtype = _compute_dtype(x_BxJxCxZ.dtype, w_ZxKxc.dtype)
    return x_BxJxCxZ, w_ZxKxc, {"precision": _exact_precision(dtype, precision)}


# The contractions of the chunk product, on (B, J, C, Z) operands and (B, J, C, K, c) outputs:
# y = x w over Z; dx = dy w over (K, c); dw = x dy over (B, J, C).
_FORWARD = (((3,), (0,)), ((), ()))
_INPUT_GRAD = (((3, 4), (1, 2)), ((), ()))
_WEIGHT_GRAD = (((0, 1, 2), (0, 1, 2)), ((), ()))
# The same written channels last, (K, c, B, J, C) outputs, the order ``dot_general(w, x)``
# writes: y = w^T x over Z; dx = dy^T w over (K, c); dw = x^T dy over (B, J, C).
_CL_FORWARD = (((0,), (3,)), ((), ()))
_CL_INPUT_GRAD = (((0, 1), (1, 2)), ((), ()))
_CL_WEIGHT_GRAD = (((0, 1, 2), (2, 3, 4)), ((), ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _chunk_matmul(x_BxJxCxZ, w_ZxKxc, precision: str, out_dtype, channels_last: bool):
    x_BxJxCxZ, w_ZxKxc, options = _product_operands(precision, x_BxJxCxZ, w_ZxKxc)
    operands = (
        (w_ZxKxc, x_BxJxCxZ, _CL_FORWARD) if channels_last else (x_BxJxCxZ, w_ZxKxc, _FORWARD)
    )
    return lax.dot_general(*operands, preferred_element_type=out_dtype, **options)


def _chunk_matmul_fwd(x_BxJxCxZ, w_ZxKxc, precision, out_dtype, channels_last):
    y = _chunk_matmul(x_BxJxCxZ, w_ZxKxc, precision, out_dtype, channels_last)
    return y, (x_BxJxCxZ, w_ZxKxc)


def _chunk_matmul_bwd(precision, out_dtype, channels_last, residuals, dy):
    # Written out so that both products read dy in the layout the forward product wrote it
    # (JAX's own transpose had XLA copy it first): dx = dy w^T contracts its (K, c) axes,
    # dw = x^T dy its (B, J, C) ones, each accumulated in float32.
    del out_dtype
    x_BxJxCxZ, w_ZxKxc = residuals
    wide = _compute_dtype(x_BxJxCxZ.dtype, w_ZxKxc.dtype)
    in_x_BxJxCxZ, in_w_ZxKxc, options = _product_operands(precision, x_BxJxCxZ, w_ZxKxc)
    dy = dy.astype(in_w_ZxKxc.dtype)
    input_grad, weight_grad = (
        (_CL_INPUT_GRAD, _CL_WEIGHT_GRAD) if channels_last else (_INPUT_GRAD, _WEIGHT_GRAD)
    )
    product = functools.partial(lax.dot_general, preferred_element_type=wide, **options)
    dx_BxJxCxZ = product(dy, in_w_ZxKxc, input_grad)
    dw_ZxKxc = product(in_x_BxJxCxZ, dy, weight_grad)
    return dx_BxJxCxZ.astype(x_BxJxCxZ.dtype), dw_ZxKxc.astype(w_ZxKxc.dtype)


_chunk_matmul.defvjp(_chunk_matmul_fwd, _chunk_matmul_bwd)


def _chunk_product(x_BxJxCxZ, w_ZxKxc, precision, out_dtype, exact_algorithm, channels_last):
    """``chunk_product`` or, ``channels_last``, ``chunk_product_channels_last``, once the
    operands and precision are checked; the output dtype defaults to the operand's, at least
    float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    _exact_precision(jnp.float32, exact_algorithm)  # checks the name
    if x_BxJxCxZ.ndim != 4 or w_ZxKxc.ndim != 3 or x_BxJxCxZ.shape[-1] != w_ZxKxc.shape[0]:
        raise ValueError(
            f"the chunk product takes an operand (batch, chunks, channels, Z) and weights "
            f"(Z, K, c) with the same Z, got {x_BxJxCxZ.shape} and {w_ZxKxc.shape}"
        )
    out_dtype = _compute_dtype(x_BxJxCxZ.dtype) if out_dtype is None else jnp.dtype(out_dtype)
    mode = "fast" if precision == "fast" else exact_algorithm
    return _chunk_matmul(x_BxJxCxZ, w_ZxKxc, mode, out_dtype, channels_last)


def chunk_product(
    x_BxJxCxZ, w_ZxKxc, precision: str = "exact", out_dtype=None, exact_algorithm="highest"
):
    """Every chunk's outputs in one matrix product, ``y_BxJxCxKxc = [u_j; m_j]^T [T; R]``.
    ``y`` stays in the layout the product writes (``sequence_from_chunks`` orders it by
    position), rounded to ``out_dtype`` (default the operand's, at least float32; bfloat16
    halves the bytes for a bfloat16 consumer). ``precision`` and ``exact_algorithm`` are as in
    ``memory_chunked``."""
    return _chunk_product(x_BxJxCxZ, w_ZxKxc, precision, out_dtype, exact_algorithm, False)


def chunk_product_channels_last(
    x_BxJxCxZ, w_ZxKxc, precision: str = "exact", out_dtype=None, exact_algorithm="highest"
):
    """``chunk_product`` written channels last: ``y_KxcxBxJxC``, the same numbers with the
    channels minor and the projection and step axes major, as a matrix product ``w^T x``
    writes them (no transpose), for sums over the channels along the minor axis."""
    return _chunk_product(x_BxJxCxZ, w_ZxKxc, precision, out_dtype, exact_algorithm, True)


def sequence_from_chunks(y_BxJx___xc, length: int):
    """``y_BxJx...xc`` -> ``y_BxTx...``: chunks J and steps c become T = ``length`` positions."""
    batch, chunks, *middle, c = y_BxJx___xc.shape
    y_BxJxcx___ = jnp.moveaxis(y_BxJx___xc, -1, 2)
    return y_BxJxcx___.reshape(batch, chunks * c, *middle)[:, :length]


def memory_chunked(
    u_BxTxC,
    order: int,
    theta: float,
    l_KxQ=None,
    m0_BxCxQ=None,
    *,
    chunk: int = DEFAULT_CHUNK,
    precision: str = "exact",
    exact_algorithm: str = "highest",
):
    """The memory in chunks of c steps by matrix products: ``L m_t`` (or ``m_t``) for every t,
    the function of ``memory_reduced`` (``memory_fft`` without L) for any T, with the state
    ``m0_BxCxQ`` carried in (default zeros) and out, so a sequence in pieces equals the whole.

    With ``G[k] = L H[k]`` (k < c) and ``m_j`` the state carried into chunk j, the outputs
    ``y_{j,t} = sum_{s<=t} G[t-s] u_{j,s} + (L Abar^{t+1}) m_j`` (a c x c Toeplitz product plus
    the state's read-out) are one product (``chunk_product``); the end states
    ``s_j = sum_s H[c-1-s] u_{j,s}`` are passed on as ``m_{j+1} = Abar^c m_j + s_j`` by a
    ``lax.scan`` over J (``chunk_operands``).

    ``precision`` is the output products': "exact", float32 accuracy (1e-6 of max|m| at the
    paper's largest layer in float32 products, 1.1e-5 in ``exact_algorithm="bf16x3"``), or
    "fast", one bf16 pass for bf16 models (about 3e-3); the state is always at float32
    accuracy.
    Returns ``(y_BxTxCxK, m_BxCxQ)`` (K = Q without L), float32 (float64 for float64 input).
    """
    operand = jnp.bfloat16 if precision == "fast" else None  # chunk_product checks the name
    exact = {"exact_algorithm": exact_algorithm}
    x_BxJxCxZ, final_BxCxQ = chunk_operands(
        u_BxTxC, order, theta, m0_BxCxQ, chunk=chunk, dtype=operand, **exact
    )
    c = x_BxJxCxZ.shape[-1] - order
    dtype = final_BxCxQ.dtype
    w_ZxKxc = chunk_weights(order, theta, c, l_KxQ, dtype=dtype, **exact)
    y_BxJxCxKxc = chunk_product(x_BxJxCxZ, w_ZxKxc, precision, out_dtype=dtype, **exact)
    return sequence_from_chunks(y_BxJxCxKxc, u_BxTxC.shape[1]), final_BxCxQ
