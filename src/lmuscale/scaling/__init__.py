"""Scaling laws without plotting: the published reference curves (``reference``), fits to
measured losses (``fits``) and their tests by extrapolation (``extrapolate``).
``python -m lmuscale.scaling`` prints the curves at Table 3's sizes; ``... predict`` predicts
from a fits.json.
"""

from __future__ import annotations

from lmuscale.scaling.extrapolate import (
    Extrapolation,
    Law,
    Line,
    holdout,
    law,
    line_holdout,
    load_fits,
    save_fits,
)
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
    "Extrapolation",
    "Fit",
    "FitError",
    "Law",
    "Line",
    "fit_chinchilla",
    "fit_power_law",
    "fit_saturating",
    "holdout",
    "law",
    "line_holdout",
    "load_fits",
    "min_steps",
    "reference_table",
    "save_fits",
    "steps_to_match",
    "transformer_floor",
    "transformer_loss",
]
