"""Figures and tables from a sweep's results (``python -m lmuscale.analysis RESULTS --out DIR``).

``analyse`` reads a results table, fits every family (``lmuscale.scaling``) and writes
``fig3``, ``fig4`` and ``fig5`` (PNG and PDF), ``fits.csv`` and ``fits.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmuscale.analysis import figures, tables
from lmuscale.analysis.fitting import GroupFit, find, fit_all
from lmuscale.analysis.results import Results, ResultsError, Run, load_results
from lmuscale.files import atomic_write_bytes


@dataclass
class Report:
    results: Results
    fits: list[GroupFit]
    files: list[Path]


def analyse(
    results,
    out,
    *,
    split: str = "test",
    size: float | None = None,
    n_boot: int = 1000,
    ci: float = 0.95,
    seed: int = 0,
    progress: bool = False,
) -> Report:
    """Read ``results`` (a results.jsonl or .csv), fit, and write the figures and tables into
    ``out``. Each file is replaced atomically. Raises ``ResultsError`` for an unusable table."""
    loaded = load_results(results, split)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fits = fit_all(loaded, n_boot=n_boot, ci=ci, seed=seed, progress=progress)
    files = []
    files += figures.save(figures.figure3(loaded, fits), out / "fig3")
    files += figures.save(figures.figure4(loaded, size), out / "fig4")
    files += figures.save(figures.figure5(loaded, fits), out / "fig5")
    tables.write_csv(out / "fits.csv", fits)
    files.append(out / "fits.csv")
    atomic_write_bytes(out / "fits.md", tables.markdown(loaded, fits).encode())
    files.append(out / "fits.md")
    return Report(loaded, fits, files)


__all__ = [
    "GroupFit",
    "Report",
    "Results",
    "ResultsError",
    "Run",
    "analyse",
    "find",
    "fit_all",
    "load_results",
]
