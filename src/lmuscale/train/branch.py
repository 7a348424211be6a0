"""A branch: a run that starts from another run's checkpoint (its parent's, at ``step``) rather
than from its initial state, e.g. a cooldown of a warmup-stable-decay run (``optim.schedule``).

Its first start copies the parent's checkpoint and the parent's log lines up to that step into
its own folder, and from there it resumes as any run does: the batches are a function of
(seed, step) and the checkpoint holds the rest, so its first step starts from exactly the
parent's state. A sweep's ``Trial(..., branch_from=(name, step))`` makes one (``sweep.spec``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from lmuscale import workdir as workdir_lib
from lmuscale.files import atomic_write_bytes
from lmuscale.outcomes import ConfigError
from lmuscale.train.checkpoint import FILES


@dataclasses.dataclass(frozen=True)
class Branch:
    """Start from the checkpoint at ``step`` of the run in ``folder`` (the trial ``trial``)."""

    trial: str
    folder: Path
    step: int

    def record(self) -> dict:
        """What the branch's summary says of it."""
        return {"trial": self.trial, "folder": self.folder.name, "step": self.step}


def seed(workdir: Path, branch: Branch) -> None:
    """Copy the parent's checkpoint at ``branch.step`` and its log lines up to that step into
    ``workdir``, which holds no checkpoint. The checkpoint arrives last, by a rename: a start
    killed before it seeds again."""
    source = branch.folder / workdir_lib.CHECKPOINTS / str(branch.step)
    if not (source / FILES).is_file():
        kept = sorted(
            int(p.name)
            for p in (branch.folder / workdir_lib.CHECKPOINTS).glob("*")
            if p.name.isdigit()
        )
        raise ConfigError(
            f"{workdir}: a branch of {branch.trial} at step {branch.step}, but {source} is not a "
            f"complete checkpoint (the parent keeps {', '.join(map(str, kept)) or 'none'}): "
            "branch at a step the parent saved (its checkpoint.keep_steps)"
        )
    for log in (workdir_lib.METRICS, workdir_lib.EVAL):
        lines = _lines_until(branch.folder / log, branch.step)
        atomic_write_bytes(workdir / log, b"".join(lines))
    staging = workdir / f".branch-{branch.step}"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    (workdir / workdir_lib.CHECKPOINTS).mkdir(exist_ok=True)
    staging.rename(workdir / workdir_lib.CHECKPOINTS / str(branch.step))


def _lines_until(path: Path, step: int) -> list[bytes]:
    """The records of a JSONL log (``workdir.read_log``) whose step is at most ``step``, as
    lines written as the run's logs write them."""
    records = workdir_lib.read_log(path)
    return [(json.dumps(r) + "\n").encode() for r in records if r.get("step", step + 1) <= step]
