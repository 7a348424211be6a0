"""Weights & Biases logging: a run interrupted and resumed in offline mode, read back from W&B's
own run files and compared with metrics.jsonl, eval.jsonl, the config and summary.json; the
step handling of an online resume, failures, the missing package, and a sweep's group.

No network: every real W&B run here is offline, and W&B's folders are the test's own.
"""

from __future__ import annotations

import json
import shutil
import signal
import struct
import sys
from pathlib import Path

import pytest
import wandb
from ml_collections import ConfigDict
from small_config import small
from sweep_files import write_sweep
from wandb.proto import wandb_internal_pb2

from lmuscale.models import SRUConfig
from lmuscale.outcomes import Exit, LoggingServiceError
from lmuscale.resume import flatten, upgrade
from lmuscale.sweep import config_hash, load_sweep
from lmuscale.train import ConfigError, TrainingInterrupted, base_config, loop, run
from lmuscale.train.config import check
from lmuscale.train.metrics import MetricsLog
from lmuscale.train.wandb_log import MISSING
from lmuscale.workdir import WANDB as RUN_FILE

# -- W&B's run file: a LevelDB-style log of Record protos ------------------------------------

BLOCK = 32768  # records never straddle a block; a block's tail under a header is padding
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path) -> list:
    """Every Record of a ``.wandb`` file: a 7-byte header (":W&B", magic, version), then
    chunks of (crc32, length, type) + payload, a record split over blocks as FIRST..LAST."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    out, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            out.append(wandb_internal_pb2.Record.FromString(parts))
            parts = b""
    return out


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


class OfflineRun:
    """What one offline W&B session recorded: its run record, config, history rows (by
    step), summary and exit code."""

    def __init__(self, folder: Path):
        (path,) = folder.glob("run-*.wandb")
        self.folder = folder
        self.config, self.summary, self.history = {}, {}, {}
        self.exit_code = None
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
                self.config.update(
                    {_key(u): json.loads(u.value_json) for u in record.run.config.update}
                )
            elif kind == "config":
                self.config.update(
                    {_key(u): json.loads(u.value_json) for u in record.config.update}
                )
            elif kind == "history":
                row = {_key(i): json.loads(i.value_json) for i in record.history.item}
                self.history.setdefault(row["_step"], {}).update(row)
            elif kind == "summary":
                self.summary.update(
                    {_key(u): json.loads(u.value_json) for u in record.summary.update}
                )
            elif kind == "exit":
                self.exit_code = record.exit.exit_code

    def scalars(self, kind: str) -> dict[int, dict]:
        """step -> {key: value} of the ``kind/`` scalars (train or eval)."""
        prefix = f"{kind}/"
        out = {}
        for step, row in sorted(self.history.items()):
            values = {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)}
            if values:
                out[step] = values
        return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _quiet_offline_wandb(monkeypatch, root: Path) -> None:
    """W&B offline and silent, with every folder it would use in $HOME under ``root``."""
    for name in ("CONFIG", "CACHE", "DATA", "ARTIFACT"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(root / name.lower()))
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the run's own files go to the workdir
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")
    monkeypatch.setenv("WANDB__DISABLE_META", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def _wandb_config(data_path) -> object:
    """``small``'s run with a 1-layer SRU, the quickest model to compile (the training runs
    here are mostly compilation), logging to W&B project ``lmuscale-tests``."""
    config = base_config(SRUConfig(d=16, n_layers=1, vocab_size=256))
    config.name = "small"
    for section in ("data", "train", "optim", "eval", "checkpoint", "log"):
        config[section].update(small(str(data_path))[section].to_dict())
    config.log.update(
        wandb=True, wandb_project="lmuscale-tests", wandb_mode="offline", tensorboard=False
    )
    config.checkpoint.update(every=4, keep=3)
    return config


# -- a run interrupted at step 6, resumed from its checkpoint at step 4 ------------------------


@pytest.fixture(scope="module")
def resumed(byte_corpus, tmp_path_factory):
    """(config, workdir, first session's OfflineRun, second session's OfflineRun, summary)."""
    root = tmp_path_factory.mktemp("wandb")
    workdir = root / "run"
    config = _wandb_config(byte_corpus)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _quiet_offline_wandb(monkeypatch, root)
        original = loop.Session.log_step

        def log_step(self, done):
            original(self, done)
            if done == 6 and self.start == 0:
                signal.raise_signal(signal.SIGTERM)  # a scheduler's notice: stop after step 6

        monkeypatch.setattr(loop.Session, "log_step", log_step)
        with pytest.raises(TrainingInterrupted, match="stopped after step 6"):
            run(config, workdir)
        # As if killed after the step-6 log lines but before their checkpoint: the resume
        # starts at step 4 and logs steps 5 and 6 again.
        shutil.rmtree(workdir / "checkpoints" / "6")
        summary = run(config, workdir)
        wandb.teardown()  # the W&B service this process started, with the env it saw
    first, second = sorted((workdir / "wandb").glob("offline-run-*"))
    return config, workdir, OfflineRun(first), OfflineRun(second), summary


def test_both_sessions_log_to_the_run_id_stored_in_the_workdir(resumed):
    config, workdir, first, second, _ = resumed
    run_id = json.loads((workdir / RUN_FILE).read_text())["id"]
    assert first.run.run_id == second.run.run_id == run_id
    assert first.run.project == second.run.project == "lmuscale-tests"
    assert first.run.display_name == config.name == "small"
    assert first.run.run_group == ""  # a run outside a sweep has no group
    # The interrupted session is marked failed; the one that finished, finished.
    assert (first.exit_code, second.exit_code) == (1, 0)


def test_the_logged_scalars_are_the_logs_lines_at_their_steps(resumed):
    _, workdir, first, second, _ = resumed
    metrics, evals = _lines(workdir / "metrics.jsonl"), _lines(workdir / "eval.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, 13))
    # The first session logged steps 1-6; the second resumed at its checkpoint (step 4), so it
    # logged from step 5 on.
    assert sorted(first.scalars("train")) == list(range(1, 7))
    assert sorted(second.scalars("train")) == list(range(5, 13))
    assert sorted(first.scalars("eval")) == [4] and sorted(second.scalars("eval")) == [8, 12]
    # What W&B holds last for each step is the line metrics.jsonl / eval.jsonl kept, every
    # key but the step (None, an unknown MFU, is not logged).
    for kind, lines in (("train", metrics), ("eval", evals)):
        logged = first.scalars(kind) | second.scalars(kind)
        want = {
            r["step"]: {k: v for k, v in r.items() if k != "step" and v is not None} for r in lines
        }
        assert logged == want, kind
    # The steps logged twice carry the same numbers (the resume recomputes them), but timings.
    for step in (5, 6):
        a, b = first.scalars("train")[step], second.scalars("train")[step]
        for key in ("loss", "lr", "grad_norm", "param_norm", "tokens"):
            assert a[key] == b[key], (step, key)


def test_the_config_is_the_resolved_config_flattened(resumed):
    config, workdir, first, second, _ = resumed
    want = flatten(json.loads((workdir / "config.json").read_text()))
    # the config as given, with the data's fingerprint that the run filled in
    assert config.data.fingerprint == "" and want["data.fingerprint"].startswith("sha256:")
    given = {**flatten(config), "data.fingerprint": want["data.fingerprint"]}
    assert want == json.loads(json.dumps(given))
    for session in (first, second):
        assert {k: v for k, v in session.config.items() if not k.startswith("_wandb")} == want


def test_the_summary_holds_the_summarys_numbers_and_per_position_table(resumed):
    _, workdir, first, second, summary = resumed
    assert json.loads((workdir / "summary.json").read_text()) == summary
    scalars = flatten({k: v for k, v in summary.items() if not k.endswith("_per_position")})
    assert "params.non_embedding" in scalars and "val_bits_per_byte" in scalars
    assert {k: second.summary[k] for k in scalars} == scalars
    assert "val_loss" not in first.summary  # the interrupted session had no summary
    # The per-position losses: a table with a row per position, and a line plot of it.
    table_path = second.folder / "files" / second.summary["per_position.path"]
    table = json.loads(table_path.read_text())
    assert table["columns"] == ["position", "val_loss", "test_loss"]
    want = list(
        zip(range(32), summary["val_per_position"], summary["test_per_position"], strict=True)
    )
    assert [tuple(row) for row in table["data"]] == want
    assert "_wandb.visualize.per_position_loss" in second.config


# -- the step handling of an online resume, and failures, with a stand-in for wandb.init -------


class StandInRun:
    """What ``wandb.init`` returns, as far as ``wandb_log`` uses it; ``starting_step`` is
    where an online W&B run's history ends when it is resumed."""

    def __init__(self, starting_step: int = 0, fail: str = ""):
        self.starting_step, self.fail = starting_step, fail
        self.logged, self.summary, self.exit_code = [], {}, None

    def log(self, data, step=None):
        if self.fail == "log":
            raise wandb.errors.CommError("upload stalled")
        self.logged.append((step, data))

    def finish(self, exit_code=None):
        if self.fail == "finish":
            raise wandb.errors.CommError("the service went away")
        self.exit_code = exit_code


def _stand_in(monkeypatch, run: StandInRun) -> list[dict]:
    calls = []
    monkeypatch.setattr(wandb, "init", lambda **options: calls.append(options) or run)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    return calls


def test_an_online_resume_sends_only_the_steps_after_wandbs_history(tmp_path, monkeypatch):
    stand_in = StandInRun(starting_step=7)  # W&B holds steps up to 6; the checkpoint is at 4
    calls = _stand_in(monkeypatch, stand_in)
    (tmp_path / RUN_FILE).write_text('{"id": "abc12345"}')
    config = small()
    config.log.update(wandb=True, wandb_group="grid", wandb_mode="online")
    log = MetricsLog(tmp_path, 4, enabled=True, tensorboard=False, wandb=config)
    for step in range(5, 9):
        log.write("train", {"step": step, "loss": 1.0 / step, "mfu": None})
    log.write("eval", {"step": 8, "val_loss": 0.5})
    log.summary(
        {
            "status": "finished",
            "val_loss": 0.5,
            "params": {"total": 3},
            "val_per_position": [1.0, 0.5],
            "test_per_position": [2.0, 1.0],
        }
    )
    log.close()
    (options,) = calls
    assert options == {
        "id": "abc12345",  # the stored id, resumed
        "resume": "allow",
        "project": None,  # W&B's default: WANDB_PROJECT
        "name": "small",
        "group": "grid",
        "mode": "online",
        "config": flatten(config),
        "dir": str(tmp_path),
    }
    stepped = [(step, data) for step, data in stand_in.logged if step is not None]
    assert stepped == [
        (7, {"train/loss": 1 / 7}),
        (8, {"train/loss": 1 / 8}),
        (8, {"eval/val_loss": 0.5}),
    ]
    # The workdir's own log has every step from the checkpoint on.
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [5, 6, 7, 8]
    ((step, curves),) = [(s, d) for s, d in stand_in.logged if s is None]
    assert sorted(curves) == ["per_position", "per_position_loss"]
    assert curves["per_position"].data == [[0, 1.0, 2.0], [1, 0.5, 1.0]]
    assert stand_in.summary == {"status": "finished", "val_loss": 0.5, "params.total": 3}
    assert stand_in.exit_code == 0


def test_wandb_failures_are_one_line_errors_naming_log_wandb(tmp_path, monkeypatch, capsys):
    def init(**options):
        raise wandb.errors.CommError("Network error (ConnectionError)\nretrying")

    monkeypatch.setattr(wandb, "init", init)
    config = small()
    config.log.wandb = True
    with pytest.raises(LoggingServiceError) as error:
        MetricsLog(tmp_path, 0, enabled=True, tensorboard=False, wandb=config)
    message = str(error.value)
    assert Exit.of(error.value) is Exit.LOGGING_SERVICE  # the command line's one line and 9
    run_id = json.loads((tmp_path / RUN_FILE).read_text())["id"]  # kept for the next try
    assert message.startswith(f"log.wandb: W&B could not start run {run_id} (CommError: Network")
    assert "\n" not in message and "--config.log.wandb_mode=offline" in message

    _stand_in(monkeypatch, StandInRun(fail="log"))
    log = MetricsLog(tmp_path, 0, enabled=True, tensorboard=False, wandb=config)
    with pytest.raises(
        LoggingServiceError, match=rf"^log\.wandb: W&B could not log step 1 of run {run_id} "
    ):
        log.write("train", {"step": 1, "loss": 1.0})
    log.close()

    # A failure to finish is said, not raised: it would hide how the run ended.
    _stand_in(monkeypatch, StandInRun(fail="finish"))
    MetricsLog(tmp_path, 0, enabled=True, tensorboard=False, wandb=config).close()
    assert (
        f"log.wandb: W&B could not finish run {run_id} (CommError: the service"
        in capsys.readouterr().err
    )

    (tmp_path / RUN_FILE).write_text("{")
    with pytest.raises(LoggingServiceError, match=rf"^{tmp_path / RUN_FILE}: cannot be read"):
        MetricsLog(tmp_path, 0, enabled=True, tensorboard=False, wandb=config)


def test_without_the_wandb_package_the_run_stops_before_training(
    byte_corpus, tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    config = small(str(byte_corpus))
    config.log.wandb = True
    with pytest.raises(ConfigError) as error:
        run(config, tmp_path / "work")
    assert (
        str(error.value)
        == MISSING
        == ("log.wandb=true needs the wandb package: pip install -e '.[wandb]'")
    )
    assert not (tmp_path / "work").exists()  # nothing written (and nothing compiled)


# -- config and sweep --------------------------------------------------------------------------


def test_a_sweep_puts_its_trials_that_use_wandb_in_a_group_named_after_it(
    tmp_path, byte_corpus, monkeypatch
):
    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(byte_corpus))
    trials = {
        "plain": {},
        "logged": {"log.wandb": True},
        "own": {"log.wandb": True, "log.wandb_group": "mine"},
    }
    plain, logged, own = load_sweep(write_sweep(tmp_path, trials, name="grid.py")).trials
    assert [t.config.log.wandb_group for t in (plain, logged, own)] == ["", "grid", "mine"]
    # The group is no part of a trial's identity: the same trial without W&B has its folder.
    (without,) = load_sweep(write_sweep(tmp_path, {"logged": {}}, name="other.py")).trials
    assert logged.folder_name == without.folder_name


def test_configs_saved_before_wandb_upgrade_and_a_bad_mode_is_named():
    config = small()
    saved = config.to_dict()
    for key in [k for k in saved["log"] if k.startswith("wandb")]:
        del saved["log"][key]
    with pytest.raises(ConfigError, match=r"missing keys log\.wandb"):
        check(ConfigDict(saved))  # what a sweep worker would meet without the upgrade
    upgraded = upgrade(saved)
    check(ConfigDict(upgraded))
    assert upgraded["log"] == config.log.to_dict()
    assert config_hash(saved) == config_hash(config)  # the old trial folders keep their names
    config.log.wandb_mode = "cloud"
    with pytest.raises(ConfigError, match=r"log\.wandb_mode must be online, offline, disabled"):
        check(config)
