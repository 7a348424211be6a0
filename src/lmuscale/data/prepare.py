"""Prepare a source once into token files per split and the ``meta.json`` that pins them
(``format.py``); what it promises is in README, "Data".

Splits are by document (SPLIT_RULE), from its text alone; within a split, documents keep the
source's order, so the files are the same for any number of workers. Resume: at a shard
boundary, at most every COMMIT_SECONDS, the token files in ``OUT.partial/`` are fsynced and the
progress record replaced atomically; a rerun cuts the files back to that record and goes on with
the next shard. ``meta.json`` is written last, then ``OUT.partial`` is renamed to ``OUT``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import datetime
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmuscale import __version__
from lmuscale.data.format import (
    FORMAT,
    META,
    SPLITS,
    fingerprint,
    read_meta,
    scan_tokens,
    token_dtype,
    work_folder,
)
from lmuscale.data.sources import (
    EMBEDDED_SOURCES,
    TEXT_COLUMN,
    BadLine,
    DataError,
    Document,
    Source,
    open_source,
)
from lmuscale.data.tokenizer import Tokenizer, get_tokenizer
from lmuscale.files import atomic_write_json, fsync_dir
from lmuscale.processes import die_with_parent

FRACTIONS = {"train": 0.96, "val": 0.03, "test": 0.01}
SPLIT_RULE = (
    "u = blake2b(utf-8 text, digest_size=8, key=seed as 8 little-endian bytes), big-endian, "
    "/ 2**64; train if u < 0.96, val if u < 0.99, else test"
)
CHUNK_CHARS = 1 << 18  # text per task sent to a worker
CHUNK_DOCS = 2048
EXAMPLES = 20  # bad lines named in the metadata
COMMIT_SECONDS = 0.5  # the most often progress is made durable (fsyncs are not free)
SMALL_INPUT = 32 << 20  # bytes of input below which the default is to tokenise in-process


def split_of(data: bytes, seed: int) -> str:
    """The split of a document, from its UTF-8 bytes (see SPLIT_RULE)."""
    digest = hashlib.blake2b(data, digest_size=8, key=seed.to_bytes(8, "little")).digest()
    u = int.from_bytes(digest, "big") / 2**64
    if u < FRACTIONS["train"]:
        return "train"
    return "val" if u < FRACTIONS["train"] + FRACTIONS["val"] else "test"


_worker: dict = {}


def _start_worker(tokenizer: Tokenizer, seed: int, parent: int | None = None) -> None:
    """Set up a worker process, or this one (``parent`` None). A worker dies with the prepare
    (pid ``parent``), even a SIGKILLed one: else it would wait forever on a queue it holds both
    ends of, keeping the prepare's stdout open."""
    if parent is not None and not die_with_parent(parent):
        os._exit(1)  # the prepare died while this worker was starting: nobody wants its work
    _worker["tokenizer"] = tokenizer  # pickled from the parent: faster than building it again
    _worker["seed"] = seed


def _tokenize(chunk: list[tuple[str, str]]) -> dict:
    """Token ids per split for a list of (text, where), EOT after each document, with counts
    and bad lines; an id outside the vocabulary is a DataError (it would corrupt the files)."""
    tokenizer, seed = _worker["tokenizer"], _worker["seed"]
    ids = {s: [] for s in SPLITS}
    documents = dict.fromkeys(SPLITS, 0)
    n_bytes = dict.fromkeys(SPLITS, 0)
    bad = []
    eot = np.array([tokenizer.eot], np.int64)
    for text, where in chunk:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            bad.append((where, f"text holds an unpaired surrogate (U+{ord(text[e.start]):04X})"))
            continue
        doc = tokenizer.encode_array(text)
        low, high = (int(doc.min()), int(doc.max())) if doc.size else (0, 0)
        if low < 0 or high >= tokenizer.vocab_size:
            wrong = high if high >= tokenizer.vocab_size else low
            raise DataError(
                f"{where}: token id {wrong} is out of range for {tokenizer.name}'s vocab of "
                f"{tokenizer.vocab_size} ({token_dtype(tokenizer.vocab_size)} files)"
            )
        if (doc == tokenizer.eot).any():
            bad.append((where, f"text holds the end-of-text id {tokenizer.eot} ({tokenizer.name})"))
            continue
        split = split_of(data, seed)
        ids[split] += [doc, eot]
        documents[split] += 1
        n_bytes[split] += len(data)
    return {
        "ids": {s: np.concatenate(v) if v else np.zeros(0, np.int64) for s, v in ids.items()},
        "documents": documents,
        "bytes": n_bytes,
        "bad": bad,
    }


class _InProcess(concurrent.futures.Executor):
    """An executor that runs each task here as it is submitted (workers = 0)."""

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        future.set_result(fn(*args))
        return future


def _chunks(items: Iterable[Document | BadLine]) -> Iterator[list | BadLine]:
    """Documents grouped into tasks of about CHUNK_CHARS of text; bad lines pass through."""
    chunk, chars = [], 0
    for item in items:
        if isinstance(item, BadLine):  # after the documents before it: reports keep file order
            if chunk:
                yield chunk
                chunk, chars = [], 0
            yield item
            continue
        chunk.append((item.text, item.where))
        chars += len(item.text)
        if chars >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _plan(source: Source, tokenizer: Tokenizer, seed: int) -> dict:
    """What must match for a folder (finished or not) to be this job's."""
    return {
        "format": FORMAT,
        "source": source.describe(),
        "tokenizer": {key: getattr(tokenizer, key) for key in ("name", "vocab_size", "eot")},
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "seed": seed,
    }


def _same_job(meta: dict, plan: dict) -> bool:
    made = (meta["format"], meta["source"], meta["dtype"], meta.get("split", {}).get("seed"))
    wanted = (plan["format"], plan["source"], plan["dtype"], plan["seed"])
    tokenizer = {key: meta["tokenizer"][key] for key in plan["tokenizer"]}
    return made == wanted and tokenizer == plan["tokenizer"]


def _chain(chain: str, shard: str) -> str:
    """A running hash of the finished shards' names, to recognise them on resume."""
    return hashlib.sha256(f"{chain}\n{shard}".encode()).hexdigest()


def _start(out: Path, work: Path, plan: dict, restart: bool) -> dict | None:
    """Create or resume ``work``; returns the progress record (None: finished, to publish)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(
            f"{out}: exists, is not empty and holds no prepared dataset; "
            "use an empty or new --out folder"
        )
    if work.exists():
        if (work / META).exists() and not restart:  # finished, but not yet renamed into place
            if not _same_job(read_meta(work), plan):
                raise DataError(
                    f"{work}: holds a finished prepare of a different job; pass --restart "
                    "to discard it"
                )
            return None
        try:
            old = json.loads((work / "plan.json").read_text())
        except (OSError, json.JSONDecodeError):
            old = None  # killed before the plan was written: nothing to keep
        if old is not None and old != plan and not restart:
            raise DataError(
                f"{work}: holds an unfinished prepare of a different job "
                f"({json.dumps(old)[:300]}); rerun that command to finish it, "
                "or pass --restart to discard it"
            )
        if restart or old is None:
            shutil.rmtree(work)
    if not work.exists():
        work.mkdir(parents=True)
        atomic_write_json(work / "plan.json", plan)
    progress = work / "progress.json"
    if progress.exists():
        return json.loads(progress.read_text())
    return {
        "shards": 0,
        "chain": "",
        "last_shard": None,
        **{count: dict.fromkeys(SPLITS, 0) for count in ("tokens", "documents", "bytes")},
        "bad_lines": 0,
        "bad_examples": [],
        "seconds": 0.0,
    }


def _cpus() -> int:
    """CPUs this process may run on (the affinity mask, as SLURM and containers set it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def skipped_note(source: Source, examples: int = 3) -> str:
    """One line on the files in the folders given that ``source`` does not read."""
    kinds = collections.Counter(path.suffix or "no suffix" for path in source.skipped)
    counts = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    shown = ", ".join(str(path) for path in source.skipped[:examples])
    more = ", ..." if len(source.skipped) > examples else ""
    files = "file" if len(source.skipped) == 1 else "files"
    return (
        f"note: {source.spec} skipped {len(source.skipped)} {files} in the folders given that it "
        f"does not read ({counts}): {shown}{more}"
    )


def prepare(
    spec: str,
    inputs: Iterable[str] = (),
    *,
    out: str | os.PathLike,
    tokenizer: str = "gpt2",
    text_column: str = TEXT_COLUMN,
    seed: int = 0,
    workers: int | None = None,
    max_bad_lines: int = 0,
    restart: bool = False,
    progress: bool = True,
) -> dict:
    """Prepare ``spec`` (see ``sources.open_source``) into ``out``; returns the metadata.

    ``workers``: tokenizer processes (0: in this process; default one per CPU, or 0 for inputs
    under SMALL_INPUT). They are spawned, so a calling script needs the ``__main__`` guard.
    """
    out = Path(out).absolute()
    if max_bad_lines < 0:
        raise DataError(f"--max-bad-lines must be >= 0, got {max_bad_lines}")
    if workers is not None and workers < 0:
        raise DataError(f"--workers must be >= 0, got {workers}")
    if not 0 <= seed < 2**64:
        raise DataError(f"--seed must be in [0, 2**64), got {seed}")
    source = open_source(spec, list(inputs), text_column)
    if source.skipped:
        print(skipped_note(source), file=sys.stderr)
    tok = get_tokenizer(tokenizer)
    plan = _plan(source, tok, seed)
    if (out / META).exists():
        meta = read_meta(out)
        if _same_job(meta, plan):
            print(f"{out}: already prepared ({meta['source']['spec']})", file=sys.stderr)
            return meta
        raise DataError(
            f"{out}: already holds a prepared dataset of {meta['source'].get('spec')!r} "
            "with other settings; use another --out or remove it"
        )
    work = work_folder(out)
    state = _start(out, work, plan, restart)
    if state is not None:
        if workers is None:  # worker start-up costs more than it saves on small inputs
            small = source.nbytes is not None and source.nbytes < SMALL_INPUT
            workers = 0 if small else _cpus()
        run = _Run(work, state, np.dtype(plan["dtype"]), max_bad_lines, workers, progress, spec)
        with contextlib.closing(run):
            if workers > 0:
                pool = concurrent.futures.ProcessPoolExecutor(
                    workers,
                    mp_context=multiprocessing.get_context("spawn"),  # safe after jax or threads
                    initializer=_start_worker,
                    initargs=(tok, seed, os.getpid()),
                )
            else:
                _start_worker(tok, seed)
                pool = _InProcess()
            try:
                run.shards(source, pool)
            finally:
                pool.shutdown(cancel_futures=True)
        _finish(work, plan, tok, run.state, workers, max_bad_lines)
    _publish(work, out)
    return read_meta(out)


class _Run:
    """One prepare's open state: token files, counters, the bad-line policy, the bar."""

    def __init__(self, work, state, dtype, max_bad_lines, workers, progress, spec):
        self.work, self.state, self.dtype, self.workers = work, state, dtype, workers
        self.max_bad_lines = max_bad_lines
        self.started = self.committed = time.perf_counter()
        self.earlier_seconds = state["seconds"]  # of the runs this one resumes
        self.new_tokens = 0
        self.bar = tqdm(
            desc=f"prepare {spec}",
            unit=" docs",
            initial=sum(state["documents"].values()),
            disable=not progress,
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.1 if sys.stderr.isatty() else 10.0,
        )
        self.files = {}
        for split in SPLITS:  # cut back to the last record: later bytes may be torn
            path, size = work / f"{split}.bin", state["tokens"][split] * dtype.itemsize
            self.files[split] = f = open(path, "r+b" if path.exists() else "w+b")  # noqa: SIM115
            if os.fstat(f.fileno()).st_size < size:
                self.close()
                raise DataError(f"{path}: shorter than its progress record says; use --restart")
            f.truncate(size)
            f.seek(size)

    def close(self) -> None:
        self.bar.close()
        for f in self.files.values():
            f.close()

    def bad(self, where: str, reason: str) -> None:
        """The bad-line policy: stop, or report, count and skip up to ``max_bad_lines``."""
        if self.max_bad_lines == 0:
            raise DataError(f"{where}: {reason} (allow skipping with --max-bad-lines N)")
        self.state["bad_lines"] += 1
        if self.state["bad_lines"] > self.max_bad_lines:
            raise DataError(
                f"{where}: {reason}; that is bad line {self.state['bad_lines']}, more than "
                f"--max-bad-lines {self.max_bad_lines}"
            )
        if len(self.state["bad_examples"]) < EXAMPLES:
            self.state["bad_examples"].append(f"{where}: {reason}")
        print(f"skipped {where}: {reason}", file=sys.stderr)

    def shards(self, source: Source, pool) -> None:
        """Tokenise the unfinished shards, at most 2 chunks per worker in flight. Results, bad
        lines and shard ends share one queue in source order: bad lines are met in file order,
        and a record is only written at a shard boundary."""
        done, chain, seen = self.state["shards"], "", 0
        pending = collections.deque()  # futures, bad lines, and names of finished shards

        def drain(keep: int) -> None:
            while len(pending) > keep:
                item = pending.popleft()
                if isinstance(item, str):
                    self.finished(item)
                elif isinstance(item, BadLine):
                    self.bad(item.where, item.reason)
                else:
                    self.write(item.result())

        for index, shard in enumerate(source.shards()):
            seen = index + 1
            if index < done:  # finished by an earlier run: only check it is the same shard
                chain = _chain(chain, shard.name)
                if index == done - 1 and chain != self.state["chain"]:
                    raise DataError(
                        f"{source.spec}: the inputs changed since the interrupted run (its "
                        f"{done} finished shards, the last {self.state['last_shard']}, are not "
                        "the first ones now); use --restart"
                    )
                continue
            for item in _chunks(shard.documents()):
                if isinstance(item, BadLine):
                    pending.append(item)
                    if self.max_bad_lines == 0:
                        drain(keep=0)  # strict: stop at the first bad line, in file order
                else:
                    pending.append(pool.submit(_tokenize, item))
                drain(keep=2 * max(self.workers, 1))
            pending.append(shard.name)
        drain(keep=0)
        if seen < done:
            raise DataError(
                f"{source.spec}: fewer shards ({seen}) than the interrupted run finished "
                f"({done}); use --restart"
            )
        self.commit()

    def write(self, result: dict) -> None:
        for where, reason in result["bad"]:
            self.bad(where, reason)
        for split in SPLITS:
            ids = result["ids"][split]
            self.files[split].write(ids.astype(self.dtype).tobytes())
            self.state["tokens"][split] += int(ids.size)
            self.state["documents"][split] += result["documents"][split]
            self.state["bytes"][split] += result["bytes"][split]
            self.new_tokens += int(ids.size)
        self.bar.update(sum(result["documents"].values()))
        elapsed = time.perf_counter() - self.started
        self.bar.set_postfix_str(
            f"{sum(self.state['tokens'].values()):,} tokens, "
            f"{self.new_tokens / max(elapsed, 1e-9):,.0f} tok/s"
        )

    def finished(self, shard: str) -> None:
        self.state["shards"] += 1
        self.state["chain"] = _chain(self.state["chain"], shard)
        self.state["last_shard"] = shard
        if time.perf_counter() - self.committed >= COMMIT_SECONDS:
            self.commit()

    def commit(self) -> None:
        """Make the finished shards durable: data first, then the record that points past it."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        self.state["seconds"] = self.earlier_seconds + time.perf_counter() - self.started
        atomic_write_json(self.work / "progress.json", self.state)
        self.committed = time.perf_counter()


def _check_splits(work: Path, plan: dict, state: dict) -> None:
    """Refuse inputs without documents, or with a split that got none. The work folder is
    removed first: a rerun (or a new ``--seed``) would only meet this job again."""
    spec, files = plan["source"]["spec"], [name for name, _ in plan["source"]["files"]]
    named = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    documents = sum(state["documents"].values())
    empty = [split for split in SPLITS if state["tokens"][split] == 0]
    if not empty:
        return
    shutil.rmtree(work)
    if documents == 0:
        skipped = f"; {state['bad_lines']} bad lines were skipped" if state["bad_lines"] else ""
        raise DataError(f"{spec}: the inputs hold no documents ({named}){skipped}")
    split = empty[0]
    raise DataError(
        f"{spec}: the {split} split has no tokens: none of the {documents} documents fell in "
        f"it (the hash split sends about {FRACTIONS[split]:.0%} of them there); use more "
        f"documents (a .txt file is one, a JSONL file has one per line; about "
        f"{round(3 / min(FRACTIONS.values()))} give every split a few) or another --seed"
    )


def _finish(work: Path, plan: dict, tok: Tokenizer, state: dict, workers: int, max_bad: int):
    """Checksum the token files and write meta.json beside them."""
    _check_splits(work, plan, state)
    dtype = np.dtype(plan["dtype"])
    splits = {  # _Run wrote exactly the recorded tokens, each checked by _tokenize
        split: {
            "file": f"{split}.bin",
            "documents": state["documents"][split],
            "tokens": state["tokens"][split],
            "bytes": state["bytes"][split],
            "sha256": scan_tokens(work / f"{split}.bin", dtype, tok.vocab_size)[0],
        }
        for split in SPLITS
    }
    tokens = sum(state["tokens"].values())
    meta = {
        "format": FORMAT,
        "source": plan["source"],
        "tokenizer": {**plan["tokenizer"], "source": tok.source},
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "split": {"rule": SPLIT_RULE, "fractions": FRACTIONS, "seed": plan["seed"]},
        "splits": splits,
        "shards": state["shards"],
        "bad_lines": {
            "max_bad_lines": max_bad,
            "skipped": state["bad_lines"],
            "examples": state["bad_examples"],
        },
        "prepared": {
            "seconds": round(state["seconds"], 3),
            "tokens_per_second": round(tokens / max(state["seconds"], 1e-9)),
            "workers": workers,
            "lmuscale": __version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
    }
    meta["fingerprint"] = fingerprint(meta)
    atomic_write_json(work / META, meta)


def _publish(work: Path, out: Path) -> None:
    """The last step: drop the bookkeeping and rename the finished folder into place."""
    for name in ("plan.json", "progress.json"):
        (work / name).unlink(missing_ok=True)
    if out.exists():
        out.rmdir()  # empty (checked at the start); rename cannot replace a folder everywhere
    os.replace(work, out)
    fsync_dir(out.parent)


def prepare_embedded(out: Path, source: str, tokenizer: str, progress: bool) -> None:
    """Prepare the embedded corpus ``source`` in ``out`` once, under a lock beside ``out`` (a
    sweep's workers may start together)."""
    if source not in EMBEDDED_SOURCES:
        raise DataError(f"{source!r} is not an embedded source ({', '.join(EMBEDDED_SOURCES)})")
    out = Path(out)
    if (out / META).exists():
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / META).exists():
            print(f"data: preparing the embedded {source} corpus in {out}", file=sys.stderr)
            prepare(source, [], out=out, tokenizer=tokenizer, progress=progress)
