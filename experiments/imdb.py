"""IMDB sentiment (parallel-LMU paper §4.3, Table 4) with the memory-only model.

    python -m lmuscale.tasks experiments/imdb.py --workdir runs/imdb \
        --config.data.path=PATH/imdb.npz      (or PATH/aclImdb)

PATH is Keras's imdb.npz or the aclImdb folder of the original release; without it the
command stops and says what to give (nothing is downloaded). 20,000 words, the last 500
tokens of each review, 2,500 training reviews held out for validation.

``lmu``: the paper's "DN only" model. Token embeddings go straight into the Legendre memory
(no encoder, no output layer: d = 1, theta = maxlen = 500), whose final state (eq 25) feeds a
logistic output. The paper fed frozen 300-d GloVe vectors and trained 301 parameters; GloVe
is not bundled, so here a 16-d embedding is learned with the rest (320,000 + 17 parameters).
Adam's defaults, batches of 32, 10 epochs.
"""

from lmuscale.tasks import base_config

NAMES = ("lmu",)


def get_config(name):
    if name != "lmu":
        raise ValueError(f"unknown model {name!r}; this file has {', '.join(NAMES)}")
    config = base_config(
        "imdb",
        kind="lmu",
        units=0,
        order=1,
        theta=500.0,
        memory_dim=0,
        vocab_size=20_000,
        embed_dim=16,
    )
    config.name = name
    config.train.update(epochs=10, batch_size=32, eval_batch_size=500)
    return config
