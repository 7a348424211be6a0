"""Hand-made results tables for the analysis tests and notebooks: the paper's grid with losses
drawn from known curves plus noise, in the format a sweep writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lmuscale.scaling import LMU_G_PAPER, LMU_PAPER, TABLE3_SIZES, transformer_loss

BATCH = 512 * 1024
SEQ_LEN = 1024


def per_position(final: float, family: str, length: int = SEQ_LEN) -> list[float]:
    """A made-up per-position curve ending near ``final``: LMUs flatten after ~100 tokens."""
    t = np.arange(1, length + 1)
    knee = 100 if family == "lmu" else length
    curve = final + 2.0 / np.sqrt(np.minimum(t, knee))
    return [round(float(v), 5) for v in curve]


def row(trial, family, n, steps, loss, **extra) -> dict:
    tokens = steps * BATCH
    return {
        "trial": trial,
        "family": family,
        "N": int(n),
        "total_params": int(n + 50257 * np.sqrt(n / 24)),
        "seq_len": SEQ_LEN,
        "tokenizer": "gpt2",
        "global_batch": 512,
        "steps": steps,
        "tokens": tokens,
        "test_loss": loss,
        "val_loss": loss,
        "status": "finished",
        "test_per_position": per_position(loss, family),
        "val_per_position": per_position(loss, family),
        **extra,
    }


def paper_rows(
    noise: float = 0.005, seed: int = 0, tenx: bool = True, more_steps: tuple = ()
) -> list[dict]:
    """LMU and LMU_G from the paper's fits, the transformer from Kaplan eq 1.6 at 25k steps
    (and 250k with ``tenx``, and each of ``more_steps``), each loss times exp(N(0, noise))."""
    rng = np.random.default_rng(seed)
    rows = []
    curves = {
        "lmu": LMU_PAPER,
        "lmu_g": LMU_G_PAPER,
        "transformer": lambda n: transformer_loss(n, 25_000),
    }
    for family, curve in curves.items():
        for n in TABLE3_SIZES:
            loss = float(curve(n) * np.exp(rng.normal(0, noise)))
            rows.append(row(f"{family}-{n // 1000}k", family, n, 25_000, loss))
    for steps in ((250_000,) if tenx else ()) + tuple(more_steps):
        suffix = "10x" if steps == 250_000 else f"{steps // 1000}k-steps"
        for n in TABLE3_SIZES:
            loss = float(transformer_loss(n, steps) * np.exp(rng.normal(0, noise)))
            rows.append(row(f"transformer-{n // 1000}k-{suffix}", "transformer", n, steps, loss))
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
