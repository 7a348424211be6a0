"""The optimisation: Adam (AdamW with ``optim.weight_decay``), a learning-rate schedule, and
reduce-on-plateau.

Schedules (``optim.schedule``), each from linear warmup over ``optim.warmup_steps``:
- ``"cosine"``, the paper's: a cosine decay to the floor at ``train.steps``;
- ``"wsd"``, warmup-stable-decay: the peak rate until the decay's last ``decay_steps`` steps
  (or ``decay_fraction`` of the run), then down to the floor along ``decay_shape``: ``linear``,
  ``cosine`` or ``1-sqrt`` (1 - sqrt(progress), Hägele et al. 2024). A decay of 0 steps keeps
  the peak rate to the end: a stable run, from whose checkpoints cooldowns branch.
The floor is ``final_lr_fraction`` of the peak. Step s (0-based) is the s-th update.

Reduce-on-plateau reads the validation loss, so it is kept out of the optax chain (``optimizer``):
the train step multiplies the updates by its ``scale``, for a learning rate ``schedule(s) * scale``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax import contrib

SCHEDULES = ("cosine", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def cosine(peak: float, warmup_steps: int, total_steps: int, floor: float = 0.0):
    """Linear warmup from 0 to ``peak`` over ``warmup_steps``, then cosine decay to ``floor``
    (a fraction of ``peak``) at ``total_steps``."""

    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * step / max(warmup_steps, 1)
        progress = jnp.clip((step - warmup_steps) / (total_steps - warmup_steps), 0.0, 1.0)
        if floor:  # without one, the paper's expression as it always was, bit for bit
            cosine = peak * (floor + (1 - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress)))
        else:
            cosine = 0.5 * peak * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup_steps, warm, cosine)

    return lr


def peak_until(optim, total_steps: int) -> int:
    """The first step whose rate may differ from that of another schedule of the same kind,
    peak and warmup: where a "wsd" decay starts, or the end of the cosine's warmup."""
    if optim.schedule == "wsd":
        return total_steps - decay_steps(optim, total_steps)
    return optim.warmup_steps


def decay_steps(optim, total_steps: int) -> int:
    """The steps of a "wsd" schedule's decay: ``decay_steps``, else ``decay_fraction`` of the
    run (rounded)."""
    return optim.decay_steps or round(optim.decay_fraction * total_steps)


def wsd(peak, warmup_steps, total_steps, decay: int, shape: str, floor: float = 0.0):
    """Warmup-stable-decay: linear warmup to ``peak``, constant, then ``decay`` steps down to
    ``floor`` (a fraction of ``peak``) along ``shape`` (``DECAY_SHAPES``), reached at
    ``total_steps``."""
    pieces = [optax.linear_schedule(0.0, peak, warmup_steps), optax.constant_schedule(peak)]
    if not decay:  # a stable run (optax's cosine piece refuses 0 steps)
        return optax.join_schedules(pieces, [warmup_steps])
    end = peak * floor
    if shape == "linear":
        down = optax.linear_schedule(peak, end, decay)
    elif shape == "cosine":
        down = optax.cosine_decay_schedule(peak, decay, alpha=floor)
    else:  # 1-sqrt: no optax piece has it

        def down(step):
            progress = jnp.clip(jnp.asarray(step, jnp.float32) / decay, 0.0, 1.0)
            return end + (peak - end) * (1.0 - jnp.sqrt(progress))

    return optax.join_schedules([*pieces, down], [warmup_steps, total_steps - decay])


def schedule(optim, total_steps: int) -> optax.Schedule:
    """The learning rate at each step of a config's ``optim`` section, for a run of
    ``total_steps``."""
    floor = optim.final_lr_fraction
    if optim.schedule == "cosine":
        return cosine(optim.learning_rate, optim.warmup_steps, total_steps, floor)
    decay = decay_steps(optim, total_steps)
    shape = optim.decay_shape
    return wsd(optim.learning_rate, optim.warmup_steps, total_steps, decay, shape, floor)


def decayed(path, _leaf, optim) -> bool:
    """Whether weight decay applies to the parameter at ``path`` (a key path): every weight
    but norms' (a module named ``norm*``), biases (``bias``, the SRU's ``b``) and the
    embeddings (token and position tables), unless ``optim.weight_decay_norms`` / ``_biases``
    / ``_embedding`` say so."""
    names = [str(getattr(k, "key", k)) for k in path]
    if any(name.startswith("norm") for name in names[:-1]):
        return optim.weight_decay_norms
    if names[-1] in ("bias", "b"):
        return optim.weight_decay_biases
    if names[-1] in ("embedding", "positions"):
        return optim.weight_decay_embedding
    return True


def decay_mask(params, optim):
    """A tree like ``params``: True where ``decayed``."""
    return jax.tree_util.tree_map_with_path(lambda p, x: decayed(p, x, optim), params)


def optimizer(optim, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The per-step chain for a config's ``optim`` section, and its schedule. Weight decay is
    decoupled (AdamW: added to Adam's update, then scaled by the learning rate)."""
    lr = schedule(optim, total_steps)
    parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    parts.append(optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps))
    if optim.weight_decay > 0:  # none: the chain (and its state) as before weight decay
        mask = lambda params: decay_mask(params, optim)  # noqa: E731
        parts.append(optax.add_decayed_weights(optim.weight_decay, mask))
    parts.append(optax.scale_by_learning_rate(lr))
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
