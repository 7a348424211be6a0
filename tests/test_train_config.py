"""Training configs: files, named configs, command-line overrides, and every rejection."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from lmuscale.models import NAMES, named_config
from lmuscale.resume import upgrade
from lmuscale.train import ConfigError, base_config, load, model_config, override
from lmuscale.train.__main__ import main, parse
from lmuscale.train.config import check
from lmuscale.train.loop import check_workdir

ROOT = Path(__file__).resolve().parents[1]
OWT2 = ROOT / "experiments" / "owt2.py"


@pytest.mark.parametrize("name", NAMES)
def test_paper_configs_are_table3_models_with_the_papers_training(name):
    config = load(f"{OWT2}:{name}")
    model, named = model_config(config.model), named_config(name)
    how = {f: getattr(named, f) for f in ("dtype", "batch_chunk") if hasattr(named, f)}
    assert dataclasses.replace(model, **how) == named  # Table 3's model, computed otherwise
    # Mixed precision, and micro-batches planned from the device's memory.
    assert model.dtype == "bfloat16" and getattr(model, "batch_chunk", 0) == 0
    assert config.train.microbatches == 0
    assert config.train.steps == 25_000
    assert config.train.global_batch * config.data.seq_len == 512 * 1024
    assert config.train.steps * 512 * 1024 == 13_107_200_000  # "13.1B tokens"
    assert config.optim.learning_rate == 1e-3  # Keras/optax Adam default
    assert (config.optim.b1, config.optim.b2, config.optim.eps) == (0.9, 0.999, 1e-8)


def test_data_path_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("LMUSCALE_OWT2", "/somewhere/owt2")
    assert load(f"{OWT2}:lmu-55k").data.path == "/somewhere/owt2"


def test_unknown_name_names_the_file_and_line():
    with pytest.raises(ConfigError, match=r"owt2\.py:\d+: ValueError: unknown config 'lmu-2M'"):
        load(f"{OWT2}:lmu-2M")


def test_overrides_are_typed_like_their_defaults():
    config = load(f"{OWT2}:tiny")
    override(
        config,
        [
            "train.steps=100",
            "optim.learning_rate=3e-4",
            "optim.grad_clip=1",
            "model.dtype=bfloat16",
            "log.progress=false",
            "data.path=/x",
        ],
    )
    assert config.train.steps == 100 and isinstance(config.train.steps, int)
    assert config.optim.learning_rate == 3e-4
    assert config.optim.grad_clip == 1.0 and isinstance(config.optim.grad_clip, float)
    assert model_config(config.model).dtype == "bfloat16"
    assert config.log.progress is False
    assert config.data.path == "/x"


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("train.stepz=5", r"unknown config key 'train\.stepz'; did you mean 'train\.steps'"),
        ("nope=1", r"unknown config key 'nope'"),
        ("train.steps=abc", r"--config\.train\.steps: expected an int, got 'abc'"),
        ("train.steps=1.5", r"expected an int, got '1\.5'"),
        ("log.progress=maybe", r"expected a bool"),
        ("train.steps", r"expected --config\.KEY=VALUE"),
        ("train.steps=0", r"train\.steps must be > 0, got 0"),
        (
            "train.steps=100000000000",
            r"train\.steps = 100,000,000,000 is out of range: counts and sizes must be below "
            r"2\*\*31 \(XLA's step counter and shapes are 32-bit\)",
        ),
        ("train.global_batch=100000000000", r"train\.global_batch = 100,000,000,000 is out of"),
        ("model.d=3000000000", r"model\.d = 3,000,000,000 is out of range"),
        ("train.microbatches=3", r"global_batch \(16\) must be a multiple of train\.microbatches"),
        ("optim.warmup_steps=250", r"warmup_steps \(250\) must be below train\.steps \(250\)"),
        (
            "model.family=rnn",
            r"model\.family must be lmu, lmu_g, transformer, sru, sru_pp or lstm, got 'rnn'",
        ),
        ("model.q=0", r"model: .*q"),
    ],
)
def test_bad_overrides_are_rejected_by_name(item, message):
    with pytest.raises(ConfigError, match=message):
        override(load(f"{OWT2}:tiny"), [item])


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("optim.learning_rate=-1", r"optim\.learning_rate must be > 0, got -1\.0"),
        ("optim.learning_rate=0", r"optim\.learning_rate must be > 0, got 0\.0"),
        ("optim.learning_rate=inf", r"optim\.learning_rate must be > 0, got inf"),
        ("optim.learning_rate=nan", r"optim\.learning_rate must be > 0, got nan"),
        ("optim.b1=1", r"optim\.b1 must be in \[0, 1\), got 1\.0"),
        ("optim.b1=-0.1", r"optim\.b1 must be in \[0, 1\), got -0\.1"),
        ("optim.b2=1", r"optim\.b2 must be in \[0, 1\), got 1\.0"),
        ("optim.b2=nan", r"optim\.b2 must be in \[0, 1\), got nan"),
        ("optim.eps=0", r"optim\.eps must be > 0, got 0\.0"),
        ("optim.eps=-inf", r"optim\.eps must be > 0, got -inf"),
        ("optim.grad_clip=-1", r"optim\.grad_clip must be >= 0, got -1\.0"),
        ("optim.grad_clip=nan", r"optim\.grad_clip must be >= 0, got nan"),
        ("optim.plateau_factor=1", r"optim\.plateau_factor must be in \(0, 1\), got 1\.0"),
        ("optim.plateau_factor=0", r"optim\.plateau_factor must be in \(0, 1\), got 0\.0"),
        ("optim.plateau_rtol=0", r"optim\.plateau_rtol must be in \(0, 1\], got 0\.0"),
        ("optim.plateau_rtol=nan", r"optim\.plateau_rtol must be in \(0, 1\], got nan"),
        ("optim.plateau_patience=0", r"optim\.plateau_patience must be >= 1, got 0"),
        ("optim.plateau_cooldown=-1", r"optim\.plateau_cooldown must be >= 0, got -1"),
        ("optim.plateau_min_scale=2", r"optim\.plateau_min_scale must be in \[0, 1\], got 2\.0"),
        (
            "optim.plateau_min_scale=-0.5",
            r"optim\.plateau_min_scale must be in \[0, 1\], got -0\.5",
        ),
        ("optim.plateau_min_scale=inf", r"optim\.plateau_min_scale must be in \[0, 1\], got inf"),
        ("train.seed=-1", r"train\.seed must be in \[0, 2\*\*32\), got -1"),
        ("train.seed=4294967296", r"train\.seed must be in \[0, 2\*\*32\), got 4294967296"),
        ("train.memory_budget_gb=nan", r"train\.memory_budget_gb must be >= 0, got nan"),
        ("peak_flops=-1", r"peak_flops must be >= 0, got -1\.0"),
        ("peak_flops=inf", r"peak_flops must be >= 0, got inf"),
        ("distributed.num_processes=-1", r"distributed\.num_processes must be >= 0, got -1"),
        ("distributed.process_id=-2", r"distributed\.process_id must be >= -1, got -2"),
    ],
)
def test_out_of_range_values_are_rejected_with_key_and_value(item, message):
    with pytest.raises(ConfigError, match=rf"^command line: {message}$"):
        override(load(f"{OWT2}:tiny"), [item])


@pytest.mark.parametrize(
    "item",
    [
        "optim.b1=0",
        "optim.b2=0",
        "optim.plateau_factor=0.999",
        "optim.plateau_rtol=1",
        "optim.plateau_patience=1",
        "optim.plateau_min_scale=1",
        "train.seed=4294967295",
        "distributed.process_id=0",
    ],
)
def test_values_at_the_edge_of_their_range_are_accepted(item):
    override(load(f"{OWT2}:tiny"), [item])


def test_a_config_file_with_a_bad_learning_rate_names_the_file(tmp_path):
    body = "    config.optim.learning_rate = -1\n"
    message = r"exp\.py: optim\.learning_rate must be > 0, got -1\.0$"  # ConfigDict made it a float
    with pytest.raises(ConfigError, match=message):
        load(_config_file(tmp_path, body))


def test_every_shipped_config_passes_the_range_checks():
    # The paper's models are loaded one by one above; tiny and the sweeps' trials here.
    load(f"{OWT2}:tiny")
    from lmuscale.sweep.spec import load_sweep

    for path in sorted((ROOT / "sweeps").glob("*.py")):
        assert load_sweep(path).trials  # each trial is checked as it is resolved


def test_transformer_sequence_cannot_exceed_its_positions():
    with pytest.raises(ConfigError, match=r"data\.seq_len \(2048\) exceeds model\.max_len"):
        override(load(f"{OWT2}:transformer-55k"), ["data.seq_len=2048"])


def _config_file(tmp_path, body: str) -> str:
    path = tmp_path / "exp.py"
    path.write_text(
        "from lmuscale.models import named_config\n"
        "from lmuscale.train import base_config\n\n"
        "def get_config(name):\n"
        "    config = base_config(named_config('lmu-55k'))\n"
        f"{body}"
        "    return config\n"
    )
    return f"{path}:x"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "    config.train.learning_rate = 1.0\n",
            r"exp\.py: unknown config key 'train\.learning_rate'; did you mean 'optim\.lea",
        ),
        ("    config.train.steps = '100'\n", r"exp\.py:6: TypeError: .*field 'steps'"),
        ("    config.train.steps = True\n", r"train\.steps must be an int, got True \(bool\)"),
        ("    config.model.d = 1.5\n", r"exp\.py:6: TypeError: .*field 'd'"),
        ("    del config['eval']\n", r"exp\.py: missing keys eval\.batches"),
        ("    config.data.seq_len = (\n", r"exp\.py:\d+: SyntaxError"),
    ],
)
def test_bad_config_files_are_rejected_with_file_and_key(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message):
        load(_config_file(tmp_path, body))


def test_a_config_file_cannot_add_keys(tmp_path):
    body = "    with config.unlocked():\n        config.train.stepz = 3\n"
    with pytest.raises(ConfigError, match=r"exp\.py: unknown config key 'train\.stepz'"):
        load(_config_file(tmp_path, body))


def test_missing_config_file():
    with pytest.raises(ConfigError, match=r"config file 'nowhere\.py' not found"):
        load("nowhere.py:x")


def test_loaded_configs_are_locked():
    config = load(f"{OWT2}:tiny")
    with pytest.raises(AttributeError):
        config.train.stepz = 1


def test_command_line_parsing_and_exit_code(capsys):
    args, overrides = parse(
        ["--config", "e.py:x", "--config.train.steps", "5", "--workdir", "w", "--config.a=b"]
    )
    assert (args.config, args.workdir, overrides) == ("e.py:x", "w", ["train.steps=5", "a=b"])
    code = main(["--config", f"{OWT2}:tiny", "--workdir", "unused", "--config.train.stepz=5"])
    assert code == 1
    assert "unknown config key 'train.stepz'" in capsys.readouterr().err


def test_resuming_another_config_is_refused_but_log_settings_may_change(tmp_path):
    config = load(f"{OWT2}:tiny")
    (tmp_path / "checkpoints" / "200").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    changed = override(load(f"{OWT2}:tiny"), ["log.every=7", "log.progress=false"])

    check_workdir(changed, tmp_path)
    other = override(load(f"{OWT2}:tiny"), ["optim.learning_rate=0.01"])
    with pytest.raises(ConfigError, match=r"optim\.learning_rate: 0\.003 -> 0\.01"):
        check_workdir(other, tmp_path)


def test_a_run_saved_before_the_memory_modes_resumes_with_the_fft_memory(tmp_path):
    # Runs saved before memory_mode existed computed the LMU memory by FFT.
    config = load(f"{OWT2}:tiny")
    saved = config.to_dict()
    del saved["model"]["memory_mode"], saved["model"]["memory_chunk"]
    (tmp_path / "checkpoints" / "200").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=r"model\.memory_mode: 'fft' -> 'chunked'"):
        check_workdir(config, tmp_path)
    check_workdir(override(load(f"{OWT2}:tiny"), ["model.memory_mode=fft"]), tmp_path)


def test_configs_saved_before_the_memory_modes_are_upgraded_to_the_fft_memory():
    saved = load(f"{OWT2}:tiny").to_dict()
    del saved["model"]["memory_mode"], saved["model"]["memory_chunk"]
    with pytest.raises(ConfigError, match="memory_mode"):
        check(ConfigDict(saved))  # what a sweep worker would meet without the upgrade
    upgraded = upgrade(saved)
    check(ConfigDict(upgraded))
    assert upgraded["model"]["memory_mode"] == "fft"
    assert "memory_mode" not in saved["model"]  # the saved dict is not modified
    transformer = load(f"{OWT2}:transformer-55k").to_dict()
    assert upgrade(transformer) == transformer


def test_configs_saved_before_the_memory_budget_resume_and_keep_their_sweep_hash(tmp_path):
    from lmuscale.sweep import config_hash

    config = load(f"{OWT2}:tiny")
    saved = config.to_dict()
    del saved["train"]["memory_budget_gb"]
    with pytest.raises(ConfigError, match="memory_budget_gb"):
        check(ConfigDict(saved))
    upgraded = upgrade(saved)
    check(ConfigDict(upgraded))
    assert upgraded["train"]["memory_budget_gb"] == 0.0
    (tmp_path / "checkpoints" / "200").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    check_workdir(config, tmp_path)
    # The budget only picks a plan, which the workdir records: it may change on resume, and
    # it is not part of a trial's folder name.
    check_workdir(override(load(f"{OWT2}:tiny"), ["train.memory_budget_gb=3"]), tmp_path)
    assert config_hash(config) == config_hash(saved)


# The keys whose change keeps a run's hash and lets it resume: settings of the run that leave
# its numbers as they are (to rounding, for the kernel switches and the memory budget's plan).
RESUMABLE = (
    "distributed.",
    "log.",
    "data.path",
    "data.verify",
    "data.prepare",
    "peak_flops",
    "train.memory_budget_gb",
    "model.loss_impl",
    "model.memory_impl",
    "checkpoint.keep_steps",
)


def _changed(value):
    """Another value of ``value``'s type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 + 1
    return f"{value}-other"


@pytest.mark.parametrize("family", ["lmu", "lmu_g", "transformer", "sru", "sru_pp", "lstm"])
def test_every_option_that_changes_numbers_changes_the_hash_and_refuses_a_resume(family, tmp_path):
    # Every key of a config (each family's model fields among them): changed, either the
    # trial's hash changes and a resume of the saved config is refused with the key named,
    # or the key is one of the resumable settings, which keep both.
    from lmuscale.resume import RESUMABLE_CHANGES, differences, flatten
    from lmuscale.sweep.spec import config_hash

    assert sorted(RESUMABLE_CHANGES) == sorted(RESUMABLE)
    config = base_config(named_config(f"{family}-55k"))
    config.data.path = str(tmp_path)
    config.data.fingerprint = "sha256:0123456789abcdef"  # as training records it
    saved = json.loads(json.dumps(config.to_dict()))  # as config.json holds it
    keys = flatten(config)
    assert f"model.{dataclasses.fields(named_config(f'{family}-55k'))[0].name}" in keys
    for key, value in keys.items():
        other = ConfigDict(config.to_dict())
        other.update_from_flattened_dict({key: _changed(value)})
        changed = differences(saved, other)
        if key.startswith(RESUMABLE):
            assert config_hash(other) == config_hash(config) and changed == {}, key
        else:
            assert config_hash(other) != config_hash(config), key
            assert list(changed) == [key], key


def test_a_fingerprint_not_yet_known_is_no_difference_and_stays_out_of_the_hash(tmp_path):
    # "" is what a sweep's trial has before training reads the data: the trial hashes as it did
    # before fingerprints existed, and a saved config.json with the fingerprint filled in is
    # the same run. Two known fingerprints that differ are another run.
    from lmuscale.resume import ADDED_KEYS, differences
    from lmuscale.sweep.spec import config_hash

    config = base_config(named_config("lmu-55k"))
    saved = json.loads(json.dumps(config.to_dict()))
    del saved["data"]["fingerprint"], saved["data"]["prepare"]  # a config.json from before
    before = config_hash(saved)
    assert ADDED_KEYS["data.fingerprint"] == "" and config_hash(config) == before
    saved["data"]["fingerprint"] = "sha256:aaaa"
    assert differences(saved, config) == {}
    config.data.fingerprint = "sha256:bbbb"
    assert differences(saved, config) == {"data.fingerprint": ("sha256:aaaa", "sha256:bbbb")}
    assert config_hash(config) != before


def test_a_float_key_given_a_large_int_is_not_a_count():
    """peak_flops (a float) written as an int: the 32-bit range of counts does not apply."""
    from lmuscale.train.config import check

    config = load(f"{OWT2}:tiny")
    config.peak_flops = 312_000_000_000_000
    check(config)
    config.train.steps = 2**31
    with pytest.raises(ConfigError, match=r"train\.steps = 2,147,483,648 is out of range"):
        check(config)
