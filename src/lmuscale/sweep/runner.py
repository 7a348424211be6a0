"""Running a sweep: trial folders, embedded data, the executor, the results table.

The runner keeps no state of its own but the results table: every trial's status is read
from its folder, and the table (``lmuscale.sweepdir.Table``) is rewritten after every trial's
end, so a runner killed at any moment, started again, picks up where things are.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import os
import time
from pathlib import Path

from tqdm import tqdm

from lmuscale.files import atomic_write_json
from lmuscale.outcomes import ConfigError, Exit
from lmuscale.sweep.spec import ResolvedTrial, Sweep
from lmuscale.sweep.worker import settle
from lmuscale.sweepdir import AFTER, RESULTS, RESULTS_CSV, TRIALS, Table, write_index
from lmuscale.train.metrics import duration
from lmuscale.workdir import DONE, METRICS, TRIAL, last_record, read_json, status

# Without a bar, the sweep's progress line comes this often: under a minute, polls included.
LINE_SECONDS = 50.0


def select(sweep: Sweep, only: str | None) -> list[ResolvedTrial]:
    """The trials whose name matches any of the comma-separated globs in ``only``."""
    if not only:
        return list(sweep.trials)
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    chosen = [t for t in sweep.trials if any(fnmatch.fnmatchcase(t.name, p) for p in patterns)]
    if not chosen:
        names = ", ".join(t.name for t in sweep.trials)
        raise ConfigError(f"--only {only!r} matches no trial of {sweep.path}; the trials: {names}")
    return chosen


def folders(sweep: Sweep, workdir: Path, trials: list[ResolvedTrial]) -> dict[str, Path]:
    """Create every trial folder, each with its trial.json (the same bytes on every run of the
    runner), and the sweep folder's index of them."""
    workdir.mkdir(parents=True, exist_ok=True)
    write_index(workdir, sweep.path, {t.name: t.folder_name for t in sweep.trials if not t.waits})
    out = {}
    for trial in trials:
        folder = out[trial.name] = workdir / TRIALS / trial.folder_name
        folder.mkdir(parents=True, exist_ok=True)
        record = {"name": trial.name, "key": trial.key, "config": trial.config.to_dict()}
        if trial.branch_from is not None:  # what the worker starts it from
            parent, step = trial.branch_from
            record["branch_from"] = {"trial": parent, "folder": trial.parent_folder, "step": step}
        if read_json(folder / TRIAL) != record:
            atomic_write_json(folder / TRIAL, record)
    return out


def prepare_data(trials: list[ResolvedTrial], progress: bool) -> None:
    """Prepare each missing embedded dataset that a trial's ``data.prepare`` asks for once,
    before workers start."""
    from lmuscale.data import EMBEDDED_SOURCES, prepare_embedded

    for path, data in {Path(t.config.data.path): t.config.data for t in trials}.items():
        if data.prepare and data.source in EMBEDDED_SOURCES:
            prepare_embedded(path, data.source, data.tokenizer, progress)


def check_data(trials: list[ResolvedTrial], rows: dict[str, dict]) -> None:
    """Refuse to count a trial as done on data other than what it finished on: each ended
    trial's recorded fingerprint against that of the dataset now at its ``data.path``."""
    from lmuscale.data import DataError
    from lmuscale.data.format import read_meta

    def current(path: str) -> str | None:
        try:
            return read_meta(Path(path))["fingerprint"]
        except DataError:
            return None  # nothing there to compare: nothing will be trained on it either

    changed: dict[tuple, list[str]] = {}
    now_at: dict[str, str | None] = {}  # each folder's meta.json read once
    for trial in trials:
        was, path = rows[trial.name]["data_fingerprint"], trial.config.data.path
        if rows[trial.name]["status"] not in DONE or not was or trial.config.data.fingerprint:
            continue  # not ended, ended before fingerprints, or pinned (its folder is its own)
        if path not in now_at:
            now_at[path] = current(path)
        now = now_at[path]
        if now is not None and now != was:
            changed.setdefault((path, was, now), []).append(trial.name)
    for (path, was, now), names in changed.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ConfigError(
            f"{path} holds the dataset {now}, but {shown} ended on {was}: their results are of "
            "other data. Give the data they trained on, or train them again on this data, in "
            f"new trial folders, with --config.data.fingerprint={now}"
        )


class Progress:
    """A bar over the steps of every selected trial, read from their metrics.jsonl; without
    one (``show`` false), a line every ``every`` seconds of ``clock``: trials done, running and
    left, steps, and an ETA at the pace of this invocation's steps."""

    def __init__(
        self,
        paths: dict[str, Path],
        trials: list[ResolvedTrial],
        show: bool,
        every: float = LINE_SECONDS,
        clock=time.monotonic,
        waiting: int = 0,
    ):
        self.paths = paths
        self.waiting = waiting  # trials of a later stage, not counted in the line's trials
        self.steps = {t.name: t.config.train.steps for t in trials}
        self.bar = tqdm(
            total=sum(self.steps.values()),
            unit="step",
            disable=not show,
            dynamic_ncols=True,
            desc="sweep",
        )
        self.every = 2.0 if show else every
        self.clock = clock
        self.last = None
        self.first = None  # (time, steps done) at the first update

    def step_of(self, name: str, state: str) -> int:
        if state in DONE:
            return self.steps[name]
        record = last_record(self.paths[name] / METRICS)
        return min(int(record["step"]), self.steps[name]) if record else 0

    def update(self, active: dict[Path, str], force: bool = False) -> None:
        now = self.clock()
        if not force and self.last is not None and now - self.last < self.every:
            return
        self.last = now
        states = {name: status(path) for name, path in self.paths.items()}
        done = sum(self.step_of(name, state) for name, state in states.items())
        if not self.bar.disable:
            self.bar.n = done
            names = [p.name.rsplit("-", 1)[0] for p, s in active.items() if s == "running"]
            self.bar.set_postfix_str(", ".join(names) or "-", refresh=False)
            self.bar.refresh()
            return
        self.first = self.first or (now, done)
        counts = {s: sum(state == s for state in states.values()) for s in ("running", "failed")}
        finished = sum(state in DONE for state in states.values())
        left = len(states) - finished - counts["running"]
        total, (t0, done0) = self.bar.total, self.first
        eta = "ETA unknown"
        if done > done0 and now > t0:
            eta = f"ETA {duration((total - done) * (now - t0) / (done - done0))}"
        failed = f" ({counts['failed']} of them failed)" if counts["failed"] else ""
        later = f"; {self.waiting} more wait for these" if self.waiting else ""
        print(
            f"sweep: {finished}/{len(states)} trials done, {counts['running']} running, "
            f"{left} left{failed}; {done}/{total} steps; {duration(now - t0)} elapsed, {eta}"
            + later,
            flush=True,
        )

    def write(self, text: str) -> None:
        self.bar.write(text) if not self.bar.disable else print(text, flush=True)

    def close(self) -> None:
        self.update({}, force=True)
        self.bar.close()


def describe(row: dict) -> str:
    name, state = row["trial"], row["status"]
    if state == "finished":
        return (
            f"{name}: finished, val loss {row['val_loss']:.4f}, test loss {row['test_loss']:.4f} "
            f"({duration(row['wall_seconds'])})"
        )
    if state in ("failed", "diverged"):
        first = (row["error"] or "").strip().splitlines()
        return f"{name}: {state}: {first[-1] if first else '?'} (see {TRIALS}/{row['folder']})"
    return f"{name}: {state}" + (f" at step {row['step']}" if row["step"] else "")


def results_table(rows: list[dict]) -> str:
    """The results as Markdown: sizes, tokens, losses (nats per token), bits/byte, time."""
    lines = [
        "| trial | family | N | total params | tokens | val loss | test loss | val bits/byte "
        "| wall | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def number(value):
        return "-" if value is None else f"{value:.4f}"

    for r in rows:
        lines.append(
            f"| {r['trial']} | {r['family']} | {r['N']:,} | {r['total_params']:,} "
            f"| {r['tokens']:,} | {number(r['val_loss'])} | {number(r['test_loss'])} "
            f"| {number(r['val_bits_per_byte'])} | {duration(r['wall_seconds'])} | {r['status']} |"
        )
    return "\n".join(lines)


def run_sweep(
    sweep: Sweep,
    workdir: Path,
    *,
    only: str | None = None,
    executor: str = "local",
    parallel: int = 1,
    detach: bool = False,
    slurm: dict | None = None,
    show: bool | None = None,
    after: bool = False,
) -> int:
    """Run (or resume) the selected trials; returns the exit status: ``Exit.FINISHED`` when all
    finished, else ``Exit.UNFINISHED``. Once every trial has ended, the sweep file's ``after``
    runs, once for each results table (``after``: again, on the same table)."""
    if executor not in ("local", "slurm"):
        raise ConfigError(f"--executor {executor!r}: expected local or slurm")
    show = os.isatty(2) if show is None else show
    if sweep.table is None or sweep.table.workdir != workdir:  # the table get_trials reads
        sweep = dataclasses.replace(sweep, workdir=workdir, table=Table(workdir))
    while not isinstance(sweep, int):
        sweep = _run_stage(sweep, workdir, only, executor, parallel, detach, slurm, show, after)
    return sweep


def _run_stage(sweep, workdir, only, executor, parallel, detach, slurm, show, again) -> int | Sweep:
    """Run the selected trials that do not wait. Returns the sweep file read again where that
    gives trials which waited for these something to run (``Sweep.reload``), else the exit
    status."""
    chosen = select(sweep, only)
    trials = [t for t in chosen if not t.waits]
    paths = folders(sweep, workdir, trials)
    rows = {r["trial"]: r for r in sweep.table.write(sweep.trials)}
    check_data(trials, rows)
    todo = [t for t in trials if rows[t.name]["status"] not in DONE]
    for trial in trials:
        if trial not in todo:  # a worker killed after its summary, before its end record
            settle(paths[trial.name])
    waiting = (
        f", {len(chosen) - len(trials)} waiting for others" if len(trials) < len(chosen) else ""
    )
    print(
        f"sweep {sweep.path}: {len(chosen)} trials, {len(trials) - len(todo)} already done, "
        f"{len(todo)} to run ({executor}){waiting}; results in {workdir / RESULTS_CSV}",
        flush=True,
    )
    prepare_data(todo, show)
    if executor == "slurm" and todo:
        from lmuscale.sweep.slurm import run_slurm, wait

        submitted = run_slurm(sweep, workdir, [paths[t.name] for t in todo], parallel, slurm)
        print(f"submitted {submitted}", flush=True)
        if detach:
            print("run the same command without --detach to wait for the results", flush=True)
            return 0
    if todo:
        progress = Progress(paths, trials, show, waiting=len(chosen) - len(trials))
        try:
            if executor == "local":
                _run_local(sweep, [paths[t.name] for t in todo], parallel, progress)
            else:
                wait(workdir, progress.update, progress.write)
        finally:
            progress.close()
    final = sweep.table.write(sweep.trials)
    mine = [r for r in final if r["trial"] in paths]
    if mine:
        print(results_table(mine), flush=True)
    for row in mine:
        if row["status"] != "finished":
            print(describe(row), flush=True)
    finished = all(r["status"] == "finished" for r in mine)
    waits = [t for t in chosen if t.waits]
    if waits and all(r["status"] in ("finished", "diverged") for r in mine):
        later = sweep.reload()
        if [t.name for t in later.waiting] != [t.name for t in sweep.waiting]:
            return later
        for reason in dict.fromkeys(t.waits for t in waits):
            count = sum(t.waits == reason for t in waits)
            print(f"{count} trial(s) not run: {reason}", flush=True)
        return Exit.UNFINISHED
    everything = all(r["status"] in DONE for r in final) and not sweep.waiting
    if everything and sweep.after is not None:
        _after(sweep, workdir, again)
    return Exit.FINISHED if finished and not waits else Exit.UNFINISHED


def _after(sweep: Sweep, workdir: Path, again: bool) -> None:
    """The sweep file's ``after(workdir)``, unless it has run on this results table (recorded
    in ``AFTER`` once it returns) and ``again`` is False."""
    table = hashlib.sha256((workdir / RESULTS).read_bytes()).hexdigest()
    done = read_json(workdir / AFTER) or {}
    if done.get("results_sha256") == table and not again:
        print(
            f"after(): already run on these results ({workdir / AFTER}); --after runs it again",
            flush=True,
        )
        return
    sweep.after(workdir)
    atomic_write_json(workdir / AFTER, {"results_sha256": table, "time": time.time()})


def _run_local(sweep: Sweep, todo: list[Path], parallel, progress: Progress) -> None:
    """Train ``todo`` in worker processes here, ``parallel`` at a time, reporting each end."""
    from lmuscale.sweep.local import run_local

    def on_end(folder: Path, _state: str) -> None:
        rows = {r["folder"]: r for r in sweep.table.write(sweep.trials, ended={folder.name})}
        progress.write(describe(rows[folder.name]))

    try:
        run_local(todo, parallel, progress.update, on_end)
    except BaseException:  # the rows of the trials that were stopped
        sweep.table.write(sweep.trials, ended={f.name for f in todo if status(f) != "pending"})
        raise
