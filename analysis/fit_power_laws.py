# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Power-law fits to a sweep's results
#
# Every family at every token budget gets a pure power law L = (Nc / N)^alpha (least squares
# in log space, OLS standard errors, bootstrap CIs) and the saturating form L = E + A / N^alpha;
# a family with two or more budgets also gets the Chinchilla form L = E + A/N^alpha + B/D^beta.
# Set `LMUSCALE_RESULTS` to a sweep's `results.jsonl` (default: the demo sweep's,
# `runs/demo/results.jsonl` in this repository).

# %%
import os
from pathlib import Path

from IPython.display import Markdown, display

from lmuscale import scaling
from lmuscale.analysis import fit_all, load_results

# this folder: the script's under python, the notebook's under Jupyter (its working folder)
HERE = Path(__file__).resolve().parent if "__file__" in globals() else Path.cwd()
RESULTS = Path(os.environ.get("LMUSCALE_RESULTS", HERE.parent / "runs/demo/results.jsonl"))
N_BOOT = int(os.environ.get("LMUSCALE_N_BOOT", "1000"))
results = load_results(RESULTS)
print(f"{len(results.runs)} runs ({', '.join(results.families)}) from {RESULTS}")
for note in results.skipped:
    print("left out:", note)

# %%
fits = fit_all(results, n_boot=N_BOOT, ci=0.95, seed=0)
lines = [
    "| fit | form | parameter | estimate | 95% CI | RMS log residual |",
    "|---|---|---|---|---|---|",
]
for g in fits:
    if g.fit is None:
        lines.append(f"| {g.name} | {g.form} | | not fitted: {g.error} | | |")
        continue
    for name, value, low, high in zip(
        g.fit.names, g.fit.estimate, g.fit.ci_low, g.fit.ci_high, strict=True
    ):
        lines.append(
            f"| {g.name} | {g.form} | {name} | {value:.4g} | {low:.4g} to {high:.4g} | "
            f"{g.fit.rms_residual:.4f} |"
        )
display(Markdown("\n".join(lines)))

# %% [markdown]
# The paper's exponents for comparison (nats per GPT-2 token; only meaningful for GPT-2 runs):

# %%
for curve in (scaling.LMU_PAPER, scaling.LMU_G_PAPER, scaling.LSTM, scaling.KAPLAN_CONVERGED):
    print(f"{curve.label}: alpha = {curve.alpha}, Nc = {curve.nc:.3g}")

# %% [markdown]
# Residuals of the power-law fits, log(measured) - log(fitted), per trial:

# %%
for g in fits:
    if g.fit is not None and g.form == "power_law":
        shown = ", ".join(f"{t} {r:+.4f}" for t, r in zip(g.trials, g.fit.residuals, strict=True))
        print(f"{g.name}: {shown}")
