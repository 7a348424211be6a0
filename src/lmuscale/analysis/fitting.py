"""Which fits an analysis makes: the power law and saturating form at each family and budget of
the paper grid, and Chinchilla's L(N, D) over each family's grid budgets and IsoFLOP runs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from lmuscale.analysis.results import ROLE_NAMES, Results, label
from lmuscale.scaling import BATCH_TOKENS, Fit, FitError
from lmuscale.scaling.fits import FITTERS


@dataclass(frozen=True)
class GroupFit:
    """One form fitted to one family's runs of one role, at one budget (``tokens``) or across
    budgets (None)."""

    family: str
    tokens: float | None
    steps: float | None
    form: str
    trials: tuple[str, ...]
    fit: Fit | None
    error: str | None = None
    role: str = "grid"

    @property
    def name(self) -> str:
        if self.role != "grid":
            return f"{label(self.family)}, {ROLE_NAMES[self.role]} runs"
        if self.tokens is None:
            return f"{label(self.family)}, all budgets"
        where = f"{self.steps:,.0f} steps"
        if round(self.tokens) != round(self.steps * BATCH_TOKENS):  # not the paper's batch
            where += f" x {self.tokens / self.steps:,.0f} tokens"
        return f"{label(self.family)}, {where}"


def fit_all(results: Results, *, n_boot: int, ci: float, seed: int, progress=False) -> list:
    """The fits of the module docstring, the paper grid's from ``Results.grid``; Chinchilla's
    where the runs have two or more budgets. A group too small for a form gets a ``GroupFit``
    with ``error``."""
    grid = results.grid()
    jobs = []
    for family in grid.families:
        for tokens in grid.budgets(family):
            runs = grid.group(family, tokens)
            jobs += [(family, tokens, runs, f, "grid") for f in ("power_law", "saturating")]
    for role, of_role in (("grid", grid), ("isoflop", results.select(roles=("isoflop",)))):
        for family in of_role.families:
            if len(of_role.budgets(family)) > 1:
                runs = [r for r in of_role.runs if r.family == family]
                jobs.append((family, None, runs, "chinchilla", role))
    fits = []
    bar = tqdm(jobs, desc="fitting", unit="fit", disable=not progress, leave=False)
    for family, tokens, runs, form, role in bar:
        bar.set_postfix_str(f"{label(family)}, {form}")
        n = np.array([r.n for r in runs])
        loss = np.array([r.loss for r in runs])
        steps = None if tokens is None else float(np.median([r.steps for r in runs]))
        data = (n, loss) if form != "chinchilla" else (n, np.array([r.tokens for r in runs]), loss)
        try:
            fit = FITTERS[form](*data, n_boot=n_boot, ci=ci, seed=seed)
            error = None
        except FitError as e:
            fit, error = None, str(e)
        trials = tuple(r.trial for r in runs)
        fits.append(GroupFit(family, tokens, steps, form, trials, fit, error, role))
    return fits


def find(fits, family: str, tokens: float | None, form: str) -> GroupFit | None:
    return next((f for f in fits if (f.family, f.tokens, f.form) == (family, tokens, form)), None)
