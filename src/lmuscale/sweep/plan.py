"""``--dry-run``: the sweep as a table of sizes, tokens, FLOPs and an estimated time.

A trial's time is its training FLOPs (not evaluation or compilation) over the first model
FLOP/s of: ``measured`` (its metrics.jsonl), ``family`` (the median of its family's measured
trials), then ``Throughput.lookup``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from lmuscale.sweep.runner import _duration
from lmuscale.sweep.throughput import Throughput
from lmuscale.sweep.trials import result_row
from lmuscale.workdir import METRICS, read_log


def measured_flops(folder: Path, flops_per_token: float) -> float | None:
    """Median model FLOP/s of a trial's logged steps, or None before it has logged any."""
    speeds = [
        r["tokens_per_second"] for r in read_log(folder / METRICS) if r.get("tokens_per_second")
    ]
    return statistics.median(speeds) * flops_per_token if speeds else None


def plan(trials, workdir: Path, throughput: Throughput) -> list[dict]:
    rows = []
    by_family: dict[str, list[float]] = {}  # the measured FLOP/s of each family's trials
    for trial in trials:
        folder = workdir / "trials" / trial.folder_name
        row = result_row(trial, folder)
        row["flops_per_second"] = measured_flops(folder, row["flops_per_token"])
        row["source"] = "measured" if row["flops_per_second"] else None
        if row["source"]:
            by_family.setdefault(row["family"], []).append(row["flops_per_second"])
        rows.append(row)
    for row in rows:
        if not row["source"] and row["family"] in by_family:
            row["flops_per_second"] = statistics.median(by_family[row["family"]])
            row["source"] = "family"
        elif not row["source"]:
            row["flops_per_second"], row["source"] = throughput.lookup(row["family"], row["N"])
        speed = row["flops_per_second"]
        row["seconds"] = row["total_flops"] / speed if speed else None
    return rows


def _count(n: float) -> str:
    n = float(f"{n:.3g}")  # rounded first: 999.6 of a unit is 1 of the next, not "1e+03"
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def table(rows: list[dict]) -> str:
    """The dry-run table as Markdown, with a total line."""
    header = (
        "| trial | family | N (non-emb.) | total params | train FLOPs/token | tokens | total FLOPs "
        "| FLOP/s | from | est. time | status |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        lines.append(
            f"| {r['trial']} | {r['family']} | {r['N']:,} | {r['total_params']:,} "
            f"| {_count(r['flops_per_token'])} | {_count(r['tokens'])} "
            f"| {_count(r['total_flops'])} "
            f"| {_count(r['flops_per_second']) if r['flops_per_second'] else '-'} "
            f"| {r['source'] or '-'} | {_duration(r['seconds'])} | {r['status']} |"
        )
    known = [r["seconds"] for r in rows if r["seconds"] is not None]
    total_time = _duration(sum(known)) if known else "-"
    if known and len(known) < len(rows):
        total_time += f" ({len(rows) - len(known)} unknown)"
    lines.append(
        f"| **total** ({len(rows)}) | | | | | {_count(sum(r['tokens'] for r in rows))} "
        f"| {_count(sum(r['total_flops'] for r in rows))} | | | {total_time} | |"
    )
    return "\n".join(lines)
