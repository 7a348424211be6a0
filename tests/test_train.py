"""The training loop in-process: schedule, plateau, accumulation, evaluation, logs, failures."""

from __future__ import annotations

import gzip
import json
import math
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small_config import small

from lmuscale import GPT2_VOCAB
from lmuscale.data import open_dataset
from lmuscale.models import build, count_params
from lmuscale.outcomes import DamagedFile
from lmuscale.train import ConfigError, TrainingDiverged, model_config, optim, run
from lmuscale.train import step as step_lib
from lmuscale.train.checkpoint import Checkpoints
from lmuscale.train.config import check


def test_schedule_is_linear_warmup_then_cosine_to_zero():
    lr = optim.cosine(peak=2.0, warmup_steps=10, total_steps=110)
    for s in range(0, 111, 5):
        warm, cosine = 2.0 * s / 10, 0.5 * 2.0 * (1 + math.cos(math.pi * (s - 10) / 100))
        want = warm if s < 10 else cosine
        assert float(lr(s)) == pytest.approx(want, rel=1e-6, abs=1e-7), s
    assert float(lr(10)) == pytest.approx(2.0)
    assert float(lr(60)) == pytest.approx(1.0)
    assert float(lr(110)) == pytest.approx(0.0, abs=1e-7)


def test_plateau_halves_the_scale_after_patience_evaluations_without_improvement():
    c = small().optim
    c.update(plateau_factor=0.5, plateau_patience=2, plateau_rtol=0.01)
    transform = optim.plateau(c)
    state = transform.init({"w": jnp.zeros(3)})
    scales = []
    # 4.97 is not an improvement on 5.0 by 1%; 4.0 is.
    for value in [5.0, 4.97, 4.97, 4.0, 4.0, 3.99, 3.99, 3.99, 3.99]:
        state = optim.plateau_update(transform, state, value)
        scales.append(float(state.scale))
    assert scales == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125]


def _init_and_step(config, microbatches, mesh=None):
    """``(init, mesh, train_step)`` of ``config``: the state's init function, not yet run."""
    config.train.microbatches = microbatches
    model = build(model_config(config.model))
    tx, lr = optim.optimizer(config.optim, config.train.steps)
    plateau = optim.plateau(config.optim)
    init = step_lib.init_fn(model, tx, plateau, 0, config.data.seq_len)
    mesh = mesh or step_lib.make_mesh(1)
    return init, mesh, step_lib.make_train_step(model, tx, lr, mesh, jax.eval_shape(init))


def _setup(config, microbatches, mesh=None):
    init, mesh, train_step = _init_and_step(config, microbatches, mesh)
    return step_lib.init_state(init, mesh), train_step


def test_gradient_accumulation_equals_one_large_batch(byte_corpus):
    from lmuscale.data import TrainBatches

    dataset = open_dataset(byte_corpus)
    batches = TrainBatches(dataset, seq_len=32, global_batch=8, seed=0)
    results = {}
    for micro in (1, 4):
        config = small(str(byte_corpus))
        config.optim.warmup_steps = 0  # every one of the 3 steps updates the parameters
        state, train_step = _setup(config, micro)
        layout = step_lib.MicroBatches(step_lib.make_mesh(1), micro)
        losses = []
        for s in range(3):
            tokens = layout.place(batches(s))
            state, metrics = train_step(state, tokens)
            losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
        results[micro] = (losses, jax.device_get(state["params"]))
    np.testing.assert_allclose(results[1][0], results[4][0], rtol=2e-6)
    flat1, flat4 = (jax.tree.leaves(results[m][1]) for m in (1, 4))
    for a, b in zip(flat1, flat4, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


def test_micro_batches_are_the_batch_cut_into_runs_in_order():
    rows = np.arange(12 * 5, dtype=np.int32).reshape(12, 5)  # 12 windows of T + 1 = 5 tokens
    layout = step_lib.MicroBatches(step_lib.make_mesh(1), 3)
    placed, abstract = layout.place(rows), layout.abstract(global_batch=12, seq_len=4)
    assert (placed.shape, placed.dtype) == (abstract.shape, abstract.dtype) == ((3, 4, 5), "int32")
    assert placed.sharding == abstract.sharding == layout.sharding
    for m in range(3):
        np.testing.assert_array_equal(placed[m], rows[4 * m : 4 * m + 4])


def test_a_bfloat16_paper_model_tracks_its_float32_run(byte_corpus):
    """lmu-55k as the paper configs build it (bfloat16 compute), 20 steps of 4 x 32 bytes at
    the paper's Adam with a 2-step warmup, against the same run in float32. Measured on CPU:
    the losses fall 1.48 nats and differ by at most 1.0e-3 nats (1.0e-4 relative); the bound
    is 5x that. (At 8 x 64 bytes the curves were nearly the same, falling 1.54 nats and
    differing by 0.9e-3, in 4x the step time: the fall is set by the number of steps.)"""
    from lmuscale.data import TrainBatches
    from lmuscale.models import named_config
    from lmuscale.train import base_config

    batches = TrainBatches(open_dataset(byte_corpus), seq_len=32, global_batch=4, seed=0)
    dtypes = ("float32", "bfloat16")
    setups = {}
    for dtype in dtypes:
        config = base_config(named_config("lmu-55k", dtype=dtype, batch_chunk=0))
        config.data.seq_len = 32
        config.optim.warmup_steps = 2
        setups[dtype] = _init_and_step(config, 1)
    # Both initial states in one compiled function: XLA draws the identical parameters once
    # (the draws are most of the time to compile an init), and both runs start from them.
    mesh = setups["float32"][1]
    inits = [setups[dtype][0] for dtype in dtypes]
    shardings = [step_lib.state_shardings(mesh, jax.eval_shape(init)) for init in inits]
    states = jax.jit(lambda: [init() for init in inits], out_shardings=shardings)()
    jax.tree.map(np.testing.assert_array_equal, *jax.device_get(states))
    losses = {}
    for dtype, state in zip(dtypes, states, strict=True):
        train_step = setups[dtype][2]
        losses[dtype] = []
        for s in range(20):
            state, metrics = train_step(state, jnp.asarray(batches(s).reshape(1, 4, 33)))
            losses[dtype].append(float(metrics["loss"]))
        # Parameters and the Adam moments stay float32 whatever the compute dtype.
        for leaf in jax.tree.leaves({k: state[k] for k in ("params", "opt_state")}):
            assert leaf.dtype in (jnp.float32, jnp.int32), (dtype, leaf.dtype)
    f32, bf16 = np.array(losses["float32"]), np.array(losses["bfloat16"])
    assert f32[0] - f32[-1] > 1.0  # the run learns, so tracking means something
    assert np.abs(bf16 - f32).max() < 5e-3
    assert np.abs(bf16 - f32).max() > 0  # and bfloat16 really computed otherwise


@pytest.fixture(scope="module")
def finished(byte_corpus, tmp_path_factory):
    """One complete small run: (config, workdir, summary)."""
    workdir = tmp_path_factory.mktemp("run")
    config = small(str(byte_corpus))
    config.optim.update(plateau_rtol=0.5, plateau_patience=1)  # the plateau scale will move
    config.log.update(profile_start=6, profile_steps=3)  # a trace of steps 6-8
    summary = run(config, workdir)
    return config, workdir, summary


def _final_params(config, workdir):
    model = build(model_config(config.model))
    tx, _ = optim.optimizer(config.optim, config.train.steps)
    init = step_lib.init_fn(model, tx, optim.plateau(config.optim), 0, config.data.seq_len)
    checkpoints = Checkpoints(workdir / "checkpoints", keep=2)
    state, meta = checkpoints.restore(checkpoints.latest_step(), jax.eval_shape(init))
    checkpoints.close()
    return model, state, meta


def test_final_losses_equal_a_direct_evaluation_of_every_window(finished, byte_corpus):
    config, workdir, summary = finished
    model, state, _ = _final_params(config, workdir)
    dataset = open_dataset(byte_corpus)
    for split in ("val", "test"):
        n = dataset.windows(split, 32)
        windows = dataset.read_windows(split, 32, np.arange(n))
        _, per_position = model.apply(
            state["params"], windows[:, :-1], windows[:, 1:], method=model.loss
        )
        per_position = np.asarray(per_position, np.float64)
        assert summary[f"{split}_tokens"] == n * 32
        assert summary[f"{split}_loss"] == pytest.approx(per_position.mean(), rel=1e-5)
        np.testing.assert_allclose(summary[f"{split}_per_position"], per_position.mean(0), 1e-5)
        meta = dataset.meta["splits"][split]
        bits = per_position.mean() / math.log(2) * meta["tokens"] / meta["bytes"]
        assert summary[f"{split}_bits_per_byte"] == pytest.approx(bits, rel=1e-5)
    assert summary["status"] == "finished"
    # What ran for each kernel switch ("auto" in the config), resolved on this CPU.
    assert (summary["loss_impl"], summary["memory_impl"]) == ("xla", "xla")
    assert summary["params"]["non_embedding"] == count_params(model.config).non_embedding
    assert summary["tokens"] == 12 * 8 * 32


def test_metrics_log_every_step_with_its_learning_rate(finished):
    config, workdir, _ = finished
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    evals = [json.loads(line) for line in (workdir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [4, 8, 12]
    # plateau_rtol 0.5, patience 1: each evaluation after the first halves the scale
    assert [e["lr_scale"] for e in evals] == [1.0, 0.5, 0.25]
    lr = optim.cosine(config.optim.learning_rate, 2, 12)
    for r in records:
        scale = 1.0 if r["step"] <= 8 else 0.5  # the scale set by the evaluation before
        assert r["lr"] == pytest.approx(float(lr(r["step"] - 1)) * scale, rel=1e-6, abs=1e-8)
        assert r["tokens"] == r["step"] * 8 * 32
        assert r["grad_norm"] > 0 and r["loss"] > 0 and r["elapsed"] > 0
        assert r["mfu"] is None  # no peak is known for a CPU
    assert all(r["tokens_per_second"] > 0 for r in records[1:])
    assert records[0]["loss"] == pytest.approx(math.log(256), abs=0.1)


def _tensorboard_scalars(folder) -> dict:
    """tag -> {step: value} from TFRecord event files (length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_holds_the_same_scalars(finished):
    _, workdir, _ = finished
    scalars = _tensorboard_scalars(workdir / "tensorboard")
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert scalars["train/loss"] == pytest.approx({r["step"]: r["loss"] for r in records})
    assert sorted(scalars["eval/val_loss"]) == [4, 8, 12]


LINE = re.compile(
    r"^step (\d+)/12: loss (\S+) \((\d+)-step mean (\S+)\), (\S+) tokens/s, .+ elapsed, ETA (.+)$"
)


def test_without_a_terminal_a_line_every_log_step_holds_the_logged_numbers(
    byte_corpus, tmp_path, capsys
):
    config = small(str(byte_corpus))
    config.log.update(every=5, progress=True)  # a bar is asked for, but stderr is captured
    run(config, tmp_path)
    out, err = capsys.readouterr()
    lines = [LINE.match(line) for line in out.splitlines() if LINE.match(line)]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [int(m[1]) for m in lines] == [r["step"] for r in records] == [5, 10, 12]
    for m, r, mean_of in zip(lines, records, (5, 5, 2), strict=True):
        assert float(m[2]) == pytest.approx(r["loss"], abs=5e-5)
        assert (int(m[3]), float(m[4])) == (mean_of, pytest.approx(r["loss_mean"], abs=5e-5))
        assert m[5] == f"{r['tokens_per_second']:,.0f}"
    assert lines[-1][6] == "0 s" and "unknown" not in lines[0][6]
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    val = [float(v) for v in re.findall(r"^step \d+: val loss (\S+) nats", out, re.M)]
    assert val == pytest.approx([e["val_loss"] for e in evals], abs=5e-5) and len(val) == 3
    assert "\r" not in out + err  # no bar


def test_the_time_left_is_this_session_s_pace_since_its_first_step(monkeypatch):
    from types import SimpleNamespace

    from lmuscale.train import loop

    now = [100.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    clock = loop.Clock(elapsed_before=50.0)  # a session resumed after step 2
    assert clock.seconds_left(3, 20) is None
    now[0] = 130.0  # the first step done, compiled: the pace starts here
    clock.restart(3)
    assert clock.seconds_left(3, 20) is None
    now[0] = 140.0
    clock.restart(7)  # after a hook: the pace still counts from step 3
    now[0] = 142.0
    assert clock.seconds_left(9, 20) == pytest.approx(12.0 / 6 * 11)
    assert clock.elapsed() == pytest.approx(50.0 + 42.0)


def test_the_demo_writes_tensorboard_events_in_the_folders_it_had():
    """Its trials log to TensorBoard (which ``test_tensorboard_holds_the_same_scalars`` reads
    back), and turning that on left every trial's hash, so its folder, as it was."""
    from pathlib import Path

    from lmuscale.sweep import config_hash, load_sweep

    sweep = load_sweep(Path(__file__).resolve().parent.parent / "sweeps" / "demo.py")
    for trial in sweep.trials:
        assert trial.config.log.tensorboard
        before = trial.config.copy_and_resolve_references()
        before.log.tensorboard = False
        assert config_hash(before) == trial.key


def test_the_profile_traces_exactly_the_chosen_steps(finished):
    _, workdir, _ = finished
    traces = list((workdir / "profile").glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert len(traces) == 1, traces
    assert list(traces[0].parent.glob("*.xplane.pb"))  # TensorBoard's profile plugin reads it
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    steps = sorted(
        int(e["args"]["step_num"])
        for e in events
        if e.get("name") == "train" and "step_num" in e.get("args", {})
    )
    assert steps == [6, 7, 8]
    # The devices' side is there too: the compiled step's kernels (XLA's fusions) ran.
    assert any("fusion" in e.get("name", "") for e in events if e.get("ph") == "X")


def test_a_session_resumed_past_the_profiled_steps_traces_nothing_and_says_so(tmp_path, capsys):
    from lmuscale.train.profile import StepTrace

    trace = StepTrace(tmp_path, start=3, count=2, resumed_at=6, last=12, primary=True)
    assert "steps 3-4 were done before this session" in capsys.readouterr().out
    for step in range(7, 13):
        trace.before(step, None)
        assert not trace.running
    assert not (tmp_path / "profile").exists()
    # A session resumed inside the range traces the steps left.
    assert [s for s in range(1, 13) if StepTrace(tmp_path, 3, 4, 4, 12, False).wanted(s)] == [5, 6]


def test_a_profile_after_the_last_step_is_refused(byte_corpus):
    config = small(str(byte_corpus))
    config.log.update(profile_start=13, profile_steps=2)
    with pytest.raises(ConfigError, match=r"log.profile_start \(13\) is after the last step"):
        check(config)


def test_a_finished_run_is_not_run_again(finished):
    config, workdir, summary = finished
    before = (workdir / "metrics.jsonl").read_bytes()
    assert run(config, workdir) == summary
    assert (workdir / "metrics.jsonl").read_bytes() == before


def test_a_resume_names_a_torn_middle_line_and_drops_a_torn_last_one(finished, tmp_path):
    config, done, _ = finished
    workdir = tmp_path / "run"
    shutil.copytree(done, workdir)
    (workdir / "summary.json").unlink()
    shutil.rmtree(workdir / "checkpoints" / "12")  # the run resumes from step 8
    metrics = workdir / "metrics.jsonl"
    whole = metrics.read_bytes()
    lines = whole.splitlines(keepends=True)
    metrics.write_bytes(b"".join(lines[:2]) + lines[2][:15] + b"".join(lines[3:]))
    damaged = metrics.read_bytes()
    with pytest.raises(DamagedFile, match=rf"{re.escape(str(metrics))}:3: not a JSON log line"):
        run(config, workdir)
    assert metrics.read_bytes() == damaged

    metrics.write_bytes(whole + b'{"step": 13, "lo')  # mended, and a kill's torn last line
    run(config, workdir)
    assert metrics.read_bytes()[: len(b"".join(lines[:8]))] == b"".join(lines[:8])
    logs = {
        "metrics.jsonl": ("step", "loss", "lr", "grad_norm", "param_norm", "tokens"),
        "eval.jsonl": ("step", "val_loss", "lr_scale"),
    }
    for name, keys in logs.items():  # the resumed steps equal the first run's
        want = [json.loads(line) for line in (done / name).open()]
        got = [json.loads(line) for line in (workdir / name).open()]
        assert [[r.get(k) for k in keys] for r in got] == [[r.get(k) for k in keys] for r in want]
    assert not [p.name for p in workdir.iterdir() if p.name.startswith(".")]


# A program lowered for compilation, or compiled. The suite compiles through a persistent cache
# (conftest.py): a program read from it is still lowered first (jax 0.10 also reports the read
# as a backend compile, which the lowering event does not depend on).
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
COMPILATIONS: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *args, **kwargs: COMPILATIONS.append(name) if name in COMPILE_EVENTS else None
)


def test_the_compilation_listener_sees_compilations():
    COMPILATIONS.clear()
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0))
    assert COMPILE_EVENTS[0] in COMPILATIONS  # lowered, whether the cache held it or not


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"data.path": "{missing}"}, r"no dataset at .*missing; prepare one with"),
        ({"data.tokenizer": "gpt2"}, r"meta\.json: the dataset was tokenised with 'bytes' but"),
        ({"model.vocab_size": 512}, r"meta\.json: the dataset's vocabulary has 256 ids .* 512"),
        ({"data.seq_len": 100_000}, r"data: .*val\.bin: the val split has \d+ tokens, fewer than"),
        ({"data.path": ""}, r"data\.path is empty"),
        (
            {"data.path": "{missing}", "data.source": "shakespeare"},
            r"no dataset at .*missing; set --config\.data\.prepare=true to prepare the embedded",
        ),
        ({"data.prepare": True, "data.source": "text"}, r"data\.prepare is for the embedded"),
        ({"data.fingerprint": "sha256:0"}, r"fingerprint is sha256:\w+, but data\.fingerprint"),
    ],
)
def test_bad_datasets_are_rejected_before_anything_compiles(
    byte_corpus, tmp_path, changes, message
):
    config = small(str(byte_corpus))
    for key, value in changes.items():
        section, name = key.split(".")
        config[section][name] = (
            value.format(missing=tmp_path / "missing") if isinstance(value, str) else value
        )
    COMPILATIONS.clear()
    with pytest.raises(ConfigError, match=message):
        run(config, tmp_path / "work")
    assert not COMPILATIONS
    assert not (tmp_path / "work").exists() and not (tmp_path / "missing").exists()


def test_a_dataset_prepared_from_another_source_than_the_config_says_is_refused(
    datafiles, tmp_path
):
    # A GPT-2 corpus made from text files, given to a config that says it is OpenWebText2.
    from lmuscale.data.prepare import prepare

    texts = datafiles.jsonl("docs.jsonl", datafiles.texts(400, words=10))
    prepare("text", [str(texts)], out=tmp_path / "gpt2", tokenizer="gpt2", progress=False)
    config = small(str(tmp_path / "gpt2"))
    config.data.update(tokenizer="gpt2", source="owt2")
    config.model.vocab_size = GPT2_VOCAB
    message = r"gpt2/meta\.json: the dataset was prepared from 'text' but data\.source is 'owt2'"
    with pytest.raises(ConfigError, match=message):
        run(config, tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(byte_corpus, tmp_path):
    config = small(str(byte_corpus))
    # warmup step 0 has lr 0; step 1 has lr 2.5e37: the parameters overflow at step 2
    config.optim.update(learning_rate=1e38, warmup_steps=4)
    config.checkpoint.every = 1
    with pytest.raises(TrainingDiverged, match=r"diverged at step 2: .*last good checkpoint is"):
        run(config, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["step"] == 2
    assert Checkpoints(tmp_path / "checkpoints", keep=2).latest_step() == 1
    _, state, _ = _final_params(config, tmp_path)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(state["params"]))


def test_each_action_fires_at_its_period_and_again_on_resume(byte_corpus, tmp_path, monkeypatch):
    import signal

    from lmuscale.train import TrainingInterrupted, loop

    fired = []

    def spy(name):
        original = getattr(loop.Session, name)

        def action(self, done, *args):
            fired.append((name, done))
            if (name, done) == ("log_step", 6) and len(fired) < 10:
                signal.raise_signal(signal.SIGTERM)  # a scheduler's notice, mid-run
            return original(self, done, *args)

        monkeypatch.setattr(loop.Session, name, action)

    for name in ("log_step", "validate", "checkpoint", "stop"):
        spy(name)
    config = small(str(byte_corpus))
    config.train.steps = 12
    config.log.every, config.eval.every = 3, 4
    config.checkpoint.update(every=5, keep=10)

    with pytest.raises(TrainingInterrupted, match="SIGTERM received: stopped after step 6"):
        run(config, tmp_path)
    first = list(fired)
    # The stop action checkpoints through the checkpoint action.
    assert first == [
        ("log_step", 3),
        ("validate", 4),
        ("checkpoint", 5),
        ("log_step", 6),
        ("stop", 6),
        ("checkpoint", 6),
    ]
    fired.clear()
    summary = run(config, tmp_path)
    assert fired == [
        ("validate", 8),
        ("log_step", 9),
        ("checkpoint", 10),
        ("log_step", 12),
        ("validate", 12),
        ("checkpoint", 12),
    ]
    assert summary["status"] == "finished"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    evaluated = [json.loads(line)["step"] for line in (tmp_path / "eval.jsonl").open()]
    assert [r["step"] for r in records] == [3, 6, 9, 12] and evaluated == [4, 8, 12]
    # Each session's first step starts the clock, so even its first log line has a speed.
    assert all(r["tokens_per_second"] > 0 for r in records)
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [5, 6, 10, 12]


# Wall-clock numbers: the only ones a stop and a resume may change.
TIMINGS = ("elapsed", "tokens_per_second", "mfu", "wall_seconds")


def _numbers(workdir) -> dict:
    """Every logged and summarised number of a run but its timings."""
    logs = {
        name: [
            {k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            for line in (workdir / name).open()
        ]
        for name in ("metrics.jsonl", "eval.jsonl")
    }
    summary = json.loads((workdir / "summary.json").read_text())
    return {**logs, "summary": {k: v for k, v in summary.items() if k not in TIMINGS}}


def _windowed(data_path):
    """Log lines every 5 steps, so a line's loss_mean is the mean of 5 steps' losses."""
    config = small(str(data_path))
    config.train.steps = 20
    config.log.every, config.eval.every = 5, 7
    config.checkpoint.update(every=4, keep=10)
    return config


@pytest.fixture(scope="module")
def windowed_whole(byte_corpus, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("windowed")
    run(_windowed(byte_corpus), workdir)
    return _numbers(workdir)


@pytest.mark.parametrize("resume_from", [14, 12])
def test_a_stop_between_two_log_lines_changes_no_logged_number(
    byte_corpus, tmp_path, monkeypatch, windowed_whole, resume_from
):
    """Ctrl-C after step 14, between the log lines of steps 10 and 15; the run resumes from
    the stop's checkpoint (14), or, as after a kill, from the periodic one before it (12)."""
    import signal

    from lmuscale.train import TrainingInterrupted, loop

    validate = loop.Session.validate

    def validate_then_ctrl_c(self, done):
        validate(self, done)
        if done == 14 and self.start == 0:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(loop.Session, "validate", validate_then_ctrl_c)
    config = _windowed(byte_corpus)
    with pytest.raises(TrainingInterrupted, match="SIGINT received: stopped after step 14"):
        run(config, tmp_path)
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [4, 8, 12, 14]
    for step in saved:
        if step > resume_from:
            shutil.rmtree(tmp_path / "checkpoints" / str(step))
    run(config, tmp_path)
    got = _numbers(tmp_path)
    assert [r["step"] for r in got["metrics.jsonl"]] == [5, 10, 15, 20]
    step_15 = windowed_whole["metrics.jsonl"][2]
    assert step_15["loss_mean"] != step_15["loss"]  # the mean of 5 steps, not of the last
    for name, numbers in windowed_whole.items():
        assert got[name] == numbers, name
