"""A jax.profiler trace of chosen train steps (``log.profile_steps``), each step annotated."""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax

from lmuscale import workdir as workdir_lib


class StepTrace:
    """Starts the trace before step ``start`` and stops it once ``count`` steps have run,
    in ``workdir/profile`` (``process_<i>`` below it with several processes); steps up to
    ``resumed_at`` (done before this session) and after ``last`` are not traced."""

    def __init__(self, workdir: Path, start: int, count: int, resumed_at: int, last: int, primary):
        self.folder = workdir / workdir_lib.PROFILE
        if jax.process_count() > 1:
            self.folder = self.folder / f"process_{jax.process_index()}"
        self.first = max(start, resumed_at + 1)
        self.last = min(start + count - 1, last)
        self.primary = primary
        self.running = False
        if count and self.first > self.last and primary:
            print(
                f"log.profile_steps: steps {start}-{start + count - 1} were done before this "
                f"session (it starts after step {resumed_at}); nothing is traced",
                flush=True,
            )

    def wanted(self, step: int) -> bool:
        return self.first <= step <= self.last

    def before(self, step: int, state) -> None:
        """Called before step ``step`` runs; ``state`` is what the previous step left."""
        if step == self.first and self.wanted(step):
            # The devices finish the earlier steps first, so none of them lands in the trace.
            jax.block_until_ready(state)
            self.folder.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
            self.running = True

    def annotate(self, step: int):
        """The context a traced step runs in: "train" in TensorBoard's step-time view."""
        if not self.running:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, outputs) -> None:
        """Called once step ``step`` is dispatched: the trace stops when its outputs exist."""
        if self.running and step == self.last:
            jax.block_until_ready(outputs)
            self.close()
            if self.primary:
                print(
                    f"profile of steps {self.first}-{self.last}: {self.folder} (TensorBoard's "
                    f"profile tab, or perfetto_trace.json.gz in ui.perfetto.dev)",
                    flush=True,
                )

    def close(self) -> None:
        """Stop a running trace (also when the run ends early: what was traced is written)."""
        if self.running:
            self.running = False
            jax.profiler.stop_trace()
