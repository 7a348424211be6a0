"""Model sizes: Table 3's grid, the parameter and FLOP records, and lookups by family.

N is the non-embedding parameter count (Kaplan et al. 2020, REFERENCE §2-3): all but the tied
token embedding and the transformer's positions. FLOPs are per token, a multiply-add being 2
and an element-wise multiply, add, sigmoid or tanh 1. Every family has the LMU's width
d = round(sqrt(N / 24)) at every row, and its own rule (``sized``) for the rest.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from lmuscale.models import family as families
from lmuscale.models.family import ModelConfig


@dataclasses.dataclass(frozen=True)
class Table3Row:
    """One row of the paper's Table 3 as printed (N and total are the paper's round numbers)."""

    size: str
    n: int
    total: float
    d: int
    q: int
    q_prime: int


TABLE3 = (
    Table3Row("55k", 55_000, 2.4e6, 48, 50, 5),
    Table3Row("100k", 100_000, 3.3e6, 65, 65, 7),
    Table3Row("200k", 200_000, 4.8e6, 91, 90, 9),
    Table3Row("300k", 300_000, 5.9e6, 112, 110, 13),
    Table3Row("500k", 500_000, 7.3e6, 144, 150, 15),
    Table3Row("1M", 1_000_000, 11e6, 204, 220, 22),
)
SIZES = tuple(row.size for row in TABLE3)
PAPER_FAMILIES = ("lmu", "lmu_g", "transformer")  # the LMU paper's grid (sweeps/owt2.py)
BASELINE_FAMILIES = ("sru", "sru_pp", "lstm")  # recurrent baselines (sweeps/baselines.py)


def names() -> tuple[str, ...]:
    """Every registered family at every size: "lmu-55k", ..., "lstm-1M"."""
    return tuple(f"{family}-{size}" for family in families.names() for size in SIZES)


def __getattr__(name: str):
    # FAMILIES and NAMES are read when asked, so they include every family registered by
    # then (families register when their modules are imported, after this one).
    if name == "FAMILIES":
        return families.names()
    if name == "NAMES":
        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class ParamCount:
    non_embedding: int
    embedding: int

    @property
    def total(self) -> int:
        return self.non_embedding + self.embedding


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs per token: one block's terms by name, the block count, the unembedding."""

    per_layer: dict[str, float]
    n_layers: int
    unembedding: float

    @property
    def layers(self) -> float:
        return self.n_layers * sum(self.per_layer.values())

    @property
    def forward(self) -> float:
        return self.layers + self.unembedding

    @property
    def train(self) -> float:
        """Forward + backward, the usual 3x forward (the figure MFU is computed from)."""
        return 3.0 * self.forward


def width(n_params: float) -> int:
    """The paper's embedding width rule d = sqrt(N / 24), rounded."""
    return round(math.sqrt(n_params / 24))


def ffn_params(d: int, hidden: int) -> int:
    return 2 * d * hidden + hidden + d


def attention_params(d: int) -> int:
    return 4 * d * d + 4 * d


def row(size: str | int) -> Table3Row:
    """A row of Table 3 by name ("55k"), or the grid point of any N (an int): the LMU's width,
    with q / d and q' / q interpolated in log N (held at the end rows' ratios)."""
    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; Table 3 has {', '.join(SIZES)}")
        return TABLE3[SIZES.index(size)]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1_000:
        raise ValueError(f"a size is a Table 3 name or a whole N >= 1000, got {size!r}")
    for table_row in TABLE3:
        if table_row.n == size:
            return table_row
    log_n = [math.log(r.n) for r in TABLE3]
    d = width(size)
    q = max(1, round(d * float(np.interp(math.log(size), log_n, [r.q / r.d for r in TABLE3]))))
    q_prime_ratio = float(np.interp(math.log(size), log_n, [r.q_prime / r.q for r in TABLE3]))
    return Table3Row(_name(size), size, math.nan, d, q, max(1, round(q * q_prime_ratio)))


def _name(n: int) -> str:
    """A size's short name: 55000 -> "55k", 1500000 -> "1.5M"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def nearest(n_of, target: int, candidates) -> int:
    """The candidate whose ``n_of(candidate)`` is nearest ``target`` (the smaller on a tie)."""
    return min(candidates, key=lambda k: (abs(n_of(k) - target), k))


def deepened(make, size: str):
    """``make(d=..., n_layers=...)`` at the LMU's width, of the depth whose N is nearest."""
    target = row(size)
    d = width(target.n)
    n_layers = nearest(
        lambda depth: count_params(make(d=d, n_layers=depth)).non_embedding,
        target.n,
        range(1, 65),
    )
    return make(d=d, n_layers=n_layers)


def count_params(config: ModelConfig) -> ParamCount:
    """Non-embedding and embedding parameters of any config, without building the model."""
    return families.of(config).params(config)


def flops_per_token(config: ModelConfig, seq_len: int = 1024) -> FlopCount:
    return families.of(config).flops(config, seq_len)


def named_config(name: str, **overrides) -> ModelConfig:
    """A named model (``"lmu-1M"``, see ``NAMES``); ``overrides`` replace fields afterwards."""
    family, _, size = name.partition("-")
    if family not in families.REGISTRY or size not in SIZES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(names())}")
    record = families.get(family)
    fixed = sorted(set(overrides) & set(record.fixed))
    if fixed:
        raise ValueError(f"{fixed[0]} is decided by the family in {name!r}: pick another family")
    return record.sized(size, **overrides)
