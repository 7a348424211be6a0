"""``python -m lmuscale.train`` for tests/test_train_multiprocess.py, recording every window
this process reads.

With ``LMUSCALE_TEST_READS=FILE`` each call of ``TokenDataset.read_windows`` appends one JSON
line ``{"split", "ids"}`` to FILE (flushed at once, so a killed process leaves whole lines).
"""

import json
import os
import sys

from lmuscale.data.loader import TokenDataset
from lmuscale.train.__main__ import main

_read_windows = TokenDataset.read_windows


def _recorded(self, split, seq_len, window_ids):
    with open(os.environ["LMUSCALE_TEST_READS"], "a") as log:
        log.write(json.dumps({"split": split, "ids": [int(i) for i in window_ids]}) + "\n")
    return _read_windows(self, split, seq_len, window_ids)


if os.environ.get("LMUSCALE_TEST_READS"):
    TokenDataset.read_windows = _recorded

if __name__ == "__main__":
    sys.exit(main())
