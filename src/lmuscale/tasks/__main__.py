"""``python -m lmuscale.tasks FILE.py[:NAME] --workdir DIR [--config.KEY=VALUE ...]`` (README,
"Tasks from the parallel-LMU paper").

Exit statuses (``lmuscale.outcomes.Exit``): 0 done, 1 bad config, 6 missing or unreadable data,
2 bad arguments, 3 a training loss diverged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmuscale.files import atomic_write_json
from lmuscale.outcomes import ConfigError, Exit, folder, run_main
from lmuscale.workdir import SUMMARY, read_json


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m lmuscale.tasks",
        description="Train the parallel-LMU paper's task models from an experiment file.",
        epilog="Override any config key with --config.KEY=VALUE, e.g. --config.train.epochs=5.",
    )
    parser.add_argument("experiment", help="FILE.py[:NAME], e.g. experiments/mackey_glass.py")
    parser.add_argument("--workdir", required=True, type=folder, help="one folder per model inside")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--accept-unverified",
        action="store_true",
        help="resume from a checkpoint with no files.json and no checksums, otherwise refused",
    )
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for item in rest:
        if not item.startswith("--config.") or "=" not in item:
            parser.error(f"unrecognized argument {item!r} (config keys are --config.KEY=VALUE)")
        overrides.append(item[len("--config.") :])
    return args, overrides


def table(results: list[dict]) -> str:
    metric = results[0]["metric"]
    unit = " (%)" if metric == "accuracy" else ""
    lines = [
        f"{'model':<12} {'params':>9} {'test ' + metric + unit:>16} {'best epoch':>11} "
        f"{'train s':>9}"
    ]
    for r in results:
        lines.append(
            f"{r['name']:<12} {r['params']:>9,} {r['test_' + metric]:>16.4f} "
            f"{r['best_epoch']:>5}/{r['epochs']:<5} {r['train_seconds']:>9.0f}"
        )
    paper = ", ".join(f"{k} {v:g}" for k, v in results[0]["paper"].items())
    lines.append(f"paper ({results[0]['task']}, {metric}): {paper}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_main(lambda: _run(*parse(sys.argv[1:] if argv is None else argv)))


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from lmuscale.tasks.config import check
    from lmuscale.tasks.train import run_task
    from lmuscale.train.config import load, load_module, override

    path, _, only = args.experiment.partition(":")
    workdir = Path(args.workdir)
    names = [only] if only else list(getattr(load_module(Path(path)), "NAMES", []))
    if not names:
        raise ConfigError(f"{path}: lists no NAMES; give FILE.py:NAME")
    configs = [override(load(f"{path}:{n}", check), overrides, check) for n in names]
    results = []
    for name, config in zip(names, configs, strict=True):
        print(f"{name}: training in {workdir / name}", flush=True)
        summary = run_task(
            config,
            workdir / name,
            progress=False if args.quiet else None,
            accept_unverified=args.accept_unverified,
        )
        results.append(summary)
        metric = summary["metric"]
        print(f"{name}: test {metric} {summary['test_' + metric]:.4f}", flush=True)
    print(table(results))
    # Every finished model in the workdir, so a run of one NAME keeps the others' results.
    everything = [read_json(p) for p in sorted(workdir.glob(f"*/{SUMMARY}"))]
    atomic_write_json(workdir / "results.json", everything)
    return Exit.FINISHED


if __name__ == "__main__":
    sys.exit(main())
