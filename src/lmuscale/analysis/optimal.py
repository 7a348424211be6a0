"""The compute-optimal analyses a results table supports: IsoFLOP (3 or more sizes at each
of 2 or more budgets), the envelope (curves of 2 or more sizes), data efficiency (``_pairs``)
and learning rates (a size run at 2 or more rates); each one left out gets a line saying why."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from lmuscale.analysis import optimal_figures as figures
from lmuscale.analysis.curves import load_curves
from lmuscale.analysis.efficiency import DataEfficiency, data_efficiency
from lmuscale.analysis.figures import save
from lmuscale.analysis.isoflop import Envelope, Frontier, budgets, envelope, fit_frontier
from lmuscale.analysis.learning_rate import (
    LearningRateChoice,
    select_learning_rates,
    write_learning_rates,
)
from lmuscale.analysis.results import LMU_FAMILIES, Results, family_key, label

LEARNING_RATES = "learning_rates.json"


@dataclass
class OptimalReport:
    frontiers: list[Frontier] = field(default_factory=list)
    envelopes: list[Envelope] = field(default_factory=list)
    efficiency: list[DataEfficiency] = field(default_factory=list)
    rates: list[LearningRateChoice] = field(default_factory=list)
    curves: dict = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)  # one line per analysis not made
    ci: float = 0.95

    def csv_rows(self, ci: float) -> list[dict]:
        """Rows in fits.csv's columns: one per estimate, with its CI where it has one."""
        rows = []
        for frontier in self.frontiers:
            for fit in frontier.fits:
                common = _row(f"{label(fit.family)}, C = {fit.budget:.3g}", fit.family, "isoflop")
                common.update(formula="L = c0 (log10 N)^2 + c1 log10 N + c2", ci=ci)
                common["n_points"] = len(fit.runs)
                if fit.n_opt is None:
                    rows.append({**common, "error": fit.error})
                    continue
                for name, value in (("N_opt", fit.n_opt), ("D_opt", fit.d_opt)):
                    rows.append({**common, **_interval(name, value), "n_boot_used": fit.kept})
                rows.append({**common, "parameter": "L_opt", "estimate": fit.loss_opt})
            common = _row(f"{label(frontier.family)}, all budgets", frontier.family, "frontier")
            common.update(formula="N_opt ∝ C^a, D_opt ∝ C^b", ci=ci)
            common["n_points"] = sum(f.n_opt is not None for f in frontier.fits)
            if frontier.a is None:
                rows.append({**common, "error": frontier.error})
            else:
                rows += [{**common, **_interval("a", frontier.a)}]
                rows += [{**common, **_interval("b", frontier.b)}]
        for env in self.envelopes:
            common = _row(f"{label(env.family)}, envelope", env.family, "envelope")
            common.update(formula="N along the lower envelope ∝ C^a", ci=ci)
            common["n_points"] = len(env.flops)
            if env.a is None:
                rows.append({**common, "error": env.error})
            else:
                rows.append({**common, **_interval("a", env.a)})
        for eff in self.efficiency:
            a, b = eff.families
            common = _row(f"{label(b)} / {label(a)} tokens", f"{a},{b}", "data_efficiency")
            common.update(formula=f"tokens to reach loss {eff.target:.4f}", n_points=len(eff.n))
            if eff.ratio_geomean is None:
                rows.append({**common, "error": eff.error})
            else:
                rows.append({**common, "parameter": "ratio_geomean", "estimate": eff.ratio_geomean})
        for choice in self.rates:
            common = _row(f"{label(choice.family)}, N = {choice.n:,.0f}", choice.family, "lr")
            common.update(formula="parabola in log10 LR", n_points=len(choice.learning_rates))
            rows.append(
                {
                    **common,
                    "parameter": "learning_rate",
                    "estimate": choice.best,
                    "error": None if choice.bracketed else "not bracketed",
                }
            )
        return rows

    def markdown(self, ci: float) -> list[str]:
        out = ["## Compute-optimal analyses", ""]
        if not (self.frontiers or self.envelopes or self.efficiency or self.rates):
            return [*out, "None could be made: see the last section."]
        if self.frontiers:
            out += ["", f"### IsoFLOP minima (Chinchilla approach 2; {ci:.0%} CIs)", ""]
            out += ["| family | C (FLOPs) | sizes | N_opt | D_opt | loss at N_opt | note |"]
            out += ["|---|---:|---:|---|---|---:|---|"]
            for frontier in self.frontiers:
                for fit in frontier.fits:
                    start = f"| {label(fit.family)} | {fit.budget:.3g} | {len(fit.runs)} |"
                    if fit.n_opt is None:
                        out.append(f"{start} — | — | — | {fit.error} |")
                    else:
                        optimum = " | ".join(v.text(",.0f") for v in (fit.n_opt, fit.d_opt))
                        optimum += f" | {fit.loss_opt:.4f}"
                        out.append(f"{start} {optimum} | |")
            out += ["", "| family | a (N_opt ∝ C^a) | b (D_opt ∝ C^b) | budgets fitted | note |"]
            out += ["|---|---|---|---:|---|"]
            for frontier in self.frontiers:
                used = sum(f.n_opt is not None for f in frontier.fits)
                if frontier.a is None:
                    out.append(f"| {label(frontier.family)} | — | — | {used} | {frontier.error} |")
                else:
                    note = "" if used >= 3 else "under 3 budgets: drawn only over them"
                    out.append(
                        f"| {label(frontier.family)} | {frontier.a.text('.3f')} | "
                        f"{frontier.b.text('.3f')} | {used} | {note} |"
                    )
        if self.envelopes:
            out += ["", "### Lower envelope of the evaluation curves (Chinchilla approach 1)", ""]
            out += ["| family | runs | FLOPs covered | a (N ∝ C^a along it) | note |"]
            out += ["|---|---:|---|---|---|"]
            for env in self.envelopes:
                runs = sum(c.run.family == env.family for c in self.curves.values())
                span = f"{env.flops[0]:.3g} to {env.flops[-1]:.3g}" if len(env.flops) else "—"
                a = "—" if env.a is None else env.a.text(".3f")
                out.append(f"| {label(env.family)} | {runs} | {span} | {a} | {env.error or ''} |")
        if self.efficiency:
            out += ["", "### Data efficiency: tokens to reach a loss", ""]
            for eff in self.efficiency:
                a, b = (label(f) for f in eff.families)
                if eff.ratio_geomean is None:
                    out.append(f"- {b} vs {a} at loss {eff.target:.4f}: {eff.error}")
                    continue
                out.append(
                    f"- {b} needs **{eff.ratio_geomean:.3g}x** the tokens of {a} to reach a "
                    f"validation loss of {eff.target:.4f} (geometric mean over {len(eff.n)} "
                    f"sizes of {a}; each {b} size interpolated in log N)."
                )
                out += ["", f"| N ({a}) | tokens, {a} | tokens, {b} | ratio |"]
                out += ["|---:|---:|---:|---:|"]
                for n, ta, tb, r in zip(eff.n, eff.tokens_a, eff.tokens_b, eff.ratio, strict=True):
                    out.append(f"| {n:,.0f} | {ta:,.0f} | {tb:,.0f} | {r:.3g} |")
                out += ["", *(f"- Size left out: {line}" for line in eff.left_out), ""]
        if self.rates:
            out += ["", "### Learning rates", "", f"Written to `{LEARNING_RATES}`.", ""]
            out += ["| family | N | tokens | grid | best on grid | chosen | note |"]
            out += ["|---|---:|---:|---|---:|---:|---|"]
            for c in self.rates:
                grid = ", ".join(f"{x:g}" for x in c.learning_rates)
                note = "" if c.bracketed else "at the edge of the grid: extend it"
                out.append(
                    f"| {label(c.family)} | {c.n:,.0f} | {c.tokens:,.0f} | {grid} | "
                    f"{c.grid_best:g} | {c.best:.3g} | {note} |"
                )
        return out


def compute_optimal(
    results: Results, *, n_boot: int, ci: float, seed: int, target: float | None = None
) -> OptimalReport:
    """Every compute-optimal analysis ``results`` supports, each on the runs of its role:
    IsoFLOP frontiers on the IsoFLOP runs; the envelope on each family's IsoFLOP runs (its
    grid runs without); data efficiency on the grid runs (the IsoFLOP runs without); learning
    rates on the learning-rate grid. The rest are named in ``left_out``. ``target``: the loss
    of the data-efficiency comparison."""
    report = OptimalReport(ci=ci)
    iso, grid = results.select(roles=("isoflop",)), results.grid()
    without = {r.family for r in grid.runs + iso.runs if r.flops is None}
    for family in sorted(without, key=family_key):
        report.left_out.append(
            f"{label(family)}: IsoFLOP and envelope: the table has no flops_per_token"
        )
    for family in [f for f in iso.families if f not in without]:
        runs = [r for r in iso.runs if r.family == family]
        groups = [g for _, g in budgets(runs) if len({r.n for r in g}) >= 3]
        if len(groups) >= 2:
            grid_runs = [r for g in groups for r in g]
            report.frontiers.append(
                fit_frontier(family, grid_runs, n_boot=n_boot, ci=ci, seed=seed)
            )
        else:
            report.left_out.append(
                f"{label(family)}: IsoFLOP (approach 2) needs 3 or more sizes at each of 2 or "
                f"more compute budgets; the IsoFLOP runs have {len(groups)} such budget(s)"
            )
    if not iso.runs and not without:
        report.left_out.append("IsoFLOP (approach 2): the table has no IsoFLOP runs")
    curves, missing = load_curves(dataclasses.replace(results, runs=grid.runs + iso.runs))
    report.curves = curves
    if missing:
        shown = "; ".join(missing[:5]) + (
            f"; and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        report.left_out.append(f"evaluation curves: {shown}")
    by_role = {}
    for curve in curves.values():
        by_role.setdefault((curve.run.role, curve.run.family), []).append(curve)
    for family in sorted({r.family for r in grid.runs + iso.runs}, key=family_key):
        mine = by_role.get(("isoflop", family)) or by_role.get(("grid", family), [])
        if family in without:
            continue
        if len({c.run.n for c in mine}) >= 2:
            report.envelopes.append(envelope(family, mine, n_boot=n_boot, ci=ci, seed=seed))
        else:
            report.left_out.append(
                f"{label(family)}: envelope (approach 1) needs evaluation curves of 2 or more "
                f"sizes; found {len({c.run.n for c in mine})}"
            )
    lr = results.select(roles=("learning_rate",))
    report.rates, notes = select_learning_rates(lr.runs)
    report.left_out += [f"learning rates: {note}" for note in notes]
    if not lr.runs:
        report.left_out.append(
            "learning rates: no family and size was run at 2 or more learning rates"
        )
    for role in ("grid", "isoflop"):
        families = [f for r, f in sorted(by_role, key=lambda k: family_key(k[1])) if r == role]
        if len(families) >= 2:
            break
    else:
        report.left_out.append(
            "data efficiency: needs evaluation curves of two families in the grid (or the "
            "IsoFLOP runs)"
        )
        return report
    for a, b in _pairs(families):
        pair = by_role[role, a] + by_role[role, b]
        report.efficiency.append(data_efficiency(pair, a, b, target))
    return report


def write(report: OptimalReport, results: Results, out: Path) -> list[Path]:
    """The figures of the analyses made, and learning_rates.json; returns the paths."""
    files = []
    unit = results.unit
    if report.frontiers:
        files += save(figures.isoflop_figure(report.frontiers, unit, report.ci), out / "isoflop")
    minima = any(fit.n_opt is not None for f in report.frontiers for fit in f.fits)
    if minima or any(e.error is None for e in report.envelopes):  # else an empty figure
        files += save(figures.optimal_figure(report.frontiers, report.envelopes), out / "optimal")
    for eff in [e for e in report.efficiency if e.ratio_geomean is not None]:
        curves = [c for c in report.curves.values() if c.run.trial in eff.reached]
        name = f"tokens_{eff.families[0]}_{eff.families[1]}"
        files += save(figures.tokens_figure(curves, eff, unit), out / name)
    if report.rates:
        files += save(figures.learning_rate_figure(report.rates, unit), out / "learning_rate")
        write_learning_rates(out / LEARNING_RATES, report.rates)
        files.append(out / LEARNING_RATES)
    return files


def _pairs(families: list[str]) -> list[tuple[str, str]]:
    """Each LMU family against the transformer; without both, the first two families."""
    if "transformer" in families and any(f in LMU_FAMILIES for f in families):
        return [(f, "transformer") for f in LMU_FAMILIES if f in families]
    return [tuple(families[:2])] if len(families) >= 2 else []


def _row(name: str, family: str, form: str) -> dict:
    return {"fit": name, "family": family, "form": form}


def _interval(name: str, value) -> dict:
    return {"parameter": name, "estimate": value.estimate, "ci_low": value.lo, "ci_high": value.hi}
