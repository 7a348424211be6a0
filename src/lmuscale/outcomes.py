"""How a run ends: one exception class and one exit status per outcome, in one table (``Exit``).

Every command line runs its body through ``run_main``, which turns an outcome's exception into
one line on stderr and its exit status; any other exception is a bug and keeps its traceback.
A stop signal (Ctrl-C; SIGTERM, SIGUSR1 or SIGUSR2 as ``SignalStop``) is never lost: one during
start-up (``start_command``: ``python -m lmuscale.X`` from the package's first line until
``run_main``, before anything is written) ends the process at once with one line; one that
reaches an import, or code whose exceptions Python drops (a garbage-collection callback), is
sent again moments later; and a body that ends after one arrived ends as stopped.
Classes that say more (``CheckpointError``, ``BenchmarkError``, ...) subclass these. This module
imports nothing from lmuscale, so every layer can raise them.
"""

from __future__ import annotations

import argparse
import atexit
import enum
import errno
import math
import os
import signal
import sys
import threading
from collections.abc import Callable


class ConfigError(ValueError):
    """A config that cannot run: the message names the file, key or value."""


class DataError(ValueError):
    """Bad input or a bad prepared dataset; the message names the file (and line, key or value)."""


class WorkdirBusy(RuntimeError):
    """Another process holds the workdir's lock."""


class OutOfMemoryBudget(RuntimeError):
    """No micro-batch count's train step fits in the memory budget."""


class StorageError(RuntimeError):
    """A file of the run that cannot be written, or read back as written; the message names it."""


class DamagedFile(StorageError):
    """A run's file that no longer parses; the message names it (and the line) and what to do."""


class LoggingServiceError(RuntimeError):
    """A logging service (W&B) could not start or log a run; the message says what to do."""


class TrainingDiverged(RuntimeError):
    """The loss or the parameters became NaN or infinite."""


class TrainingInterrupted(RuntimeError):
    """A stop signal arrived; the run saved a checkpoint and can be resumed."""

    def __init__(self, message: str, signal_name: str = ""):
        super().__init__(message)
        self.signal_name = signal_name


class LostProcess(RuntimeError):
    """A multi-process run lost another of its processes (a collective or the coordinator
    failed). The checkpoints written are intact."""


@enum.unique
class Exit(enum.IntEnum):
    """The outcomes: exit status, the exception class (None: no exception makes it), the word
    that begins the one line, and what it means (the README's table is made from this)."""

    def __new__(cls, code: int, error: type[BaseException] | None, word: str, meaning: str):
        member = int.__new__(cls, code)
        member._value_ = code
        member.error, member.word, member.meaning = error, word, meaning
        return member

    FINISHED = 0, None, "", "finished (or had finished before)"
    CONFIG = 1, ConfigError, "error", "a bad config; the message names the file, key or value"
    ARGUMENTS = 2, None, "error", "bad command-line arguments (argparse's usage message)"
    DIVERGED = 3, TrainingDiverged, "error", "the loss or the parameters became NaN or infinite"
    STOPPED = (
        4,
        TrainingInterrupted,
        "stopped",
        "SIGTERM, SIGUSR1 or SIGUSR2 stopped it (training: after a checkpoint); run it again "
        "to resume",
    )
    LOST_PROCESS = (
        5,
        LostProcess,
        "error",
        "a multi-process run lost another of its processes; start all of them again to resume",
    )
    DATA = 6, DataError, "error", "bad input data: a dataset, a corpus or a results table"
    MEMORY = (
        7,
        OutOfMemoryBudget,
        "error",
        "no micro-batch count's train step fits in the memory budget",
    )
    IO = (
        8,
        StorageError,
        "error",
        "a checkpoint, log or output that cannot be written, or read back intact",
    )
    LOGGING_SERVICE = 9, LoggingServiceError, "error", "W&B could not start or log the run"
    UNFINISHED = (
        10,
        None,
        "",
        "a sweep: a selected trial failed, diverged or did not finish (its table says which)",
    )
    BUSY = (
        75,
        WorkdirBusy,
        "error",
        "another process holds the workdir's (or trial's) lock; nothing was started",
    )
    INTERRUPTED = (
        130,
        KeyboardInterrupt,
        "stopped",
        "Ctrl-C (SIGINT); during training it also stops after a checkpoint",
    )

    @classmethod
    def of(cls, error: BaseException) -> Exit | None:
        """The outcome of ``error``, or None when it is in no row (a bug)."""
        # One class, two statuses: a shell reports a Ctrl-C as 130, the other signals as 4.
        if isinstance(error, TrainingInterrupted) and error.signal_name == "SIGINT":
            return cls.INTERRUPTED
        if isinstance(error, SignalStop):
            return cls.STOPPED
        for outcome in cls:
            if outcome.error is not None and isinstance(error, outcome.error):
                return outcome
        return None


def reason(error: OSError) -> str:
    """Why ``error``'s read or write failed, for a person."""
    if error.errno == errno.EROFS:
        return "the filesystem is read-only"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if error.errno == errno.ENOSPC:
        return "no space left on the device (or no inodes)"
    if error.errno == errno.EDQUOT:
        return "no space left in the disk quota"
    return error.strerror or str(error)


# What a file's write (or read) meets on a full, read-only or failing disk: the I/O outcome,
# wherever it is met (a folder a command makes, say), not a traceback.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


def _storage_error(error: BaseException) -> BaseException:
    """``error`` as a ``StorageError`` naming its file, when it is a storage ``OSError``."""
    if not isinstance(error, OSError) or error.errno not in STORAGE_ERRNOS:
        return error
    where = error.filename2 or error.filename  # a rename names its target second
    return StorageError(f"{where}: {reason(error)}" if where else reason(error))


def one_line(error: BaseException, *, named: bool = False) -> str:
    """The first non-empty line of ``error``'s message (its class's name when it has none);
    ``named``: after the class's name, for an error from another library whose message alone
    may not say what failed ("OSError: [Errno 28] No space left on device")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0]}" if named else lines[0]


class SignalStop(KeyboardInterrupt):
    """SIGTERM, SIGUSR1 or SIGUSR2 outside training's own handling (which checkpoints first):
    raised where a Ctrl-C's KeyboardInterrupt would be, so that the same clean-ups run; its
    outcome is ``Exit.STOPPED``."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class _Interrupts:
    """The stop signals as a command line takes them: ``starting`` until its ``run_main``;
    ``received``: the last one that arrived (until the outermost ``run_main`` ends, ``depth``
    deep)."""

    starting = False
    received: int | None = None
    depth = 0
    hooked = False  # sys.unraisablehook passes a dropped KeyboardInterrupt on (once a process)


def stop_received() -> int | None:
    """The stop signal this command line has received (None: none), even where it became
    another error on its way up."""
    return _Interrupts.received


def _take(signum: int, handler) -> object:
    """Install ``handler`` for ``signum`` unless the process ignores it (a ``cmd &`` of a
    script that is not interactive ignores SIGINT, as Python itself leaves it); the previous."""
    previous = signal.getsignal(signum)
    if previous is not signal.SIG_IGN:
        signal.signal(signum, handler)
    return previous


def start_command(held: list[int] = ()) -> None:
    """A command line is starting (its imports, which turn an interrupt into another error, or
    drop it): a stop signal ends it with one line; ``held``: those that came before this call
    (read after this module's handlers are in place, so none falls between)."""
    _Interrupts.starting = True
    for signum in STOP_SIGNALS:
        _take(signum, _on_stop)
    if held:
        _stopped_starting(held[0])
    _hook_unraisable()


def _stopped_starting(signum: int) -> None:
    name = signal.Signals(signum).name
    print(f"stopped: {name} received while starting; nothing was done", file=sys.stderr)
    sys.stderr.flush()
    # From inside an import: nothing to clean up, nothing to raise.
    os._exit(Exit.INTERRUPTED if signum == signal.SIGINT else Exit.STOPPED)


def _stop_error(signum: int) -> KeyboardInterrupt:
    return (
        KeyboardInterrupt() if signum == signal.SIGINT else SignalStop(signal.Signals(signum).name)
    )


def _on_stop(signum, frame) -> None:
    if _Interrupts.starting:
        _stopped_starting(signum)
    _Interrupts.received = signum
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            _again(signum)  # numpy's import, say, would make it an ImportError
            return
        frame = frame.f_back
    raise _stop_error(signum)


def _again(signum: int) -> None:
    """Send ``signum`` again in a moment, while a ``run_main`` runs: to this module's handler,
    or to one the body put in its place since (training's, which checkpoints first)."""

    def send():
        if _Interrupts.depth > 0 and signal.getsignal(signum) not in (None, signal.SIG_IGN):
            os.kill(os.getpid(), signum)

    timer = threading.Timer(0.05, send)
    timer.daemon = True
    timer.start()


def _hook_unraisable() -> None:
    if _Interrupts.hooked:
        return
    _Interrupts.hooked = True
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        signum = _Interrupts.received
        taken = signum is not None and _Interrupts.depth > 0
        if taken and isinstance(unraisable.exc_value, KeyboardInterrupt):
            _again(signum)  # raised in a callback whose errors Python drops: raise it elsewhere
        else:
            previous(unraisable)

    sys.unraisablehook = hook


def _exiting(status: int):
    """A stop signal's handler once a command line's work has ended, with ``status``: the
    process ends at once with that status (an exit that hangs on a thread can still be
    stopped). Python's exit hooks then ignore them: the interpreter's last steps give a handled
    signal back its default action, which would end the process as killed (an ignored one
    they leave so)."""

    def handler(signum, frame) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    atexit.register(lambda: [signal.signal(signum, signal.SIG_IGN) for signum in STOP_SIGNALS])
    return handler


def run_main(body: Callable[[], int], *, interrupted: str = "SIGINT received") -> int:
    """``body()``'s exit status, or that of the outcome it raised (after ``report``);
    ``interrupted``: the line for a Ctrl-C (during start-up included; another stop signal's
    has its name for SIGINT), also when ``body`` ended otherwise after one (dropped by a
    callback, or turned into another error). Only the outermost call (a sweep file's
    ``after()`` may call another command's ``main``) takes the signals."""
    outer = _Interrupts.depth == 0 and threading.current_thread() is threading.main_thread()
    previous = {s: _take(s, _on_stop) for s in STOP_SIGNALS} if outer else {}
    _hook_unraisable()
    _Interrupts.starting = False
    _Interrupts.depth += 1
    status = 1  # a bug's traceback
    try:
        status = body()
        if _Interrupts.received is not None:
            raise _stop_error(_Interrupts.received)
        return status
    except BaseException as error:
        signum = _Interrupts.received
        if signum is not None and not isinstance(error, SystemExit | TrainingInterrupted):
            error = _stop_error(signum)  # the signal first: what it became in a library, or cut
        error = _storage_error(error)
        if Exit.of(error) is None or (signum is not None and not outer):
            raise  # an inner call: the outermost reports the signal
        status = report(error, interrupted=interrupted)
        return status
    finally:
        _Interrupts.depth -= 1
        if outer:
            _Interrupts.received = None
            if _on_stop in previous.values():  # a command line's process
                exiting = _exiting(status)
            for signum, handler in previous.items():
                # A command line's process, now exiting: too late to stop anything but the exit.
                if signal.getsignal(signum) is _on_stop:
                    signal.signal(signum, handler if handler is not _on_stop else exiting)


def report(error: BaseException, *, interrupted: str = "SIGINT received") -> Exit:
    """Print ``error`` (of an outcome's class) as one line on stderr and return its outcome."""
    outcome = Exit.of(error)
    text = interrupted if isinstance(error, KeyboardInterrupt) else one_line(error)
    if isinstance(error, SignalStop):
        name = error.signal_name
        text = text.replace("SIGINT", name) if "SIGINT" in text else f"{name} received: {text}"
    print(f"{outcome.word}: {text}", file=sys.stderr, flush=True)
    if outcome is Exit.LOST_PROCESS:
        # Not a normal exit: jax.distributed's shutdown would wait for the lost process (until
        # the heartbeat timeout, then abort with a stack trace), and so would orbax's threads.
        sys.stdout.flush()
        os._exit(outcome)
    return outcome


def exit_table() -> str:
    """The exit statuses as a Markdown table (the README holds a copy; a test compares)."""
    lines = ["| status | outcome |", "|---:|---|"]
    lines += [f"| {outcome.value} | {outcome.meaning} |" for outcome in Exit]
    return "\n".join(lines)


# Argument types for the command lines: a bad value is argparse's one line and status 2.


def folder(text: str) -> str:
    """A folder argument: an empty or blank one would mean the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: give a folder")
    return text


def bounded(kind: type, low: float, high: float, *, above: bool = False, says: str = ""):
    """An argument of ``kind`` (int or float) in [``low``, ``high``] (``above``: > ``low``),
    finite: the range the code computes in (int32 lengths, 32-bit seeds, float32). ``says``:
    the range as the error names it (default: the interval)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        inside = (value > low if above else value >= low) and value <= high
        if not (inside and math.isfinite(value)):
            interval = f"{'(' if above else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{text} is out of range: {says or interval}")
        return value

    parse.__name__ = kind.__name__
    return parse
