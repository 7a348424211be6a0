"""Mackey-Glass, 15 steps ahead (parallel-LMU paper §4.2, Table 3): the parallel LMU and an LSTM.

    python -m lmuscale.tasks experiments/mackey_glass.py --workdir runs/mackey-glass

Both models see the same series: 32 training, 4 validation and 8 test series of 5,000 steps
(dt = 1, tau = 17), made by ``lmuscale.tasks.mackey_glass`` with no download. At every step
the model reads x_0..x_t and predicts x_{t+15}; the score is the test NRMSE over every step of
every test series. About 6 minutes on two CPU cores.

- ``lmu``: the paper's model. A parallel-LMU layer with a 1-unit input encoder, order 40,
  theta 50 and 140 tanh output units (eqs 18-20), then a dense layer of 80 relu units and a
  linear output: 17,243 parameters (the paper: "about 18k").
- ``lstm``: one LSTM layer of 64 units and a linear output, 16,961 parameters.

Both train with Adam's defaults (as in the paper) on batches of 4 series, for 100 epochs (the
paper ran 500), and are tested at their best validation epoch.
"""

from lmuscale.tasks import base_config

NAMES = ("lmu", "lstm")


def get_config(name):
    if name == "lmu":
        model = dict(
            kind="lmu",
            units=140,
            order=40,
            theta=50.0,
            memory_dim=1,
            output_activation="tanh",
            hidden=80,
            hidden_activation="relu",
        )
    elif name == "lstm":
        model = dict(kind="lstm", lstm_units=64)
    else:
        raise ValueError(f"unknown model {name!r}; this file has {', '.join(NAMES)}")
    config = base_config("mackey_glass", **model)
    config.name = name
    config.data.update(train=32, val=4, test=8, length=5000)
    config.train.update(epochs=100, batch_size=4, eval_batch_size=8)
    return config
