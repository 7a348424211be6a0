"""The optimiser is the paper's: Adam (Kingma & Ba, bias-corrected moments) with the configured
b1, b2 and eps, optional global-norm clipping, and a learning rate that warms up linearly from 0
and then decays along a cosine to 0 at the last step (REFERENCE §2).

Every training test compares the code with itself, so a wrong Adam (b1 and b2 swapped, eps
inside the square root, no bias correction) would pass them. Here ``optim.optimizer`` runs
several steps on a small pytree against Adam written out in float64 numpy, with the schedule's
values worked out by hand. One Adam step cannot tell b1 from b2 (its bias-corrected update is
g / (|g| + eps) whatever they are), so the comparison runs five.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lmuscale.models import named_config
from lmuscale.train import base_config, optim

WARMUP = 2
STEPS = 5
# The paper's schedule at steps 0..4 for warmup 2 and 5 steps, as fractions of the peak: linear
# from 0 (0, 1/2), then 0.5 (1 + cos(pi k / 3)) for k = 0, 1, 2 steps into the decay.
SCHEDULE = (0.0, 0.5, 1.0, 0.75, 0.25)

SHAPES = {"w": (3, 4), "b": (4,), "inner": {"s": ()}}


def optim_section(**overrides):
    section = base_config(named_config("lmu-55k")).optim
    section.update(warmup_steps=WARMUP, **overrides)
    return section


def gradients(seed: int):
    """STEPS pytrees of float64 gradients of different sizes and signs, so that the moments'
    running averages differ from the latest gradient."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    return [
        jax.tree.unflatten(treedef, [rng.normal(0.0, 1.0 + 3 * step, s) for s in leaves])
        for step in range(STEPS)
    ]


def reference_adam(section, grads_per_step):
    """Adam in float64: each step's updates (to be added to the parameters)."""
    b1, b2, eps, peak = section.b1, section.b2, section.eps, section.learning_rate
    m = jax.tree.map(np.zeros_like, grads_per_step[0])
    v = jax.tree.map(np.zeros_like, grads_per_step[0])
    updates = []
    for step, grads in enumerate(grads_per_step):
        if section.grad_clip > 0:
            total = np.sqrt(sum(np.sum(g**2) for g in jax.tree.leaves(grads)))
            factor = min(1.0, section.grad_clip / total)
            grads = jax.tree.map(lambda g, factor=factor: g * factor, grads)
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        t = step + 1
        lr = peak * SCHEDULE[step]
        updates.append(
            jax.tree.map(
                lambda m, v, lr=lr, t=t: -lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps),
                m,
                v,
            )
        )
    return updates


def run_optimizer(section, grads_per_step):
    tx, lr = optim.optimizer(section, STEPS)
    params = jax.tree.map(lambda g: jnp.ones(g.shape, jnp.float32), grads_per_step[0])
    state = tx.init(params)
    updates, rates = [], []
    for step, grads in enumerate(grads_per_step):
        grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
        update, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, update)
        updates.append(jax.tree.map(np.asarray, update))
        rates.append(float(lr(step)))
    return updates, rates, float(lr(STEPS))


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # the paper's: Adam's defaults, no clipping
        # other moments and a large eps (which would show it inside the square root), and a
        # clip that binds on every step but the first (whose gradients are the smallest)
        {"b1": 0.7, "b2": 0.95, "eps": 1e-2, "grad_clip": 5.0, "learning_rate": 0.3},
    ],
    ids=["paper", "configured"],
)
def test_optimizer_is_adam_with_the_papers_schedule(overrides):
    section = optim_section(**overrides)
    grads_per_step = gradients(seed=len(overrides))
    if section.grad_clip > 0:
        norms = [np.sqrt(sum(np.sum(g**2) for g in jax.tree.leaves(gs))) for gs in grads_per_step]
        assert norms[0] < section.grad_clip < min(norms[1:])
    expected = reference_adam(section, grads_per_step)
    got, rates, last_rate = run_optimizer(section, grads_per_step)
    np.testing.assert_allclose(rates, np.array(SCHEDULE) * section.learning_rate, rtol=1e-6)
    assert last_rate == 0.0
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        pairs = zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(e), strict=True)
        for (path, a), b in pairs:
            where = f"step {step}, {jax.tree_util.keystr(path)}"
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-9, err_msg=where)
    assert all(np.all(leaf != 0) for leaf in jax.tree.leaves(got[2]))
