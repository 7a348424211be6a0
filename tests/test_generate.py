"""Sampling with the recurrent mode, and the ``python -m lmuscale.generate`` command."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from small_config import small
from sweep_files import write_sweep
from test_models import init, jiggle, tiny

from lmuscale import generate
from lmuscale.data.tokenizer import byte_tokenizer
from lmuscale.models import build, named_config
from lmuscale.outcomes import Exit
from lmuscale.sweep import load_sweep
from lmuscale.sweep.runner import folders
from lmuscale.train import model_config, optim, run
from lmuscale.train import step as step_lib
from lmuscale.train.checkpoint import Checkpoints, Found, locate, read_variables


@pytest.mark.parametrize("family", ["lmu", "lmu_g", "transformer"])
def test_greedy_samples_are_the_parallel_argmax(family):
    model = build(tiny(family))
    params = jiggle(init(model), 0.3)
    prompt = [5, 17, 3, 88]
    new = generate.sample(model, params, prompt, 12, temperature=0.0)
    sequence = jnp.asarray([prompt + new.tolist()])
    logits = jax.jit(model.apply)(params, sequence)
    # Each new token is the argmax of the parallel forward at the position before it.
    np.testing.assert_array_equal(np.argmax(logits[0, len(prompt) - 1 : -1], -1), new)


def test_sampling_is_a_function_of_the_seed():
    model = build(tiny("lmu"))
    params = jiggle(init(model), 0.3)
    draws = [generate.sample(model, params, [1, 2], 40, seed=s) for s in (0, 0, 1)]
    np.testing.assert_array_equal(draws[0], draws[1])
    assert not np.array_equal(draws[0], draws[2])
    assert len(set(draws[0].tolist())) > 5  # temperature 1 on a spread distribution
    for temperature in (-1.0, 1e308, float("nan")):  # 1e308 is infinite in float32
        with pytest.raises(ValueError, match=r"--temperature must be in \[0, 3\.4e38\]"):
            generate.sample(model, params, [1], 4, temperature=temperature)


def test_transformer_cannot_sample_past_its_positions():
    model = build(tiny("transformer"))
    with pytest.raises(ValueError, match="max_len=70 exceeds the transformer's max_len=64"):
        generate.sample(model, init(model), [1] * 10, 60)


@pytest.fixture
def checkpoint(tmp_path):
    """lmu-55k with the byte vocabulary, its parameters saved by orbax."""
    model = build(named_config("lmu-55k", vocab_size=256))
    params = jiggle(init(model, key=3), 0.05)
    path = tmp_path / "checkpoint"
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, params)
    checkpointer.wait_until_finished()
    return model, params, path


def test_command_samples_from_a_checkpoint(checkpoint, capsys):
    """orbax's checkpoint of the variables alone carries no CRC-32s: refused unless accepted,
    and then said to be unverified."""
    model, params, path = checkpoint
    prompt = "To be, or not to be"
    argv = ["--model", "lmu-55k", "--tokenizer", "bytes", "--checkpoint", str(path)]
    argv += ["--prompt", prompt, "--tokens", "24", "--temperature", "0.7", "--seed", "4"]
    assert generate.main(argv) == Exit.IO
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"error: {path}: cannot be verified (an orbax checkpoint of the variables alone, with "
        "no CRC-32s), so it is not used; run again with --accept-unverified to use it anyway\n"
    )
    assert generate.main([*argv, "--accept-unverified"]) == 0
    out, err = capsys.readouterr()
    assert f"{path}: used UNVERIFIED (an orbax checkpoint" in err
    tokenizer = byte_tokenizer()
    new = generate.sample(
        model, params, tokenizer.encode(prompt), 24, temperature=0.7, seed=4, start_id=0
    )
    assert out == prompt + tokenizer.decode(new) + "\n"


def test_command_rejects_a_checkpoint_of_another_model(checkpoint, capsys):
    _, _, path = checkpoint
    argv = ["--model", "lmu-100k", "--tokenizer", "bytes", "--checkpoint", str(path)]
    assert generate.main([*argv, "--accept-unverified"]) == Exit.IO
    message = capsys.readouterr().err
    assert "does not fit the model" in message
    assert "['bias'] has shape (3, 5) in the checkpoint but (3, 7) in the model" in message


def test_module_runs_from_the_command_line():
    command = [sys.executable, "-m", "lmuscale.generate", "--model", "transformer-55k"]
    command += ["--prompt", "Hello", "--tokens", "3", "--seed", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello") and "random init" in result.stderr


@pytest.fixture(scope="module")
def trained(byte_corpus, tmp_path_factory):
    """A 4-step run of the small config with checkpoints at steps 2 and 4: (config, workdir)."""
    workdir = tmp_path_factory.mktemp("trained")
    config = small(str(byte_corpus))
    config.train.update(steps=4)
    config.optim.update(warmup_steps=1)
    config.eval.update(every=2)
    config.checkpoint.update(every=2)
    run(config, workdir)
    return config, workdir


def _trained_params(config, workdir, step):
    """The model of ``config`` and its parameters at ``step``, restored as training does."""
    model = build(model_config(config.model))
    tx, _ = optim.optimizer(config.optim, config.train.steps)
    init_fn = step_lib.init_fn(model, tx, optim.plateau(config.optim), 0, config.data.seq_len)
    checkpoints = Checkpoints(workdir / "checkpoints", keep=2)
    state, _ = checkpoints.restore(step, jax.eval_shape(init_fn))
    checkpoints.close()
    return model, state["params"]


def test_workdir_samples_from_its_newest_checkpoint_with_its_config(trained, capsys):
    config, workdir = trained
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]
    model, params = _trained_params(config, workdir, 4)
    _, older = _trained_params(config, workdir, 2)
    found = locate(workdir)
    assert found == Found(workdir / "checkpoints" / "4" / "state", workdir)
    loaded = read_variables(found.state, model)
    for ours, theirs in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    # step 4's parameters, not step 2's: training moved the embedding
    assert not np.array_equal(
        loaded["params"]["embed"]["embedding"], older["params"]["embed"]["embedding"]
    )
    tokens = jnp.asarray([list(b"the memory holds")])
    np.testing.assert_array_equal(model.apply(loaded, tokens), model.apply(params, tokens))

    prompt = "the memory"
    argv = ["--workdir", str(workdir), "--prompt", prompt, "--tokens", "24"]
    assert generate.main([*argv, "--temperature", "0.7", "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    tokenizer = byte_tokenizer()
    new = generate.sample(
        model, params, tokenizer.encode(prompt), 24, temperature=0.7, seed=3, start_id=0
    )
    assert out == prompt + tokenizer.decode(new) + "\n"
    assert f"parameters from {workdir}/checkpoints/4/state" in err
    assert f"the model of {workdir}/config.json" in err


def test_every_form_of_a_checkpoint_gives_the_same_text(trained, capsys, monkeypatch):
    _, workdir = trained
    step = workdir / "checkpoints" / "4"
    texts = {}
    for form in (
        ["--workdir", workdir],
        ["--checkpoint", workdir],
        ["--checkpoint", step],
        ["--checkpoint", step / "state"],
    ):
        argv = [*map(str, form), "--prompt", "the", "--tokens", "16", "--seed", "5"]
        assert generate.main(argv) == 0, form
        out, err = capsys.readouterr()
        assert f"parameters from {step}/state" in err
        texts[str(form)] = out
    assert len(set(texts.values())) == 1, texts
    assert next(iter(texts.values())).startswith("the")
    # the checkpoints folder and an older step are checkpoints too, and so is a relative path
    assert locate(workdir / "checkpoints") == locate(workdir)
    assert locate(workdir / "checkpoints" / "2").state.parent.name == "2"
    monkeypatch.chdir(step)
    assert locate(".") == locate(step / "state")
    assert locate("../..") == locate(workdir)


def _damage(workdir: Path, how: str) -> Path:
    """Damage checkpoint 4 of ``workdir``; the path its error names."""
    state = workdir / "checkpoints" / "4" / "state"
    if how == "no state":
        shutil.rmtree(state)
        return state.parent
    if how == "data files":
        paths = [p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"]
    else:  # one file: manifest.ocdbt or _METADATA
        paths = [state / how]
    assert paths
    for path in paths:
        os.truncate(path, path.stat().st_size // 2)
    return state.parent  # the files are checked, and named, before orbax reads any


DAMAGES = {
    "no state": "no state/ folder (an incomplete or damaged checkpoint)",
    "data files": "cannot be read: state/d/",
    "manifest.ocdbt": "cannot be read: state/manifest.ocdbt has ",
    "_METADATA": "cannot be read: state/_METADATA has ",
}


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_checkpoint_is_one_named_error(trained, tmp_path, capsys, how):
    _, workdir = trained
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    named = _damage(copy, how)
    for where in (copy, named):
        assert generate.main(["--checkpoint", str(where), "--tokens", "4"]) == Exit.IO
        out, err = capsys.readouterr()
        assert out == ""
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"error: {named}: {DAMAGES[how]}"), lines[0]
        assert lines[0].endswith(f"; try the one before: --checkpoint {copy}/checkpoints/2")
    # and the one before still samples
    assert generate.main(["--checkpoint", str(copy / "checkpoints" / "2"), "--tokens", "4"]) == 0


def test_a_checkpoint_with_flipped_bits_is_refused_by_the_command(trained, tmp_path):
    """One bit flipped in each data file: the command names the checkpoint and samples nothing
    (it sampled different text before its files were checked)."""
    _, workdir = trained
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    state = copy / "checkpoints" / "4" / "state"
    for path in (p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    command = [sys.executable, "-m", "lmuscale.generate", "--workdir", str(copy), "--tokens", "4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == Exit.IO, result.stdout
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {state.parent}: cannot be read: state/d/"), lines[0]
    assert "differs from its CRC-32 when saved: its files were damaged" in lines[0]


def test_a_checkpoint_from_before_file_checksums_is_read_on_its_arrays(trained, tmp_path, capsys):
    """Without files.json orbax reads the files: a truncated one is still one line, with
    tensorstore's reason and none of its internal details."""
    _, workdir = trained
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    for step in ("2", "4"):
        (copy / "checkpoints" / step / "files.json").unlink()
    assert generate.main(["--workdir", str(copy), "--tokens", "4", "--seed", "1"]) == 0
    capsys.readouterr()
    state = _damage(copy, "data files") / "state"
    assert generate.main(["--workdir", str(copy), "--tokens", "4"]) == Exit.IO
    _, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {state}: cannot be read ("), lines[0]
    assert "TensorStore details" not in lines[0] and "pybind11" not in lines[0], lines[0]
    assert lines[0].endswith(f"; try the one before: --checkpoint {copy}/checkpoints/2")
    # orbax's failed reads leave futures whose errors asyncio logs when they are collected:
    # here, not in a later test of this worker that asserts its log is clean (it happened).
    gc.collect()


def test_parameters_that_differ_from_their_checksums_are_refused(trained, tmp_path, capsys):
    """Step 2's state in step 4's folder: every file reads, but the parameters are not the ones
    whose CRC-32s training saved beside them."""
    _, workdir = trained
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    state = copy / "checkpoints" / "4" / "state"
    shutil.rmtree(state)
    shutil.copytree(copy / "checkpoints" / "2" / "state", state)
    (state.parent / "files.json").unlink()  # else its files are refused before they are read
    assert generate.main(["--workdir", str(copy), "--tokens", "4"]) == Exit.IO
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {state}: does not match the checksums saved with it (")
    assert "arrays differ, e.g. ['params']['params']" in err
    assert err.rstrip().endswith(f"; try the one before: --checkpoint {copy}/checkpoints/2")


def _unverifiable(copy: Path, step: str, meta: bool) -> Path:
    """Checkpoint ``step`` of ``copy`` as nothing can verify it: no files.json, and no
    checksums in its JSON (``meta``) or no JSON at all; bits flipped in its largest array file."""
    folder = copy / "checkpoints" / step
    (folder / "files.json").unlink()
    if meta:
        saved = json.loads((folder / "meta" / "metadata").read_text())
        del saved["checksums"]
        (folder / "meta" / "metadata").write_text(json.dumps(saved))
    else:
        (folder / "meta" / "metadata").unlink()
    arrays = [p for p in folder.rglob("*") if p.is_file() and p.parent.name == "d"]
    largest = max(arrays, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    for i in range(len(data) // 2 % 4096, len(data), 4096):
        data[i] ^= 0x10
    largest.write_bytes(bytes(data))
    return folder


@pytest.mark.parametrize("meta", [True, False], ids=["meta without checksums", "no meta"])
def test_a_checkpoint_nothing_can_verify_is_refused_unless_accepted(
    trained, tmp_path, capsys, meta
):
    """It sampled from flipped bits with exit 0; now it is named, and used only when asked."""
    _, workdir = trained
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    folder = _unverifiable(copy, "4", meta)
    missing = "no checksums in meta/metadata" if meta else "no meta/metadata"
    assert generate.main(["--workdir", str(copy), "--tokens", "4"]) == Exit.IO
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"error: {folder}: cannot be verified (no files.json and {missing}), so it is not "
        "used; run again with --accept-unverified to use it anyway, or try the one before: "
        f"--checkpoint {copy}/checkpoints/2\n"
    )
    argv = ["--workdir", str(copy), "--tokens", "4", "--accept-unverified"]
    assert generate.main(argv) == 0
    out, err = capsys.readouterr()
    assert out and err.splitlines()[0] == (
        f"checkpoint: {folder}: used UNVERIFIED (no files.json and {missing}), as "
        "--accept-unverified asks"
    )


def test_a_truncated_checkpoint_stops_the_command_with_one_line(trained, tmp_path):
    """In a real process, where orbax's threads would otherwise report on their way out."""
    _, workdir = trained
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    state = _damage(copy, "data files")
    command = [sys.executable, "-m", "lmuscale.generate", "--workdir", str(copy)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == Exit.IO
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        line for line in result.stderr.splitlines() if line.startswith(f"error: {state}: ")
    ], result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_paths_that_are_no_checkpoint_are_named(trained, tmp_path, capsys):
    _, workdir = trained
    (tmp_path / "a-file").write_text("")
    (tmp_path / "empty").mkdir()
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    (tmp_path / "fresh" / "config.json").write_text("{}")
    broken = tmp_path / "broken"
    shutil.copytree(workdir, broken)
    (broken / "config.json").write_bytes(b"\x89PNG\r\n")
    unconfigured = tmp_path / "unconfigured"
    shutil.copytree(workdir, unconfigured)
    (unconfigured / "config.json").unlink()
    cases = {
        ("--checkpoint", tmp_path / "missing"): f"{tmp_path}/missing: no such checkpoint folder",
        ("--checkpoint", tmp_path / "a-file"): f"{tmp_path}/a-file: a file, not a checkpoint",
        ("--checkpoint", tmp_path / "empty"): f"{tmp_path}/empty: not a checkpoint (expected a",
        ("--workdir", tmp_path / "empty"): f"{tmp_path}/empty/checkpoints: no checkpoint yet",
        ("--workdir", tmp_path / "fresh"): f"{tmp_path}/fresh/checkpoints: no checkpoint yet",
        ("--workdir", tmp_path / "missing"): f"{tmp_path}/missing: no such folder",
        ("--workdir", broken): f"{broken}/config.json: not JSON ('utf-8' codec can't decode",
        ("--workdir", unconfigured): f"{unconfigured}/config.json: not found; give --model",
    }
    for (option, path), message in cases.items():
        assert generate.main([option, str(path), "--tokens", "4"]) == Exit.IO, (option, path)
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"error: {message}"), (option, path, err)
        assert len(err.splitlines()) == 1, err


def test_the_workdir_decides_the_tokenizer(trained, capsys):
    _, workdir = trained
    with pytest.raises(SystemExit) as stopped:
        generate.main(["--workdir", str(workdir), "--tokenizer", "gpt2"])
    assert stopped.value.code == 2
    assert "--tokenizer gpt2: the run in" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        generate.main(["--workdir", str(workdir), "--checkpoint", str(workdir)])
    assert stopped.value.code == 2


@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_a_prompt_that_is_not_utf8_is_refused_by_either_tokenizer(tokenizer):
    """The prompt as a shell passes it, raw bytes: Python hands it over with surrogateescape,
    and GPT-2's tokenizer took it (as U+FFFD) where the byte tokenizer refused it."""
    command = [sys.executable, "-m", "lmuscale.generate", "--model", "transformer-55k"]
    command += ["--tokenizer", tokenizer, "--prompt", b"caf\xe9 au lait", "--tokens", "3"]
    result = subprocess.run(command, capture_output=True, timeout=300, check=False)
    assert result.returncode == 2 and result.stdout == b""
    assert result.stderr.decode().endswith(
        "error: --prompt: not valid UTF-8 (byte 0xe9 at line 1, column 4)\n"
    )


@pytest.fixture
def sweep_folder(trained, byte_corpus, tmp_path, monkeypatch):
    """A sweep's folder as the runner makes it, with trials lmu-a (pending), lmu-ab (finished:
    the trained run) and tf-x (interrupted: the trained run less its summary)."""
    _, workdir = trained
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    trials = {"lmu-a": {}, "lmu-ab": {"train.seed": 1}, "tf-x": {}}
    sweep = load_sweep(write_sweep(tmp_path, trials))
    paths = folders(sweep, tmp_path / "sweep", sweep.trials)
    for name in ("lmu-ab", "tf-x"):
        shutil.copytree(workdir, paths[name], dirs_exist_ok=True)
    (paths["tf-x"] / "summary.json").unlink()
    return tmp_path / "sweep", paths


def test_a_sweep_trial_is_chosen_by_its_name_or_a_unique_prefix(sweep_folder, capsys):
    sweep, paths = sweep_folder
    argv = ["--prompt", "the", "--tokens", "16", "--seed", "2"]
    assert generate.main(["--workdir", str(paths["lmu-ab"]), *argv]) == 0
    direct = capsys.readouterr()
    for trial, name in (("lmu-ab", "lmu-ab"), ("tf", "tf-x")):
        assert generate.main(["--workdir", str(sweep), "--trial", trial, *argv]) == 0, trial
        out, err = capsys.readouterr()
        assert out == direct.out
        assert f"parameters from {paths[name]}/checkpoints/4/state" in err
    # lmu-a is a name, though also a prefix of lmu-ab: its folder, which has no checkpoint
    assert generate.main(["--workdir", str(sweep), "--trial", "lmu-a", *argv]) == Exit.IO
    assert capsys.readouterr().err.startswith(
        f"error: {paths['lmu-a']}/checkpoints: no checkpoint yet"
    )


def test_a_sweep_folder_lists_its_trials_when_none_or_several_match(sweep_folder, capsys):
    sweep, paths = sweep_folder
    val_loss = json.loads((paths["lmu-ab"] / "summary.json").read_text())["val_loss"]
    rows = {
        "lmu-a": "  lmu-a   pending",
        "lmu-ab": f"  lmu-ab  finished, val loss {val_loss:.4f}",
        "tf-x": "  tf-x    interrupted",
    }
    every = list(rows)
    cases = {  # the arguments: the first line, the trials listed
        (): (f"{sweep} is a sweep's folder; choose a trial with --trial NAME (or a prefix)", every),
        ("--trial", "lmu"): (
            f"--trial lmu: 2 trials of {sweep} start with it",
            ["lmu-a", "lmu-ab"],
        ),
        ("--trial", "x"): (f"--trial x: no trial of {sweep} starts with it; its trials", every),
    }
    for extra, (head, names) in cases.items():
        assert generate.main(["--workdir", str(sweep), *extra]) == Exit.ARGUMENTS, extra
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [f"error: {head}:", *map(rows.get, names)], extra
    # --trial needs a sweep's folder
    assert generate.main(["--workdir", str(paths["lmu-ab"]), "--trial", "a"]) == Exit.ARGUMENTS
    assert "is not a sweep's folder (no sweep.json)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        generate.main(["--trial", "lmu-ab"])
    assert stopped.value.code == 2
