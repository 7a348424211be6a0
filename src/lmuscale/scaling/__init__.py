"""Scaling laws: the published reference curves and fits to measured losses (no plotting).

``lmuscale.scaling.reference``: Kaplan et al.'s L(N) and L(N, S), the LSTM and LMU fits quoted by
the LMU paper, and the transformer steps needed to reach a loss. ``lmuscale.scaling.fits``: power
law, saturating and Chinchilla fits with standard errors, bootstrap CIs and residuals.
``python -m lmuscale.scaling`` prints the reference curves at Table 3's sizes.
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
    PowerLaw,
    critical_batch,
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
    "PowerLaw",
    "critical_batch",
    "fit_chinchilla",
    "fit_power_law",
    "fit_saturating",
    "min_steps",
    "reference_table",
    "steps_to_match",
    "transformer_floor",
    "transformer_loss",
]
