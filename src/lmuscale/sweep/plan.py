"""``--dry-run``: the sweep as a table of sizes, learning rates, tokens, FLOPs and a time.

A trial's training time is its training FLOPs over the first model FLOP/s of: ``measured``
(its metrics.jsonl), ``family`` (the median of its family's measured trials), then
``Throughput.lookup``. Its estimate adds a per-trial overhead (process start-up, compilation,
evaluation, checkpoints): the median of the sweep's finished trials' (attempts.jsonl, from
the process's start to the trial's end, less the training time at its own speed), else
``OVERHEAD_SECONDS`` for the device kind.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from lmuscale.scaling.fits import human
from lmuscale.sweep.throughput import Throughput
from lmuscale.sweepdir import TRIALS
from lmuscale.train.metrics import duration
from lmuscale.workdir import ATTEMPTS, METRICS, read_log

# Seconds a trial takes beyond its training steps at their median speed, where no trial of the
# sweep has finished to measure it: on a CPU, as the demo sweeps measured; on a GPU, a guess.
OVERHEAD_SECONDS = {"cpu": (14.0, "CPU default"), "gpu": (120.0, "GPU guess")}


def _speeds(folder: Path) -> list[float]:
    return [
        r["tokens_per_second"] for r in read_log(folder / METRICS) if r.get("tokens_per_second")
    ]


def measured_overhead(folder: Path, tokens: int, speeds: list[float]) -> float | None:
    """Seconds from the worker's start to the trial's end beyond its steps at their median
    speed (of ``speeds``), for a trial finished in one attempt whose runner recorded the start;
    else None."""
    events = read_log(folder / ATTEMPTS)
    if len(events) != 2 or not speeds:
        return None
    start, end = events
    if "spawned" not in start or end.get("outcome") != "finished":
        return None
    return max(0.0, end["time"] - start["spawned"] - tokens / statistics.median(speeds))


def overhead(throughput: Throughput, rows: list[dict]) -> tuple[float, str]:
    """(seconds, where from) of the per-trial overhead: see the module docstring."""
    measured = [r["overhead"] for r in rows if r["overhead"] is not None]
    if measured:
        return statistics.median(measured), f"measured ({len(measured)} finished trials)"
    if throughput.overhead is not None:
        return throughput.overhead, "configured"
    platform = throughput.platform
    if not platform:  # this machine's: where the dry run's trials would start
        import jax

        platform = jax.devices()[0].platform
    return OVERHEAD_SECONDS.get(platform, OVERHEAD_SECONDS["gpu"])


def plan(trials, workdir: Path, throughput: Throughput) -> list[dict]:
    rows = []
    by_family: dict[str, list[float]] = {}  # the measured FLOP/s of each family's trials
    for trial in trials:
        folder = workdir / TRIALS / trial.folder_name
        row = trial.result_row(folder)
        row["dtype"] = trial.config.model.get("dtype")
        speeds = _speeds(folder)
        row["flops_per_second"] = (
            statistics.median(speeds) * row["flops_per_token"] if speeds else None
        )
        row["source"] = "measured" if row["flops_per_second"] else None
        own_tokens = row["spent_flops"] / row["flops_per_token"]  # a branch's own steps
        row["overhead"] = measured_overhead(folder, own_tokens, speeds)
        row["waits"], row["note"] = trial.waits, trial.note
        if trial.waits:
            row["status"] = "waits"
        if row["source"]:
            by_family.setdefault(row["family"], []).append(row["flops_per_second"])
        rows.append(row)
    extra, extra_source = overhead(throughput, rows)
    for row in rows:
        if not row["source"] and row["family"] in by_family:
            row["flops_per_second"] = statistics.median(by_family[row["family"]])
            row["source"] = "family"
        elif not row["source"]:
            row["flops_per_second"], row["source"] = throughput.lookup(
                row["family"], row["N"], row["flops_per_token"], row["dtype"]
            )
        speed = row["flops_per_second"]
        # the training steps (a branch trains only its own: spent_flops)
        row["seconds"] = row["spent_flops"] / speed if speed else None
        row["overhead"], row["overhead_source"] = extra, extra_source
        row["estimate"] = row["seconds"] + extra if speed else None
    return rows


def table(rows: list[dict]) -> str:
    """The dry-run table as Markdown, with a total line and the overhead it includes."""
    notes = any(r.get("note") for r in rows)
    header = (
        "| trial | family | N (non-emb.) | total params | learning rate | tokens | tokens/param "
        "| train FLOPs/token | total FLOPs | FLOP/s | from | est. time | status |"
        + (" note |" if notes else "")
    )
    lines = [
        header,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|" + "---|" * notes,
    ]
    for r in rows:
        rate = "-" if r.get("waits") and not r["branch_from"] else f"{r['learning_rate']:.3g}"
        lines.append(
            f"| {r['trial']} | {r['family']} | {r['N']:,} | {r['total_params']:,} "
            f"| {rate} "
            f"| {human(r['tokens'])} | {r['tokens'] / r['N']:,.0f} "
            f"| {human(r['flops_per_token'])} | {human(r['total_flops'])} "
            f"| {human(r['flops_per_second']) if r['flops_per_second'] else '-'} "
            f"| {r['source'] or '-'} | {duration(r['estimate'])} | {r['status']} |"
            + (f" {r.get('note') or '-'} |" if notes else "")
        )
    known = [r["estimate"] for r in rows if r["estimate"] is not None]
    total_time = duration(sum(known)) if known else "-"
    if known and len(known) < len(rows):
        total_time += f" ({len(rows) - len(known)} unknown)"
    lines.append(
        f"| **total** ({len(rows)}) | | | | | {human(sum(r['tokens'] for r in rows))} | "
        f"| | {human(sum(r['spent_flops'] for r in rows))} | | | {total_time} | |"
    )
    lines += branch_lines(rows)
    if rows:
        lines.append(
            f"\nEach estimate includes {duration(rows[0]['overhead'])} a trial of start-up, "
            f"compilation, evaluation and checkpoints: {rows[0]['overhead_source']}."
        )
    waits = [r["waits"] for r in rows if r.get("waits")]
    for reason in dict.fromkeys(waits):
        lines.append(
            f"{waits.count(reason)} trial(s) wait for {reason}; the runner starts them once "
            "the trials before them have ended (their learning rate is shown as -)."
        )
    return "\n".join(lines)


def branch_lines(rows: list[dict]) -> list[str]:
    """What the branches save: their compute with their parents', against the same budgets
    trained as independent runs (none without branches)."""
    branches = [r for r in rows if r["branch_from"]]
    if not branches:
        return []
    parents = {r["branch_from"] for r in branches}
    stable = sum(r["spent_flops"] for r in rows if r["trial"] in parents)
    cooldowns = sum(r["spent_flops"] for r in branches)
    alone = sum(r["total_flops"] for r in branches)
    return [
        f"\nThe total counts a branch's own steps only ({len(branches)} branches of "
        f"{len(parents)} runs: tokens and total FLOPs per row include the parent's share).",
        f"Branches: {human(stable + cooldowns)} FLOPs ({human(stable)} in their {len(parents)} "
        f"parents, {human(cooldowns)} in their own steps); the same {len(branches)} budgets as "
        f"independent runs: {human(alone)} FLOPs ({(stable + cooldowns) / alone:.0%} of it).",
    ]


def missing_data(trials) -> list[str]:
    """A warning line per data folder that trials read and that is not a prepared dataset
    (embedded sources with ``data.prepare`` are prepared as the sweep starts)."""
    from lmuscale.data import EMBEDDED_SOURCES, DataError
    from lmuscale.data.loader import open_dataset

    readers: dict[str, list[str]] = {}
    data = {}
    for trial in trials:
        c = trial.config.data
        if not (c.prepare and c.source in EMBEDDED_SOURCES):
            readers.setdefault(trial.config.data.path, []).append(trial.name)
            data[trial.config.data.path] = trial.config.data
    warnings = []
    for path, names in readers.items():
        try:
            open_dataset(path, verify=False)
        except DataError as error:
            why = str(error) if Path(path).is_dir() else f"{path}: no such folder"
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            warnings.append(
                f"warning: the data of {len(names)} trial(s) ({shown}) is missing: {why}; "
                f"prepare it first: python -m lmuscale.data prepare {data[path].source or 'SOURCE'}"
                f" INPUT --out {path}"
            )
    return warnings
