# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Figure 3: loss against model size
#
# Measured points per family, power-law fits with bootstrap CI bands, and (for GPT-2 tokens)
# Kaplan's transformer at 25k steps, the LSTM fit and the paper's LMU and LMU_G fits.
# Set `LMUSCALE_RESULTS` to a sweep's `results.jsonl` (default: the demo sweep's,
# `runs/demo/results.jsonl` in this repository).

# %%
import os
from pathlib import Path

from IPython.display import Image, display

from lmuscale.analysis import figures, fit_all, load_results, paper_figures

# this folder: the script's under python, the notebook's under Jupyter (its working folder)
HERE = Path(__file__).resolve().parent if "__file__" in globals() else Path.cwd()
RESULTS = Path(os.environ.get("LMUSCALE_RESULTS", HERE.parent / "runs/demo/results.jsonl"))
N_BOOT = int(os.environ.get("LMUSCALE_N_BOOT", "1000"))
results = load_results(RESULTS)
fits = fit_all(results, n_boot=N_BOOT, ci=0.95, seed=0)

# %% [markdown]
# Drawn as `python -m lmuscale.analysis` draws it (from the paper-grid runs), or refused with
# the same reason. Saved as PNG and PDF in a `notebooks` folder beside the results (never in the
# sweep's own `analysis` folder, which the command writes), then shown:

# %%
drawn, refusals = paper_figures(results.grid(), fits)
if "fig3" in drawn:
    OUT = RESULTS.parent / "notebooks"
    OUT.mkdir(exist_ok=True)
    saved = figures.save(drawn["fig3"], OUT / "fig3")
    print(*saved, sep="\n")
    display(Image(filename=str(saved[0])))
else:
    print(*[line for line in refusals if line.startswith("Figure 3")], sep="\n")
