"""``python -m lmuscale.models``: every named config's sizes and FLOPs per token, as a table."""

from __future__ import annotations

from lmuscale.models.lmu import LMUConfig
from lmuscale.models.sizes import NAMES, SIZES, TABLE3, count_params, flops_per_token, named_config
from lmuscale.models.sru import SRUPPConfig
from lmuscale.models.transformer import TransformerConfig

HEADER = ("model", "d", "layers", "q", "q'", "d'", "pre", "post", "heads", "N", "embedding")
HEADER += ("total",)
HEADER += ("vs paper N", "vs paper total", "train MFLOP/tok")


def shape_columns(config) -> tuple:
    """layers, q, q', d' (SRU++'s attention width), pre-block (FFN width or "attn"), post/MLP
    width, heads ("-" where none)."""
    layers = config.n_layers
    if isinstance(config, TransformerConfig):
        return (layers, "-", "-", "-", "attn", config.mlp_dim, config.n_heads)
    if isinstance(config, SRUPPConfig):
        return (layers, "-", "-", config.d_prime, "attn", "-", 1)
    if not isinstance(config, LMUConfig):  # SRU, LSTM: no block but the recurrence
        return (layers, "-", "-", "-", "-", "-", "-")
    if config.global_attention:
        return (layers, config.q, config.q_prime, "-", "attn", config.post_ffn_dim, config.n_heads)
    return (layers, config.q, config.q_prime, "-", config.pre_ffn_dim, config.post_ffn_dim, "-")


def main() -> None:
    rows = [HEADER]
    for name in NAMES:
        config = named_config(name)
        paper = TABLE3[SIZES.index(name.partition("-")[2])]
        count = count_params(config)
        rows.append(
            (
                name,
                config.d,
                *shape_columns(config),
                f"{count.non_embedding:,}",
                f"{count.embedding:,}",
                f"{count.total:,}",
                f"{count.non_embedding / paper.n - 1:+.1%}",
                f"{count.total / paper.total - 1:+.1%}",
                f"{flops_per_token(config).train / 1e6:.1f}",
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(HEADER))]
    for row in rows:
        cells = [str(cell).rjust(width) for cell, width in zip(row, widths, strict=True)]
        cells[0] = str(row[0]).ljust(widths[0])
        print("  ".join(cells))


if __name__ == "__main__":
    main()
