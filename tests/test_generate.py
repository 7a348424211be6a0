"""Sampling with the recurrent mode, and the ``python -m lmuscale.generate`` command."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_models import init, jiggle, tiny

from lmuscale import generate
from lmuscale.data.tokenizer import byte_tokenizer
from lmuscale.models import build, named_config


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
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        generate.sample(model, params, [1], 4, temperature=-1.0)


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
    model, params, path = checkpoint
    prompt = "To be, or not to be"
    argv = ["--model", "lmu-55k", "--tokenizer", "bytes", "--checkpoint", str(path)]
    argv += ["--prompt", prompt, "--tokens", "24", "--temperature", "0.7", "--seed", "4"]
    assert generate.main(argv) == 0
    tokenizer = byte_tokenizer()
    new = generate.sample(
        model, params, tokenizer.encode(prompt), 24, temperature=0.7, seed=4, start_id=0
    )
    assert capsys.readouterr().out == prompt + tokenizer.decode(new) + "\n"


def test_command_rejects_a_checkpoint_of_another_model(checkpoint, capsys):
    _, _, path = checkpoint
    argv = ["--model", "lmu-100k", "--tokenizer", "bytes", "--checkpoint", str(path)]
    with pytest.raises(SystemExit):
        generate.main(argv)
    message = capsys.readouterr().err
    assert "does not fit the model" in message
    assert "['bias'] has shape (3, 5) in the checkpoint but (3, 7) in the model" in message


def test_module_runs_from_the_command_line():
    command = [sys.executable, "-m", "lmuscale.generate", "--model", "transformer-55k"]
    command += ["--prompt", "Hello", "--tokens", "3", "--seed", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello") and "random init" in result.stderr


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
