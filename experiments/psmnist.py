"""Permuted sequential MNIST (parallel-LMU paper §4.1, Table 2): the parallel LMU.

    python -m lmuscale.tasks experiments/psmnist.py --workdir runs/psmnist \
        --config.data.path=DIR_WITH_MNIST

DIR_WITH_MNIST holds the four MNIST idx files (or a TensorFlow Datasets data_dir with mnist);
without it the command stops and says what to give (nothing is downloaded). Each image is 784
pixels in a fixed seeded order, one per step; the 50k/10k/10k split is the standard one.

``lmu``: a parallel-LMU layer with a 1-unit input encoder, order 468, theta 784 (the whole
sequence) and 346 relu output units, read only at the last step (eq 25: the final state is one
contraction, no scan), then a 10-way softmax: 166,092 parameters (the paper: 165k, 98.49%).
Adam's defaults, batches of 100, 30 epochs.
"""

from lmuscale.tasks import base_config

NAMES = ("lmu",)


def get_config(name):
    if name != "lmu":
        raise ValueError(f"unknown model {name!r}; this file has {', '.join(NAMES)}")
    config = base_config(
        "psmnist",
        kind="lmu",
        units=346,
        order=468,
        theta=784.0,
        memory_dim=1,
        output_activation="relu",
    )
    config.name = name
    config.train.update(epochs=30, batch_size=100, eval_batch_size=500)
    return config
