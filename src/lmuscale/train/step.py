"""The train state, the mesh and its shardings, and the jitted train and eval steps.

The state ``{"step", "params", "opt_state", "plateau"}`` is all a resume needs: batches are a
function of (seed, step) and the models draw no random numbers. Batches are split over the
mesh's "data" axis, state arrays over "model" (ZeRO-3 style: XLA gathers what each op needs).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lmuscale.models import LanguageModel

AXES = ("data", "model")
CACHE_ENV = "LMUSCALE_XLA_CACHE"  # the compilation cache's folder, or "off"


def compilation_cache() -> Path | None:
    """Turn on JAX's persistent compilation cache for this process; returns its folder. The
    folder is ``$LMUSCALE_XLA_CACHE`` ("off": no cache), else ``$XDG_CACHE_HOME/lmuscale/xla``
    (``~/.cache/lmuscale/xla``); a cache JAX was given already (``JAX_COMPILATION_CACHE_DIR``)
    is kept. A cached executable is the compiler's own output, so the numbers do not change.
    Concurrent processes may share the folder: an entry that another is still writing, or that
    a killed process left torn, fails JAX's decompression, and JAX compiles afresh."""
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    choice = os.environ.get(CACHE_ENV, "")
    if choice == "off":
        return None
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = Path(choice) if choice else home / "lmuscale" / "xla"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"note: no compilation cache: {folder}: {error.strerror}", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return folder


def make_mesh(model_axis: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over ``devices`` (default: all of them, across processes)."""
    devices = list(jax.devices() if devices is None else devices)
    if model_axis < 1 or len(devices) % model_axis:
        raise ValueError(
            f"mesh.model ({model_axis}) must divide the number of devices ({len(devices)})"
        )
    grid = np.array(devices, dtype=object).reshape(len(devices) // model_axis, model_axis)
    return Mesh(grid, AXES)


def spec_for(shape: tuple[int, ...], model_axis: int) -> P:
    """Replicated, or split over "model" along the largest dimension it divides."""
    candidates = [i for i, n in enumerate(shape) if n % model_axis == 0]
    if model_axis == 1 or not candidates:
        return P()
    axis = max(candidates, key=lambda i: shape[i])
    return P(*[("model" if i == axis else None) for i in range(len(shape))])


def state_shardings(mesh: Mesh, abstract_state):
    model_axis = mesh.shape["model"]
    return jax.tree.map(
        lambda leaf: NamedSharding(mesh, spec_for(leaf.shape, model_axis)), abstract_state
    )


def batch_sharding(mesh: Mesh, ndim: int, axis: int = 0) -> NamedSharding:
    """Split dimension ``axis`` of an ``ndim``-dimensional batch over "data"."""
    return NamedSharding(mesh, P(*[("data" if i == axis else None) for i in range(ndim)]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def to_global(local_rows: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from each process's rows (its contiguous block of the sharded axis)."""
    return jax.make_array_from_process_local_data(sharding, local_rows)


@dataclasses.dataclass(frozen=True)
class MicroBatches:
    """How the train step takes a global batch of B windows of T + 1 tokens: as M = ``count``
    micro-batches, one (M, B/M, T+1) int32 array whose axis 1 is split over "data".

    Each process cuts its contiguous block of the B windows (``data.TrainBatches``) into M
    equal runs in order; micro-batch m is the processes' runs m, in process order.
    """

    mesh: Mesh
    count: int

    @property
    def sharding(self) -> NamedSharding:
        return batch_sharding(self.mesh, 3, axis=1)

    def shape(self, rows: int, seq_len: int) -> tuple[int, int, int]:
        """(M, rows / M, T + 1): ``rows`` windows (a process's block, or all B) as M runs."""
        return (self.count, rows // self.count, seq_len + 1)

    def abstract(self, global_batch: int, seq_len: int) -> jax.ShapeDtypeStruct:
        """The global batch's shape, dtype and sharding: what the train step compiles for."""
        shape = self.shape(global_batch, seq_len)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.sharding)

    def place(self, rows_BxT1: np.ndarray) -> jax.Array:
        """The global batch from this process's (B / processes, T + 1) rows of it."""
        rows, width = rows_BxT1.shape
        return to_global(rows_BxT1.reshape(self.shape(rows, width - 1)), self.sharding)


def init_fn(model: LanguageModel, tx, plateau, seed: int, seq_len: int):
    """``() -> state``: the initial state, parameters drawn from ``seed``."""

    def init():
        params = model.init(jax.random.key(seed), jnp.zeros((1, seq_len), jnp.int32))
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": tx.init(params),
            "plateau": plateau.init(params),
        }

    return init


def init_state(init, mesh: Mesh, shardings=None):
    """The initial state, each array created directly with its sharding."""
    if shardings is None:
        shardings = state_shardings(mesh, jax.eval_shape(init))
    return jax.jit(init, out_shardings=shardings)()


def norm(tree) -> jax.Array:
    """The global L2 norm of a pytree, in float32."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def make_train_step(model: LanguageModel, tx, lr_schedule, mesh: Mesh, abstract_state):
    """``(state, tokens_MxBxT1) -> (state, metrics)``, jitted with the state donated.

    Gradients are summed over the M micro-batches in a ``lax.scan`` and divided by M, and the
    updates scaled by the plateau scale. ``metrics["finite"]``: the loss and the new
    parameters hold no NaN or infinity.
    """

    def mean_loss(params, tokens_BxT1):  # nats per token
        mean, _ = model.apply(params, tokens_BxT1[:, :-1], tokens_BxT1[:, 1:], method=model.loss)
        return mean

    grad = jax.value_and_grad(mean_loss)

    def step(state, tokens_MxBxT1):
        params = state["params"]
        micro = tokens_MxBxT1.shape[0]
        if micro == 1:
            loss, grads = grad(params, tokens_MxBxT1[0])
        else:

            def accumulate(total, tokens_BxT1):
                loss, g = grad(params, tokens_BxT1)
                return jax.tree.map(jnp.add, total, g), loss

            zeros = jax.tree.map(jnp.zeros_like, params)
            grads, losses = jax.lax.scan(accumulate, zeros, tokens_MxBxT1)
            grads = jax.tree.map(lambda g: g / micro, grads)
            loss = losses.mean()
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        scale = state["plateau"].scale
        updates = jax.tree.map(lambda u: u * scale.astype(u.dtype), updates)
        params = optax.apply_updates(params, updates)
        param_norm = norm(params)
        metrics = {
            "loss": loss,
            "grad_norm": norm(grads),
            "param_norm": param_norm,
            "lr": lr_schedule(state["step"]) * scale,
            "finite": jnp.isfinite(loss) & jnp.isfinite(param_norm),
        }
        new_state = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}
        return new_state, metrics

    shardings = state_shardings(mesh, abstract_state)
    return jax.jit(
        step,
        in_shardings=(shardings, MicroBatches(mesh, 1).sharding),
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=0,
    )


def make_eval_step(model: LanguageModel, mesh: Mesh, abstract_params):
    """``(params, tokens_BxT1, valid_B) -> {"sum": (), "per_position": (T,), "rows": ()}``:
    the float32 loss summed over valid rows, and at each position."""

    def evaluate(params, tokens_BxT1, valid_B):
        # Gather the parameters first: with model-sharded parameters, XLA:CPU otherwise gives
        # the FFT an operand layout its runtime rejects (RET_CHECK in fft_thunk.cc).
        params = jax.lax.with_sharding_constraint(params, replicated(mesh))
        _, per_position_BxT = model.apply(
            params, tokens_BxT1[:, :-1], tokens_BxT1[:, 1:], method=model.loss
        )
        weight_Bx1 = valid_B.astype(jnp.float32)[:, None]
        masked = per_position_BxT * weight_Bx1
        return {
            "sum": masked.sum(),
            "per_position": masked.sum(axis=0),
            "rows": weight_Bx1.sum(),
        }

    param_shardings = state_shardings(mesh, abstract_params)
    return jax.jit(
        evaluate,
        in_shardings=(param_shardings, batch_sharding(mesh, 2), batch_sharding(mesh, 1)),
        out_shardings=replicated(mesh),
    )


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape["data"]
