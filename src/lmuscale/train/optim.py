"""The paper's optimisation: Adam, warmup then cosine decay to zero, reduce-on-plateau.

Reduce-on-plateau reads the validation loss, so it is kept out of the optax chain (``optimizer``):
the train step multiplies the updates by its ``scale``, for a learning rate ``schedule(s) * scale``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax import contrib


def schedule(peak: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``peak`` over ``warmup_steps``, then cosine decay to 0 at
    ``total_steps``. Step s (0-based) is the s-th update."""

    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * step / max(warmup_steps, 1)
        progress = jnp.clip((step - warmup_steps) / (total_steps - warmup_steps), 0.0, 1.0)
        cosine = 0.5 * peak * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup_steps, warm, cosine)

    return lr


def optimizer(optim, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The per-step chain for a config's ``optim`` section, and its schedule."""
    lr = schedule(optim.learning_rate, optim.warmup_steps, total_steps)
    parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    parts += [
        optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps),
        optax.scale_by_learning_rate(lr),
    ]
    return optax.chain(*parts), lr


def plateau(optim) -> optax.GradientTransformationExtraArgs:
    """Reduce-on-plateau on the validation loss: one value per evaluation."""
    return contrib.reduce_on_plateau(
        factor=optim.plateau_factor,
        patience=optim.plateau_patience,
        rtol=optim.plateau_rtol,
        cooldown=optim.plateau_cooldown,
        min_scale=optim.plateau_min_scale,
        accumulation_size=1,
    )


def plateau_update(transform, state, val_loss):
    """The plateau state after one validation loss (it scales no updates itself)."""
    _, state = transform.update({}, state, value=jnp.asarray(val_loss, jnp.float32))
    return state


plateau_update_jit = jax.jit(plateau_update, static_argnums=0)
