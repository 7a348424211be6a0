"""The cross-entropy's fused kernels (ops.cross_entropy_pallas), run in Pallas's interpret mode
on CPU at small shapes, against a float64 softmax and XLA's path (ops.cross_entropy)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_models import reference_cross_entropy, reference_gradients

from lmuscale import ops
from lmuscale.ops import cross_entropy_pallas as pallas
from lmuscale.ops.cross_entropy import cross_entropy as xla_or_fused

Launch, Tiling = pallas.Launch, pallas.Tiling
TILES = {"tiling": Tiling.shared(8, 16), "interpret": True}
# Each kernel its own tiles, warps and stages; the tokens and the vocabulary are padded to the
# largest tile of each: 33 tokens to 48 (dw's step of 16), V = 70 to 96 (dw's 32 rows).
PER_KERNEL = Tiling(Launch(8, 8, 4, 1), Launch(4, 16, 8, 3), Launch(32, 16, 2, 2))
# d held in power-of-two parts instead of padded to one: d = 100 as 64 + 32 + 16, d = 40 as
# 32 + 16.
SPLIT = {"tiling": Tiling.shared(8, 16, split_width=True), "interpret": True}
SPLIT_PER_KERNEL = dataclasses.replace(PER_KERNEL, split_width=True)


def fused(h, w, targets, **tiles):
    return pallas.cross_entropy(h, w, targets, **{**TILES, **tiles})


def inputs(batch, length, width, vocab, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((batch, length, width)), dtype)
    w = jnp.asarray(0.5 * rng.standard_normal((vocab, width)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    return h, w, targets


# 33 tokens: four whole tiles of 8 and one of 1. V = 53: three whole vocabulary tiles of 16
# and one with 5 real columns and 11 masked. d = 12 is padded to 16, d = 20 to 32.
# The fourth case takes the GPU's default tiles (64 x 64 at d = 40 in float32): one short tile
# of tokens, and 100 real columns of 128. The fifth gives each kernel other tiles (PER_KERNEL).
# The next three take dh from the forward's expected embeddings instead of the dh kernel. The
# last three hold d in parts (SPLIT).
@pytest.mark.parametrize(
    ("shape", "tiles"),
    [
        ((3, 11, 12, 53), TILES),
        ((1, 5, 20, 16), TILES),
        ((2, 8, 16, 17), TILES),
        ((2, 7, 40, 100), {"interpret": True}),
        ((3, 11, 12, 70), {"tiling": PER_KERNEL, "interpret": True}),
        ((3, 11, 12, 53), {**TILES, "dh_from_forward": True}),
        ((2, 7, 40, 100), {"interpret": True, "dh_from_forward": True}),
        ((3, 11, 12, 70), {"tiling": PER_KERNEL, "interpret": True, "dh_from_forward": True}),
        ((3, 11, 100, 53), SPLIT),
        ((2, 7, 40, 70), {"tiling": SPLIT_PER_KERNEL, "interpret": True}),
        ((3, 11, 100, 53), {**SPLIT, "dh_from_forward": True}),
    ],
    ids=[
        "ragged",
        "one-short-token-tile",
        "whole-token-tiles",
        "default-tiles",
        "per-kernel",
        "dh-from-forward-ragged",
        "dh-from-forward-default-tiles",
        "dh-from-forward-per-kernel",
        "split-width-ragged",
        "split-width-per-kernel",
        "split-width-dh-from-forward",
    ],
)
def test_losses_and_weighted_gradients_equal_a_float64_softmax(shape, tiles):
    batch, length = shape[:2]
    h, w, targets = inputs(*shape)
    weights = np.random.default_rng(9).uniform(-1.0, 2.0, (batch, length)).astype(np.float32)

    def losses_and_pullback(h, w, weights):  # one compiled program
        losses, pullback = jax.vjp(lambda h, w: pallas.cross_entropy(h, w, targets, **tiles), h, w)
        return losses, *pullback(weights)

    losses, dh, dw = jax.jit(losses_and_pullback)(h, w, jnp.asarray(weights))
    assert losses.shape == (batch, length) and losses.dtype == jnp.float32
    np.testing.assert_allclose(losses, reference_cross_entropy(h, w, targets), rtol=2e-6)
    # Per-position weights of either sign: exact for dw too (the XLA path's dw is NaN here).
    want_dh, want_dw = reference_gradients(h, w, targets, weights)
    for got, want in ((dh, want_dh), (dw, want_dw)):
        assert got.dtype == jnp.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_the_kernels_equal_the_xla_path_for_a_mean_loss():
    h, w, targets = inputs(2, 13, 24, 70, seed=3)

    def mean(loss_fn):
        return jax.jit(jax.value_and_grad(lambda h, w: loss_fn(h, w, targets).mean(), (0, 1)))(h, w)

    got = mean(lambda h, w, t: fused(h, w, t, tiling=Tiling.shared(8, 32)))
    want = mean(lambda h, w, t: xla_or_fused(h, w, t, chunk=5, impl="xla"))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, x in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, x, rtol=1e-5, atol=1e-6 * np.abs(x).max())


@pytest.mark.parametrize("dh_from_forward", [False, True], ids=["dh-kernel", "dh-from-forward"])
def test_bfloat16_activations_match_the_xla_path_to_bfloat16_rounding(dh_from_forward):
    # As in a bf16 model: h in bfloat16, the embedding a float32 parameter that both paths
    # cast to bfloat16; products accumulate in float32, dlogits are rounded to bfloat16. 125
    # tiles of the vocabulary, so that dh summed in bfloat16 instead of float32 would show.
    h, w, targets = inputs(2, 9, 40, 2000, seed=4, dtype=jnp.bfloat16)

    def mean(loss_fn):
        return jax.jit(jax.value_and_grad(lambda h, w: loss_fn(h, w, targets).mean(), (0, 1)))(h, w)

    (loss, (dh, dw)) = mean(functools.partial(fused, dh_from_forward=dh_from_forward))
    (xla_loss, (xla_dh, xla_dw)) = mean(lambda h, w, t: xla_or_fused(h, w, t, impl="xla"))
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    # The losses see the same bf16 operands and float32 sums: equal but for summation order.
    w_bf16 = np.asarray(w.astype(jnp.bfloat16), np.float64)
    exact = reference_cross_entropy(np.asarray(h, np.float64), w_bf16, targets).mean()
    assert float(loss) == pytest.approx(exact, rel=1e-6)
    assert float(loss) == pytest.approx(float(xla_loss), rel=1e-6)
    # Gradients: within a few bf16 roundings of each other and of float64 (measured: 3.2e-3
    # and 4.7e-3 of the largest for dh, 2.0e-3 and 2.0e-3 for dw; XLA alone 3.7e-3, 1.3e-3).
    want_dh, want_dw = reference_gradients(h, w_bf16, targets, np.full(targets.shape, 1 / 18))
    assert targets.size == 18
    for got, xla, want in ((dh, xla_dh, want_dh), (dw, xla_dw, want_dw)):
        scale = np.abs(want).max()
        got, xla = np.asarray(got, np.float64), np.asarray(xla, np.float64)
        assert np.abs(got - want).max() <= 1e-2 * scale
        assert np.abs(got - xla).max() <= 1e-2 * scale


@pytest.mark.parametrize("dh_from_forward", [False, True], ids=["dh-kernel", "dh-from-forward"])
def test_very_low_logits_give_finite_gradients(dh_from_forward):
    # Every logit near -100, so lse is too: exp(0 - lse) in a padded column (logit 0) would
    # overflow to inf, and inf times w's zero padded row is NaN. The padded columns are masked.
    h, w, targets = inputs(1, 6, 8, 20, seed=5)
    w = jnp.abs(w) + 1.0
    h = -100.0 * jnp.ones_like(h) / (w.sum(-1).min())

    def total(h, w):
        return fused(h, w, targets, dh_from_forward=dh_from_forward).sum()

    losses, (dh, dw) = jax.value_and_grad(total, (0, 1))(h, w)
    want_dh, want_dw = reference_gradients(h, w, targets, np.ones(targets.shape))
    assert np.isfinite(losses) and np.all(np.isfinite(dh)) and np.all(np.isfinite(dw))
    np.testing.assert_allclose(dh, want_dh, rtol=1e-4, atol=1e-5 * np.abs(want_dh).max())
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-5 * np.abs(want_dw).max())


def test_targets_outside_the_vocabulary_give_the_same_gradients_in_both_forms():
    # A target in the padded columns (V = 53 pads to 64), one past them and a negative one
    # match no real column: their loss takes a target logit of 0 and their dh no w row, in
    # the dh kernel and in dh from the forward alike.
    h, w, targets = inputs(2, 5, 12, 53, seed=6)
    targets = targets.at[0, :3].set(jnp.array([57, 64, -2]))
    forms = [
        jax.value_and_grad(
            lambda h, w, form=form: fused(h, w, targets, dh_from_forward=form).sum(), (0, 1)
        )(h, w)
        for form in (False, True)
    ]
    (loss, (dh, dw)), (loss_f, (dh_f, dw_f)) = forms
    np.testing.assert_allclose(loss_f, loss, rtol=1e-6)
    np.testing.assert_allclose(dh_f, dh, rtol=1e-5, atol=1e-6 * np.abs(dh).max())
    np.testing.assert_array_equal(dw_f, dw)  # the same dw kernel on the same lse
    # Those three tokens' loss is their log-sum-exp (a target logit of 0), and their dh is
    # g E_p[w]: the softmax-weighted mean of w's rows, no target row.
    logits = jnp.einsum("td,vd->tv", h[0, :3], w)
    lse = jax.nn.logsumexp(logits, axis=-1)
    np.testing.assert_allclose(fused(h, w, targets)[0, :3], lse, rtol=1e-6)
    probs = jax.nn.softmax(logits, axis=-1)
    np.testing.assert_allclose(dh[0, :3], probs @ w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dh_from_forward", [False, True], ids=["dh-kernel", "dh-from-forward"])
def test_no_tokens_give_no_losses_and_zero_gradients(dh_from_forward):
    h, w, targets = inputs(0, 4, 8, 20)

    def total(h, w):
        return fused(h, w, targets, dh_from_forward=dh_from_forward).sum()

    value, (dh, dw) = jax.value_and_grad(total, (0, 1))(h, w)
    assert float(value) == 0.0 and dh.shape == h.shape and not np.any(dw)


def test_an_empty_vocabulary_is_named():
    h, w, targets = inputs(1, 4, 8, 1)
    with pytest.raises(ValueError, match=r"w \(0, 8\) has no rows: the vocabulary is empty"):
        fused(h, w[:0], targets)


def test_bad_tiles_and_shapes_are_named():
    h, w, targets = inputs(1, 4, 8, 20)
    with pytest.raises(ValueError, match=r"tiling\.forward\.step must be .* >= 1, got 24"):
        fused(h, w, targets, tiling=Tiling.shared(8, 24))
    # On a GPU, Triton's products need tiles of at least 16.
    with pytest.raises(ValueError, match=r"tiling\.forward\.rows must be .* >= 16, got 8"):
        pallas.cross_entropy(h, w, targets, tiling=Tiling.shared(8, 16))
    bad_warps = dataclasses.replace(PER_KERNEL, dh=Launch(4, 16, 6, 1))
    with pytest.raises(ValueError, match=r"tiling\.dh\.warps must be a power of two <= 32, got 6"):
        fused(h, w, targets, tiling=bad_warps)
    no_stages = dataclasses.replace(PER_KERNEL, dw=Launch(4, 16, 4, 0))
    with pytest.raises(ValueError, match=r"tiling\.dw\.stages must be a whole number >= 1, got 0"):
        fused(h, w, targets, tiling=no_stages)
    # A tiling read back from a benchmark's JSON (Tiling.from_dict).
    written = dataclasses.asdict(PER_KERNEL)
    assert Tiling.from_dict(written) == PER_KERNEL
    assert Tiling.from_dict({k: v for k, v in written.items() if k != "split_width"}) == PER_KERNEL
    with pytest.raises(ValueError, match=r"a tiling has the launches .*, got .*'tiles'"):
        Tiling.from_dict({**written, "tiles": 3})
    with pytest.raises(ValueError, match=r"tiling\.dw must be an object with rows, step"):
        Tiling.from_dict({**written, "dw": {"rows": 32}})
    with pytest.raises(ValueError, match=r"tiling\.split_width must be true or false, got 'yes'"):
        Tiling.from_dict({**written, "split_width": "yes"})
    not_a_bool = dataclasses.replace(PER_KERNEL, split_width=1)
    with pytest.raises(ValueError, match=r"tiling\.split_width must be a bool, got 1"):
        fused(h, w, targets, tiling=not_a_bool)
    with pytest.raises(ValueError, match=r"h \(1, 4, 8\), w \(20, 6\) and targets"):
        fused(h, w[:, :6], targets)


def test_the_width_is_padded_to_a_power_of_two_or_held_in_parts():
    cases = {
        204: (256, ((0, 256),), 208, ((0, 128), (128, 64), (192, 16))),
        48: (64, ((0, 64),), 48, ((0, 32), (32, 16))),
        256: (256, ((0, 256),), 256, ((0, 256),)),
        12: (16, ((0, 16),), 16, ((0, 16),)),
    }
    for width, (whole, whole_parts, split, split_parts) in cases.items():
        assert pallas.padded_width(width) == whole
        assert pallas.width_parts(whole) == whole_parts
        assert pallas.padded_width(width, split=True) == split
        assert pallas.width_parts(split) == split_parts


@pytest.mark.parametrize(
    ("width", "dtype", "dh_from_forward", "split"),
    [
        (204, jnp.bfloat16, False, False),
        (48, jnp.float32, False, False),
        (204, jnp.bfloat16, True, False),
        (204, jnp.bfloat16, False, True),
        (204, jnp.bfloat16, True, True),
    ],
)
def test_the_kernels_lower_to_triton_for_an_nvidia_gpu(width, dtype, dh_from_forward, split):
    # Lowering for CUDA runs here without a GPU, at the default tiles: every primitive in the
    # kernels must have a Triton lowering rule and every loaded tile a shape Triton takes
    # (powers of two). Triton's own compilation (layouts, shared memory, registers), the run
    # and its numerics need the GPU (benchmarks/cross_entropy.py --part loss). With dh from
    # the forward there is no dh kernel, and the forward has a third output. With the width
    # split, d = 204 is held as 208 (128 + 64 + 16), each part its own power-of-two load.
    tiling = dataclasses.replace(pallas.default_tiling(width, dtype), split_width=split)
    wide = pallas.padded_width(width, split)
    h = jax.ShapeDtypeStruct((2, 300, width), dtype)
    w = jax.ShapeDtypeStruct((50257, width), jnp.float32)
    targets = jax.ShapeDtypeStruct((2, 300), jnp.int32)

    options = {"tiling": tiling, "dh_from_forward": dh_from_forward}

    def loss_and_grads(h, w, targets):
        def loss(h, w):
            return pallas.cross_entropy(h, w, targets, **options).mean()

        return jax.value_and_grad(loss, (0, 1))(h, w)

    text = ops.lowered_for_cuda(loss_and_grads, h, w, targets).as_text()
    names = re.findall(r'name = "_(\w+)_kernel"', text)
    assert names == (["forward", "dw"] if dh_from_forward else ["forward", "dh", "dw"])
    [forward] = [line for line in text.splitlines() if '"_forward_kernel"' in line]
    assert (f"tensor<640x{wide}xf32>" in forward.split("->")[-1]) == dh_from_forward
    [dw] = [line for line in text.splitlines() if '"_dw_kernel"' in line]
    assert f"tensor<50304x{wide}xf32>" in dw.split("->")[-1]

    # The losses alone (an evaluation) form no expected embeddings, whatever the form.
    def loss_alone(h, w, targets):
        return pallas.cross_entropy(h, w, targets, **options).mean()

    text = ops.lowered_for_cuda(loss_alone, h, w, targets).as_text()
    [forward] = [line for line in text.splitlines() if '"_forward_kernel"' in line]
    assert forward.split("->")[-1].strip().startswith("(tensor<640xf32>, tensor<640xf32>)")
    assert f"640x{wide}" not in forward.split("->")[-1]


def test_each_kernel_is_launched_on_a_gpu_with_its_own_tiles_warps_and_stages():
    # 600 tokens pad to 640 (dh's 64 rows), V = 50,257 to 50,304 (dw's 128 rows): the grids
    # are 640 / 32, 640 / 64 and 50,304 / 128 programs.
    tiling = Tiling(Launch(32, 64, 4, 1), Launch(64, 32, 8, 3), Launch(128, 16, 16, 2))
    h = jax.ShapeDtypeStruct((2, 300, 204), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((50257, 204), jnp.float32)
    targets = jax.ShapeDtypeStruct((2, 300), jnp.int32)

    def loss_and_grads(h, w, targets):
        def loss(h, w):
            return pallas.cross_entropy(h, w, targets, tiling=tiling).mean()

        return jax.value_and_grad(loss, (0, 1))(h, w)

    text = ops.lowered_for_cuda(loss_and_grads, h, w, targets).as_text()
    launched = {}
    for line in text.splitlines():
        if "xla.gpu.triton" in line:
            [name] = re.findall(r'name = "_(\w+)_kernel"', line)
            launched[name] = tuple(
                int(re.search(rf"{key} = (\d+)", line).group(1))
                for key in ("grid_x", "num_warps", "num_stages")
            )
    assert launched == {"forward": (20, 4, 1), "dh": (10, 8, 3), "dw": (393, 16, 2)}
