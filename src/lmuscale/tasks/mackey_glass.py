"""The Mackey-Glass series (REFERENCE §5) and its 15-step-ahead prediction task.

    dx/dt = beta x(t - tau) / (1 + x(t - tau)^n) - gamma x(t),  beta 0.2, gamma 0.1, n 10, tau 17

integrated by RK4 with a step h that divides tau, so the delayed values at a step's ends are
grid points. At the half step, the cubic Hermite interpolant of the neighbouring grid values
and their slopes keeps the scheme fourth order. The history is constant, x(t) = x0 for
t <= 0, so the slope jumps at t = 0: the interval ending there uses the left slope (zero).
tests/test_tasks.py checks the series against scipy's DOP853 by the method of steps.
"""

from __future__ import annotations

import numpy as np
from ml_collections import ConfigDict

from lmuscale.outcomes import ConfigError
from lmuscale.tasks.base import Split, Splits, Task

TAU = 17.0
BETA = 0.2
GAMMA = 0.1
POWER = 10


def rhs(x, x_delayed):
    """The right-hand side of the delay equation."""
    return BETA * x_delayed / (1.0 + x_delayed**POWER) - GAMMA * x


def integrate(x0, duration: float, *, h: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(t_T, x_TxB)`` float64 on the grid t = 0, h, ..., duration (T = round(duration / h) + 1)
    for the constant histories x(t <= 0) = x0, a number (then ``x_T``) or B of them; TAU / h
    must be a whole number."""
    ratio = TAU / h
    if ratio < 1 or abs(ratio - round(ratio)) > 1e-9:
        raise ValueError(f"the step h={h} must divide tau={TAU} (tau / h = {ratio:g})")
    if not duration > 0:
        raise ValueError(f"duration must be > 0, got {duration!r}")
    lag, steps = round(ratio), round(duration / h)
    x0 = np.asarray(x0, dtype=np.float64)
    if not np.all(x0 > 0):
        raise ValueError(f"the history x0 must be positive, got {x0!r}")

    # Row i is t = (i - lag) h: rows 0..lag-1 are the history, row lag is t = 0.
    x = np.empty((lag + steps + 1, *x0.shape))
    slope = np.zeros_like(x)  # the history's slope is zero
    x[: lag + 1] = x0
    for i in range(lag, lag + steps):
        j = i - lag  # the delayed interval [t - tau, t - tau + h] is rows j, j + 1
        k1 = rhs(x[i], x[j])
        slope[i] = k1
        right = slope[j + 1] if j + 1 != lag else 0.0  # left slope where it jumps, at t = 0
        mid = 0.5 * (x[j] + x[j + 1]) + h * (slope[j] - right) / 8.0
        k2 = rhs(x[i] + 0.5 * h * k1, mid)
        k3 = rhs(x[i] + 0.5 * h * k2, mid)
        k4 = rhs(x[i] + h * k3, x[j + 1])
        x[i + 1] = x[i] + h * (k1 + 2.0 * k2 + 2.0 * k3 + k4) / 6.0
    return h * np.arange(steps + 1), x[lag:]


def series(
    count: int,
    length: int,
    *,
    seed: int = 0,
    dt: float = 1.0,
    washout: float = 500.0,
    h: float = 0.1,
) -> np.ndarray:
    """``x_BxT`` float64: ``count`` series of ``length`` samples ``dt`` time units apart, each from
    its own history x0 ~ U(0.5, 1.5) (seeded), after ``washout`` time units of transient."""
    every = dt / h
    if abs(every - round(every)) > 1e-9:
        raise ValueError(f"dt={dt} must be a whole number of integration steps h={h}")
    every = round(every)
    x0 = np.random.default_rng(seed).uniform(0.5, 1.5, size=count)
    skip = round(washout / h)
    _, x = integrate(x0, h * (skip + every * (length - 1)), h=h)
    return x[skip::every].T.copy()


def load(data: ConfigDict) -> Splits:
    """Independent series for train, val and test (histories x0 from one generator seeded by
    ``data.seed``), standardised by the training series' mean and std (NRMSE does not depend
    on it). An example is a whole series: x_0..x_t predicts x_{t + horizon} at every t."""
    counts = (data.train, data.val, data.test)
    if min(counts) <= 0 or data.length <= 0 or data.washout < 0 or data.seed < 0:
        raise ConfigError(
            f"data.train, data.val, data.test, data.length must be > 0 and data.washout, "
            f"data.seed >= 0; got {counts}, {data.length}, {data.washout}, {data.seed}"
        )
    try:
        x = series(
            sum(counts),
            data.length + data.horizon,
            seed=data.seed,
            dt=data.dt,
            washout=data.washout,
        )
    except ValueError as error:  # dt: the message names the value
        raise ConfigError(f"data: {error}") from None
    if not 0 < data.horizon < x.shape[1]:
        raise ConfigError(f"data: horizon must be in 1..{x.shape[1] - 1}, got {data.horizon}")
    mean, std = x[: data.train].mean(), x[: data.train].std()
    x_BxT = ((x - mean) / std).astype(np.float32)
    parts = [
        Split(s[:, : -data.horizon, None], s[:, data.horizon :, None])
        for s in np.split(x_BxT, np.cumsum(counts)[:-1])
    ]
    source = (
        f"Mackey-Glass tau={TAU:g}, {data.length} steps of dt={data.dt:g}, horizon "
        f"{data.horizon}, {counts[0]}/{counts[1]}/{counts[2]} series (seed {data.seed})"
    )
    return Splits(*parts, source=source)


TASK = Task(
    name="mackey_glass",
    loss="mse",
    metric="nrmse",
    outputs=1,
    sequence_output=True,
    data={
        "seed": 0,
        "train": 128,
        "val": 16,
        "test": 32,
        "length": 1000,
        "horizon": 15,
        "dt": 1.0,
        "washout": 500.0,
    },
    load=load,
    paper={"LSTM": 0.059, "LMU": 0.049, "parallel LMU": 0.044, "hybrid": 0.045},
)
