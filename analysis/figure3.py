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
# # Figure 3: loss against model size
#
# Measured points per family, power-law fits with bootstrap CI bands, and (for GPT-2 tokens)
# Kaplan's transformer at 25k steps, the LSTM fit and the paper's LMU and LMU_G fits.
# Set `LMUSCALE_RESULTS` to a sweep's `results.jsonl` (default: the demo sweep's).

# %%
import os
from pathlib import Path

from IPython.display import Image, display

from lmuscale.analysis import figures, fit_all, load_results

RESULTS = Path(os.environ.get("LMUSCALE_RESULTS", "../runs/demo/results.jsonl"))
N_BOOT = int(os.environ.get("LMUSCALE_N_BOOT", "1000"))
results = load_results(RESULTS)
fits = fit_all(results, n_boot=N_BOOT, ci=0.95, seed=0)

# %% [markdown]
# Saved as PNG and PDF in an `analysis` folder beside the results, then shown:

# %%
fig = figures.figure3(results, fits)
(RESULTS.parent / "analysis").mkdir(exist_ok=True)
saved = figures.save(fig, RESULTS.parent / "analysis" / "fig3")
print(*saved, sep="\n")
display(Image(filename=str(saved[0])))
