"""Choosing the learning rate at each model size, and the file a sweep reads the choices from
(``write_learning_rates``, then ``read_learning_rates(path).lookup(family, n)``).
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmuscale.analysis.results import Run, family_key, groups_within, label
from lmuscale.files import atomic_write_json, read_tagged_json
from lmuscale.outcomes import DataError

FORMAT = "lmuscale learning rates"
VERSION = 1
SIZE_RTOL = 0.05  # runs whose N are within 5% of each other are one size
REQUIRED = ("family", "N", "learning_rate")


@dataclass(frozen=True)
class LearningRateChoice:
    """The rate chosen for one (family, size, token budget). Arrays follow ``learning_rates``."""

    family: str
    n: float  # non-embedding parameters (the median of the size's runs)
    tokens: float  # the token budget of the runs
    learning_rates: np.ndarray  # the grid tried, ascending
    loss: np.ndarray  # final loss at each rate, mean over seeds (nats)
    best: float  # the parabola's vertex; grid_best when not bracketed
    grid_best: float  # the rate of the grid's lowest loss
    bracketed: bool  # False: grid_best is the smallest or largest rate tried
    trials: tuple[str, ...]

    @property
    def note(self) -> str:
        """Empty when the optimum is bracketed; otherwise which way to extend the grid."""
        if self.bracketed:
            return ""
        low = self.grid_best == self.learning_rates[0]
        return (
            f"{label(self.family)} N={self.n:.4g}, {self.tokens:.4g} tokens: the best rate, "
            f"{self.grid_best:.4g}, is the {'smallest' if low else 'largest'} tried; extend the "
            f"grid {'below' if low else 'above'} it"
        )


def select_learning_rates(runs: list[Run]) -> tuple[list[LearningRateChoice], list[str]]:
    """One ``LearningRateChoice`` per (family, size, token budget) with >= 2 distinct rates:
    the vertex of the parabola in log10(rate) through the best rate (loss averaged over seeds)
    and its neighbours. A rate whose runs all diverged is not in the results table, so a grid
    that ends at one can look unbracketed. The second list says what was left out and why."""
    left_out = []
    no_rate = defaultdict(list)
    usable = []
    for run in runs:
        if run.learning_rate is None:
            no_rate[run.family].append(run.trial)
        elif not math.isfinite(run.loss):
            left_out.append(f"{run.trial}: loss is {run.loss}")
        else:
            usable.append(run)
    for family, trials in sorted(no_rate.items(), key=lambda kv: family_key(kv[0])):
        left_out.append(
            f"{label(family)}: no learning_rate in {len(trials)} run(s): {', '.join(trials)}"
        )
    choices = []
    for family in sorted({r.family for r in usable}, key=family_key):
        of_family = [r for r in usable if r.family == family]
        for at_size in groups_within(of_family, lambda r: r.n, SIZE_RTOL):
            n = float(np.median([r.n for r in at_size]))
            for tokens in sorted({r.tokens for r in at_size}):
                group = [r for r in at_size if r.tokens == tokens]
                rates = sorted({r.learning_rate for r in group})
                if len(rates) < 2:
                    left_out.append(
                        f"{label(family)} N={n:.4g}, {tokens:.4g} tokens: only one learning rate "
                        f"({rates[0]:.4g}) in {', '.join(r.trial for r in group)}"
                    )
                    continue
                choices.append(_choose(family, n, tokens, rates, group))
    return choices, left_out


def _choose(family, n, tokens, rates, group) -> LearningRateChoice:
    loss = np.array([np.mean([r.loss for r in group if r.learning_rate == lr]) for lr in rates])
    grid = np.array(rates)
    i = int(np.argmin(loss))
    bracketed = 0 < i < len(grid) - 1
    best = grid[i]
    if bracketed:
        best = 10 ** _vertex(np.log10(grid[i - 1 : i + 2]), loss[i - 1 : i + 2])
    return LearningRateChoice(
        family=family,
        n=n,
        tokens=float(tokens),
        learning_rates=grid,
        loss=loss,
        best=float(best),
        grid_best=float(grid[i]),
        bracketed=bracketed,
        trials=tuple(r.trial for r in sorted(group, key=lambda r: (r.learning_rate, r.trial))),
    )


def _vertex(x, y) -> float:
    """The vertex of the parabola through three points whose middle one is lowest (so it lies
    between the outer two); the middle x when the three are level."""
    d0, d2 = x[1] - x[0], x[1] - x[2]
    num = d0**2 * (y[1] - y[2]) - d2**2 * (y[1] - y[0])
    den = d0 * (y[1] - y[2]) - d2 * (y[1] - y[0])
    return float(x[1]) if den == 0 else float(x[1] - 0.5 * num / den)


def write_learning_rates(path, choices: list[LearningRateChoice]) -> None:
    """Write ``choices`` to ``path`` atomically (the ``learning_rate`` of each is its best)."""
    rows = [
        {
            "family": c.family,
            "N": float(c.n),
            "tokens": float(c.tokens),
            "learning_rate": float(c.best),
            "bracketed": bool(c.bracketed),
            "grid": [float(v) for v in c.learning_rates],
            "loss": [float(v) for v in c.loss],
        }
        for c in choices
    ]
    atomic_write_json(path, {"format": FORMAT, "version": VERSION, "rates": rows})


@dataclass(frozen=True)
class _Rate:
    n: float
    learning_rate: float
    tokens: float | None
    index: int  # its place in the file's "rates"


@dataclass(eq=False)  # compared and hashed by identity, as a plain class
class LearningRates:
    """A learning-rate file (``read_learning_rates``). Rows of one family within 5% in N are one
    size; of a size's rows, the one with the largest token budget counts (none: the smallest)."""

    path: Path
    _rates: dict[str, tuple[_Rate, ...]]

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(sorted(self._rates, key=family_key))

    def sizes(self, family: str) -> np.ndarray:
        """The sizes (N) the file has for ``family``, ascending; empty for an unknown family."""
        return np.array([r.n for r in self._rates.get(family, ())])

    def lookup(self, family: str, n: float, rtol: float = 0.1) -> float:
        """The learning rate of ``family`` at the size nearest ``n`` in log N, which must be
        within ``rtol * n`` of ``n``."""
        if isinstance(n, bool) or not (isinstance(n, numbers.Real) and math.isfinite(n) and n > 0):
            raise ValueError(f"n must be a positive number of parameters, got {n!r}")
        rates = self._rates.get(family)
        if not rates:
            have = ", ".join(self.families) or "no rows"
            raise DataError(
                f"{self.path}: no learning rate for family {family!r}; the file has {have}"
            )
        nearest = min(rates, key=lambda r: abs(math.log(r.n / n)))
        if abs(nearest.n - n) > rtol * n:
            have = ", ".join(f"{r.n:.4g}" for r in rates)
            raise DataError(
                f"{self.path}: no {family} size within {rtol:.0%} of N={n:.4g} (the nearest is "
                f"N={nearest.n:.4g}); the file has {family} at N = {have}. Run a learning-rate "
                "sweep at this size, or pass a larger rtol"
            )
        return nearest.learning_rate

    def interpolate(self, family: str, n: float) -> float:
        """The rate of ``family`` at ``n``, interpolated linearly in (log N, log rate) between
        the sizes the file has, and the end sizes' rates beyond them: for a grid whose sizes
        lie between those of its learning-rate sweep (sweeps/isoflop.py)."""
        self.lookup(family, n, rtol=math.inf)  # the same errors for a bad n or family
        rates = self._rates[family]
        log_n = np.log([r.n for r in rates])
        log_lr = np.log([r.learning_rate for r in rates])
        return float(np.exp(np.interp(math.log(n), log_n, log_lr)))


def learning_rates(choices: list[LearningRateChoice], source: str) -> LearningRates:
    """``choices`` as a ``LearningRates`` (what reading them back from a file gives), its
    errors naming ``source``."""
    by_family = defaultdict(list)
    for i, c in enumerate(choices):
        by_family[c.family].append(_Rate(c.n, c.best, c.tokens, i))
    path = Path(source)
    return LearningRates(path, {f: _one_per_size(path, f, r) for f, r in by_family.items()})


def read_learning_rates(path) -> LearningRates:
    """Read a file ``write_learning_rates`` wrote; a ``DataError`` names the file
    and what is wrong with it."""
    path = Path(path)
    hint = " (write_learning_rates writes one from a learning-rate sweep's results)"
    data = read_tagged_json(path, FORMAT, VERSION, DataError, "learning-rate file", hint)
    rows = data.get("rates")
    if not isinstance(rows, list):
        raise DataError(f"{path}: 'rates' must be a list of rows, got {rows!r}")
    by_family = defaultdict(list)
    for i, row in enumerate(rows):
        where = f"{path}: rates[{i}]"
        if not isinstance(row, dict):
            raise DataError(f"{where} is {row!r}, not an object")
        missing = [key for key in REQUIRED if row.get(key) is None]
        if missing:
            raise DataError(f"{where} has no {', '.join(missing)}")
        family = row["family"]
        if not isinstance(family, str) or not family:
            raise DataError(f"{where}: family is {family!r}, not a family's name")
        tokens = row.get("tokens")
        by_family[family].append(
            _Rate(
                n=_positive(row["N"], where, "N"),
                learning_rate=_positive(row["learning_rate"], where, "learning_rate"),
                tokens=None if tokens is None else _positive(tokens, where, "tokens"),
                index=i,
            )
        )
    return LearningRates(path, {f: _one_per_size(path, f, r) for f, r in by_family.items()})


def _positive(value, where, key) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DataError(f"{where}: {key} is {value!r}, not a number")
    if not (math.isfinite(value) and value > 0):
        raise DataError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def _one_per_size(path, family, rates) -> tuple[_Rate, ...]:
    """Of each size's rows, the one with the largest token budget."""
    chosen = []
    for rows in groups_within(rates, lambda r: r.n, SIZE_RTOL):
        budget = max(-1.0 if r.tokens is None else r.tokens for r in rows)
        top = [r for r in rows if (-1.0 if r.tokens is None else r.tokens) == budget]
        if len({r.learning_rate for r in top}) > 1:
            which = " and ".join(f"rates[{r.index}]" for r in top)
            raise DataError(
                f"{path}: {which} give {family} at N={top[0].n:.4g} with the same token budget "
                f"different learning rates ({', '.join(f'{r.learning_rate:.4g}' for r in top)}); "
                "keep one"
            )
        chosen.append(top[0])
    return tuple(sorted(chosen, key=lambda r: r.n))
