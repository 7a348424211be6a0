"""How a run ends: one table of outcomes, and every command line ending through it."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmuscale import outcomes
from lmuscale.data import DataError
from lmuscale.outcomes import (
    DamagedFile,
    Exit,
    TrainingDiverged,
    WorkdirBusy,
    exit_table,
    one_line,
    run_main,
)
from lmuscale.tasks import TaskDataError
from lmuscale.train.checkpoint import CheckpointError
from lmuscale.train.config import ConfigError
from lmuscale.train.memory import OutOfMemoryBudget
from lmuscale.workdir import Lock

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def test_each_outcome_has_one_class_and_no_class_is_another_outcome():
    classes = [outcome.error for outcome in Exit if outcome.error is not None]
    assert len(set(classes)) == len(classes)
    for a, b in itertools.permutations(classes, 2):
        assert not issubclass(a, b), f"{a.__name__} is a {b.__name__}"
    assert {outcome.word for outcome in Exit} == {"", "error", "stopped"}


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (ConfigError("x"), Exit.CONFIG),
        (DataError("x"), Exit.DATA),
        (TaskDataError("x"), Exit.DATA),
        (WorkdirBusy("x"), Exit.BUSY),
        (OutOfMemoryBudget("x"), Exit.MEMORY),
        (DamagedFile("x"), Exit.IO),
        (CheckpointError("x"), Exit.IO),
        (CheckpointError("x", damaged=True), Exit.IO),
        (outcomes.StorageError("x"), Exit.IO),
        (outcomes.LoggingServiceError("x"), Exit.LOGGING_SERVICE),
        (TrainingDiverged("x"), Exit.DIVERGED),
        (outcomes.LostProcess("x"), Exit.LOST_PROCESS),
        (outcomes.TrainingInterrupted("x", "SIGTERM"), Exit.STOPPED),
        (outcomes.TrainingInterrupted("x", "SIGUSR1"), Exit.STOPPED),
        (outcomes.TrainingInterrupted("x", "SIGINT"), Exit.INTERRUPTED),
        (KeyboardInterrupt(), Exit.INTERRUPTED),
        (ValueError("x"), None),
    ],
)
def test_errors_map_to_their_outcome(error, outcome):
    assert Exit.of(error) is outcome


def test_the_codes_that_scripts_and_runners_already_read_are_kept():
    """train's and the sweep worker's statuses before the table, and argparse's 2."""
    assert (Exit.FINISHED, Exit.CONFIG, Exit.ARGUMENTS, Exit.DIVERGED) == (0, 1, 2, 3)
    assert (Exit.STOPPED, Exit.LOST_PROCESS, Exit.BUSY, Exit.INTERRUPTED) == (4, 5, 75, 130)


def test_config_error_is_a_config_error_and_nothing_else():
    errors = (WorkdirBusy, OutOfMemoryBudget, DamagedFile, outcomes.LoggingServiceError)
    for cls in (*errors, CheckpointError):
        assert not issubclass(cls, ConfigError), cls


def test_one_line_is_the_first_line_of_the_message():
    error = OSError("disk full\n  details\n")
    assert one_line(error) == "disk full"
    assert one_line(error, named=True) == "OSError: disk full"
    assert one_line(ValueError("\n\n  second\nthird")) == "second"
    assert one_line(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_run_main_prints_one_line_and_returns_the_code(capsys):
    def fails(error):
        def body():
            raise error

        return body

    assert run_main(fails(WorkdirBusy("workdir w is in use\nby pid 1"))) == 75
    assert capsys.readouterr().err == "error: workdir w is in use\n"
    assert run_main(fails(outcomes.TrainingInterrupted("SIGTERM received", "SIGTERM"))) == 4
    assert capsys.readouterr().err == "stopped: SIGTERM received\n"
    assert run_main(fails(KeyboardInterrupt()), interrupted="before training") == 130
    assert capsys.readouterr().err == "stopped: before training\n"
    assert run_main(lambda: Exit.FINISHED) == 0
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        run_main(lambda: 1 // 0)


def test_the_readme_lists_the_exit_codes_of_the_table():
    readme = (ROOT / "README.md").read_text()
    assert exit_table() in readme


def _env(**extra) -> dict:
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def _run(args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _ended_with(done: subprocess.CompletedProcess, code: int, line: str) -> None:
    """Exit status ``code``, and stderr ends with ``line`` (a prefix of it) and no traceback."""
    lines = [text for text in done.stderr.splitlines() if text.strip()]
    assert done.returncode == code, done.stderr
    assert lines and lines[-1].startswith(line), done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_train_ends_through_the_table(tmp_path, byte_corpus):
    config = f"{HERE / 'small_config.py'}:small"
    missing = tmp_path / "missing.py"
    done = _run(["-m", "lmuscale.train", "--config", f"{missing}:x", "--workdir", str(tmp_path)])
    _ended_with(done, Exit.CONFIG, f"error: config file '{missing}' not found")

    workdir = tmp_path / "busy"
    workdir.mkdir()
    with Lock(workdir):
        command = ["-m", "lmuscale.train", "--config", config, "--workdir", str(workdir)]
        done = _run([*command, "--quiet"], LMUSCALE_TEST_DATA=str(byte_corpus))
    _ended_with(done, Exit.BUSY, f"error: workdir {workdir} is in use by pid {os.getpid()} on")


def test_the_sweep_worker_ends_through_the_table(tmp_path):
    with Lock(tmp_path):
        done = _run(["-m", "lmuscale.sweep.worker", str(tmp_path)])
    _ended_with(done, Exit.BUSY, f"error: trial {tmp_path}: locked by pid {os.getpid()} on")


def test_a_damaged_trial_file_is_one_named_io_error(tmp_path):
    (tmp_path / "trial.json").write_text('{"name": "t", "config": {')  # cut short
    done = _run(["-m", "lmuscale.sweep.worker", str(tmp_path)])
    _ended_with(done, Exit.IO, f"error: {tmp_path / 'trial.json'}: not JSON (")


def test_sweep_tasks_generate_prepare_and_analysis_end_through_the_table(tmp_path):
    bad_sweep = tmp_path / "sweep.txt"
    done = _run(["-m", "lmuscale.sweep", str(bad_sweep)])
    _ended_with(done, Exit.CONFIG, f"error: sweep file '{bad_sweep}' not found")

    nothing = tmp_path / "nothing"
    experiment = str(ROOT / "experiments" / "imdb.py")
    command = ["-m", "lmuscale.tasks", experiment, "--workdir", str(tmp_path / "w")]
    done = _run([*command, "--quiet", f"--config.data.path={nothing}"])
    expected = f"error: IMDB needs a local copy, and none was found at '{nothing}'; give"
    _ended_with(done, Exit.DATA, expected)
    assert done.stderr.strip().endswith("lmuscale never downloads data.")  # the help, in the line

    done = _run(["-m", "lmuscale.generate", "--checkpoint", str(nothing), "--tokens", "2"])
    _ended_with(done, Exit.IO, f"error: {nothing}: no such checkpoint folder")

    command = ["-m", "lmuscale.data", "prepare", "text", str(nothing), "--out", str(tmp_path)]
    done = _run([*command, "--quiet"])
    _ended_with(done, Exit.DATA, f"error: {nothing}: no such file")

    done = _run(["-m", "lmuscale.analysis", str(nothing), "--out", str(tmp_path / "a")])
    _ended_with(done, Exit.DATA, f"error: {nothing}: no such results file")


FLOAT32 = "in [0, 3.4e38]: it divides float32 logits"
BAD_ARGUMENTS = {  # (command, arguments): the end of argparse's one line
    ("train", "--workdir="): "argument --workdir: an empty path: give a folder",
    ("train", "--workdir=  "): "argument --workdir: an empty path: give a folder",
    ("tasks", "--workdir="): "argument --workdir: an empty path: give a folder",
    ("sweep", "--workdir="): "argument --workdir: an empty path: give a folder",
    ("generate", "--workdir="): "argument --workdir: an empty path: give a folder",
    ("generate", "--checkpoint= "): "argument --checkpoint: an empty path: give a folder",
    ("data", "prepare text a.txt --out="): "argument --out: an empty path: give a folder",
    ("data", "prepare text a.txt --out=x --workers=-2"): "argument --workers: -2 is out of "
    "range: [0, 4096]",
    ("data", "info ''"): "argument folder: an empty path: give a folder",
    ("analysis", "results.csv --out="): "argument --out: an empty path: give a folder",
    (
        "generate",
        "--temperature=1e308",
    ): f"argument --temperature: 1e308 is out of range: {FLOAT32}",
    ("generate", "--temperature=inf"): f"argument --temperature: inf is out of range: {FLOAT32}",
    ("generate", "--temperature=nan"): f"argument --temperature: nan is out of range: {FLOAT32}",
    ("generate", "--temperature=-inf"): f"argument --temperature: -inf is out of range: {FLOAT32}",
    ("generate", "--temperature=-1"): f"argument --temperature: -1 is out of range: {FLOAT32}",
    ("generate", "--tokens=3000000000"): "argument --tokens: 3000000000 is out of range: in "
    "[1, 2**30]: the decoder's positions are int32",
    ("generate", "--seed=99999999999999999999999"): "argument --seed: "
    "99999999999999999999999 is out of range: in [0, 2**32): jax.random.key keeps 32 bits",
    ("sweep", "--dry-run --throughput=nan"): "argument --throughput: nan is out of range: a "
    "finite number > 0",
    ("sweep", "--dry-run --throughput=inf"): "argument --throughput: inf is out of range: a "
    "finite number > 0",
    ("analysis", "results.csv --out=x --seed=-1"): "argument --seed: -1 is out of range: [0, "
    "9.22337e+18]",
}


@pytest.mark.parametrize(("command", "arguments"), BAD_ARGUMENTS)
def test_empty_paths_and_values_out_of_range_are_bad_arguments(command, arguments, capsys):
    """Each was taken: an empty --workdir trained into the current folder; 1e308 became an
    infinite float32 temperature; a huge --tokens or --seed overflowed a C long; a NaN
    throughput printed "nan h"; --workers -2 was a data error (6)."""
    import importlib
    import shlex

    module = importlib.import_module(
        {"generate": "lmuscale.generate"}.get(command, f"lmuscale.{command}.__main__")
    )
    argv = shlex.split(arguments)
    if command in ("train", "tasks", "sweep"):
        argv = ["--config=c.py", *argv] if command == "train" else ["file.py", *argv]
    with pytest.raises(SystemExit) as stopped:
        module.main(argv)
    assert stopped.value.code == Exit.ARGUMENTS
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1].endswith(
        f"error: {BAD_ARGUMENTS[command, arguments]}"
    ), err


@pytest.mark.parametrize("command", ["sweep", "data"])
def test_a_read_only_output_folder_is_the_io_outcome_in_one_line(
    command, tmp_path, monkeypatch, capsys
):
    """Each made its folder with a bare mkdir: a read-only filesystem gave a traceback and
    status 1 (train's workdir: a config error, 1). Any storage error that reaches the command
    line is the I/O outcome, naming the file."""
    import errno
    import importlib

    from sweep_files import write_sweep

    monkeypatch.setenv("LMUSCALE_TEST_DATA", str(tmp_path))
    out = tmp_path / "readonly" / "out"
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if "readonly" in str(self):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    if command == "sweep":
        argv = [str(write_sweep(tmp_path, {"a": {}})), "--workdir", str(out), "--quiet"]
    else:
        docs = tmp_path / "docs.jsonl"
        docs.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(400)))
        argv = ["prepare", "text", str(docs), "--out", str(out), "--tokenizer", "bytes", "--quiet"]
    module = importlib.import_module(f"lmuscale.{command}.__main__")
    assert module.main(argv) == Exit.IO
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}") and err.endswith(": the filesystem is read-only\n")
    assert len(err.splitlines()) == 1, err


# Sends this process a SIGINT when it first looks for jax, the first of the slow imports: a
# Ctrl-C while the command line is still starting up, at the same point every time. A terminal
# delivers Ctrl-C, so SIGINT is first unblocked and given Python's default handler: a process
# inherits an ignored or blocked SIGINT from its parent, here the pytest worker, which some
# earlier test in it can leave so (seen once in CI-like runs: the SIGINT never arrived).
INTERRUPT_AT_IMPORT = """
import os, runpy, signal, sys

signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
signal.signal(signal.SIGINT, signal.default_int_handler)

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "jax":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupt())
runpy.run_module("lmuscale.train", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_importing_is_one_line_and_status_130(tmp_path):
    config = f"{HERE / 'small_config.py'}:small"
    args = ["--config", config, "--workdir", str(tmp_path / "w")]
    done = _run(["-c", INTERRUPT_AT_IMPORT, *args])
    assert (done.returncode, done.stderr) == (
        130,
        "stopped: SIGINT received before training began\n",
    )
    assert not (tmp_path / "w").exists()


def test_a_ctrl_c_that_python_would_drop_in_a_callback_still_ends_the_command(capsys):
    """A KeyboardInterrupt raised in ``__del__`` (or a garbage-collection callback) was printed
    as "Exception ignored" and lost: the command ran on and exited 0. It is raised again
    outside the callback."""
    import signal
    import time

    class Finalised:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, inside __del__

    def body():
        Finalised()
        time.sleep(1.0)  # the work goes on; the interrupt is raised again within 50 ms
        return Exit.FINISHED

    assert run_main(body) == Exit.INTERRUPTED
    assert capsys.readouterr().err == "stopped: SIGINT received\n"


def test_a_ctrl_c_during_an_import_that_would_turn_it_into_an_import_error_ends_the_command(
    tmp_path, monkeypatch, capsys
):
    """numpy's import turns a KeyboardInterrupt into "ImportError: numpy._core.multiarray
    failed to import" (train at 0.15 s: a traceback, status 1). The interrupt is held until the
    import is done; a body that swallows it anyway still ends as interrupted."""
    import importlib
    import signal
    import time

    (tmp_path / "converting.py").write_text(
        "import os, signal, time\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "except KeyboardInterrupt:\n"
        "    raise ImportError('converting failed to import') from None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def body():
        importlib.import_module("converting")
        time.sleep(1.0)
        return Exit.FINISHED

    assert run_main(body) == Exit.INTERRUPTED
    assert capsys.readouterr().err == "stopped: SIGINT received\n"

    def swallowing():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        except KeyboardInterrupt:
            pass  # as a library's broad except would
        return Exit.FINISHED

    assert run_main(swallowing) == Exit.INTERRUPTED
    assert capsys.readouterr().err == "stopped: SIGINT received\n"


def test_a_command_run_inside_another_leaves_the_signals_to_the_outer_one(capsys):
    """A sweep file's ``after()`` may call another command's ``main``: its Ctrl-C is the
    outer command's (which reports it), and the process's own handler comes back after."""
    import signal
    import time

    before = signal.getsignal(signal.SIGINT)

    def inner():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        return Exit.FINISHED

    def outer():
        run_main(inner)
        return Exit.FINISHED  # not reached: the interrupt goes through the inner call

    assert run_main(outer, interrupted="stopped by the outer command") == Exit.INTERRUPTED
    assert capsys.readouterr().err == "stopped: stopped by the outer command\n"

    def bad_table():
        raise DataError("results.csv: not a results table")

    assert run_main(lambda: run_main(bad_table)) == Exit.DATA  # reported by the inner call
    assert capsys.readouterr().err == "error: results.csv: not a results table\n"
    assert signal.getsignal(signal.SIGINT) is before


def test_an_ignored_ctrl_c_stays_ignored(tmp_path):
    """A command started with SIGINT ignored (``cmd &`` in a script) ran on when it was sent
    one, as Python leaves it; taking the signal over would stop it."""
    import signal
    import time

    process = subprocess.Popen(
        [sys.executable, "-m", "lmuscale.scaling"],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    err = process.communicate(timeout=120)[1]
    assert (process.returncode, err) == (0, "")


def _ctrl_c_commands(tmp: Path, corpus: Path) -> dict[str, list[str]]:
    """One short job per command line (each a few seconds when not stopped)."""
    from results_files import paper_rows, write_jsonl

    results = write_jsonl(tmp / "results.jsonl", paper_rows()[:6])
    docs = tmp / "docs.jsonl"
    docs.write_text("".join(f'{{"text": "document {i}: a few words"}}\n' for i in range(2000)))
    sweep = tmp / "sweep.py"
    sweep.write_text(
        "from lmuscale.sweep import Trial\n\n\ndef get_trials():\n"
        f"    yield Trial('a', {str(HERE / 'small_config.py') + ':small'!r}, {{}})\n"
    )
    return {
        "train": ["lmuscale.train", "--config", f"{HERE / 'small_config.py'}:small", "--quiet"],
        "tasks": ["lmuscale.tasks", str(ROOT / "experiments" / "mackey_glass.py") + ":lmu"],
        "generate": ["lmuscale.generate", "--model", "transformer-55k", "--tokens", "3"],
        "scaling": ["lmuscale.scaling"],
        "analysis": ["lmuscale.analysis", str(results), "--n-boot", "0", "--quiet"],
        "data": ["lmuscale.data", "prepare", "text", str(docs), "--tokenizer", "bytes"],
        "sweep": ["lmuscale.sweep", str(sweep), "--dry-run"],
    }


FOLDER_FLAG = {"train": "--workdir", "tasks": "--workdir", "analysis": "--out", "data": "--out"}


@pytest.mark.parametrize("delay", [0.25, 0.7, 1.5, 3.0])
def test_ctrl_c_or_sigterm_at_any_moment_of_every_command_is_one_line_and_its_status(
    tmp_path, byte_corpus, delay
):
    """Each command line, started as a user does (``python -m``) and sent a stop signal after
    ``delay`` seconds (the commands run side by side: later or earlier for each under the
    load): SIGINT or SIGTERM, in turn, so that each command gets each at two delays. It ends
    with one "stopped:" line, no traceback, and status 130 (SIGINT) or 4 (SIGTERM); or, when it
    had finished before the signal, with 0. Ctrl-C was 23 tracebacks in 34 tries, and 5
    interrupts lost (the command ran to its end with 0); SIGTERM killed a task run (143)."""
    import signal
    import time

    turn = [0.25, 0.7, 1.5, 3.0].index(delay)

    env = _env(LMUSCALE_TEST_DATA=str(byte_corpus), JAX_PLATFORMS="cpu")
    started = {}
    for name, command in _ctrl_c_commands(tmp_path, byte_corpus).items():
        if name in FOLDER_FLAG:
            command = [*command, FOLDER_FLAG[name], str(tmp_path / name)]
        started[name] = subprocess.Popen(
            [sys.executable, "-m", *command],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    time.sleep(delay)
    finished = set()
    sent = {}
    for i, (name, process) in enumerate(started.items()):  # each about ``delay`` after its start
        if process.poll() is None:
            sent[name] = signal.SIGTERM if (i + turn) % 2 else signal.SIGINT
            process.send_signal(sent[name])
        else:
            finished.add(name)
    for name, process in started.items():
        err = process.communicate(timeout=300)[1]
        lines = err.splitlines()
        if name in finished:
            assert process.returncode == 0, (name, err)
            continue
        stopped = Exit.INTERRUPTED if sent[name] == signal.SIGINT else Exit.STOPPED
        assert process.returncode in (stopped, Exit.FINISHED), (name, sent[name], err)
        assert "Traceback" not in err and "Exception ignored" not in err, (name, err)
        if process.returncode == stopped:
            assert lines and lines[-1].startswith("stopped: "), (name, err)
            assert sum(line.startswith(("stopped: ", "error: ")) for line in lines) == 1
