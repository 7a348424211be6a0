"""The flash cross-entropy (ops.cross_entropy_flash): its Mosaic GPU kernels run on CPU in
Pallas's GPU interpreter ("interpret"), and the same tiles as plain JAX ("blocked"), against a
float64 softmax and XLA's path; lowered for an H100; on 8 CPU devices against one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_models import reference_cross_entropy, reference_gradients

from lmuscale import ops
from lmuscale.ops import cross_entropy_flash as flash
from lmuscale.ops.cross_entropy import cross_entropy as xla_or_kernels

HERE = Path(__file__).resolve().parent
Blocks = flash.Blocks


def inputs(batch, length, width, vocab, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((batch, length, width)), dtype)
    w = jnp.asarray(0.5 * rng.standard_normal((vocab, width)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    return h, w, targets


def mean_loss(loss_fn, h, w, targets):
    """The mean loss and its gradients in h and w, one compiled program."""
    return jax.jit(jax.value_and_grad(lambda h, w: loss_fn(h, w, targets).mean(), (0, 1)))(h, w)


# 33 tokens, fewer than one tile of 128 (two warpgroups of 64); V = 53, fewer than one tile,
# d = 12 padded to 16; the default blocks (the bf16 and low-logit tests below take them too).
# Then other blocks, 128-row vocabulary steps, 128-token dw steps, three stages: 140 tokens,
# two forward programs and two dw steps, each 116 tokens short; V = 300, three dw programs
# and three vocabulary steps, the last 84 rows short; d = 40. And the blocked form.
OTHER = Blocks(block_kv=128, block_t=128, stages=3)


@pytest.mark.parametrize(
    ("shape", "blocks", "mode"),
    [
        ((3, 11, 12, 53), Blocks(), "interpret"),
        ((2, 70, 40, 300), OTHER, "interpret"),
        ((2, 70, 40, 300), Blocks(), "blocked"),
    ],
    ids=["one-short-tile", "several-programs", "blocked"],
)
def test_losses_and_weighted_gradients_equal_a_float64_softmax(shape, blocks, mode):
    batch, length = shape[:2]
    h, w, targets = inputs(*shape)
    weights = np.random.default_rng(9).uniform(-1.0, 2.0, (batch, length)).astype(np.float32)

    def losses(h, w):
        return flash.cross_entropy(h, w, targets, blocks=blocks, mode=mode)

    def losses_and_pullback(h, w, weights):
        loss, pullback = jax.vjp(losses, h, w)
        return loss, *pullback(weights)

    loss, dh, dw = jax.jit(losses_and_pullback)(h, w, jnp.asarray(weights))
    assert loss.shape == (batch, length) and loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, reference_cross_entropy(h, w, targets), rtol=2e-6)
    # Per-position weights of either sign: the cotangent enters exactly.
    want_dh, want_dw = reference_gradients(h, w, targets, weights)
    for got, want in ((dh, want_dh), (dw, want_dw)):
        assert got.dtype == jnp.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_bfloat16_activations_match_the_xla_path_to_bfloat16_rounding():
    # As in a bf16 model: h in bfloat16, the float32 embedding cast to bfloat16 by both paths,
    # float32 sums; the probabilities go to the tensor cores in bfloat16, as XLA's dlogits do.
    # V = 200: two vocabulary steps of the online log-sum-exp, the second 72 rows short.
    h, w, targets = inputs(2, 9, 40, 200, seed=4, dtype=jnp.bfloat16)
    loss, (dh, dw) = mean_loss(
        lambda h, w, t: flash.cross_entropy(h, w, t, mode="interpret"), h, w, targets
    )
    xla_loss, (xla_dh, xla_dw) = mean_loss(
        lambda h, w, t: xla_or_kernels(h, w, t, impl="xla"), h, w, targets
    )
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    w_bf16 = np.asarray(w.astype(jnp.bfloat16), np.float64)
    exact = reference_cross_entropy(np.asarray(h, np.float64), w_bf16, targets).mean()
    assert float(loss) == pytest.approx(exact, rel=1e-6)
    assert float(loss) == pytest.approx(float(xla_loss), rel=1e-6)
    want_dh, want_dw = reference_gradients(h, w_bf16, targets, np.full(targets.shape, 1 / 18))
    for got, xla, want in ((dh, xla_dh, want_dh), (dw, xla_dw, want_dw)):
        scale = np.abs(want).max()
        got, xla = np.asarray(got, np.float64), np.asarray(xla, np.float64)
        assert np.abs(got - want).max() <= 1e-2 * scale
        assert np.abs(got - xla).max() <= 1e-2 * scale


def test_very_low_logits_and_targets_outside_the_vocabulary_match_the_xla_path():
    # Every logit near -100: a masked padded row would need exp(-inf); here its logit is
    # PAD_LOGIT from the extra column, and its probability exactly 0. Three targets match no
    # row (one in the padding, one past it, one negative): their loss is the log-sum-exp and
    # their dh has no target row, as in XLA's path.
    h, w, targets = inputs(1, 6, 8, 20, seed=5)
    w = jnp.abs(w) + 1.0
    h = -100.0 * jnp.ones_like(h) / w.sum(-1).min()
    targets = targets.at[0, :3].set(jnp.array([57, 128, -2]))
    got = mean_loss(lambda h, w, t: flash.cross_entropy(h, w, t, mode="interpret"), h, w, targets)
    want = mean_loss(lambda h, w, t: xla_or_kernels(h, w, t, impl="xla"), h, w, targets)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(got))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, x in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, x, rtol=1e-4, atol=1e-5 * np.abs(x).max())


def test_no_tokens_give_no_losses_and_zero_gradients():
    h, w, targets = inputs(0, 4, 8, 20)
    loss, (dh, dw) = jax.value_and_grad(
        lambda h, w: flash.cross_entropy(h, w, targets, mode="interpret").sum(), (0, 1)
    )(h, w)
    assert float(loss) == 0.0 and dh.shape == h.shape and not np.any(dw)


def test_bad_blocks_modes_dtypes_and_shapes_are_named():
    h, w, targets = inputs(1, 4, 8, 20)
    for blocks, message in (
        ({"block_kv": 32}, "blocks.block_kv must be a multiple of 64, got 32"),
        ({"block_t": 100}, "blocks.block_t must be a multiple of 64, got 100"),
        ({"stages": 1}, "blocks.stages must be at least 2, got 1"),
    ):
        with pytest.raises(ValueError, match=message):
            Blocks(**blocks)
    with pytest.raises(ValueError, match=r"mode must be one of .* got 'cpu'"):
        flash.cross_entropy(h, w, targets, mode="cpu")
    with pytest.raises(ValueError, match="take bfloat16 or float16 h, got float32"):
        flash.cross_entropy(h, w, targets)  # on a GPU, float32 would run as TF32
    with pytest.raises(ValueError, match=r"h \(1, 4, 8\), w \(20, 9\)"):
        flash.cross_entropy(h, jnp.pad(w, ((0, 0), (0, 1))), targets, mode="blocked")
    with pytest.raises(ValueError, match="the vocabulary is empty"):
        flash.cross_entropy(h, w[:0], targets, mode="blocked")


def test_the_kernels_lower_for_an_h100_as_two_mosaic_gpu_kernels():
    # The paper's bf16 shapes at d = 204 (padded to 208): lowered for CUDA here, no GPU
    # needed. The forward and dw are Mosaic GPU kernels; nothing else is a kernel.
    h = jax.ShapeDtypeStruct((2, 1024, 204), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((50257, 204), jnp.float32)
    targets = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
    assert flash.padded_width(204) == 208 and flash.padded_width(48) == 64

    def step(h, w, targets):
        loss = lambda h, w: flash.cross_entropy(h, w, targets).mean()  # noqa: E731
        return jax.value_and_grad(loss, (0, 1))(h, w)

    text = ops.lowered_for_cuda(step, h, w, targets).as_text()
    assert len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text)) == 2
    assert text.count("stablehlo.custom_call") == 2


def test_on_eight_devices_each_takes_its_share_and_the_gradients_are_summed():
    # The shard_map path on 8 CPU devices (4 x 2, tokens split over both axes) against one
    # device, in a subprocess (XLA_FLAGS before jax is imported). The blocked form: Pallas's
    # GPU interpreter cannot run several devices' kernels at once.
    script = HERE / "sharded_flash.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = {key: np.asarray(value) for key, value in json.loads(done.stdout).items()}
    h, w, targets = inputs(8, 9, 20, 70, seed=7)
    loss, (dh, dw) = mean_loss(
        lambda h, w, t: flash.cross_entropy(h, w, t, mode="blocked"), h, w, targets
    )
    np.testing.assert_allclose(sharded["loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(sharded["dh"], dh, rtol=1e-5, atol=1e-7 * np.abs(dh).max())
    np.testing.assert_allclose(sharded["dw"], dw, rtol=1e-5, atol=1e-6 * np.abs(dw).max())
    assert sharded["devices"] == 8
