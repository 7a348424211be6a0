"""``python -m lmuscale.train`` for tests/test_train_multiprocess.py, recording every window
this process reads.

With ``LMUSCALE_TEST_READS=FILE`` each call of ``TokenDataset.read_windows`` appends one JSON
line ``{"split", "ids"}`` to FILE (flushed at once, so a killed process leaves whole lines).
With ``LMUSCALE_TEST_HANG=WHERE:STEP:FILE`` the process creates FILE and then waits forever
where it would read the training batch of step STEP (WHERE ``batch``: between two steps'
collectives) or save the checkpoint of step STEP (``save``): a test kills it there.
"""

import json
import os
import sys
import threading
from pathlib import Path

from lmuscale.data.loader import TokenDataset, TrainBatches
from lmuscale.train.__main__ import main
from lmuscale.train.checkpoint import Checkpoints

_read_windows = TokenDataset.read_windows
_train_batch = TrainBatches.__call__
_save = Checkpoints.save


def _recorded(self, split, seq_len, window_ids):
    with open(os.environ["LMUSCALE_TEST_READS"], "a") as log:
        log.write(json.dumps({"split": split, "ids": [int(i) for i in window_ids]}) + "\n")
    return _read_windows(self, split, seq_len, window_ids)


def _hang_at(where: str, step: int) -> None:
    where_at, step_at, marker = os.environ["LMUSCALE_TEST_HANG"].split(":", 2)
    if (where_at, int(step_at)) == (where, step):
        Path(marker).touch()
        threading.Event().wait()


def _batch(self, step):
    _hang_at("batch", step + 1)  # ``step`` counts the steps done before this batch's
    return _train_batch(self, step)


def _saving(self, step, state, meta):
    _hang_at("save", step)
    return _save(self, step, state, meta)


if os.environ.get("LMUSCALE_TEST_READS"):
    TokenDataset.read_windows = _recorded
if os.environ.get("LMUSCALE_TEST_HANG"):
    TrainBatches.__call__ = _batch
    Checkpoints.save = _saving

if __name__ == "__main__":
    sys.exit(main())
