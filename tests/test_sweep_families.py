"""Each recurrent baseline (SRU, SRU++, LSTM) trains in a tiny sweep through the real runner,
and sweeps/baselines.py lists the paper grid of them."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lmuscale.models import count_params
from lmuscale.models.sizes import BASELINE_FAMILIES, SIZES
from lmuscale.sweep import load_sweep
from lmuscale.sweep.runner import run_sweep
from lmuscale.train import model_config

REPO = Path(__file__).resolve().parent.parent

# One tiny byte-level model per family (SRU++: a plain layer, then one with attention), 10 steps
# of 4 x 32 bytes; the sweep file builds its configs in Python.
SWEEP = """
from lmuscale.models import LSTMConfig, SRUConfig, SRUPPConfig
from lmuscale.sweep import Trial
from lmuscale.train import base_config

MODELS = {{
    "sru": SRUConfig(d=16, n_layers=2, vocab_size=256),
    "sru_pp": SRUPPConfig(d=16, d_prime=8, n_layers=2, attention_every=2, vocab_size=256),
    "lstm": LSTMConfig(d=16, n_layers=1, vocab_size=256),
}}


def get_trials():
    for family, model in MODELS.items():
        c = base_config(model)
        c.data.update(path={data!r}, tokenizer="bytes", seq_len=32)
        c.train.update(steps=10, global_batch=4)
        c.optim.update(learning_rate=1e-2, warmup_steps=2)
        c.eval.update(every=10, global_batch=4, batches=2, final_batches=2)
        c.checkpoint.update(every=10, keep=1)
        c.log.update(every=1, progress=False, tensorboard=False)
        yield Trial(family, c)
"""


def test_each_recurrent_baseline_trains_in_a_tiny_sweep(tmp_path, byte_corpus, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # for the worker processes
    path = tmp_path / "baselines_tiny.py"
    path.write_text(SWEEP.format(data=str(byte_corpus)))
    sweep = load_sweep(path)
    work = tmp_path / "work"
    # The real runner in this process; its workers train the three trials side by side.
    assert run_sweep(sweep, work, parallel=3, show=False) == 0
    rows = [json.loads(line) for line in (work / "results.jsonl").read_text().splitlines()]
    assert [row["trial"] for row in rows] == list(BASELINE_FAMILIES)
    for row, trial in zip(rows, sweep.trials, strict=True):
        assert row["status"] == "finished", row["error"]
        assert row["family"] == row["trial"]
        params = count_params(model_config(trial.config.model))
        assert (row["N"], row["total_params"]) == (params.non_embedding, params.total)
        assert row["steps"] == 10 and row["tokens"] == 10 * 4 * 32
        # Learned something: below the uniform ln 256 and below its own first training loss.
        assert math.isfinite(row["val_loss"]) and row["val_loss"] < math.log(256)
        records = [
            json.loads(line)
            for line in (work / "trials" / row["folder"] / "metrics.jsonl").read_text().splitlines()
        ]
        losses = [r["loss"] for r in records if "loss" in r and "grad_norm" in r]
        assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0], (row["trial"], losses)


def test_baselines_sweep_is_the_paper_grid_of_each_family(monkeypatch):
    monkeypatch.setenv("LMUSCALE_OWT2", "/data/owt2")
    sweep = load_sweep(REPO / "sweeps" / "baselines.py")
    expected = [f"{family}-{size}" for family in BASELINE_FAMILIES for size in SIZES]
    assert [t.name for t in sweep.trials] == expected
    for trial in sweep.trials:
        family = trial.name.partition("-")[0]
        assert trial.config.model.family == family
        assert trial.config.train.steps == 25_000
        assert trial.config.train.global_batch * trial.config.data.seq_len == 512 * 1024
        assert trial.config.data.path == "/data/owt2"
    n = count_params(model_config(sweep.trials[-1].config.model)).non_embedding
    assert abs(n / 1e6 - 1) < 0.05  # lstm-1M
