"""Model sizes in one place: Table 3's grid, the parameter counter, FLOPs per token.

Nothing here builds a model or touches a device: counts and FLOPs are closed-form functions
of a config (tests/test_models.py checks the counts against ``jax.eval_shape`` of ``init``).

Conventions (Kaplan et al. 2020, REFERENCE §2-3):
- N is the non-embedding parameter count: everything except the token embedding (tied with
  the output) and the transformer's learned positions. Biases and LayerNorms count in N.
- FLOPs are per token, a multiply-add being 2; training is 3x the forward pass.

The recurrent baselines (SRU, SRU++, LSTM) sit on the same grid: the LMU's width
d = round(sqrt(N / 24)) at every row, and one free integer solved so that N is nearest the
row's N (``_nearest``):
- SRU: the number of layers (3d^2 + 6d each, so ~8 = 24 d^2 / 3 d^2). 8 at every row; N is
  +4.9%, +4.7%, +1.6%, +2.2%, +1.0%, +0.9% off the row (the small rows lose to the 6d terms).
- SRU++: the SRU's depth at that row, attention in every 4th layer (2 of 8), and d' solved:
  d' = 23, 32, 50, 60, 81, 115 (0.48-0.56 d), N within 0.2% of every row.
- LSTM: the number of layers (8d^2 + 6d each): 3 at every row, N +2.3%, +2.7%, +0.3%,
  +1.1%, +0.1%, +0.3% off the row.
"""

from __future__ import annotations

import dataclasses
import math

from lmuscale.models.base import default_heads
from lmuscale.models.lmu import LMUConfig
from lmuscale.models.lstm import LSTMConfig
from lmuscale.models.sru import SRUConfig, SRUPPConfig
from lmuscale.models.transformer import TransformerConfig

ModelConfig = LMUConfig | TransformerConfig | SRUConfig | SRUPPConfig | LSTMConfig

THETA = 350.0
N_LAYERS = 3
PRE_FFN_RATIO = 1.5
TRANSFORMER_LAYERS = 2  # d = sqrt(N / 24) is N = 12 n_layers d^2 at 2 layers
SRU_PP_ATTENTION_EVERY = 4  # 2 attention layers of 8; SRU++ finds attention needed in few layers

# Per-channel element-wise FLOPs of one recurrent step (each multiply, add, sigmoid or tanh
# counts 1). SRU: f and r 4 each (v c, two adds, sigmoid), c 4, h 4. LSTM: b 4, U h add 4,
# four gate nonlinearities, c 3, tanh(c) 1, h 1, the residual add 1.
SRU_ELEMENTWISE = 16
LSTM_ELEMENTWISE = 18


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
FAMILIES = PAPER_FAMILIES + BASELINE_FAMILIES
NAMES = tuple(f"{family}-{size}" for family in FAMILIES for size in SIZES)


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


def _ffn_params(d: int, hidden: int) -> int:
    return 2 * d * hidden + hidden + d


def _attention_params(d: int) -> int:
    return 4 * d * d + 4 * d


def sru_layer_params(d: int, d_prime: int = 0) -> int:
    """One SRU layer (pre-LN 2d, v and b 4d, no matmul bias); with d' > 0 an SRU++ layer,
    whose projection is W1 (d d'), W2 (2 d'^2), alpha (1), its LN (2 d') and W3 (3 d' d)."""
    if d_prime:
        projection = d * d_prime + 2 * d_prime * d_prime + 1 + 2 * d_prime + 3 * d_prime * d
    else:
        projection = 3 * d * d
    return 2 * d + projection + 4 * d


def lstm_layer_params(d: int) -> int:
    """One LSTM layer: pre-LN 2d, W (4d^2) with bias 4d, U (4d^2)."""
    return 2 * d + 4 * d * d + 4 * d + 4 * d * d


def count_params(config: ModelConfig) -> ParamCount:
    """Non-embedding and embedding parameters of any config, without building the model."""
    d = config.d
    if isinstance(config, SRUConfig | SRUPPConfig):
        layers = sum(
            sru_layer_params(d, config.d_prime if config.has_attention(i) else 0)
            for i in range(config.n_layers)
        )
        return ParamCount(layers + 2 * d, config.vocab_size * d)
    if isinstance(config, LSTMConfig):
        return ParamCount(config.n_layers * lstm_layer_params(d) + 2 * d, config.vocab_size * d)
    if isinstance(config, LMUConfig):
        pre = (
            _attention_params(d) if config.global_attention else _ffn_params(d, config.pre_ffn_dim)
        )
        implicit = 3 * config.q_prime * config.q + 3 * config.q_prime + config.q_prime
        per_layer = 3 * 2 * d + pre + implicit + _ffn_params(d, config.post_ffn_dim)
        return ParamCount(config.n_layers * per_layer + 2 * d, config.vocab_size * d)
    if isinstance(config, TransformerConfig):
        per_layer = 2 * 2 * d + _attention_params(d) + _ffn_params(d, config.mlp_dim)
        embedding = config.vocab_size * d + config.max_len * d
        return ParamCount(config.n_layers * per_layer + 2 * d, embedding)
    raise TypeError(f"no parameter counter for {type(config).__name__}")


def lmu_flops(config: LMUConfig, seq_len: int = 1024) -> FlopCount:
    """Table 2 of the LMU paper, per layer, plus the unembedding (2 d V).

    LMU + Q + K + V (reduced order, FFT): 3d[5(q'+1)(log2 n + 1) + 6q'] + 6qq'; QK^T: 2dq'^2;
    M': 2dq'^2 + dq'; m: 2dq'; each FFN: 4dd'. The _G variant's global attention replaces the
    pre-FFN: 8d^2 for its four projections and 4nd for scores and values, counted over the
    full n as for the transformer.
    """
    d, q, k, n = config.d, config.q, config.q_prime, seq_len
    terms = {"memory_qkv": 3 * d * (5 * (k + 1) * (math.log2(n) + 1) + 6 * k) + 6 * q * k}
    terms["scores"] = 2 * d * k * k
    terms["mixing"] = 2 * d * k * k + d * k
    terms["readout"] = 2 * d * k
    if config.global_attention:
        terms["global_attention"] = 8 * d * d + 4 * n * d
    else:
        terms["pre_ffn"] = 4 * d * config.pre_ffn_dim
    terms["post_ffn"] = 4 * d * config.post_ffn_dim
    return FlopCount(terms, config.n_layers, 2.0 * d * config.vocab_size)


def transformer_flops(config: TransformerConfig, seq_len: int = 1024) -> FlopCount:
    """2 per non-embedding weight, plus 4 n d per layer for the attention scores and values.

    This is the forward third of the common "6N + 12 n_layers n d" training count (Kaplan et
    al. §2.1; Chowdhery et al. appendix B), with the full n (no discount for the causal mask).
    """
    d = config.d
    per_layer = count_params(dataclasses.replace(config, n_layers=1)).non_embedding - 2 * d
    terms = {"weights": 2.0 * per_layer, "attention": 4.0 * seq_len * d}
    # The final LayerNorm's 2d weights are part of N; they are counted in no layer (negligible).
    return FlopCount(terms, config.n_layers, 2.0 * d * config.vocab_size)


def sru_flops(config: SRUConfig | SRUPPConfig, seq_len: int = 1024) -> FlopCount:
    """2 per weight of each matmul, plus the element-wise recurrence (16 d per layer).

    A plain layer's matmul is [W, W_f, W_r]: 6 d^2. An SRU++ attention layer has W1, W2, W3
    (2 d d' + 4 d'^2 + 6 d d'), scores and values 4 n d' over the full n as the transformer
    counter does, and Q + alpha A (2 d'). LayerNorms are not counted (as in ``lmu_flops``).
    The layers of SRU++ differ, so ``per_layer`` holds the mean over its layers: ``layers``
    is exactly the sum.
    """
    d, n_layers = config.d, config.n_layers
    attention = sum(config.has_attention(i) for i in range(n_layers))
    terms = {"projection": 6.0 * d * d * (n_layers - attention) / n_layers}
    if attention:
        k = config.d_prime
        share = attention / n_layers
        terms["attention_projections"] = (2 * d * k + 4 * k * k + 6 * k * d) * share
        terms["attention"] = (4 * seq_len * k + 2 * k) * share
    terms["recurrence"] = float(SRU_ELEMENTWISE * d)
    return FlopCount(terms, n_layers, 2.0 * d * config.vocab_size)


def lstm_flops(config: LSTMConfig, seq_len: int = 1024) -> FlopCount:
    """2 per weight of W (all positions at once) and of U (inside the scan), plus 18 d
    element-wise per layer. ``seq_len`` changes nothing: the recurrence is O(1) per token."""
    del seq_len
    d = config.d
    terms = {
        "input_projection": 8.0 * d * d,
        "recurrent_projection": 8.0 * d * d,
        "recurrence": float(LSTM_ELEMENTWISE * d),
    }
    return FlopCount(terms, config.n_layers, 2.0 * d * config.vocab_size)


def flops_per_token(config: ModelConfig, seq_len: int = 1024) -> FlopCount:
    if isinstance(config, LMUConfig):
        return lmu_flops(config, seq_len)
    if isinstance(config, TransformerConfig):
        return transformer_flops(config, seq_len)
    if isinstance(config, SRUConfig | SRUPPConfig):
        return sru_flops(config, seq_len)
    if isinstance(config, LSTMConfig):
        return lstm_flops(config, seq_len)
    raise TypeError(f"no FLOP counter for {type(config).__name__}")


def _row(size: str) -> Table3Row:
    for row in TABLE3:
        if row.size == size:
            return row
    raise ValueError(f"unknown size {size!r}; Table 3 has {', '.join(SIZES)}")


def lmu_config(size: str, *, global_attention: bool = False, **overrides) -> LMUConfig:
    """A Table 3 row as a config, the post-FFN width solved so that N hits the row's N.

    d = round(sqrt(N/24)), q and q' from the table, theta = 350, 3 layers, pre-FFN 1.5 d. The
    _G variant has the same d, q, q' and solves its own post-FFN width. ``overrides`` replace
    any field afterwards (e.g. dtype, remat), without re-solving.
    """
    row = _row(size)
    d = width(row.n)
    base = LMUConfig(
        d=d,
        q=row.q,
        q_prime=row.q_prime,
        post_ffn_dim=1,
        pre_ffn_dim=0 if global_attention else math.floor(PRE_FFN_RATIO * d + 0.5),
        theta=THETA,
        n_layers=N_LAYERS,
        global_attention=global_attention,
        n_heads=default_heads(d),
    )
    per_unit = base.n_layers * (2 * d + 1)
    post = 1 + round((row.n - count_params(base).non_embedding) / per_unit)
    return dataclasses.replace(base, post_ffn_dim=post, **overrides)


def transformer_config(size: str, **overrides) -> TransformerConfig:
    """The transformer at a Table 3 grid point: 2 layers of the LMU's width, 4d MLP."""
    d = width(_row(size).n)
    config = TransformerConfig(d=d, n_heads=default_heads(d), n_layers=TRANSFORMER_LAYERS)
    return dataclasses.replace(config, **overrides)


def _nearest(n_of, target: int, candidates) -> int:
    """The candidate whose parameter count ``n_of(candidate)`` is nearest ``target`` (the
    smaller on a tie)."""
    return min(candidates, key=lambda k: (abs(n_of(k) - target), k))


def _deepened(make, size: str):
    """``make(d=..., n_layers=...)`` at the LMU's width, with the depth whose N is nearest the
    row's N."""
    row = _row(size)
    d = width(row.n)
    n_layers = _nearest(
        lambda n: count_params(make(d=d, n_layers=n)).non_embedding, row.n, range(1, 65)
    )
    return make(d=d, n_layers=n_layers)


def sru_config(size: str, **overrides) -> SRUConfig:
    """SRU at a Table 3 grid point: the LMU's width, the number of layers solved for N."""
    return dataclasses.replace(_deepened(SRUConfig, size), **overrides)


def sru_pp_config(size: str, **overrides) -> SRUPPConfig:
    """SRU++ at a Table 3 grid point: the SRU's width and depth, attention in every 4th layer,
    the attention width d' solved for N."""
    sru = sru_config(size)
    n_target = _row(size).n

    def config(d_prime: int) -> SRUPPConfig:
        return SRUPPConfig(
            d=sru.d,
            d_prime=d_prime,
            n_layers=sru.n_layers,
            attention_every=SRU_PP_ATTENTION_EVERY,
        )

    d_prime = _nearest(
        lambda k: count_params(config(k)).non_embedding, n_target, range(1, 4 * sru.d + 1)
    )
    return dataclasses.replace(config(d_prime), **overrides)


def lstm_config(size: str, **overrides) -> LSTMConfig:
    """LSTM at a Table 3 grid point: the LMU's width, the number of layers solved for N."""
    return dataclasses.replace(_deepened(LSTMConfig, size), **overrides)


def named_config(name: str, **overrides) -> ModelConfig:
    """``"lmu-1M"``, ``"lmu_g-55k"``, ``"transformer-300k"``, ``"sru_pp-1M"``, ...: see
    ``NAMES``."""
    family, _, size = name.partition("-")
    if family not in FAMILIES or size not in SIZES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(NAMES)}")
    if family == "transformer":
        return transformer_config(size, **overrides)
    if family == "sru":
        return sru_config(size, **overrides)
    if family == "sru_pp":
        return sru_pp_config(size, **overrides)
    if family == "lstm":
        return lstm_config(size, **overrides)
    return lmu_config(size, global_attention=family == "lmu_g", **overrides)
