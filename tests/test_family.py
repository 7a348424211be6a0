"""The family registry: a family defined and registered in this file alone is built, counted,
sized on Table 3's grid and trained by ``python -m lmuscale.train``'s own code, and every
registered family's config survives the round trip through a training config."""

from __future__ import annotations

import dataclasses
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from lmuscale import resume, workdir
from lmuscale.layers import layer_norm
from lmuscale.models import build, count_params, flops_per_token, named_config, sizes
from lmuscale.models import family as families
from lmuscale.models.base import LanguageModel, RecurrentConfig
from lmuscale.models.family import Registered
from lmuscale.train import base_config
from lmuscale.train import config as config_lib
from lmuscale.train.__main__ import main as train_main


@dataclasses.dataclass(frozen=True)
class ToyConfig(RecurrentConfig):
    n_layers: int = 1


class ShiftBlock(nn.Module):
    """x_t += W [LN(x)_t; LN(x)_{t-1}] + b: the smallest causal block with a parameter."""

    d: int

    @nn.compact
    def __call__(self, x_BxTxD):
        h_BxTxD = layer_norm(x_BxTxD.dtype)(x_BxTxD)
        previous_BxTxD = jnp.pad(h_BxTxD, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        return x_BxTxD + nn.Dense(self.d)(jnp.concatenate([h_BxTxD, previous_BxTxD], -1))


class ToyModel(LanguageModel):
    config: ToyConfig
    block_class = ShiftBlock

    def block_fields(self, layer: int) -> dict:
        del layer
        return {"d": self.config.d}


def toy_params(c: ToyConfig) -> sizes.ParamCount:
    per_layer = 2 * c.d + 2 * c.d * c.d + c.d
    return sizes.ParamCount(c.n_layers * per_layer + 2 * c.d, c.vocab_size * c.d)


TOY = families.Family(
    "toy",
    ToyConfig,
    ToyModel,
    sized=lambda size, **overrides: dataclasses.replace(
        sizes.deepened(ToyConfig, size), **overrides
    ),
    params=toy_params,
    flops=lambda c, seq_len: sizes.FlopCount(
        {"shift": 4.0 * c.d * c.d}, c.n_layers, 2.0 * c.d * c.vocab_size
    ),
    shape=lambda c: {},
)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(families.REGISTRY, "toy", TOY)
    return TOY


CONFIG_FILE = """
from lmuscale.models import family
from lmuscale.train import base_config


def get_config(name):
    config = base_config(family.get("toy").config(d=8, n_layers=2, vocab_size=256))
    config.name = "toy"
    config.data.update(path={data!r}, tokenizer="bytes", seq_len=16)
    config.train.update(steps=2, global_batch=4)
    config.optim.update(warmup_steps=1)
    config.eval.update(every=2, global_batch=4, batches=1, final_batches=1)
    config.checkpoint.update(every=1)
    config.log.update(every=1, progress=False, tensorboard=False)
    return config
"""


def test_a_family_registered_in_a_test_file_builds_counts_sizes_and_trains(
    toy, byte_corpus, tmp_path
):
    config = named_config("toy-55k")
    assert type(config) is ToyConfig and config.family == "toy"
    assert "toy-55k" in sizes.NAMES and "toy" in sizes.FAMILIES
    # Sized on the grid: the LMU's width, the depth whose N is nearest 55k.
    assert config.d == 48 and config.n_layers == 12
    assert abs(count_params(config).non_embedding / 55_000 - 1) < 0.05
    assert flops_per_token(config).train == 3 * (12 * 4 * 48 * 48 + 2 * 48 * 50257)

    model = build(config)
    assert isinstance(model, ToyModel)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    built = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))
    assert built == count_params(config).total

    section = base_config(config).model
    assert section.family == "toy" and config_lib.model_config(section) == config

    config_file = tmp_path / "toy_config.py"
    config_file.write_text(CONFIG_FILE.format(data=str(byte_corpus)))
    workdir = tmp_path / "run"
    assert train_main(["--config", f"{config_file}:toy", "--workdir", str(workdir), "--quiet"]) == 0
    summary = json.loads((workdir / "summary.json").read_text())
    trained = ToyConfig(d=8, n_layers=2, vocab_size=256)
    assert summary["status"] == "finished" and summary["family"] == "toy"
    assert summary["loss_impl"] == "xla"  # "auto", resolved on this CPU
    assert summary["params"]["non_embedding"] == count_params(trained).non_embedding
    losses = [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").open()]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < math.log(256) + 0.5


@dataclasses.dataclass(frozen=True)
class PlainConfig(Registered):
    """A family's config written from ``Registered`` alone, as models/ documents: it predates
    (or leaves out) fields that the built-in families share, such as loss_impl."""

    d: int


def test_a_saved_run_of_a_family_without_loss_impl_upgrades_without_it(monkeypatch):
    monkeypatch.setitem(
        families.REGISTRY, "plain", dataclasses.replace(TOY, name="plain", config=PlainConfig)
    )
    saved = {"model": {"family": "plain", "d": 8}}
    assert resume.upgrade(saved)["model"] == {"family": "plain", "d": 8}
    # A built-in family's saved run predates the key: it ran the XLA path.
    saved = {"model": {"family": "transformer", "d": 8, "n_heads": 2}}
    assert resume.upgrade(saved)["model"]["loss_impl"] == "xla"


def test_an_unregistered_family_is_named():
    assert "toy" not in families.names()
    with pytest.raises(config_lib.ConfigError, match=r"model\.family must be lmu, lmu_g, .*'toy'"):
        config_lib.model_config({"family": "toy", "d": 8})
    with pytest.raises(TypeError, match="no registered model family for a ToyConfig"):
        build(ToyConfig(d=8))


def test_a_second_record_under_a_registered_name_is_refused(toy):
    with pytest.raises(ValueError, match="'toy' is already registered"):
        families.register(dataclasses.replace(toy, flops=toy.params))
    assert families.register(toy) is toy  # registering the same record again is harmless


@pytest.mark.parametrize("name", sizes.NAMES)
def test_every_named_config_survives_the_training_config_round_trip(name, tmp_path):
    config = named_config(name)
    section = base_config(config).model
    assert section.family == config.family == name.partition("-")[0]
    assert not set(families.get(section.family).fixed) & set(section)
    assert config_lib.model_config(section) == config
    workdir.write_config(base_config(config), tmp_path)  # config.json, as a run writes it
    saved = json.loads((tmp_path / workdir.CONFIG).read_text())
    assert config_lib.model_config(saved["model"]) == config


def test_a_field_that_the_family_decides_cannot_be_set_apart_from_it():
    with pytest.raises(ValueError, match="global_attention is decided by the family"):
        named_config("lmu-55k", global_attention=True)
    section = dict(base_config(named_config("lmu-55k")).model, global_attention=True)
    with pytest.raises(config_lib.ConfigError, match=r"model\.global_attention is decided by"):
        config_lib.model_config(section)
