"""What the tests that prepare datasets share: run a prepare, read its splits back as documents,
interrupt it after its first record, and measure its peak memory in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from lmuscale.data import prepare as prep
from lmuscale.data.format import SPLITS


def run(spec, inputs, out, **kw):
    """``prepare`` with the tests' defaults: byte tokens, in-process, no progress bar."""
    kw.setdefault("tokenizer", "bytes")
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    return prep.prepare(spec, [str(p) for p in inputs], out=out, **kw)


def split_documents(folder: Path, tokenizer) -> dict[str, list[str]]:
    """Decode each split's token file back into its documents (cut at the end-of-text ids)."""
    meta = json.loads((folder / "meta.json").read_text())
    out = {}
    for split in SPLITS:
        ids = np.fromfile(folder / f"{split}.bin", dtype=meta["dtype"]).astype(np.int64)
        assert ids.size == 0 or ids[-1] == tokenizer.eot  # every document ends with one
        cuts = np.flatnonzero(ids == tokenizer.eot)
        out[split] = [tokenizer.decode(doc[:-1]) for doc in np.split(ids, cuts + 1)[:-1]]
    return out


def crash_at_first_record(monkeypatch):
    """Commit after every shard, and stop the run (like Ctrl-C) right after the first record."""
    real = prep.atomic_write_json

    def crash(path, obj):
        real(path, obj)
        if Path(path).name == "progress.json":
            raise KeyboardInterrupt

    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0.0)
    monkeypatch.setattr(prep, "atomic_write_json", crash)
    return lambda: monkeypatch.setattr(prep, "atomic_write_json", real)


# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking (pytest) process, so
# the child would report the parent's peak.
_PEAK_RSS = """\
import json, re, sys
from lmuscale.data.prepare import prepare
spec, out, inputs = sys.argv[1], sys.argv[2], sys.argv[3:]
prepare(spec, inputs, out=out, tokenizer='bytes', workers=0, progress=False)
status = open('/proc/self/status').read()
print(int(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1)) / 1024)
"""


def peak_rss_mb(spec: str, inputs, out: Path) -> tuple[float, float]:
    """(peak resident MB, MB of text prepared) of ``prepare spec inputs`` in a fresh process,
    tokenising in that process (byte tokens), so that its peak is the reading's and the
    writing's."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, spec, str(out), *map(str, inputs)],
        capture_output=True,
        text=True,
        check=True,
    )
    meta = json.loads((out / "meta.json").read_text())
    text = sum(meta["splits"][s]["bytes"] for s in SPLITS)
    return float(done.stdout.split()[-1]), text / 2**20
