"""The parallel-LMU layer (parallel-LMU eqs 18-20): every mode against a float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmuscale import lmu
from lmuscale.layers import ParallelLMU


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
    state = layer.init_state(2, x.shape[-1])
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
