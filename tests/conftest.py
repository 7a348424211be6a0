"""Shared fixtures: small input files written by the test itself, and a prepared byte corpus."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import tarfile
from pathlib import Path

# The suite compiles at XLA's CPU backend optimisation level 0, set before jax starts its
# backend and inherited by every subprocess (training runs, sweep workers). Level 0 changes
# only how hard LLVM optimises the machine code; XLA's own passes, and so the programs the
# tests check (their HLO, their buffers and memory estimates), are the same. Most of the
# suite's CPU time is compiling small programs that then run for a few steps: measured on
# three of test_models.py's heaviest tests, 193 -> 137 s of CPU. Numbers may differ from
# level 2 in the last bits (FMA contraction, vector reduction order), within every tolerance
# here; tests that compare two runs bit for bit compile both at the same level.
SUITE_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SUITE_XLA_FLAGS}".strip()
# No user-wide compilation cache (lmuscale.train.step.compilation_cache), whatever earlier runs
# left behind: a test process compiles through a cache of its own (compile_cache.py), which
# starts empty (suite_compilation_cache below); subprocesses through their module's, or none.
os.environ["LMUSCALE_XLA_CACHE"] = "off"

import jax  # noqa: E402
import pytest  # noqa: E402
import zstandard  # noqa: E402
from compile_cache import in_process  # noqa: E402

# As in nanodo's tests: an implicit broadcast between arrays of different ranks is an error.
jax.config.update("jax_numpy_rank_promotion", "raise")


# The two pytest workers (`make test`: --dist loadfile --no-loadscope-reorder) each take whole
# files in collection order: xdist queues up to two files on a worker and hands it the next one
# when its queue runs low. The files start heaviest first, so that the run does not end on one
# long file while the other worker idles. That scheduling (two files queued a worker) replayed on
# the per-file seconds of a 2026-11-27 run (pytest --durations=0, 2 CPU cores) ends the two
# workers at 990 and 1061 s in xdist's default order (most tests first), at 1025 and 1026 s in
# this one. Files not named here run last, in their own order. Only the wall time depends on the
# order: no test depends on another file's.
HEAVIEST_FIRST = (
    "test_models",
    "test_train",
    "test_generate",
    "test_train_checkpoints",
    "test_lmu",
    "test_sweep",
    "test_train_resume",
    "test_analysis",
    "test_benchmarks",
    "test_sweep_slurm",
    "test_layers",
    "test_train_multiprocess",
    "test_sweep_branches",
    "test_tasks",
    "test_outcomes",
    "test_cross_entropy",
    "test_cross_entropy_flash",
    "test_memory_pallas",
    "test_ops",
    "test_roles",
    "test_train_sharding",
    "test_extrapolate",
    "test_optimal",
    "test_notebooks",
    "test_train_memory",
    "test_sweep_stages",
    "test_prepare",
    "test_sweep_families",
    "test_sweep_throughput",
    "test_train_workdir",
    "test_scaling",
    "test_wandb",
    "test_columnar",
    "test_optim",
    "test_family",
    "test_tokenizer",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: files stay whole


class DataFiles:
    """Writes inputs under one folder; every method returns the path it wrote."""

    def __init__(self, root: Path):
        self.root = root

    @staticmethod
    def texts(n: int, seed: int = 0, words: int = 30) -> list[str]:
        """``n`` distinct little documents: English-like words, unicode, code, whitespace runs."""
        rng = random.Random(seed)
        vocab = [
            "the",
            "memory",
            "Legendre",
            "naïve",
            "café",
            "日本",
            "🙂",
            "x = f(y)\n",
            "  ",
            "\t",
        ]
        return [
            f"doc {seed}-{i}: " + " ".join(rng.choice(vocab) for _ in range(rng.randint(1, words)))
            for i in range(n)
        ]

    @staticmethod
    def jsonl_bytes(texts) -> bytes:
        return b"".join(
            json.dumps({"text": t, "meta": {"i": i}}).encode() + b"\n" for i, t in enumerate(texts)
        )

    @staticmethod
    def zst(data: bytes, frames: int = 1) -> bytes:
        """zstd-compress ``data``, as several concatenated frames if asked."""
        step = max(1, -(-len(data) // frames))
        compressor = zstandard.ZstdCompressor()
        return b"".join(compressor.compress(data[i : i + step]) for i in range(0, len(data), step))

    def write(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def jsonl(self, name: str, texts) -> Path:
        return self.write(name, self.jsonl_bytes(texts))

    def jsonl_zst(self, name: str, texts, frames: int = 1) -> Path:
        return self.write(name, self.zst(self.jsonl_bytes(texts), frames))

    def jsonl_gz(self, name: str, texts, members: int = 1) -> Path:
        """gzip-compressed JSON lines, as several concatenated members if asked."""
        data = self.jsonl_bytes(texts)
        step = max(1, -(-len(data) // members))
        parts = [gzip.compress(data[i : i + step]) for i in range(0, len(data), step)]
        return self.write(name, b"".join(parts))

    def parquet(self, name: str, columns: dict | list[str], row_group_size: int) -> Path:
        """A parquet file of ``columns`` (a list of texts is the column "text"), its row groups
        ``row_group_size`` rows each (FineWeb's files are many row groups)."""
        import pyarrow as pa  # here, not above: most test files never touch it
        import pyarrow.parquet as pq

        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        columns = {"text": columns} if isinstance(columns, list) else columns
        pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
        return path

    def arrow_stream(self, name: str, columns: dict | list[str], batch_rows: int = 1000) -> Path:
        """An Arrow IPC stream file, as datasets writes one (1,000 rows per record batch)."""
        import pyarrow as pa

        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        columns = {"text": columns} if isinstance(columns, list) else columns
        table = pa.table(columns)
        with pa.ipc.new_stream(str(path), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
        return path

    def saved_dataset(self, name: str, texts: list[str], files: int = 2) -> Path:
        """A folder laid out as ``datasets.Dataset.save_to_disk`` writes it: Arrow streams
        ``data-0000i-of-0000n.arrow``, ``dataset_info.json`` and ``state.json`` (which lists
        the data files, in order)."""
        folder = self.root / name
        step = -(-len(texts) // files)
        names = [f"data-{i:05d}-of-{files:05d}.arrow" for i in range(files)]
        for i, filename in enumerate(names):
            self.arrow_stream(f"{name}/{filename}", texts[i * step : (i + 1) * step])
        features = {"text": {"dtype": "string", "_type": "Value"}}
        info = {"citation": "", "description": "", "features": features, "license": ""}
        state = {
            "_data_files": [{"filename": filename} for filename in names],
            "_fingerprint": "0123456789abcdef",
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        self.write(f"{name}/dataset_info.json", json.dumps(info, indent=2).encode())
        self.write(f"{name}/state.json", json.dumps(state, indent=2).encode())
        return folder

    def tar(self, name: str, members: dict[str, bytes]) -> Path:
        """A tar of the given members, in order (like openwebtext2.jsonl.zst.tar)."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path, "w") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path


@pytest.fixture
def datafiles(tmp_path) -> DataFiles:
    return DataFiles(tmp_path / "inputs")


def markov_texts(n: int, seed: int = 0, length: int = 300) -> list[str]:
    """``n`` documents from a small word-level Markov chain: text a model can learn from."""
    rng = random.Random(seed)
    words = [
        "the",
        "memory",
        "holds",
        "a",
        "window",
        "of",
        "the",
        "past",
        "and",
        "reads",
        "it",
        "back",
        "in",
        "order",
    ]
    follow = {w: rng.sample(words, 3) for w in words}
    texts = []
    for i in range(n):
        word, out = rng.choice(words), [f"doc{i}"]
        while sum(len(w) + 1 for w in out) < length:
            out.append(word)
            word = rng.choice(follow[word])
        texts.append(" ".join(out))
    return texts


@pytest.fixture(scope="session", autouse=True)
def suite_compilation_cache(tmp_path_factory):
    """Each pytest worker compiles through a persistent cache that starts empty: many tests
    compile programs an earlier test compiled (a model's init, its train step), and a cached
    executable is the compiler's output, the same program (compile_cache.py). A fresh clone's
    `make test` on 2 cores, with the tests of the same change: pytest 1,181 s (1,273 s
    without the cache, at the change before). A module's own cache (``in_process``) takes over
    inside it."""
    with in_process(tmp_path_factory.mktemp("xla-cache")):
        yield


@pytest.fixture(scope="session")
def byte_corpus(tmp_path_factory) -> Path:
    """A prepared byte-level dataset of 400 documents (~120 kB), shared by the training tests."""
    from lmuscale.data.prepare import prepare

    root = tmp_path_factory.mktemp("byte-corpus")
    source = DataFiles(root).jsonl("docs.jsonl", markov_texts(400))
    out = root / "prepared"
    prepare("text", [str(source)], out=out, tokenizer="bytes", progress=False)
    return out
