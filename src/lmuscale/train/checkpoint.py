"""Checkpoints through orbax's CheckpointManager: the train state plus a little JSON.

Orbax writes each checkpoint into a temporary folder and renames it when complete, so a run
killed while saving leaves the previous checkpoints whole; the manager ignores (and cleans up)
the unfinished folder on the next start. Saves are asynchronous: the arrays are copied off
the device before ``save`` returns, then written while training goes on.
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp


class Checkpoints:
    """``workdir/checkpoints``: the last ``keep`` states, by step."""

    def __init__(self, directory: Path, keep: int):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=True
        )
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int, abstract_state) -> tuple[dict, dict]:
        """The state at ``step``, each array placed with the sharding in ``abstract_state``
        (a tree of ``jax.ShapeDtypeStruct`` with shardings), and its JSON."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
        )
        restored = self.manager.restore(step, args=args)
        return restored.state, restored.meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
