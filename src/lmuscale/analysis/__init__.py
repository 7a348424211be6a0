"""Figures and tables from a sweep's results (``python -m lmuscale.analysis RESULTS --out DIR``):
Figures 3-5, ``fits.csv`` and ``fits.md``, and the compute-optimal analyses (``optimal``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmuscale.analysis import figures, optimal, tables
from lmuscale.analysis.fitting import GroupFit, fit_all
from lmuscale.analysis.optimal import OptimalReport
from lmuscale.analysis.results import Results, ResultsError, Run, load_results
from lmuscale.files import atomic_write_bytes
from lmuscale.outcomes import StorageError


class OutputError(StorageError):
    """An output folder that cannot be made or written; the message names the path."""


@dataclass
class Report:
    results: Results
    fits: list[GroupFit]
    files: list[Path]
    optimal: OptimalReport | None = None


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
    target_loss: float | None = None,
) -> Report:
    """Read ``results`` (a results.jsonl or .csv), fit, and write the figures and tables into
    ``out`` atomically; ``target_loss``: see ``data_efficiency``. Raises ``ResultsError`` or
    ``OutputError``, before the (slow) fits when it can."""
    loaded = load_results(results, split)
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(
            f"{out}: a file, not a folder (the figures and tables go in a folder)"
        ) from None
    except OSError as e:
        raise OutputError(f"{out}: cannot make the folder ({e.strerror})") from None
    fits = fit_all(loaded, n_boot=n_boot, ci=ci, seed=seed, progress=progress)
    best = optimal.compute_optimal(loaded, n_boot=n_boot, ci=ci, seed=seed, target=target_loss)
    files = []
    try:
        files += figures.save(figures.figure3(loaded, fits), out / "fig3")
        files += figures.save(figures.figure4(loaded, size), out / "fig4")
        files += figures.save(figures.figure5(loaded, fits), out / "fig5")
        files += optimal.write(best, loaded, out)
        tables.write_csv(out / "fits.csv", fits, extra=best.csv_rows(ci))
        text = tables.markdown(loaded, fits) + "\n".join(best.markdown(ci)) + "\n"
        atomic_write_bytes(out / "fits.md", text.encode())
        files += [out / "fits.csv", out / "fits.md"]
    except OSError as e:
        path = e.filename2 or e.filename or out  # a rename names its target second
        raise OutputError(f"{path}: cannot be written ({e.strerror or e})") from None
    return Report(loaded, fits, files, best)


__all__ = [
    "GroupFit",
    "OutputError",
    "Report",
    "Results",
    "ResultsError",
    "Run",
    "analyse",
    "fit_all",
    "load_results",
]
