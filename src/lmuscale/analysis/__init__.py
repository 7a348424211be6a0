"""Figures and tables from a sweep's results (``python -m lmuscale.analysis RESULTS --out DIR``):
Figures 3-5, ``fits.csv`` and ``fits.md``, and the compute-optimal analyses (``optimal``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lmuscale.analysis import claims, extrapolation, figures, optimal, tables
from lmuscale.analysis.claims import Reading
from lmuscale.analysis.fitting import GroupFit, fit_all
from lmuscale.analysis.optimal import OptimalReport
from lmuscale.analysis.results import (
    LMU_FAMILIES,
    Results,
    Run,
    label,
    load_results,
)
from lmuscale.files import atomic_write_bytes, unwritable
from lmuscale.outcomes import DataError, StorageError
from lmuscale.scaling.extrapolate import FORM_NAMES, Extrapolation


@dataclass
class Report:
    results: Results
    fits: list[GroupFit]
    files: list[Path]
    optimal: OptimalReport | None = None
    refusals: list[str] = field(default_factory=list)  # one line per analysis not made
    tested: Extrapolation | None = None  # the hold-out tests
    claims: list[Reading] = field(default_factory=list)  # the paper's three, read from the runs

    def lines(self) -> list[str]:
        """What the console shows: the runs, each exponent, each analysis not made, the files."""
        results = self.results
        out = [f"{len(results.runs)} runs ({results.role_counts()}) from {results.path}"]
        out += [f"  left out: {note}" for note in results.skipped]
        rows = tables.summary_rows(self.fits, self.optimal, self.tested)
        for fit, form, runs, name, estimate, ci, test in rows:
            flag = f"; {test}" if tables.FLAG in test else ""
            out.append(f"  {fit}, {form}: {name} = {estimate} {ci} ({runs}){flag}")
        out += [f"  not made: {line}" for line in self.refusals]
        out.append("wrote " + ", ".join(str(p) for p in self.files))
        if self.claims:
            out.append("the paper's claims, read from these runs:")
            out += [f"  {reading.line()}" for reading in self.claims]
        return out


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
    select: dict | None = None,
) -> Report:
    """Read ``results`` (a results.jsonl or .csv), fit, and write the figures and tables into
    ``out`` atomically. Each analysis takes the runs of its role (``Results.grid`` for Figures
    3-5 and the fits in N; see ``compute_optimal`` for the rest); ``select``: keyword
    arguments of ``Results.select`` applied first. ``target_loss``: see ``data_efficiency``.
    Raises ``DataError`` (the results) or ``StorageError`` (the output folder), before the
    (slow) fits when it can."""
    loaded = load_results(results, split)
    if select:
        loaded = loaded.select(**select)
        if not loaded.runs:
            raise DataError(f"{loaded.path}: no run matches the selection ({loaded.selection})")
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StorageError(
            f"{out}: a file, not a folder (the figures and tables go in a folder)"
        ) from None
    except OSError as e:
        raise StorageError(f"{out}: cannot make the folder ({e.strerror})") from None
    fits = fit_all(loaded, n_boot=n_boot, ci=ci, seed=seed, progress=progress)
    best = optimal.compute_optimal(loaded, n_boot=n_boot, ci=ci, seed=seed, target=target_loss)
    tested = extrapolation.extrapolate(fits, best.frontiers, ci=ci)
    drawn, refusals = paper_figures(loaded.grid(), fits, size)
    if tested.records:
        drawn["extrapolation"] = extrapolation.figure(tested, loaded.unit)
    refusals += not_made(fits, best, tested)
    readings = claims.read_claims(loaded.grid(), fits, best.efficiency, ci)
    files = []
    try:
        for name, fig in drawn.items():
            files += figures.save(fig, out / name)
        files += optimal.write(best, loaded, out)
        tables.write_csv(out / "fits.csv", fits, extra=best.csv_rows(ci) + tested.csv_rows())
        extrapolation.write_fits_json(out / "fits.json", fits, best.frontiers, loaded.runs)
        text = tables.markdown(loaded, fits, best, refusals, [tested.markdown()], tested)
        text += "\n## The paper's claims, read from these runs\n\n"
        text += "".join(f"- {reading.line()}\n" for reading in readings)
        atomic_write_bytes(out / "fits.md", text.encode())
        files += [out / "fits.csv", out / "fits.json", out / "fits.md"]
    except OSError as e:
        raise unwritable(e.filename2 or e.filename or out, e) from None  # a rename: its target
    return Report(loaded, fits, files, best, refusals, tested, readings)


def not_made(fits, best: OptimalReport, tested) -> list[str]:
    """One line for each fit, compute-optimal analysis and hold-out test not made, with why."""
    refusals = [
        f"{g.name}, {g.form.replace('_', ' ')}: not fitted: {g.error}" for g in fits if g.error
    ]
    refusals += best.left_out
    refusals += [
        f"{label(f.family)}, IsoFLOP frontier: {f.error}" for f in best.frontiers if f.error
    ]
    refusals += [f"{label(e.family)}, lower envelope: {e.error}" for e in best.envelopes if e.error]
    refusals += [
        f"{label(e.families[1])} / {label(e.families[0])} tokens: {e.error}"
        for e in best.efficiency
        if e.error
    ]
    untested = {}  # one line per fit: its first refusal (holding out more leaves fewer)
    for r in tested.refusals:
        line = r.form in ("n_opt", "d_opt")  # a frontier: N_opt and D_opt say the same
        what = "budget" if line else "size"
        held = f"the largest {what}" if r.held_out == 1 else f"the largest {r.held_out}"
        form = "N_opt and D_opt lines" if line else FORM_NAMES[r.form]
        text = f"{r.name}, {form}: not tested by extrapolation: holding out {held}, {r.why}"
        untested.setdefault((r.name, line or r.form), text)
    refusals += untested.values()
    if not tested.records:
        refusals.append("extrapolation figure: not drawn: no fit could be tested")
    return refusals


def paper_figures(grid: Results, fits, size=None) -> tuple[dict, list[str]]:
    """Figures 3-5 from the paper-grid runs, by file name, each that the runs support, and one
    line for each that is not drawn, saying why."""
    if not grid.runs:
        return {}, ["Figures 3-5: not drawn: the table has no paper-grid runs"]
    drawn = {"fig3": figures.figure3(grid, fits)}
    refusals = []
    base = grid.base_tokens
    at_base = [r for r in grid.runs if r.tokens == base]
    if any(r.per_position for r in at_base):
        drawn["fig4"] = figures.figure4(grid, size)
    else:
        refusals.append(
            f"Figure 4: not drawn: no grid run at {base:,.0f} tokens has {grid.split}_per_position"
        )
    lmus = [r for r in at_base if r.family in LMU_FAMILIES]
    longer = [r for r in grid.runs if r.family == "transformer" and r.tokens > base]
    if lmus and (longer or grid.gpt2_tokens):
        drawn["fig5"] = figures.figure5(grid, fits)
    elif not lmus:
        refusals.append(f"Figure 5: not drawn: no LMU grid run at {base:,.0f} tokens")
    else:
        refusals.append(
            f"Figure 5: not drawn: no transformer grid run has more than the LMU's {base:,.0f} "
            f"tokens, and Kaplan's curve is for GPT-2 tokens ({grid.unit} here), so it would "
            "repeat Figure 3"
        )
    return drawn, refusals


__all__ = [
    "GroupFit",
    "Report",
    "Results",
    "Run",
    "analyse",
    "fit_all",
    "load_results",
]
