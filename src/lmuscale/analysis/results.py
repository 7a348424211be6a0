"""Reading a sweep's results table (``results.jsonl`` or ``results.csv``) for analysis.

Needs the columns trial, family, N (non-embedding parameters), steps, tokens and the loss
(``test_loss`` or ``val_loss``, nats per token). The other columns of ``Run`` are optional
(per_position: ``{split}_per_position``), and so is status: rows not "finished" are skipped.
Each run has a role (``ROLES``): the table's ``role`` column, or, for a table without one,
``infer_roles``'s guess from the runs' sizes, budgets and learning rates.
"""

from __future__ import annotations

import csv
import dataclasses
import fnmatch
import io
import json
import math
from collections import Counter, defaultdict
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
FAMILY_ORDER = tuple(LABELS)  # in legends, tables
# Fewer distinct sizes than this, and an exponent in N is a line through its points, not a law
# the points test: figures and fits.md mark it.
MIN_SIZES = 3
LMU_FAMILIES = ("lmu", "lmu_g")
# What a run is for (lmuscale.sweep.spec.ROLES): the analyses each role feeds are in
# lmuscale.analysis.analyse; ROLE_NAMES are their names in tables and messages.
ROLE_NAMES = {
    "grid": "paper grid",
    "isoflop": "IsoFLOP",
    "learning_rate": "learning-rate grid",
    "seed": "seed replicate",
    "stable": "WSD stable run",  # no analysis takes it: its cooldown branches are the budgets
}
ROLES = tuple(ROLE_NAMES)


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
    role: str = "grid"  # one of ROLES
    # a cooldown branch: the trial it started from and at which step (its tokens include them)
    branch_from: str | None = None
    branch_step: int | None = None

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
    roles_inferred: bool = False  # the table has no role column: see infer_roles
    selection: str = ""  # how the runs were selected from the table (``select``), if they were

    def select(
        self, *, roles=None, families=None, budgets=None, trials=None, note: str = ""
    ) -> Results:
        """The runs of the given roles and families, at one of ``budgets`` (training tokens or
        FLOPs, within 5%) and whose trial name matches one of the ``trials`` patterns (shell
        style: ``lmu-*``); None: any. ``note`` says why, in ``selection``."""

        def near(value):
            return value is not None and any(abs(value / b - 1) <= 0.05 for b in budgets)

        runs = [
            r
            for r in self.runs
            if (roles is None or r.role in roles)
            and (families is None or r.family in families)
            and (budgets is None or near(r.tokens) or near(r.flops))
            and (trials is None or any(fnmatch.fnmatchcase(r.trial, p) for p in trials))
        ]
        return dataclasses.replace(self, runs=runs, selection=note or self.selection)

    def grid(self) -> Results:
        """The paper-grid runs, which Figures 3-5 and the fits in N take: at each family and
        token budget the runs of one learning rate (the commonest; the lowest on a tie). The
        grid's runs at other rates are added to ``skipped``."""
        grid = self.select(roles=("grid",))
        kept, skipped = [], list(self.skipped)
        for family in grid.families:
            for tokens in grid.budgets(family):
                runs = grid.group(family, tokens)
                counts = Counter(r.learning_rate for r in runs)
                rate = min(counts, key=lambda x: (-counts[x], x or 0))
                kept += [r for r in runs if r.learning_rate == rate]
                skipped += [
                    f"{r.trial}: learning rate {_rate(r.learning_rate)}, not the "
                    f"{_rate(rate)} of the other {label(family)} grid runs at {r.tokens:,.0f} "
                    "tokens"
                    for r in runs
                    if r.learning_rate != rate
                ]
        return dataclasses.replace(grid, runs=kept, skipped=skipped)

    def role_counts(self) -> str:
        """ "8 paper grid, 15 IsoFLOP": the runs of each role, in ``ROLES`` order."""
        counts = Counter(r.role for r in self.runs)
        return ", ".join(f"{counts[r]} {ROLE_NAMES[r]}" for r in ROLES if counts[r])

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
        if self.gpt2_tokens:
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


def _rate(rate: float | None) -> str:
    return "(none in the table)" if rate is None else f"{rate:g}"


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
    left out and listed in ``skipped``. Raises ``DataError`` naming the file, line and
    column of anything malformed, or when no row is usable."""
    path = Path(path)
    if split not in LOSSES:
        raise DataError(f"split must be one of {sorted(LOSSES)}, got {split!r}")
    if path.is_dir():
        raise DataError(f"{path}: a folder; give the results table in it (results.jsonl)")
    if not path.is_file():
        raise DataError(f"{path}: no such results file (a sweep writes WORKDIR/results.jsonl)")
    read = {".jsonl": _read_jsonl, ".csv": _read_csv}.get(path.suffix)
    if read is None:
        raise DataError(f"{path}: expected a .jsonl or .csv results table")
    rows, columns = read(path, _text(path))
    if not rows:
        raise DataError(f"{path}: the table has no rows")
    loss_key = LOSSES[split]
    missing = [c for c in (*REQUIRED, loss_key) if c not in columns]
    if missing:
        raise DataError(
            f"{path}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
            f"(the table has: {', '.join(columns) or 'nothing'})"
        )
    results = Results(path, split, [], roles_inferred="role" not in columns)
    for line, row in rows:
        run = _run(path, line, row, split, results.skipped)
        if run is not None:
            results.runs.append(run)
    if not results.runs:
        raise DataError(
            f"{path}: no finished row with a finite {loss_key}; left out: "
            + "; ".join(results.skipped)
        )
    if results.roles_inferred:
        results.runs = infer_roles(results.runs)
    return results


def infer_roles(runs: list[Run]) -> list[Run]:
    """Roles for the runs of a table without a role column: a size trained at 2 or more
    learning rates on the same tokens is a learning-rate grid; of the rest, runs at one
    compute budget (FLOPs within 5%) with 3 or more sizes on 2 or more token counts are
    IsoFLOP runs; the others are the grid, where a repeat of a run at another seed (same
    family, N, tokens and rate) is a seed replicate of the lowest seed's run."""
    role = {}
    by_point = defaultdict(list)
    for run in runs:
        by_point[run.family, run.tokens].append(run)
    for group in by_point.values():
        for at_size in groups_within(group, lambda r: r.n, 0.05):
            if len({r.learning_rate for r in at_size}) > 1:
                role.update(dict.fromkeys(((r.trial, r.line) for r in at_size), "learning_rate"))
    rest = [r for r in runs if (r.trial, r.line) not in role]
    for family in {r.family for r in rest}:
        mine = [r for r in rest if r.family == family and r.flops is not None]
        for group in groups_within(mine, lambda r: r.flops, 0.05):
            if len({r.n for r in group}) >= 3 and len({r.tokens for r in group}) >= 2:
                role.update(dict.fromkeys(((r.trial, r.line) for r in group), "isoflop"))
    replicated = defaultdict(list)
    for r in runs:
        if (r.trial, r.line) not in role:
            replicated[r.family, r.n, r.tokens, r.learning_rate].append(r)
    for group in replicated.values():
        first = min(group, key=lambda r: (r.seed is None, r.seed or 0, r.line))
        for r in group:
            role[r.trial, r.line] = "grid" if r is first else "seed"
    return [dataclasses.replace(r, role=role[r.trial, r.line]) for r in runs]


def _text(path: Path) -> str:
    """The file as UTF-8 text: a binary or otherwise encoded file is named with the line of
    its first bad byte, rather than failing inside the CSV or JSON reader."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (as spreadsheets write) is dropped
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
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
            raise DataError(f"{path}:{line}: not JSON ({e.msg})") from None
        except RecursionError:
            raise DataError(f"{path}:{line}: not a results row (nested too deeply)") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line}: expected a JSON object, got {type(row).__name__}")
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
                raise DataError(
                    f"{path}:{reader.line_num}: more cells than the {len(columns)} columns"
                )
            rows.append((reader.line_num, {k: (None if v == "" else v) for k, v in row.items()}))
    except csv.Error as e:  # e.g. a field over csv's size limit
        raise DataError(f"{path}:{reader.reader.line_num}: not CSV ({e})") from None
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
        raise DataError(f"{where}: column family is empty")
    values = {key: _positive(row, where, key) for key in ("N", "steps", "tokens")}
    per_position = row.get(f"{split}_per_position")
    if isinstance(per_position, str):
        try:
            per_position = json.loads(per_position)
        except json.JSONDecodeError:
            raise DataError(f"{where}: column {split}_per_position is not a JSON list") from None
    if per_position is not None:
        # a sweep writes a non-finite loss as null
        if not isinstance(per_position, list) or not all(
            v is None or (isinstance(v, int | float) and not isinstance(v, bool))
            for v in per_position
        ):
            raise DataError(f"{where}: column {split}_per_position must be a list of numbers")
        per_position = [math.nan if v is None else float(v) for v in per_position]
    optional = {}
    for column in ("tokenizer", "folder", "branch_from"):
        name = optional[column] = row.get(column)
        if name is not None and not isinstance(name, str):
            raise DataError(f"{where}: column {column} is {name!r}, not a {column}'s name")
    for column in ("flops_per_token", "learning_rate"):
        optional[column] = _positive(row, where, column, allow_missing=True)
    role = row.get("role") or "grid"
    if role not in ROLES:
        raise DataError(f"{where}: column role is {role!r}; expected one of {', '.join(ROLES)}")
    step = _number(row.get("branch_step"), where, "branch_step", allow_missing=True)
    if (step is None) != (optional["branch_from"] is None) or (step is not None and step < 1):
        raise DataError(f"{where}: columns branch_from and branch_step: both or neither, step >= 1")
    optional["branch_step"] = None if step is None else int(step)
    seed = _number(row.get("seed"), where, "seed", allow_missing=True)
    if seed is not None and (not seed.is_integer() or seed < 0):
        raise DataError(f"{where}: column seed must be a whole number >= 0, got {seed}")
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
        role=role,
        **optional,
    )


def _number(value, where, column, allow_missing=False):
    if value is None:
        if allow_missing:
            return None
        raise DataError(f"{where}: column {column} is empty")
    if isinstance(value, bool):
        raise DataError(f"{where}: column {column} is {value!r}, not a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise DataError(f"{where}: column {column} is {value!r}, not a number") from None


def _positive(row, where, column, allow_missing=False):
    value = _number(row.get(column), where, column, allow_missing)
    if value is not None and not (math.isfinite(value) and value > 0):
        raise DataError(f"{where}: column {column} must be a positive number, got {value}")
    return value
