"""Scaling laws without plotting: the published reference curves (``reference``) and fits to
measured losses (``fits``). ``python -m lmuscale.scaling`` prints the curves at Table 3's sizes.
"""

from __future__ import annotations

from lmuscale.scaling.fits import (
    FORMULAS,
    Fit,
    FitError,
    fit_chinchilla,
    fit_power_law,
    fit_saturating,
)
from lmuscale.scaling.reference import (
    BATCH_TOKENS,
    KAPLAN_CONVERGED,
    LMU_G_PAPER,
    LMU_PAPER,
    LSTM,
    PAPER_STEPS,
    TABLE3_SIZES,
    min_steps,
    reference_table,
    steps_to_match,
    transformer_floor,
    transformer_loss,
)

__all__ = [
    "BATCH_TOKENS",
    "FORMULAS",
    "KAPLAN_CONVERGED",
    "LMU_G_PAPER",
    "LMU_PAPER",
    "LSTM",
    "PAPER_STEPS",
    "TABLE3_SIZES",
    "Fit",
    "FitError",
    "fit_chinchilla",
    "fit_power_law",
    "fit_saturating",
    "min_steps",
    "reference_table",
    "steps_to_match",
    "transformer_floor",
    "transformer_loss",
]
