"""``python -m lmuscale.models``: every named config's sizes and FLOPs per token, as a table."""

from __future__ import annotations

import sys

from lmuscale.models import family as families
from lmuscale.models.sizes import NAMES, SIZES, TABLE3, count_params, flops_per_token, named_config

SHAPE = ("q", "q'", "d'", "pre", "post", "heads")  # "-" where a family has no such part
HEADER = ("model", "d", "layers", *SHAPE, "N", "embedding", "total")
HEADER += ("vs paper N", "vs paper total", "train MFLOP/tok")


def main() -> None:
    rows = [HEADER]
    for name in NAMES:
        config = named_config(name)
        shape = families.of(config).shape(config)
        paper = TABLE3[SIZES.index(name.partition("-")[2])]
        count = count_params(config)
        rows.append(
            (
                name,
                config.d,
                config.n_layers,
                *(shape.get(column, "-") for column in SHAPE),
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
    from lmuscale.outcomes import run_main

    sys.exit(run_main(lambda: main() or 0))
