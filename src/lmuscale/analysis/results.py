"""Reading a sweep's results table (``results.jsonl`` or ``results.csv``) for analysis.

Needs the columns trial, family, N (non-embedding parameters), steps, tokens and the loss
(``test_loss`` or ``val_loss``, nats per token). The other columns of ``Run`` are optional
(per_position: ``{split}_per_position``), and so is status: rows not "finished" are skipped.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lmuscale.outcomes import DataError

REQUIRED = ("trial", "family", "N", "steps", "tokens")
LOSSES = {"test": "test_loss", "val": "val_loss"}
LABELS = {
    "lmu": "LMU",
    "lmu_g": "LMU_G",
    "transformer": "Transformer",
    "sru": "SRU",
    "sru_pp": "SRU++",
    "lstm": "LSTM",
}
FAMILY_ORDER = ("lmu", "lmu_g", "transformer", "sru", "sru_pp", "lstm")  # in legends, tables
LMU_FAMILIES = ("lmu", "lmu_g")


class ResultsError(DataError):
    """A results file that cannot be analysed; the message names the file, line and column."""


@dataclass(frozen=True)
class Run:
    """One finished trial. ``loss`` is in nats per token; ``per_position`` may be None."""

    trial: str
    family: str
    n: float
    steps: float
    tokens: float
    loss: float
    line: int
    total_params: float | None = None
    tokenizer: str | None = None
    per_position: list[float] | None = None
    flops_per_token: float | None = None  # training FLOPs per token (3x the forward)
    learning_rate: float | None = None
    seed: int | None = None
    folder: str | None = None  # the trial's folder, beside the results table

    @property
    def flops(self) -> float | None:
        """Training FLOPs of the whole run, when the table gives the FLOPs per token."""
        return None if self.flops_per_token is None else self.flops_per_token * self.tokens

    @property
    def batch_tokens(self) -> float:
        return self.tokens / self.steps


@dataclass
class Results:
    path: Path
    split: str  # "test" or "val"
    runs: list[Run]
    skipped: list[str] = field(default_factory=list)  # one line per row left out, with why

    @property
    def families(self) -> list[str]:
        return sorted({r.family for r in self.runs}, key=family_key)

    @property
    def tokenizer(self) -> str | None:
        """The runs' tokenizer: one name, "mixed", or None when the table has no column."""
        names = {r.tokenizer for r in self.runs if r.tokenizer}
        if not names:
            return None
        return names.pop() if len(names) == 1 else "mixed"

    @property
    def gpt2_tokens(self) -> bool:
        """Whether losses are per GPT-2 token, so Kaplan's and the paper's curves apply (a
        table without a tokenizer column is taken to be)."""
        return self.tokenizer in (None, "gpt2")

    @property
    def unit(self) -> str:
        """The loss unit in words: "nats per token" (GPT-2), "nats per byte", ..."""
        if self.tokenizer in (None, "gpt2"):
            return "nats per token"
        if self.tokenizer == "bytes":
            return "nats per byte"
        return f"nats per {self.tokenizer} token"

    @property
    def base_tokens(self) -> float:
        """The budget Figure 3 compares at: the commonest token count of the LMU runs (of all
        runs without LMUs); the smallest on a tie."""
        runs = [r for r in self.runs if r.family in LMU_FAMILIES] or self.runs
        counts = Counter(r.tokens for r in runs)
        return min(counts, key=lambda t: (-counts[t], t))

    def group(self, family: str, tokens: float) -> list[Run]:
        return sorted(
            (r for r in self.runs if r.family == family and r.tokens == tokens), key=lambda r: r.n
        )

    def budgets(self, family: str) -> list[float]:
        return sorted({r.tokens for r in self.runs if r.family == family})


def label(family: str) -> str:
    return LABELS.get(family, family)


def family_key(family: str) -> tuple[int, str]:
    """Sorts families as in legends and tables: ``FAMILY_ORDER``, then others by name."""
    order = FAMILY_ORDER.index(family) if family in FAMILY_ORDER else len(FAMILY_ORDER)
    return order, family


def groups_within(items, value, rtol: float) -> list[list]:
    """``items`` in ascending ``value(item)``, grouped: a group holds the items whose value is
    within ``1 + rtol`` times its first's."""
    groups: list[list] = []
    for item in sorted(items, key=value):
        if groups and value(item) <= value(groups[-1][0]) * (1 + rtol):
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def load_results(path, split: str = "test") -> Results:
    """Read and check a results table; rows that did not finish or have no finite loss are
    left out and listed in ``skipped``. Raises ``ResultsError`` naming the file, line and
    column of anything malformed, or when no row is usable."""
    path = Path(path)
    if split not in LOSSES:
        raise ResultsError(f"split must be one of {sorted(LOSSES)}, got {split!r}")
    if path.is_dir():
        raise ResultsError(f"{path}: a folder; give the results table in it (results.jsonl)")
    if not path.is_file():
        raise ResultsError(f"{path}: no such results file (a sweep writes WORKDIR/results.jsonl)")
    read = {".jsonl": _read_jsonl, ".csv": _read_csv}.get(path.suffix)
    if read is None:
        raise ResultsError(f"{path}: expected a .jsonl or .csv results table")
    rows, columns = read(path, _text(path))
    if not rows:
        raise ResultsError(f"{path}: the table has no rows")
    loss_key = LOSSES[split]
    missing = [c for c in (*REQUIRED, loss_key) if c not in columns]
    if missing:
        raise ResultsError(
            f"{path}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
            f"(the table has: {', '.join(columns) or 'nothing'})"
        )
    results = Results(path, split, [])
    for line, row in rows:
        run = _run(path, line, row, split, results.skipped)
        if run is not None:
            results.runs.append(run)
    if not results.runs:
        raise ResultsError(
            f"{path}: no finished row with a finite {loss_key}; left out: "
            + "; ".join(results.skipped)
        )
    return results


def _text(path: Path) -> str:
    """The file as UTF-8 text: a binary or otherwise encoded file is named with the line of
    its first bad byte, rather than failing inside the CSV or JSON reader."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ResultsError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (as spreadsheets write) is dropped
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ResultsError(
            f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
            "expected the results table a sweep writes"
        ) from None


def _read_jsonl(path: Path, content: str):
    rows, columns = [], {}
    for line, text in enumerate(content.splitlines(), 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise ResultsError(f"{path}:{line}: not JSON ({e.msg})") from None
        except RecursionError:
            raise ResultsError(f"{path}:{line}: not a results row (nested too deeply)") from None
        if not isinstance(row, dict):
            raise ResultsError(f"{path}:{line}: expected a JSON object, got {type(row).__name__}")
        rows.append((line, row))
        columns.update(dict.fromkeys(row))
    return rows, list(columns)


def _read_csv(path: Path, content: str):
    reader = csv.DictReader(io.StringIO(content, newline=""))
    rows = []
    try:
        columns = list(reader.fieldnames or [])
        for row in reader:
            if None in row:
                raise ResultsError(
                    f"{path}:{reader.line_num}: more cells than the {len(columns)} columns"
                )
            rows.append((reader.line_num, {k: (None if v == "" else v) for k, v in row.items()}))
    except csv.Error as e:  # e.g. a field over csv's size limit
        raise ResultsError(f"{path}:{reader.reader.line_num}: not CSV ({e})") from None
    return rows, columns


def _run(path, line, row, split, skipped) -> Run | None:
    where = f"{path}:{line}"
    trial = str(row.get("trial") or f"line {line}")
    status = row.get("status")
    if status not in (None, "finished"):
        skipped.append(f"{trial}: status {status}")
        return None
    loss = _number(row.get(LOSSES[split]), where, LOSSES[split], allow_missing=True)
    if loss is None or not math.isfinite(loss) or loss <= 0:
        skipped.append(f"{trial} ({where}): {LOSSES[split]} is {row.get(LOSSES[split])}")
        return None
    family = row.get("family")
    if not family:
        raise ResultsError(f"{where}: column family is empty")
    values = {key: _positive(row, where, key) for key in ("N", "steps", "tokens")}
    per_position = row.get(f"{split}_per_position")
    if isinstance(per_position, str):
        try:
            per_position = json.loads(per_position)
        except json.JSONDecodeError:
            raise ResultsError(f"{where}: column {split}_per_position is not a JSON list") from None
    if per_position is not None:
        # a sweep writes a non-finite loss as null
        if not isinstance(per_position, list) or not all(
            v is None or (isinstance(v, int | float) and not isinstance(v, bool))
            for v in per_position
        ):
            raise ResultsError(f"{where}: column {split}_per_position must be a list of numbers")
        per_position = [math.nan if v is None else float(v) for v in per_position]
    optional = {}
    for column in ("tokenizer", "folder"):
        name = optional[column] = row.get(column)
        if name is not None and not isinstance(name, str):
            raise ResultsError(f"{where}: column {column} is {name!r}, not a {column}'s name")
    for column in ("flops_per_token", "learning_rate"):
        optional[column] = _positive(row, where, column, allow_missing=True)
    seed = _number(row.get("seed"), where, "seed", allow_missing=True)
    if seed is not None and (not seed.is_integer() or seed < 0):
        raise ResultsError(f"{where}: column seed must be a whole number >= 0, got {seed}")
    return Run(
        trial=trial,
        family=str(family),
        n=values["N"],
        steps=values["steps"],
        tokens=values["tokens"],
        loss=loss,
        line=line,
        total_params=_number(row.get("total_params"), where, "total_params", allow_missing=True),
        per_position=per_position or None,
        seed=None if seed is None else int(seed),
        **optional,
    )


def _number(value, where, column, allow_missing=False):
    if value is None:
        if allow_missing:
            return None
        raise ResultsError(f"{where}: column {column} is empty")
    if isinstance(value, bool):
        raise ResultsError(f"{where}: column {column} is {value!r}, not a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ResultsError(f"{where}: column {column} is {value!r}, not a number") from None


def _positive(row, where, column, allow_missing=False):
    value = _number(row.get(column), where, column, allow_missing)
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ResultsError(f"{where}: column {column} must be a positive number, got {value}")
    return value
