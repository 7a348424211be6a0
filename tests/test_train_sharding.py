"""Data- and model-sharded train steps on 8 host CPU devices equal the 1-device step.

The 8-device run is a subprocess: XLA_FLAGS must be set before jax is imported, and this
process has imported it already. The 1-device steps run here, in this one-device process,
while the subprocess runs.

Both processes compile through a persistent compilation cache (``compile_cache``): the whole
runs use the steps' config, so each loads the train step and init its process compiled for
the steps instead of compiling them again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from compile_cache import env as cache_env
from compile_cache import in_process
from sharded_steps import config, steps

from lmuscale.train import run
from lmuscale.train import step as step_lib

HERE = Path(__file__).resolve().parent

# Measured (jax 0.10.2, CPU, 5 Adam steps at lr 1e-2, 2 micro-batches): losses within 9e-8
# relative, gradient norms within 6.3e-7, parameters within 2.7e-7 absolute. Sums over 8
# shards are added in another order than over 1; nothing else differs.
LOSS_RTOL = 2e-6  # losses and gradient norms
PARAM_ATOL = 1e-6


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    with in_process(tmp_path_factory.mktemp("xla-cache")):
        yield


@pytest.fixture(scope="module")
def sharded(byte_corpus, tmp_path_factory, xla_cache):
    workdir = tmp_path_factory.mktemp("sharded-run")
    cache = tmp_path_factory.mktemp("xla-cache-8")  # its own: this process writes at once
    env = {**os.environ, "PYTHONPATH": str(HERE), **cache_env(cache)}
    process = subprocess.Popen(
        [sys.executable, str(HERE / "sharded_steps.py"), str(byte_corpus), str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        one = steps(config(str(byte_corpus)), step_lib.make_mesh(1, jax.devices()[:1]), 5)
        stdout, stderr = process.communicate(timeout=600)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-3000:]
    return {"1": one, **json.loads(stdout.splitlines()[-1])}


@pytest.mark.parametrize("mesh", ["8", "4x2"])
def test_sharded_steps_equal_the_one_device_step(sharded, mesh):
    one, other = sharded["1"], sharded[mesh]
    np.testing.assert_allclose(other["losses"], one["losses"], rtol=LOSS_RTOL)
    for a, b in zip(one["params"], other["params"], strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=PARAM_ATOL)


def test_the_model_axis_really_splits_parameters(sharded):
    assert sharded["1"]["layouts"] == ["[]"]
    assert any("model" in json.loads(layout) for layout in sharded["4x2"]["layouts"])


def test_a_whole_run_on_a_4x2_mesh_matches_one_device(sharded, byte_corpus, tmp_path):
    here = run(config(str(byte_corpus)), tmp_path)
    there = sharded["run"]
    for key in ("val_loss", "test_loss"):
        assert there[key] == pytest.approx(here[key], rel=1e-5)
    np.testing.assert_allclose(there["val_per_position"], here["val_per_position"], rtol=1e-4)
