"""``python -m lmuscale.train --config FILE.py[:NAME] [--config.KEY=VALUE ...] --workdir DIR``.

Runs (or resumes) one training run. Exit status: 0 when finished, 1 for a bad config or
dataset (the message names the key, file or value) or a checkpoint that cannot be written, 2
for bad arguments, 3 when the loss diverged, 4 when SIGTERM/SIGUSR1/SIGUSR2 stopped it after a
checkpoint (run it again to resume), 5 when a multi-process run lost another of its processes
(start all of them again to resume), 130 for Ctrl-C (SIGINT): during training it also stops
after a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m lmuscale.train",
        description="Train a language model from a config file, resuming from the workdir.",
        epilog="Override any config key with --config.KEY=VALUE, e.g. --config.train.steps=100.",
    )
    parser.add_argument(
        "--config", required=True, help="FILE.py[:NAME], e.g. experiments/owt2.py:tiny"
    )
    parser.add_argument("--workdir", required=True, help="folder for checkpoints, logs, summary")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args, rest = parser.parse_known_args(argv)
    overrides = []
    items = iter(rest)
    for item in items:
        if not item.startswith("--config."):
            parser.error(f"unrecognized argument {item!r} (config keys are --config.KEY=VALUE)")
        key_value = item[len("--config.") :]
        if "=" not in key_value:
            value = next(items, None)
            if value is None:
                parser.error(f"{item} needs a value")
            key_value = f"{key_value}={value}"
        overrides.append(key_value)
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    from lmuscale.train import (
        ConfigError,
        TrainingDiverged,
        TrainingInterrupted,
        load,
        override,
        run,
    )
    from lmuscale.train.checkpoint import CheckpointError
    from lmuscale.train.loop import LostProcess

    try:
        config = override(load(args.config), overrides)
        summary = run(config, args.workdir, progress=False if args.quiet else None)
    except (ConfigError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except LostProcess as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        # Not a normal exit: jax.distributed's shutdown would wait for the lost process (until
        # the heartbeat timeout, then abort with a stack trace), and so would orbax's threads.
        os._exit(5)
    except TrainingDiverged as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    except TrainingInterrupted as error:
        print(f"stopped: {error}", file=sys.stderr)
        return 130 if error.signal_name == "SIGINT" else 4
    except KeyboardInterrupt:  # Ctrl-C before training began: nothing to save
        print("stopped: SIGINT received before training began", file=sys.stderr)
        return 130
    print(
        f"val loss {summary['val_loss']:.4f} nats ({summary['val_bits_per_byte']:.4f} bits/byte), "
        f"test loss {summary['test_loss']:.4f} nats; summary in {args.workdir}/summary.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
