"""Grids of trials for compute-optimal studies, for sweep files to yield: ``isoflop_grid`` (per
compute budget, the sizes nearest a tokens-per-parameter ratio, each trained on the tokens the
budget buys at its own training FLOPs per token, not 6N), ``wsd_grid`` (the same budgets as
cooldowns branched from one warmup-stable-decay run per size) and ``learning_rate_grid``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ml_collections import ConfigDict

from lmuscale.models import ModelConfig, count_params, flops_per_token
from lmuscale.sweep.spec import Trial, caller

MakeConfig = Callable[[ModelConfig], ConfigDict]  # a model -> its training config


@dataclass(frozen=True)
class GridPoint:
    """One model at one budget: ``flops``, its whole run's cost, is ``budget`` within rounding."""

    family: str
    model: ModelConfig
    n: int  # non-embedding parameters
    budget: float
    steps: int
    tokens: int
    flops: float


def isoflop_points(
    models: Mapping[str, Sequence[ModelConfig]],
    budgets: Iterable[float],
    *,
    batch: int,
    seq_len: int,
    per_budget: int = 5,
    tokens_per_param: float | Mapping[str, float] = 20.0,
    min_steps: int = 50,
) -> list[GridPoint]:
    """The sizes each budget trains, per family: of the candidates (any order) that afford
    ``min_steps`` steps, the ``per_budget`` consecutive sizes whose D / N lies nearest
    ``tokens_per_param`` (in log; a number, or one per family). ValueError when fewer afford
    them."""
    if not isinstance(tokens_per_param, Mapping):
        tokens_per_param = dict.fromkeys(models, tokens_per_param)
    points = []
    tokens_per_step = batch * seq_len
    for budget in budgets:
        for family, candidates in models.items():
            usable = []
            for model in sorted(candidates, key=lambda m: count_params(m).non_embedding):
                f = flops_per_token(model, seq_len).train
                steps = round(budget / (f * tokens_per_step))
                if steps >= min_steps:
                    tokens = steps * tokens_per_step
                    n = count_params(model).non_embedding
                    usable.append(GridPoint(family, model, n, budget, steps, tokens, f * tokens))
            if len(usable) < per_budget:
                raise ValueError(
                    f"{family} at C = {budget:.3g} FLOPs: only {len(usable)} of its "
                    f"{len(candidates)} sizes afford {min_steps} steps of {tokens_per_step:,} "
                    f"tokens; {per_budget} are needed (add smaller sizes or raise the budget)"
                )
            ratio = [abs(math.log(p.tokens / p.n / tokens_per_param[family])) for p in usable]
            centre = ratio.index(min(ratio))
            start = min(max(0, centre - per_budget // 2), len(usable) - per_budget)
            points += usable[start : start + per_budget]
    return points


def isoflop_grid(
    models: Mapping[str, Sequence[ModelConfig]],
    budgets: Iterable[float],
    make_config: MakeConfig,
    *,
    per_budget: int = 5,
    tokens_per_param: float | Mapping[str, float] = 20.0,
    min_steps: int = 50,
    evals: int = 10,
    seeds: Sequence[int] = (0,),
    learning_rate: Callable[[str, int], float] | None = None,
    learning_rate_from: str = "",
) -> list[Trial]:
    """The trials of an IsoFLOP study: ``isoflop_points`` (batch and sequence length from
    ``make_config``), each ``schedule``d for its steps, at each seed. ``learning_rate(family,
    n)``, if given, sets each size's rate (e.g. ``interpolate`` of the analysis's learning-rate
    file), and each trial's note (``--dry-run``) says it came ``learning_rate_from``. Trial
    names are FAMILY-N-C (``lmu-29k-3e11``), ``-sK`` added for several seeds."""
    probe = make_config(next(iter(next(iter(models.values())))))
    batch, seq_len = probe.train.global_batch, probe.data.seq_len
    points = isoflop_points(
        models,
        budgets,
        batch=batch,
        seq_len=seq_len,
        per_budget=per_budget,
        tokens_per_param=tokens_per_param,
        min_steps=min_steps,
    )
    trials = []
    for point in points:
        base = make_config(point.model)
        if (base.train.global_batch, base.data.seq_len) != (batch, seq_len):
            raise ValueError(
                f"make_config gave {point.family} a batch of {base.train.global_batch} x "
                f"{base.data.seq_len}, the first model {batch} x {seq_len}: one grid, one batch"
            )
        lr = None if learning_rate is None else learning_rate(point.family, point.n)
        name = f"{point.family}-{short(point.n)}-{short(point.budget)}"
        config = schedule(base, point.steps, evals, lr)
        note = f"learning rate {lr:.3g} from {learning_rate_from}" if lr is not None else ""
        trials += _seeded(name, config, seeds, caller(1), "isoflop", note)
    return trials


def wsd_grid(
    models: Mapping[str, Sequence[ModelConfig]],
    budgets: Iterable[float],
    make_config: MakeConfig,
    *,
    decay: float = 0.2,
    shape: str = "1-sqrt",
    min_steps: int = 50,
    evals: int = 10,
    role: str = "isoflop",
    learning_rate: Callable[[str, int], float] | None = None,
) -> list[Trial]:
    """Every model at every compute budget (training FLOPs), as cooldowns: per model, one
    stable run (warmup, then the peak rate: a "wsd" schedule without decay; role "stable"),
    and per budget a branch of it that trains the steps the budget buys at the model's own
    FLOPs per token with a "wsd" schedule whose last ``decay`` of them decay along ``shape``
    (``optim.decay_shape``). Each branch starts from the stable run's checkpoint where its
    decay begins, so the stable run trains as far as the largest budget's. The warmup is the
    base config's fraction of the smallest budget's steps (the same for all of a model's runs);
    evaluations come every ``steps // evals`` steps (the stable run's: the smallest budget's).
    Names: FAMILY-N-stable and FAMILY-N-C (``lmu-29k-3e11``). ValueError when a budget buys
    fewer than ``min_steps`` steps."""
    origin = caller(1)
    budgets = sorted(budgets)
    trials = []
    for family, candidates in models.items():
        for model in sorted(candidates, key=lambda m: count_params(m).non_embedding):
            base = make_config(model)
            n = count_params(model).non_embedding
            tokens_per_step = base.train.global_batch * base.data.seq_len
            per_token = flops_per_token(model, base.data.seq_len).train
            steps = [round(budget / (per_token * tokens_per_step)) for budget in budgets]
            if steps[0] < min_steps:
                raise ValueError(
                    f"{family} N={n:,} at C = {budgets[0]:.3g} FLOPs: {steps[0]} steps of "
                    f"{tokens_per_step:,} tokens; at least {min_steps} are needed"
                )
            fraction = base.optim.warmup_steps / base.train.steps
            warmup = min(max(1, round(fraction * steps[0])), steps[0] - 1)
            lr = None if learning_rate is None else learning_rate(family, n)
            starts = [s - round(decay * s) for s in steps]
            stable_name = f"{family}-{short(n)}-stable"
            # evaluated at the smallest budget's pace whatever its length: a larger budget added
            # later lengthens it, and its branches keep their folders (``spec``'s branch hash)
            stable = _wsd(base, max(starts), warmup, steps[0] // evals, lr, 0.0, shape)
            trials.append(Trial(stable_name, stable, role="stable", origin=origin))
            for budget, length, start in zip(budgets, steps, starts, strict=True):
                config = _wsd(base, length, warmup, length // evals, lr, decay, shape)
                note = f"cooldown of {stable_name} from step {start:,}"
                name = f"{family}-{short(n)}-{short(budget)}"
                branch = (stable_name, start)
                trials.append(
                    Trial(name, config, role=role, note=note, branch_from=branch, origin=origin)
                )
    return trials


def _wsd(base: ConfigDict, steps: int, warmup: int, every: int, lr, decay: float, shape: str):
    """``base`` trained ``steps`` on a "wsd" schedule, evaluated ``every`` steps (see
    ``wsd_grid``)."""
    config = ConfigDict(base.to_dict())
    config.train.steps = steps
    config.optim.update(
        schedule="wsd", warmup_steps=warmup, decay_fraction=decay, decay_steps=0, decay_shape=shape
    )
    if lr is not None:
        config.optim.learning_rate = float(lr)
    every = max(1, every)
    config.eval.every = every
    config.checkpoint.every = every
    config.log.every = min(config.log.every, every)
    return config


def chosen_learning_rates(done: Mapping[str, dict], trials: Sequence[Trial], split: str = "val"):
    """What the learning-rate grid ``trials`` chose (as the analysis chooses:
    ``select_learning_rates``), from ``done``, the result rows a staged sweep's ``get_trials``
    is given: ``(LearningRates, choices)``, or None until every one of ``trials`` has ended.
    A rate whose trial diverged is left out (so a grid that ends at it looks unbracketed)."""
    from lmuscale.analysis.learning_rate import learning_rates, select_learning_rates
    from lmuscale.analysis.results import Run

    rows = [done.get(t.name) for t in trials]
    if not trials or any(row is None for row in rows):
        return None
    runs = [
        Run(
            trial=row["trial"],
            family=row["family"],
            n=row["N"],
            steps=row["steps"],
            tokens=row["tokens"],
            loss=math.inf if row[f"{split}_loss"] is None else row[f"{split}_loss"],
            line=0,
            learning_rate=row["learning_rate"],
            role="learning_rate",
        )
        for row in rows
    ]
    choices, _ = select_learning_rates(runs)
    return learning_rates(choices, "the learning-rate trials"), choices


def learning_rate_grid(
    models: Mapping[str, Sequence[ModelConfig]],
    learning_rates: Sequence[float],
    make_config: MakeConfig,
    *,
    steps: int,
    evals: int = 5,
    seeds: Sequence[int] = (0,),
) -> list[Trial]:
    """Every model of every family at every learning rate, for ``steps`` steps each. Trial
    names are FAMILY-N-lrRATE (``lmu-29k-lr0.003``)."""
    trials = []
    for family, candidates in models.items():
        for model in sorted(candidates, key=lambda m: count_params(m).non_embedding):
            n = count_params(model).non_embedding
            for lr in sorted(learning_rates):
                config = schedule(make_config(model), steps, evals, lr)
                name = f"{family}-{short(n)}-lr{lr:g}"
                trials += _seeded(name, config, seeds, caller(1), "learning_rate")
    return trials


def seed_replicates(trials: Iterable[Trial], seeds: Sequence[int]) -> list[Trial]:
    """Each trial again at each of ``seeds`` (give seeds other than its own), named NAME-sK:
    role "seed", so the analysis reports the spread of the loss over seeds and fits only the
    trials given."""
    replicas = []
    for trial in trials:
        for seed in seeds:
            overrides = {**trial.overrides, "train.seed": seed}
            name = f"{trial.name}-s{seed}"
            replicas.append(Trial(name, trial.config, overrides, "seed", origin=caller(1)))
    return replicas


def schedule(config: ConfigDict, steps: int, evals: int, learning_rate=None) -> ConfigDict:
    """A copy of ``config`` trained for ``steps``: the warmup keeps the base config's fraction
    of its steps (at least 1, below ``steps``), and evaluations and checkpoints come every
    ``steps // evals`` steps (the last step always has both)."""
    config = ConfigDict(config.to_dict())
    fraction = config.optim.warmup_steps / config.train.steps
    config.train.steps = steps
    config.optim.warmup_steps = min(max(1, round(fraction * steps)), steps - 1)
    if learning_rate is not None:
        config.optim.learning_rate = float(learning_rate)
    every = max(1, steps // evals)
    config.eval.every = every
    config.checkpoint.every = every
    config.log.every = min(config.log.every, every)
    return config


def short(x: float) -> str:
    """A count in a trial name: 29216 -> "29k", 3e11 -> "3e11", 1.5e6 -> "1.5M"."""
    if x >= 1e10:
        mantissa, exponent = f"{x:.2g}".split("e")
        return f"{mantissa}e{int(exponent)}"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _seeded(name, config: ConfigDict, seeds: Sequence[int], origin: str, role: str, note=""):
    trials = []
    for seed in seeds:
        seeded = ConfigDict(config.to_dict())
        seeded.train.seed = seed
        suffix = f"-s{seed}" if len(seeds) > 1 else ""
        trials.append(Trial(name + suffix, seeded, role=role, note=note, origin=origin))
    return trials
