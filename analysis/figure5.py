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
# # Figure 5: the LMU at its budget against the transformer at 10x the steps
#
# Measured transformer runs at a larger budget where the sweep has them (`sweeps/owt2.py`
# has `transformer-SIZE-10x`), and Kaplan's L(N, S) at that budget for GPT-2 tokens. Then the
# transformer steps each LMU run's loss would take by Kaplan's eq. 1.6: infinite where the
# loss is below the transformer's infinite-training limit.
# Set `LMUSCALE_RESULTS` to a sweep's `results.jsonl` (default: the demo sweep's,
# `runs/demo/results.jsonl` in this repository).

# %%
import math
import os
from pathlib import Path

from IPython.display import Image, display

from lmuscale import scaling
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
if "fig5" in drawn:
    OUT = RESULTS.parent / "notebooks"
    OUT.mkdir(exist_ok=True)
    saved = figures.save(drawn["fig5"], OUT / "fig5")
    print(*saved, sep="\n")
    display(Image(filename=str(saved[0])))
else:
    print(*[line for line in refusals if line.startswith("Figure 5")], sep="\n")

# %% [markdown]
# Transformer steps to reach each LMU run's loss at the same N (Kaplan eq. 1.6, at the run's
# batch), for GPT-2 tokens:

# %%
if results.gpt2_tokens:
    for run in results.runs:
        if run.family not in ("lmu", "lmu_g"):
            continue
        steps = float(scaling.steps_to_match(run.loss, run.n, run.batch_tokens))
        ratio = math.inf if math.isinf(steps) else steps * run.batch_tokens / run.tokens
        print(f"{run.trial}: loss {run.loss:.4f}, transformer steps {steps:,.0f} ({ratio:.2f}x)")
else:
    print(f"not applicable: these losses are per {results.tokenizer} token, not GPT-2's")
