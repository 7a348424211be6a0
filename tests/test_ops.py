"""Choosing the ops' implementations (``lmuscale.ops``): the kernel switches, what ``resolve``
decides on each kind of device, that a run decides once and records it, and that a model runs
what it is given."""

from __future__ import annotations

import collections
import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small_config import small

from lmuscale import ops, resume
from lmuscale.models import build, named_config
from lmuscale.models.sizes import FAMILIES
from lmuscale.ops import Impls, LossKernels
from lmuscale.ops.cross_entropy_pallas import Tiling
from lmuscale.outcomes import ConfigError
from lmuscale.sweep.spec import config_hash
from lmuscale.train import base_config, run
from lmuscale.train import config as config_lib

H100 = "NVIDIA H100 80GB HBM3"


def gpu(kind=H100, capability="9.0", platform="gpu"):
    return types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability=capability)


def test_auto_takes_xla_on_this_cpu_and_pallas_is_refused_by_name():
    for dtype in (jnp.float32, jnp.bfloat16):
        assert ops.LOSS.choose("auto", dtype, jax.devices()) == "xla"
        assert ops.LOSS.choose("xla", dtype, jax.devices()) == "xla"
    with pytest.raises(ConfigError, match=r'model\.loss_impl="pallas": the fused .*cpu'):
        ops.LOSS.choose("pallas", jnp.bfloat16, jax.devices())
    with pytest.raises(ValueError, match=r"loss_impl must be one of .* got 'triton'"):
        ops.LOSS.choose("triton", jnp.float32, jax.devices())
    # The LMU layer's kernels, timed on no GPU yet: "auto" takes XLA's path everywhere, and
    # "pallas" runs on NVIDIA GPUs, one or several, in the chunked memory only.
    for devices in (jax.devices(), [gpu()], [gpu()] * 8):
        assert ops.MEMORY.choose("auto", jnp.bfloat16, devices) == "xla"
    for devices in ([gpu()], [gpu()] * 8):
        assert ops.MEMORY.choose("pallas", jnp.bfloat16, devices) == "pallas"
    with pytest.raises(ConfigError, match=r'memory_impl="pallas": the LMU .* devices are cpu'):
        ops.MEMORY.choose("pallas", jnp.bfloat16, jax.devices())
    fft = named_config("lmu-55k", memory_impl="pallas", memory_mode="fft")
    with pytest.raises(ConfigError, match=r'chunked memory, and model.memory_mode is "fft"'):
        ops.resolve(fft, [gpu()])
    chunked = ops.resolve(dataclasses.replace(fft, memory_mode="chunked"), [gpu()])
    assert (chunked.memory, chunked.memory_layout) == ("pallas", "channels-last")
    # On several GPUs the kernels split each batch, which the layer's batch chunks would give
    # them one sequence at a time.
    several = named_config("lmu-55k", memory_impl="pallas")
    with pytest.raises(
        ConfigError, match=r"on 8 devices .* model\.batch_chunk=2 runs .* use model\.batch_chunk=0"
    ):
        ops.resolve(several, [gpu()] * 8)
    whole = ops.resolve(dataclasses.replace(several, batch_chunk=0), [gpu()] * 8)
    assert whole.memory == "pallas"


def test_auto_takes_the_kernels_only_on_a_gpu_measured_faster():
    # Measured on the H200 and the H100 SXM, in bfloat16 (the README's benchmarks): "auto"
    # takes the fused loss there and in that dtype alone; not in float32, where at d = 204
    # they were 14-15x slower, and not on a GPU where they have not been timed.
    h100, h200, a100 = gpu(), gpu("NVIDIA H200"), gpu("NVIDIA A100-SXM4-80GB", capability="8.0")
    bf16, f32 = jnp.bfloat16, jnp.float32
    fused = ops.LOSS.kernels["pallas"]
    assert {(H100, "bfloat16"), ("NVIDIA H200", "bfloat16")} == fused.faster
    for measured in (h100, h200):
        assert ops.LOSS.choose("auto", "bfloat16", [measured]) == "pallas"
        assert ops.LOSS.choose("auto", jnp.dtype(bf16), [measured]) == "pallas"
        assert ops.LOSS.choose("auto", f32, [measured]) == "xla"
        assert ops.LOSS.choose("xla", bf16, [measured]) == "xla"
    assert ops.LOSS.choose("pallas", f32, [h100]) == "pallas"
    assert ops.LOSS.choose("auto", bf16, [a100]) == "xla"
    # Another table (a switch whose kernels were measured in float32 on the H100 alone).
    table = dataclasses.replace(fused, faster=frozenset({(H100, "float32")}))
    other = dataclasses.replace(ops.LOSS, kernels={"pallas": table})
    assert other.choose("auto", f32, [h100]) == "pallas"
    assert other.choose("auto", bf16, [h100]) == other.choose("auto", bf16, [h200]) == "xla"
    # Where the kernels cannot run, "auto" stays on XLA whatever the table says.
    for devices, reason in (
        ([gpu(capability="7.5")], "compute capability 7.5, below 8.0"),
        ([h100, h100], "2 devices, and the kernels are not partitioned"),
        ([types.SimpleNamespace(platform="gpu", device_kind=H100)], "not an NVIDIA"),
        ([gpu("AMD Instinct MI250X", capability="gfx90a")], "not an NVIDIA"),  # ROCm's name
    ):
        assert other.choose("auto", f32, devices) == "xla"
        with pytest.raises(ConfigError, match=reason):
            other.choose("pallas", f32, devices)


def test_the_flash_loss_runs_on_hopper_gpus_in_half_precision_and_on_several_of_them():
    # No GPU has timed the flash kernels: "auto" takes them nowhere. Asked for, they run on
    # compute capability 9.0 in bfloat16 or float16, on one GPU or several (each device its
    # share of the batch), and are refused by name elsewhere.
    h100, a100 = gpu(), gpu("NVIDIA A100-SXM4-80GB", capability="8.0")
    assert ops.LOSS.kernels["flash"].faster == frozenset()
    for devices in ([h100], [h100] * 8):
        assert ops.LOSS.choose("auto", jnp.bfloat16, devices) != "flash"
        assert ops.LOSS.choose("flash", jnp.bfloat16, devices) == "flash"
        assert ops.LOSS.choose("flash", jnp.float16, devices) == "flash"
    for impl, dtype, devices, reason in (
        (
            "flash",
            jnp.float32,
            [h100],
            "take bfloat16 or float16, and the model's dtype is float32",
        ),
        ("flash", jnp.bfloat16, [a100], "compute capability 8.0, below 9.0"),
        ("flash", jnp.bfloat16, jax.devices(), "flash cross-entropy kernels need NVIDIA GPUs"),
        ("pallas", jnp.bfloat16, [h100] * 8, "8 devices, and the kernels are not partitioned"),
    ):
        with pytest.raises(ConfigError, match=reason):
            ops.LOSS.choose(impl, dtype, devices)
    # Measured faster somewhere, "auto" would take them there, on several GPUs too.
    measured = dataclasses.replace(
        ops.LOSS.kernels["flash"], faster=frozenset({(H100, "bfloat16")})
    )
    table = dataclasses.replace(ops.LOSS, kernels={"flash": measured})
    assert table.choose("auto", jnp.bfloat16, [h100] * 8) == "flash"
    assert table.choose("auto", jnp.float32, [h100]) == "xla"
    with pytest.raises(ValueError, match=r"loss_impl must be one of .*'flash'.* got 'mosaic'"):
        ops.LOSS.choose("mosaic", jnp.bfloat16, [h100])


def test_flash_attention_is_chosen_only_on_recent_nvidia_gpus_in_half_precision():
    hopper, volta = gpu(), gpu(capability="7.0")
    assert ops.attention_implementation(jnp.bfloat16, hopper) == "cudnn"
    assert ops.attention_implementation(jnp.float16, gpu(capability="8.0")) == "cudnn"
    assert ops.attention_implementation(jnp.float32, hopper) == "xla"
    assert ops.attention_implementation(jnp.bfloat16, volta) == "xla"
    assert ops.attention_implementation(jnp.bfloat16, gpu(capability="gfx90a")) == "xla"
    no_capability = types.SimpleNamespace(platform="gpu", device_kind="a GPU")
    assert ops.attention_implementation(jnp.bfloat16, no_capability) == "xla"
    assert ops.attention_implementation(jnp.bfloat16, gpu(platform="tpu")) == "xla"
    assert ops.attention_implementation(jnp.bfloat16, jax.devices()[0]) == "xla"  # this CPU


def test_resolve_takes_each_platform_s_forms():
    # The forms XLA's compiler for each platform was measured to want (ops.Impls): a CPU's
    # here, an H100's and a TPU's for the devices given.
    lmu_bf16 = named_config("lmu-1M", dtype="bfloat16")
    here = ops.resolve(lmu_bf16)
    assert here == Impls(loss="xla", memory="xla")  # the defaults are a CPU's
    assert here.record() == {
        "loss_impl": "xla",
        "memory_impl": "xla",
        "memory_layout": "steps-last",
        "attention_impl": "xla",
        "gelu": "erfc",
        "exact_algorithm": "highest",
    }
    on_h100 = ops.resolve(lmu_bf16, [gpu()])
    assert on_h100 == Impls(
        loss="pallas",  # measured faster there in bfloat16
        memory="xla",
        memory_layout="channels-last",
        attention="cudnn",
        gelu="erf",
        exact_algorithm="bf16x3",
    )
    assert ops.resolve(named_config("lmu-1M"), [gpu()]).loss == "xla"  # float32
    on_tpu = ops.resolve(lmu_bf16, [gpu("TPU v5", platform="tpu")])
    assert (on_tpu.memory_layout, on_tpu.gelu, on_tpu.exact_algorithm) == (
        "steps-last",
        "erfc",
        "bf16x3",
    )
    # A family without the LMU memory records none; decoding resolves no switch.
    transformer = ops.resolve(named_config("transformer-55k"), [gpu()])
    assert transformer.memory is None and "memory_impl" not in transformer.record()
    decoding = ops.resolve(named_config("lmu-55k", loss_impl="pallas"), training=False)
    assert decoding.loss is None and decoding.memory is None
    # A model trained with the fused loss decodes here: build accepts the unresolved switches,
    # and its step runs.
    model = build(named_config("lmu-55k", loss_impl="pallas", vocab_size=11), decoding)
    params = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
    logits, _ = model.apply(
        params, model.decode_state(1, 3), jnp.zeros(1, jnp.int32), method=model.step
    )
    assert logits.shape == (1, 11) and bool(jnp.isfinite(logits).all())
    assert "loss_impl" not in decoding.record() and "memory_impl" not in decoding.record()


def test_impls_are_checked_and_a_model_refuses_impls_its_config_does_not_allow():
    with pytest.raises(ValueError, match=r"Impls\.memory_layout must be one of"):
        Impls(memory_layout="channels-first")
    with pytest.raises(ValueError, match=r"Impls\.memory must be one of \('xla', 'pallas'\)"):
        Impls(memory="fused")
    # The LMU layer's kernels take Q, K and V channels last, so a record says that layout.
    with pytest.raises(ValueError, match=r'"pallas" writes Q, K and V channels last.*steps-last'):
        Impls(memory="pallas", memory_layout="steps-last")
    for asked, given, key in (
        ("pallas", "xla", "loss_impl"),
        ("xla", "pallas", "loss_impl"),
        ("pallas", "xla", "memory_impl"),
        ("xla", "pallas", "memory_impl"),
    ):
        config = named_config("lmu-55k", **{key: asked})
        impls = Impls(**{key.removesuffix("_impl"): given}, memory_layout="channels-last")
        with pytest.raises(ValueError, match=f"{key}='{asked}' in the config.*'{given}'"):
            build(config, impls)
    # "auto" takes either.
    for given in ("xla", "pallas"):
        build(named_config("lmu-55k"), Impls(loss=given))


def test_the_model_configs_take_the_switches_and_keep_their_folder():
    for family in FAMILIES:
        name = f"{family}-55k"
        assert named_config(name).loss_impl == "auto"
        with pytest.raises(ValueError, match=r"loss_impl must be one of .* got 'fused'"):
            named_config(name, loss_impl="fused")
    for family in ("lmu", "lmu_g"):
        assert named_config(f"{family}-55k").memory_impl == "auto"
    with pytest.raises(ValueError, match=r"memory_impl must be one of .* got 'fused'"):
        named_config("lmu-55k", memory_impl="fused")
    # A run saved before the keys existed resumes as it ran, with the XLA paths; the keys do
    # not change a trial's folder name (the same function to rounding).
    upgraded = resume.upgrade({"model": {"family": "lmu", "d": 8}})
    assert (upgraded["model"]["loss_impl"], upgraded["model"]["memory_impl"]) == ("xla", "xla")
    assert "memory_impl" not in resume.upgrade({"model": {"family": "sru", "d": 8}})["model"]
    config = base_config(named_config("lmu-55k"))
    for key, value in (("loss_impl", "pallas"), ("loss_impl", "flash"), ("memory_impl", "xla")):
        other = base_config(named_config("lmu-55k", **{key: value}))
        assert config_hash(config) == config_hash(other)
        assert resume.differences(config.to_dict(), other) == {}


@pytest.mark.parametrize("key", ["loss_impl", "memory_impl"])
def test_training_refuses_pallas_here_before_it_writes_anything(key, byte_corpus, tmp_path):
    config = small(str(byte_corpus))
    config.model[key] = "pallas"
    with pytest.raises(ConfigError, match=rf'model\.{key}="pallas"'):
        run(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kernels", ["pallas", "flash"])
def test_a_model_given_a_kernel_loss_runs_the_kernels_and_equals_xla(kernels):
    # Impls given to the model, not chosen by it: its loss runs the kernels (here in
    # interpret mode, which any backend runs) and equals the XLA path's.
    config = config_lib.model_config(small().model)  # a one-layer LMU, d = 16
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, config.vocab_size)
    given, targets = tokens[:, :-1], tokens[:, 1:]
    results, programs = {}, {}
    options = LossKernels(tiling=Tiling.shared(8, 16), interpret=True)
    for impl in (kernels, "xla"):
        model = build(config, Impls(loss=impl, loss_kernels=options))
        params = model.init(jax.random.key(1), given)

        def loss(p, model=model):
            return model.apply(p, given, targets, method=model.loss)[0]

        programs[impl] = str(jax.make_jaxpr(jax.value_and_grad(loss))(params))
        results[impl] = jax.jit(jax.value_and_grad(loss))(params)
    marker = {"pallas": "pallas_call", "flash": "copy_gmem_to_smem"}[kernels]  # a TMA copy
    assert marker in programs[kernels] and marker not in programs["xla"]
    np.testing.assert_allclose(results[kernels][0], results["xla"][0], rtol=1e-6)
    got, want = (
        np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(results[impl][1])])
        for impl in (kernels, "xla")
    )
    # Float32 rounding of the two paths' sums, against the largest gradient of any parameter.
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_run_resolves_each_op_once_and_records_what_ran(
    byte_corpus, tmp_path, monkeypatch, capsys
):
    # The spies count and pass every call through to the real functions: they choose
    # nothing. Tracing the train and eval steps (and their micro-batch plans) resolves no op.
    resolved, chosen = [], collections.Counter()
    resolve, choose = ops.resolve, ops.Switch.choose

    def counted_resolve(*args, **kwargs):
        resolved.append(args)
        return resolve(*args, **kwargs)

    def counted_choose(switch, *args, **kwargs):
        chosen[switch.key] += 1
        return choose(switch, *args, **kwargs)

    monkeypatch.setattr(ops, "resolve", counted_resolve)
    monkeypatch.setattr(ops.Switch, "choose", counted_choose)
    config = small(str(byte_corpus))
    config.train.update(steps=2, microbatches=0)  # planned: the step compiled per count tried
    config.optim.update(warmup_steps=1)
    config.eval.update(every=2)
    config.checkpoint.update(every=2)
    workdir = tmp_path / "run"
    summary = run(config, workdir)
    assert len(resolved) == 1 and chosen == {"loss_impl": 1, "memory_impl": 1}
    impls = resolve(config_lib.model_config(config.model))
    plan = json.loads((workdir / "plan.json").read_text())
    assert plan["ops"] == impls.record() == {k: summary[k] for k in impls.record()}
    assert summary["memory_layout"] == "steps-last" and summary["gelu"] == "erfc"
    assert f"; {impls.describe()}\n" in capsys.readouterr().out  # the log's first line
