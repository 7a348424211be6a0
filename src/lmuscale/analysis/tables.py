"""fits.csv and fits.md: every fitted parameter with its CI and residuals, the reference
curves at Table 3's sizes and the transformer steps needed to match each LMU run."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np

from lmuscale.analysis.isoflop import Interval
from lmuscale.analysis.results import (
    LMU_FAMILIES,
    MIN_SIZES,
    ROLE_NAMES,
    Results,
    family_key,
    label,
)
from lmuscale.files import atomic_write_bytes
from lmuscale.scaling import FORMULAS, reference, steps_to_match
from lmuscale.scaling.extrapolate import Extrapolation
from lmuscale.scaling.fits import interval_text

CSV_FIELDS = (
    "fit",
    "family",
    "steps",
    "tokens",
    "form",
    "formula",
    "parameter",
    "estimate",
    "stderr",
    "ci_low",
    "ci_high",
    "ci",
    "n_points",
    "n_boot",
    "n_boot_used",
    "rms_log_residual",
    "residuals",
    "error",
)


def fit_rows(fits) -> list[dict]:
    """One row per fitted parameter (one row with ``error`` for a fit that was refused);
    ``residuals`` is a JSON object of trial -> log(measured) - log(fitted)."""
    rows = []
    for g in fits:
        common = {
            "fit": g.name,
            "family": g.family,
            "steps": g.steps,
            "tokens": g.tokens,
            "form": g.form,
            "formula": FORMULAS[g.form],
            "n_points": len(g.trials),
        }
        f = g.fit
        if f is None:
            rows.append({**common, "error": g.error})
            continue
        residuals = {t: round(float(r), 6) for t, r in zip(g.trials, f.residuals, strict=True)}
        common.update(
            ci=f.ci,
            n_boot=f.n_boot,
            n_boot_used=len(f.samples),
            rms_log_residual=f.rms_residual,
            residuals=json.dumps(residuals),
        )
        for i, name in enumerate(f.names):
            estimate = {"parameter": name, "estimate": f.estimate[i], "stderr": f.stderr[i]}
            rows.append({**common, **estimate, "ci_low": f.ci_low[i], "ci_high": f.ci_high[i]})
    return rows


def write_csv(path: Path, fits, extra: list[dict] = ()) -> None:
    """fits.csv: the rows of ``fits``, then ``extra`` rows in the same columns (the
    compute-optimal estimates)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in [*fit_rows(fits), *extra]:
        writer.writerow({k: _cell(row.get(k)) for k in CSV_FIELDS})
    atomic_write_bytes(path, buffer.getvalue().encode())


EXPONENTS = ("alpha", "beta")  # the parameters of a fit that the summary shows


def markdown(results: Results, fits, best, refusals: list[str], sections=(), tested=None) -> str:
    """fits.md: a summary of every exponent with its CI and runs, then ``sections`` (lists of
    lines), the fitted parameters, residuals, compute-optimal analyses, reference curves and
    data efficiency, the runs behind each fit, and last one line per analysis not made."""
    roles = "from the table's role column"
    if results.roles_inferred:
        roles = "inferred from the runs: the table has no role column"
    out = [
        "# Scaling-law fits",
        "",
        f"- Results: `{results.path}`: {len(results.runs)} runs ({results.role_counts()}; roles "
        f"{roles}), {results.split} loss in {results.unit}.",
    ]
    if results.selection:
        out.append(f"- Selected: {results.selection}.")
    out.append(
        "- N is non-embedding parameters. Fits are to log L; CIs are percentile intervals of a "
        "case bootstrap; stderr is analytic for the power law (OLS) and saturating form "
        "(Gauss-Newton), the bootstrap SD for Chinchilla."
    )
    if results.skipped:
        out.append(f"- Left out ({len(results.skipped)}): " + "; ".join(results.skipped))
    out += branch_markdown(results, fits, best)
    out += ["", *summary_markdown(fits, best, tested), ""]
    for section in sections:
        out += [*section, ""]
    out += ["## Fitted parameters", ""]
    out += ["| fit | form | points | parameter | estimate | stderr | CI | RMS log residual |"]
    out += ["|---|---|---:|---|---:|---:|---|---:|"]
    fitted = [g for g in fits if g.fit is not None]
    for g in fitted:
        f, why = g.fit, g.fit.unresolved  # a property that recomputes: once per fit
        for i, name in enumerate(f.names):
            ci = interval_text(f.ci_low[i], f.ci_high[i], why[i], ".4g")
            ci += f" ({f.ci:.0%}, {len(f.samples)} of {f.n_boot} resamples)"
            out.append(
                f"| {g.name} | {FORMULAS[g.form]} | {len(g.trials)} | {name} | "
                f"{_num(f.estimate[i])} | {_num(f.stderr[i])} | {ci} | {f.rms_residual:.4f} |"
            )
    out += ["", "## Residuals (log measured - log fitted)", ""]
    out += ["| fit | form | trial | N | tokens | loss | fitted | residual |"]
    out += ["|---|---|---|---:|---:|---:|---:|---:|"]
    for g in fitted:
        f = g.fit
        fitted = f.predict(f.n, f.tokens)
        tokens = f.tokens if f.tokens is not None else [g.tokens] * len(f.n)
        for trial, n, d, loss, p, r in zip(
            g.trials, f.n, tokens, f.loss, fitted, f.residuals, strict=True
        ):
            out.append(
                f"| {g.name} | {g.form} | {trial} | {n:,.0f} | {d:,.0f} | {loss:.4f} | "
                f"{p:.4f} | {r:+.4f} |"
            )
    out += ["", *best.markdown(best.ci), "", *seed_markdown(results)]
    out += ["", *reference_markdown(results), "", *efficiency_markdown(results.grid()), ""]
    out += ["## Runs behind each fit", ""]
    for name, trials in runs_behind(fits, best):
        out.append(f"- {name}: {', '.join(trials)}")
    out += ["", "## Not fitted or not drawn", ""]
    out += [f"- {line}" for line in refusals] or ["Every analysis was made."]
    return "\n".join(out) + "\n"


FLAG = "⚠"  # begins the check of an estimate that a reader should not take at face value


def check(tested: Extrapolation | None, name: str, form: str) -> str:
    """What the hold-out tests of fit ``name`` in ``form`` found: flagged where any failed."""
    if tested is None:
        return "no hold-out test"
    made = [r for r in tested.records if (r.name, r.form) == (name, form) and np.isfinite(r.lo)]
    if not made:
        return "not tested by extrapolation (too few sizes)"
    failed = sum(not r.covered for r in made)
    if failed:
        return f"{FLAG} failed {failed} of {len(made)} hold-out tests"
    return f"passed {len(made)} hold-out test{'s' if len(made) > 1 else ''}"


def summary_rows(fits, best, tested: Extrapolation | None = None) -> list[list[str]]:
    """Each family's exponents with their CIs, the runs behind them and what checks them: rows
    of (fit, form, runs, exponent, estimate, CI, check), each family's together. The check
    flags (``FLAG``) an estimate whose CI the points cannot pin down and a fit that failed any
    of its hold-out tests (``tested``)."""
    rows = []  # (family, cells)

    def add(family, fit, form, runs, name, value: Interval, test: str, sampled: bool = True):
        spec = ".3g" if name == "ratio" else ".3f"
        ci = interval_text(value.lo, value.hi, value.why, ".3f")
        if sampled and value.why and not math.isfinite(value.lo):
            test = f"{FLAG} not identified by the points ({value.why}); {test}"
        rows.append((family, [fit, form, runs, name, f"{value.estimate:{spec}}", ci, test]))

    for g in fits:
        if g.fit is not None:
            f, why = g.fit, g.fit.unresolved
            runs = f"{len(g.trials)} {ROLE_NAMES[g.role]} runs"
            test = check(tested, g.name, g.form)
            for i, name in enumerate(f.names):
                if name in EXPONENTS:
                    value = Interval(f.estimate[i], f.ci_low[i], f.ci_high[i], why[i])
                    add(g.family, g.name, FORMULAS[g.form], runs, name, value, test)
    for frontier in best.frontiers:
        if frontier.a is not None:
            used = [f for f in frontier.fits if f.n_opt is not None]
            runs = f"{sum(len(f.runs) for f in used)} IsoFLOP runs, {len(used)} budgets"
            fit = f"{label(frontier.family)}, IsoFLOP minima"
            tested_as = f"{label(frontier.family)}, IsoFLOP frontier"
            a, b = (check(tested, tested_as, form) for form in ("n_opt", "d_opt"))
            add(frontier.family, fit, "N_opt ∝ C^a", runs, "a", frontier.a, a)
            add(frontier.family, fit, "D_opt ∝ C^b", runs, "b", frontier.b, b)
    for env in best.envelopes:
        if env.a is not None:
            fit, runs = f"{label(env.family)}, lower envelope", f"{len(env.trials)} curves"
            sizes = len(np.unique(env.n[np.asarray(env.used, bool)]))
            test = "no hold-out test"
            if sizes < MIN_SIZES:
                test = f"{FLAG} through {sizes} distinct sizes only; {test}"
            add(env.family, fit, "N ∝ C^a along it", runs, "a", env.a, test)
    for eff in best.efficiency:
        if eff.ratio_geomean is not None:
            a, b = eff.families
            ratio = Interval(eff.ratio_geomean, math.nan, math.nan, "not bootstrapped")
            what = f"tokens to reach loss {eff.target:.4f}"
            fit, runs = f"{label(b)} / {label(a)}", f"{len(eff.n)} sizes"
            add(a, fit, what, runs, "ratio", ratio, "no hold-out test", sampled=False)
    rows.sort(key=lambda item: family_key(item[0]))  # stable: each family's rows together
    return [cells for _, cells in rows]


def summary_markdown(fits, best, tested: Extrapolation | None = None) -> list[str]:
    out = ["## Summary", ""]
    rows = summary_rows(fits, best, tested)
    if not rows:
        return [*out, "No analysis could be made: see the last section."]
    out += [f"| fit | form | runs | exponent | estimate | {best.ci:.0%} CI | check |"]
    out += ["|---|---|---|---|---:|---|---|"]
    out += ["| " + " | ".join(cells) + " |" for cells in rows]
    if any(cells[-1].startswith(FLAG) or f"; {FLAG}" in cells[-1] for cells in rows):
        out += ["", f"{FLAG}: an estimate the runs do not support as it stands; see below."]
    return out


def seed_markdown(results: Results) -> list[str]:
    """The spread of the loss over seeds at each grid point with seed replicates."""
    replicas = [r for r in results.runs if r.role == "seed"]
    if not replicas:
        return []
    out = ["## Seed replicates (the noise the fits' residuals compare with)", ""]
    out += [
        "| family | N | tokens | runs | mean loss | SD | trials |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    points = sorted(
        {(r.family, r.n, r.tokens) for r in replicas}, key=lambda p: (family_key(p[0]), p[1:])
    )
    for family, n, tokens in points:
        runs = [
            r
            for r in results.runs
            if r.role in ("grid", "seed") and (r.family, r.n, r.tokens) == (family, n, tokens)
        ]
        loss = np.array([r.loss for r in runs])
        sd = f"{loss.std(ddof=1):.4f}" if len(loss) > 1 else "—"
        out.append(
            f"| {label(family)} | {n:,.0f} | {tokens:,.0f} | {len(runs)} | {loss.mean():.4f} | "
            f"{sd} | {', '.join(r.trial for r in runs)} |"
        )
    return out


def runs_behind(fits, best) -> list[tuple[str, tuple[str, ...]]]:
    """(name, trials) of every fit and estimate made."""
    named = [(f"{g.name}, {g.form.replace('_', ' ')}", g.trials) for g in fits if g.fit is not None]
    for frontier in best.frontiers:
        trials = tuple(r.trial for f in frontier.fits for r in f.runs)
        named.append((f"{label(frontier.family)}, IsoFLOP", trials))
    named += [(f"{label(e.family)}, lower envelope", e.trials) for e in best.envelopes if e.trials]
    for eff in best.efficiency:
        a, b = (label(f) for f in eff.families)
        named.append((f"{b} / {a} tokens", tuple(eff.reached)))
    return named


def branch_markdown(results: Results, fits, best) -> list[str]:
    """The fits that rest on cooldown branches (runs with a branch_from), with how many of
    their runs are branches; none without branches."""
    branches = {r.trial for r in results.runs if r.branch_from}
    if not branches:
        return []
    out = [
        f"- Cooldown branches: {len(branches)} runs are warmup-stable-decay cooldowns, each "
        "started from a stable run's checkpoint (columns branch_from, branch_step; their tokens "
        "and FLOPs include the stable run's). They enter the fits as independent runs would; "
        "the figures draw them hollow (marked x where they leave their stable run)."
    ]
    for name, trials in runs_behind(fits, best):
        count = len(branches.intersection(trials))
        if count:
            out.append(f"  - {name}: rests on {count} branch(es) of its {len(set(trials))} runs")
    return out


def reference_markdown(results: Results) -> list[str]:
    out = ["## Reference curves at Table 3's sizes (nats per GPT-2 token)", ""]
    if not results.gpt2_tokens:
        return [*out, f"Not shown: these losses are {results.unit}, not per GPT-2 token."]
    return [*out, *reference.reference_markdown()]


def efficiency_markdown(results: Results) -> list[str]:
    """Transformer steps (Kaplan eq 1.6, at the run's batch) to reach each LMU run's loss at
    the same N; inf where the loss is below the transformer's infinite-training limit."""
    out = ["## Data efficiency: transformer steps to match each LMU run (Kaplan eq. 1.6)", ""]
    runs = [r for r in results.runs if r.family in LMU_FAMILIES]
    if not results.gpt2_tokens:
        return [*out, f"Not computed: these losses are {results.unit}, not per GPT-2 token."]
    if not runs:
        return [*out, "No LMU runs in the results."]
    out += [
        "| trial | N | LMU loss | LMU steps | transformer steps | transformer tokens | "
        "token ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(runs, key=lambda r: (r.family, r.n)):
        steps = float(steps_to_match(r.loss, r.n, r.batch_tokens))
        if math.isinf(steps):
            shown = ["inf (below the eq. 1.6 limit)", "inf", "inf"]
        else:
            tokens = steps * r.batch_tokens
            shown = [f"{steps:,.0f}", f"{tokens:,.0f}", f"{tokens / r.tokens:.2f}"]
        out.append(
            f"| {r.trial} ({label(r.family)}) | {r.n:,.0f} | {r.loss:.4f} | "
            f"{r.steps:,.0f} | " + " | ".join(shown) + " |"
        )
    return out


def _num(x) -> str:
    x = float(x)
    if not np.isfinite(x):
        return "nan"
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.3e}"


def _cell(value):
    if value is None:
        return ""
    if isinstance(value, float | np.floating):
        return "" if not np.isfinite(value) else repr(float(value))
    return value
