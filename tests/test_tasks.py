"""The parallel-LMU paper's tasks: the Mackey-Glass generator against a high-accuracy
integration, the psMNIST and IMDB readers on stand-in files, exact resume, and each
experiment's command end to end on tiny stand-in data (and its clean failure without data)."""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from scipy.integrate import solve_ivp

from lmuscale.outcomes import DamagedFile, Exit, WorkdirBusy
from lmuscale.tasks import imdb, mackey_glass, psmnist, run_task
from lmuscale.tasks import train as task_train
from lmuscale.tasks.__main__ import main
from lmuscale.tasks.base import TaskDataError
from lmuscale.tasks.config import base_config
from lmuscale.train.checkpoint import CheckpointError, Checkpoints
from lmuscale.train.config import ConfigError, override
from lmuscale.workdir import Lock, has_checkpoint

# ---------------------------------------------------------------- Mackey-Glass


def method_of_steps(x0: float, until: float, tau: float = 17.0):
    """x(t) from DOP853 at rtol 1e-12, one delay interval at a time: on [k tau, (k+1) tau]
    the delayed term is the previous interval's dense output, so this is an ODE."""
    pieces = []
    for k in range(int(np.ceil(until / tau))):
        previous = pieces[-1] if pieces else None

        def delayed(t, previous=previous):
            return x0 if previous is None else previous(t - tau)[0]

        start = x0 if previous is None else previous(k * tau)[0]
        solution = solve_ivp(
            lambda t, x, delayed=delayed: mackey_glass.rhs(x, delayed(t)),
            (k * tau, (k + 1) * tau),
            [start],
            method="DOP853",
            rtol=1e-12,
            atol=1e-12,
            dense_output=True,
        )
        pieces.append(solution.sol)
    return lambda t: pieces[min(int(t // tau), len(pieces) - 1)](t)[0]


def test_mackey_glass_matches_a_high_accuracy_integration():
    exact = method_of_steps(1.2, 300.0)
    times = (10.0, 17.0, 34.0, 50.0, 100.0, 200.0, 300.0)
    errors = {}
    for h in (0.1, 0.05):
        t, x = mackey_glass.integrate(1.2, 300.0, h=h)
        assert t[-1] == pytest.approx(300.0)
        errors[h] = np.array([abs(x[round(s / h)] - exact(s)) for s in times])
    assert errors[0.1].max() < 1e-8, errors[0.1]
    # Fourth order: halving the step divides the error by ~16.
    assert errors[0.1].max() / errors[0.05].max() > 10


def test_several_histories_integrate_as_independent_series():
    _, together = mackey_glass.integrate(np.array([0.8, 1.2]), 60.0)
    _, alone = mackey_glass.integrate(0.8, 60.0)
    np.testing.assert_array_equal(together[:, 0], alone)
    with pytest.raises(ValueError, match="must divide tau"):
        mackey_glass.integrate(1.2, 10.0, h=0.3)


def test_mackey_glass_task_predicts_fifteen_steps_ahead_on_disjoint_series():
    data = base_config("mackey_glass", kind="lstm", lstm_units=2).data
    data.update(train=6, val=2, test=3, length=120)
    splits = mackey_glass.load(data)
    assert [len(s) for s in (splits.train, splits.val, splits.test)] == [6, 2, 3]
    for split in (splits.train, splits.test):
        assert split.inputs.shape == (len(split), 120, 1)
        np.testing.assert_array_equal(split.targets[:, :-15], split.inputs[:, 15:])
    whole = np.concatenate([splits.train.inputs, splits.train.targets[:, -15:]], axis=1)
    assert abs(whole.mean()) < 1e-5 and abs(whole.std() - 1) < 1e-5  # standardised on train
    first = np.concatenate([s.inputs[:, 0, 0] for s in (splits.train, splits.val, splits.test)])
    assert len(np.unique(first)) == 11  # every series differs


# ---------------------------------------------------------------- stand-in data files


def write_idx(path, array: np.ndarray, compress: bool = False):
    magic = 0x0801 if array.ndim == 1 else 0x0803
    header = magic.to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def mnist_standin(folder, train: int = 120, test: int = 40, seed: int = 0):
    """Digit c is an image of mean brightness ~ 20 c, with noise: learnable in a few epochs."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, count, compress in (("train", train, True), ("t10k", test, False)):
        labels = rng.integers(0, 10, count)
        images = np.clip(20 * labels[:, None, None] + rng.normal(30, 8, (count, 28, 28)), 0, 255)
        write_idx(folder / f"{prefix}-images-idx3-ubyte", images, compress)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, compress)
    return folder


def test_psmnist_reads_idx_files_in_a_fixed_permuted_order(tmp_path):
    folder = mnist_standin(tmp_path / "mnist")
    data = base_config("psmnist", kind="lmu").data
    data.update(path=str(folder), val=20)
    splits = psmnist.load(data)
    assert [len(s) for s in (splits.train, splits.val, splits.test)] == [100, 20, 40]
    assert splits.train.inputs.shape == (100, 784, 1) and splits.train.targets.dtype == np.int32
    raw = psmnist.read_idx(folder / "t10k-images-idx3-ubyte", 3)
    order = np.random.default_rng(0).permutation(784)
    np.testing.assert_allclose(splits.test.inputs[3, :, 0], raw[3].reshape(-1)[order] / 255.0)
    assert not np.array_equal(order, np.arange(784))
    data.permutation_seed = 1
    assert not np.array_equal(psmnist.load(data).test.inputs, splits.test.inputs)


def test_psmnist_names_a_broken_or_missing_file(tmp_path):
    folder = mnist_standin(tmp_path / "mnist")
    (folder / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x03junk")
    data = base_config("psmnist", kind="lmu").data
    data.update(path=str(folder), val=20)
    with pytest.raises(TaskDataError, match="t10k-labels-idx1-ubyte: not an idx file"):
        psmnist.load(data)
    (folder / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(TaskDataError, match="not t10k-labels-idx1-ubyte"):
        psmnist.load(data)


def test_psmnist_reads_a_tfds_copy_without_downloading(tmp_path, monkeypatch):
    """tensorflow-datasets is optional and not installed here: a stand-in module records how
    it is called (the real one's API: load(..., download=False, batch_size=-1), as_numpy)."""
    images = np.arange(30 * 28 * 28, dtype=np.uint8).reshape(30, 28, 28, 1)
    calls = []

    def load(name, split, data_dir, download, batch_size):
        calls.append((name, split, data_dir, download, batch_size))
        return {"image": images, "label": np.arange(30) % 10}

    fake = types.SimpleNamespace(load=load, as_numpy=lambda tree: tree)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", fake)
    (tmp_path / "mnist").mkdir()
    data = base_config("psmnist", kind="lmu").data
    data.update(path=str(tmp_path), val=5)
    splits = psmnist.load(data)
    assert [c[1] for c in calls] == ["train", "test"]
    assert all(c[0] == "mnist" and c[3] is False and c[4] == -1 for c in calls)
    assert [len(splits.train), len(splits.val), len(splits.test)] == [25, 5, 30]
    np.testing.assert_array_equal(splits.val.targets, np.arange(25, 30) % 10)


def review(rng, words: list[str], sentiment: str) -> str:
    return " ".join([sentiment] * 3 + list(rng.choice(words, 12))) + "<br />The End."


def imdb_standin(tmp_path, per_class: int = 30):
    """The same reviews as an aclImdb folder and as Keras's imdb.npz (word ranks)."""
    rng = np.random.default_rng(0)
    filler = ["the", "a", "film", "plot", "actor", "scene", "and", "of"]
    folder = tmp_path / "aclImdb"
    texts = {}
    for split in ("train", "test"):
        texts[split] = []
        for label, name, word in ((0, "neg", "awful"), (1, "pos", "great")):
            (folder / split / name).mkdir(parents=True)
            for i in range(per_class):
                text = review(rng, filler, word)
                (folder / split / name / f"{i:03d}_1.txt").write_text(text)
                texts[split].append((imdb.words(text), label))
    counts = {}
    for words, _ in texts["train"]:
        for w in words:
            counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    rank = {w: r for r, w in enumerate(ranked, 1)}
    arrays = {}
    for split in ("train", "test"):
        arrays[f"x_{split}"] = np.array(
            [[rank[w] for w in words] for words, _ in texts[split]], dtype=object
        )
        arrays[f"y_{split}"] = np.array([label for _, label in texts[split]])
    np.savez(tmp_path / "imdb.npz", **arrays)
    return folder, tmp_path / "imdb.npz"


def test_imdb_folder_and_npz_give_the_same_tokens(tmp_path):
    folder, npz = imdb_standin(tmp_path)
    data = base_config("imdb", kind="lmu", vocab_size=8, embed_dim=2).data
    data.update(path=str(folder), val=10, vocab=8, maxlen=12)
    from_folder = imdb.load(data)
    data.path = str(npz)
    from_npz = imdb.load(data)
    for name in ("train", "val", "test"):
        a, b = getattr(from_folder, name), getattr(from_npz, name)
        np.testing.assert_array_equal(a.inputs, b.inputs)
        np.testing.assert_array_equal(a.targets, b.targets)
    assert [len(from_npz.train), len(from_npz.val), len(from_npz.test)] == [50, 10, 60]
    tokens = from_npz.test.inputs
    assert tokens.shape == (60, 12) and tokens.max() < 8 and (tokens == imdb.OOV).any()
    assert not (tokens == 3).any()  # Keras leaves token 3 unused


def test_imdb_encoding_follows_keras():
    # Keras's load_data(num_words=10): rank r is token r + 3, kept while below 10.
    assert imdb.encode([1, 2, 6, 7, 30], vocab=10) == [imdb.START, 4, 5, 9, imdb.OOV, imdb.OOV]
    np.testing.assert_array_equal(imdb.pad([[5, 6, 7], [8]], 2), [[6, 7], [0, 8]])
    assert imdb.words("Great film!<br />It's 10/10") == ["great", "film", "it's", "10", "10"]


# ---------------------------------------------------------------- training and the commands


def tiny_mackey_glass(epochs: int, kind: str = "lmu"):
    model = (
        dict(kind="lmu", units=8, order=6, theta=10.0, memory_dim=1, hidden=4)
        if kind == "lmu"
        else dict(kind="lstm", lstm_units=4)
    )
    config = base_config("mackey_glass", **model)
    config.name = kind
    config.data.update(train=8, val=2, test=2, length=48, washout=100.0)
    config.train.update(epochs=epochs, batch_size=4)
    return config


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    whole = run_task(tiny_mackey_glass(3), tmp_path / "whole", progress=False)
    run_task(tiny_mackey_glass(1), tmp_path / "parts", progress=False)
    # The same run asked for more epochs: not allowed in place, so continue from a copy whose
    # config says 3 epochs and whose checkpoint is at epoch 1.
    parts = tmp_path / "parts"
    (parts / "summary.json").unlink()
    config_json = json.loads((parts / "config.json").read_text())
    config_json["train"]["epochs"] = 3
    (parts / "config.json").write_text(json.dumps(config_json))
    resumed = run_task(tiny_mackey_glass(3), parts, progress=False)
    for key in ("test_nrmse", "val_nrmse", "best_epoch", "params"):
        assert resumed[key] == whole[key], key
    lines = (parts / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]


def test_a_kill_between_the_metrics_and_the_checkpoint_loses_nothing(tmp_path, monkeypatch):
    whole = run_task(tiny_mackey_glass(3), tmp_path / "whole", progress=False)
    saves = []
    save = task_train.Checkpoints.save

    def dies_at_the_second_checkpoint(self, step, state, meta):
        saves.append(step)
        if len(saves) == 2:
            raise KeyboardInterrupt  # killed after epoch 2's metrics, before its checkpoint
        save(self, step, state, meta)

    monkeypatch.setattr(task_train.Checkpoints, "save", dies_at_the_second_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        run_task(tiny_mackey_glass(3), tmp_path / "killed", progress=False)
    monkeypatch.undo()
    rows = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2  # one row ahead of the checkpoint (epoch 1)
    resumed = run_task(tiny_mackey_glass(3), tmp_path / "killed", progress=False)
    assert resumed["test_nrmse"] == whole["test_nrmse"]
    killed = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    expected = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    strip = lambda rows: [{k: v for k, v in json.loads(r).items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(killed) == strip(expected)


def test_a_damaged_metrics_row_is_named_not_dropped(tmp_path):
    run_task(tiny_mackey_glass(2), tmp_path / "run", progress=False)
    (tmp_path / "run" / "summary.json").unlink()
    metrics = tmp_path / "run" / "metrics.jsonl"
    first, second = metrics.read_bytes().splitlines()
    metrics.write_bytes(first[:-9] + b"\n" + second + b"\n")
    with pytest.raises(DamagedFile, match=rf"^{metrics}:1: not a JSON log line"):
        run_task(tiny_mackey_glass(2), tmp_path / "run", progress=False)
    assert metrics.read_bytes().splitlines()[1] == second  # left as it was


def test_a_workdir_of_another_config_is_refused(tmp_path):
    run_task(tiny_mackey_glass(1), tmp_path, progress=False)
    config = tiny_mackey_glass(1)
    config.train.learning_rate = 0.01
    with pytest.raises(ConfigError, match=r"differs in train\.learning_rate"):
        run_task(config, tmp_path, progress=False)


def test_config_keys_and_types_are_checked():
    config = tiny_mackey_glass(1)
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.epoch'.*'train\.epochs'"):
        override(config, ["train.epoch=3"])
    with pytest.raises(ConfigError, match=r"model: model\.lstm_units must be > 0"):
        base_config_check(dict(kind="lstm"))
    with pytest.raises(ConfigError, match=r"model\.mode must be 'fft' or 'scan', got 'ffft'"):
        base_config_check(dict(mode="ffft"))
    with pytest.raises(ConfigError, match="unknown activation 'swish'"):
        base_config_check(dict(output_activation="swish"))
    with pytest.raises(ConfigError, match=r"model\.memory_dim must be >= 0"):
        base_config_check(dict(memory_dim=-3))


@pytest.mark.parametrize("lr", ["0", "-1", "inf", "nan"])
def test_a_learning_rate_that_is_not_finite_and_positive_is_refused(lr):
    from lmuscale.tasks.config import check

    config = tiny_mackey_glass(1)
    config.train.learning_rate = float(lr)
    message = rf"train\.learning_rate must be finite and > 0, got {float(lr)!r}$"
    with pytest.raises(ConfigError, match=message):
        check(config)


def base_config_check(model):
    from lmuscale.tasks.config import check

    config = base_config("mackey_glass", kind="lmu")
    config.model.update(model)
    check(config)


def test_mackey_glass_command_trains_both_models(tmp_path, capsys, monkeypatch):
    experiment = tmp_path / "mg.py"
    experiment.write_text(
        "from test_tasks import tiny_mackey_glass\n"
        "NAMES = ('lmu', 'lstm')\n"
        "def get_config(name):\n"
        "    return tiny_mackey_glass(4, name)\n"
    )
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    assert main([str(experiment), "--workdir", str(tmp_path / "w"), "--quiet"]) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "w" / "results.json").read_text())
    assert [r["name"] for r in results] == ["lmu", "lstm"]
    for r in results:
        assert 0 < r["test_nrmse"] < 1.5 and r["params"] > 0
        assert f"{r['test_nrmse']:.4f}" in out
    assert "LSTM 0.059, LMU 0.049, parallel LMU 0.044" in out


def test_the_real_experiment_files_load():
    from lmuscale.tasks.config import check
    from lmuscale.train.config import load

    lmu = load("experiments/mackey_glass.py:lmu", check)
    assert (lmu.model.order, lmu.model.theta, lmu.model.units, lmu.model.hidden) == (
        40,
        50,
        140,
        80,
    )
    assert load("experiments/psmnist.py:lmu", check).model.theta == 784
    imdb_config = load("experiments/imdb.py:lmu", check)
    assert (imdb_config.model.order, imdb_config.model.theta) == (1, imdb_config.data.maxlen)


def test_psmnist_command_runs_on_stand_in_data_and_learns(tmp_path, capsys):
    folder = mnist_standin(tmp_path / "mnist", train=300, test=100)
    args = [
        "experiments/psmnist.py",
        "--workdir",
        str(tmp_path / "w"),
        "--quiet",
        f"--config.data.path={folder}",
        "--config.data.val=50",
        "--config.model.order=16",
        "--config.model.units=32",
        "--config.train.epochs=8",
        "--config.train.batch_size=25",
        "--config.train.learning_rate=0.01",
    ]
    assert main(args) == 0
    summary = json.loads((tmp_path / "w" / "lmu" / "summary.json").read_text())
    assert summary["test_accuracy"] >= 25  # chance is 10%; this run measured 40%
    assert summary["params"] == (1 + 1) + (16 + 1 + 1) * 32 + (32 + 1) * 10
    assert "parallel LMU 98.49" in capsys.readouterr().out


def test_imdb_command_runs_on_stand_in_data(tmp_path, capsys):
    _, npz = imdb_standin(tmp_path, per_class=60)
    args = [
        "experiments/imdb.py",
        "--workdir",
        str(tmp_path / "w"),
        "--quiet",
        f"--config.data.path={npz}",
        "--config.data.val=20",
        "--config.data.maxlen=24",
        "--config.model.theta=24",
        "--config.train.epochs=5",
        "--config.train.batch_size=10",
        "--config.train.learning_rate=0.05",
    ]
    assert main(args) == 0
    summary = json.loads((tmp_path / "w" / "lmu" / "summary.json").read_text())
    assert summary["test_accuracy"] >= 90  # "great" or "awful" decides every review
    assert summary["params"] == 20_000 * 16 + 16 + 1
    assert "89.1" in capsys.readouterr().out


def test_bad_data_files_and_values_are_named_without_a_traceback(tmp_path, capsys):
    broken = tmp_path / "imdb.npz"
    broken.write_bytes(b"not a zip at all")
    args = ["experiments/imdb.py", "--workdir", str(tmp_path / "w")]
    assert main([*args, f"--config.data.path={broken}"]) == Exit.DATA
    assert f"{broken}: not an .npz (zip) file" in capsys.readouterr().err
    _, npz = imdb_standin(tmp_path)
    npz.write_bytes(npz.read_bytes()[:200])  # truncated
    assert main([*args, f"--config.data.path={npz}"]) == Exit.DATA
    err = capsys.readouterr().err
    assert f"{npz}: not" in err and "Traceback" not in err
    # A bad value fails before any training, and the corrected run may use the same workdir.
    horizon = ["experiments/mackey_glass.py:lmu", *args[1:], "--config.data.horizon=0"]
    assert main(horizon) == Exit.CONFIG
    assert "data: horizon must be in 1.." in capsys.readouterr().err
    assert not has_checkpoint(tmp_path / "w" / "lmu")


@pytest.mark.parametrize("experiment", ["psmnist", "imdb"])
def test_commands_without_their_dataset_fail_cleanly(tmp_path, capsys, experiment):
    args = [f"experiments/{experiment}.py", "--workdir", str(tmp_path / "w")]
    assert main([*args, f"--config.data.path={tmp_path / 'nothing'}"]) == Exit.DATA
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert str(tmp_path / "nothing") in err and "never downloads" in err
    assert not (tmp_path / "w" / "lmu" / "summary.json").exists()


def test_a_finished_run_is_returned_without_training_even_from_an_older_summary(tmp_path):
    summary = run_task(tiny_mackey_glass(1), tmp_path, progress=False)
    assert summary["status"] == "finished"
    # Task summaries written before they had a status are finished runs too.
    del summary["status"]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    shutil.rmtree(tmp_path / "checkpoints")
    assert run_task(tiny_mackey_glass(1), tmp_path, progress=False) == summary
    assert not (tmp_path / "checkpoints").exists()


KILLED_TASK = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_tasks import tiny_mackey_glass
from lmuscale.tasks import train
save = train.Checkpoints.save
def save_then_die(self, step, state, meta):
    save(self, step, state, meta)
    if step == 2:
        self.wait()
        os.kill(os.getpid(), signal.SIGKILL)  # as a scheduler or the OOM killer would
train.Checkpoints.save = save_then_die
train.run_task(tiny_mackey_glass(3), {workdir!r}, progress=False)
"""


def test_a_killed_task_run_resumes_bit_identically(tmp_path):
    whole = run_task(tiny_mackey_glass(3), tmp_path / "whole", progress=False)
    script = KILLED_TASK.format(tests=str(Path(__file__).parent), workdir=str(tmp_path / "k"))
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert sorted(p.name for p in (tmp_path / "k" / "checkpoints").iterdir()) == ["1", "2"]
    assert not (tmp_path / "k" / "summary.json").exists()
    resumed = run_task(tiny_mackey_glass(3), tmp_path / "k", progress=False)
    assert resumed == {**whole, "train_seconds": resumed["train_seconds"]}
    for name in ("whole", "k"):  # the parameters of the last epoch, bit for bit
        assert (tmp_path / name / "checkpoints" / "3" / "meta").is_dir()
    restored = [
        Checkpoints(tmp_path / name / "checkpoints", keep=2).restore_latest(None)
        for name in ("whole", "k")
    ]
    leaves = [jax.tree.leaves(state) for _, state, _ in restored]
    assert len(leaves[0]) == len(leaves[1]) > 0
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_second_task_run_on_a_live_workdir_is_refused(tmp_path):
    (tmp_path / "w").mkdir()
    busy = rf"workdir {tmp_path / 'w'} is in use by pid "
    with Lock(tmp_path / "w"), pytest.raises(WorkdirBusy, match=busy):
        run_task(tiny_mackey_glass(1), tmp_path / "w", progress=False)
    assert not has_checkpoint(tmp_path / "w")


def test_a_task_checkpoint_from_before_orbax_is_refused_by_name(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "checkpoint.msgpack").write_bytes(b"\x85")
    with pytest.raises(CheckpointError, match=r"checkpoint.msgpack: a task checkpoint of lm"):
        run_task(tiny_mackey_glass(1), tmp_path / "w", progress=False)
