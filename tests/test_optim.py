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


# The schedules at steps 0..10 (warmup 2, 10 steps, a "wsd" decay of the last 4), as fractions
# of the peak, worked out by hand: warmup 0, 1/2; the peak until the decay starts at step 6;
# then the shape at progress k/4 for k = 1, 2, 3; the floor at step 10 (after the last update).
C = 0.5 * (1 + np.cos(np.pi / 4))  # 0.8536
HAND = {
    "linear": (0, 0.5, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0),
    "cosine": (0, 0.5, 1, 1, 1, 1, 1, C, 0.5, 1 - C, 0),
    "1-sqrt": (0, 0.5, 1, 1, 1, 1, 1, 0.5, 1 - np.sqrt(0.5), 1 - np.sqrt(0.75), 0),
}


@pytest.mark.parametrize("shape", list(HAND))
@pytest.mark.parametrize("floor", [0.0, 0.1])
@pytest.mark.parametrize("given", ["steps", "fraction"])
def test_wsd_schedule_against_hand_computed_values(shape, floor, given):
    decay = {"decay_steps": 4} if given == "steps" else {"decay_fraction": 0.4}
    section = optim_section(
        schedule="wsd", decay_shape=shape, final_lr_fraction=floor, learning_rate=2.0, **decay
    )
    _, lr = optim.optimizer(section, 10)
    # the floor lifts the decay only: peak * (floor + (1 - floor) * shape)
    hand = [v if s < 6 else floor + (1 - floor) * v for s, v in enumerate(HAND[shape])]
    got = [float(lr(s)) for s in range(11)]
    np.testing.assert_allclose(got, 2.0 * np.array(hand), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", list(HAND))
def test_a_wsd_decay_of_zero_steps_keeps_the_peak_to_the_end(shape):
    """The stable run that cooldowns branch from, whatever its shape says."""
    section = optim_section(schedule="wsd", decay_fraction=0.0, decay_shape=shape)
    _, lr = optim.optimizer(section, 10)
    got = [float(lr(s)) for s in (0, 1, 2, 9, 10)]
    np.testing.assert_allclose(got, [0.0, 5e-4, 1e-3, 1e-3, 1e-3], rtol=1e-6)
    assert got[2] == got[3] == got[4]


def test_cosine_floor_against_hand_computed_values():
    _, lr = optim.optimizer(optim_section(final_lr_fraction=0.1, learning_rate=1.0), STEPS)
    hand = (0.0, 0.5, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25, 0.1)
    np.testing.assert_allclose([float(lr(s)) for s in range(STEPS + 1)], hand, rtol=1e-6)


def model_params(name):
    from lmuscale.models import build
    from lmuscale.ops import resolve

    model_config = named_config(name)
    model = build(model_config, resolve(model_config))
    tokens = jnp.zeros((1, 8), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))["params"]


# Each family's parameters that the default mask leaves out of weight decay, by path, by hand:
# norms' scales and biases, every bias, the embeddings (tokens, and the transformer's positions).
NOT_DECAYED = {
    "lmu-55k": lambda path: path.endswith(("bias", "scale", "embedding")),
    "transformer-55k": lambda path: path.endswith(("bias", "scale", "embedding", "positions")),
}


@pytest.mark.parametrize("name", list(NOT_DECAYED))
def test_weight_decay_mask_leaves_out_norms_biases_and_embeddings(name):
    params = model_params(name)
    paths = {
        "/".join(str(k.key) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    mask = dict(zip(paths, jax.tree.leaves(optim.decay_mask(params, optim_section())), strict=True))
    kept = {p for p, decayed in mask.items() if not decayed}
    assert kept == {p for p in paths if NOT_DECAYED[name](p)}
    assert {p for p, decayed in mask.items() if decayed} >= {
        p for p in paths if p.endswith("kernel")
    }
    # Each switch puts its kind back, and only it (a norm's bias is a norm's).
    kinds = {
        "norms": lambda p: any(part.startswith("norm") for part in p.split("/")[:-1]),
        "biases": lambda p: p.endswith("bias") and not kinds["norms"](p),
        "embedding": lambda p: p.endswith(("embedding", "positions")),
    }
    for switch, kind in kinds.items():
        flags = jax.tree.leaves(
            optim.decay_mask(params, optim_section(**{f"weight_decay_{switch}": True}))
        )
        now = {p for p, decayed in zip(paths, flags, strict=True) if not decayed}
        assert kept - now == {p for p in kept if kind(p)} != set(), switch


def test_adamw_adds_the_masked_decay_to_adams_update_times_the_rate():
    """update = -lr (adam + wd * param) where the mask says, -lr adam elsewhere."""
    section = optim_section(weight_decay=0.1, learning_rate=0.5)
    params = {"dense": {"kernel": jnp.full((2, 3), 2.0), "bias": jnp.full((3,), 3.0)}}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.25), params)
    adam, _ = optim.optimizer(optim_section(learning_rate=0.5), STEPS)
    adamw, lr = optim.optimizer(section, STEPS)
    for step in range(3):  # the rate is 0 at step 0: the decay shows from step 1
        a_state, w_state = adam.init(params), adamw.init(params)
        for _ in range(step + 1):
            a_up, a_state = adam.update(grads, a_state, params)
            w_up, w_state = adamw.update(grads, w_state, params)
        rate = float(lr(step))
        np.testing.assert_allclose(w_up["dense"]["bias"], a_up["dense"]["bias"], rtol=1e-6)
        np.testing.assert_allclose(
            w_up["dense"]["kernel"], a_up["dense"]["kernel"] - rate * 0.1 * 2.0, rtol=1e-6
        )
