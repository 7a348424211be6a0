"""fits.csv and fits.md: every fitted parameter with its CI and residuals, the reference
curves at Table 3's sizes and the transformer steps needed to match each LMU run."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np

from lmuscale.analysis.results import LMU_FAMILIES, Results, label
from lmuscale.files import atomic_write_bytes
from lmuscale.scaling import FORMULAS, reference, steps_to_match

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
        if g.fit is None:
            rows.append({**common, "error": g.error})
            continue
        f = g.fit
        residuals = json.dumps(
            {t: round(float(r), 6) for t, r in zip(g.trials, f.residuals, strict=True)}
        )
        for i, name in enumerate(f.names):
            rows.append(
                {
                    **common,
                    "parameter": name,
                    "estimate": f.estimate[i],
                    "stderr": f.stderr[i],
                    "ci_low": f.ci_low[i],
                    "ci_high": f.ci_high[i],
                    "ci": f.ci,
                    "n_boot": f.n_boot,
                    "n_boot_used": len(f.samples),
                    "rms_log_residual": f.rms_residual,
                    "residuals": residuals,
                }
            )
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


def markdown(results: Results, fits) -> str:
    out = [
        "# Scaling-law fits",
        "",
        f"- Results: `{results.path}` ({len(results.runs)} runs used, {results.split} loss, "
        f"{results.unit}).",
        "- N is non-embedding parameters. Fits are to log L; CIs are percentile intervals "
        "of a case bootstrap; stderr is analytic for the power law (OLS) and saturating form "
        "(Gauss-Newton), the bootstrap SD for Chinchilla.",
    ]
    if results.skipped:
        out.append(f"- Left out ({len(results.skipped)}): " + "; ".join(results.skipped))
    out += ["", "## Fitted parameters", ""]
    out += ["| fit | form | points | parameter | estimate | stderr | CI | RMS log residual |"]
    out += ["|---|---|---:|---|---:|---:|---|---:|"]
    for g in fits:
        if g.fit is None:
            out.append(
                f"| {g.name} | {FORMULAS[g.form]} | {len(g.trials)} | — | not fitted: "
                f"{g.error} | | | |"
            )
            continue
        f = g.fit
        for i, name in enumerate(f.names):
            ci = (
                f"[{_num(f.ci_low[i])}, {_num(f.ci_high[i])}] ({f.ci:.0%}, {len(f.samples)} "
                f"of {f.n_boot} resamples)"
            )
            out.append(
                f"| {g.name} | {FORMULAS[g.form]} | {len(g.trials)} | {name} | "
                f"{_num(f.estimate[i])} | {_num(f.stderr[i])} | {ci} | {f.rms_residual:.4f} |"
            )
    out += ["", "## Residuals (log measured - log fitted)", ""]
    out += ["| fit | form | trial | N | tokens | loss | fitted | residual |"]
    out += ["|---|---|---|---:|---:|---:|---:|---:|"]
    for g in fits:
        if g.fit is None:
            continue
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
    out += ["", *reference_markdown(results), "", *efficiency_markdown(results), ""]
    return "\n".join(out)


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
