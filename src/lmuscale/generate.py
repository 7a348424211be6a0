"""Sample text with the recurrent mode: ``python -m lmuscale.generate --workdir runs/tiny ...``
for a model trained there, or ``--model lmu-1M [--checkpoint DIR]`` for a built-in size.

The prompt is fed through ``model.step`` one token at a time (for the plain LMU this carries
only the (d, q) memories, whatever the length), then tokens are drawn one at a time from
softmax(logits / temperature); temperature 0 is greedy. A prompt that is not UTF-8 is refused,
naming its first bad byte, with either tokenizer.

Where the parameters come from (never a training checkpoint's optimiser state):
- ``--workdir W``: a training workdir. The model and tokenizer are those of ``W/config.json``,
  the parameters those of the newest checkpoint in ``W/checkpoints``. For a sweep's folder
  (``runs/demo``), ``--trial NAME`` picks a trial (a unique prefix is enough); without it the
  trials are listed.
- ``--checkpoint P``: the workdir, one of its checkpoints (``W/checkpoints/N``) or that
  checkpoint's ``state`` folder all mean the same; the workdir's config gives the model unless
  ``--model`` is given. ``P`` may also be an orbax checkpoint of the variables alone, for
  which ``--model`` names the model (default lmu-1M).
- Neither: ``--model`` randomly initialised from ``--seed``, which is useful for checking the
  pipeline, not the text.

Exit status (``lmuscale.outcomes``): 0 when the text was printed; 8 for a workdir, checkpoint
or config.json that cannot be used (missing, truncated or corrupt, or of another model: the
message names the path); 2 for bad arguments (a sweep folder without a ``--trial`` it names).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lmuscale import ops
from lmuscale.data.tokenizer import TOKENIZERS, Tokenizer, get_tokenizer
from lmuscale.models import NAMES, LanguageModel, ModelConfig, build, decode, named_config
from lmuscale.outcomes import Exit, bounded, folder, run_main
from lmuscale.resume import upgrade
from lmuscale.sweepdir import INDEX
from lmuscale.train.checkpoint import CheckpointError, locate, newest, read_variables
from lmuscale.train.config import model_config
from lmuscale.workdir import CONFIG, read_json, status, summary

DEFAULT_MODEL = "lmu-1M"
FLOAT32_MAX = float(np.finfo(np.float32).max)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _draw(model, params, state, logits_BxV, n_tokens, temperature, key):
    def one(carry, step_key):
        state, logits_BxV = carry
        scaled = logits_BxV / jnp.maximum(temperature, 1e-6)
        token_B = jnp.where(
            temperature > 0,
            jax.random.categorical(step_key, scaled, axis=-1),
            jnp.argmax(logits_BxV, axis=-1),
        ).astype(jnp.int32)
        logits_BxV, state = model.apply(params, state, token_B, method=model.step)
        return (state, logits_BxV), token_B

    _, tokens_TxB = jax.lax.scan(one, (state, logits_BxV), jax.random.split(key, n_tokens))
    return tokens_TxB.T


def sample(
    model: LanguageModel,
    params,
    prompt_ids,
    n_tokens: int,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    start_id: int = 0,
) -> np.ndarray:
    """``n_tokens`` new ids continuing ``prompt_ids`` (an empty prompt starts from ``start_id``);
    the same (params, prompt, temperature, seed) give the same ids."""
    if n_tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {n_tokens}")
    if not (0 <= temperature <= FLOAT32_MAX):  # a larger one is infinite in float32
        raise ValueError(f"--temperature must be in [0, 3.4e38] (float32), got {temperature}")
    prompt = np.asarray(list(prompt_ids) or [start_id], np.int32)[None]
    state = model.decode_state(1, max_len=prompt.shape[1] + n_tokens)
    logits_BxTxV, state = decode(model, params, prompt, state)
    key = jax.random.key(seed)
    new = _draw(model, params, state, logits_BxTxV[:, -1], n_tokens, temperature, key)
    return np.asarray(new[0])


def run_config(workdir: Path) -> tuple[ModelConfig, Tokenizer]:
    """The model config and tokenizer of the run a workdir's config.json describes (upgraded
    as a resumed run would be, so an older run's config still loads)."""
    path = Path(workdir) / CONFIG
    saved = read_json(path)  # DamagedFile when it is not a JSON object
    if saved is None:
        raise CheckpointError(
            f"{path}: not found; give --model (and --tokenizer) to sample from a checkpoint "
            "without its workdir's config"
        )
    model, data = saved.get("model"), saved.get("data")
    if not isinstance(model, dict) or "family" not in model:
        raise CheckpointError(f"{path}: no model section with a family")
    if not isinstance(data, dict) or not isinstance(data.get("tokenizer"), str):
        raise CheckpointError(f"{path}: no data.tokenizer")
    try:
        config = model_config(upgrade(saved)["model"])
        tokenizer = get_tokenizer(data["tokenizer"])
    except ValueError as error:  # ConfigError too
        raise CheckpointError(f"{path}: {error}") from None
    if config.vocab_size != tokenizer.vocab_size:
        raise CheckpointError(
            f"{path}: model.vocab_size is {config.vocab_size} but the {tokenizer.name} "
            f"tokenizer has {tokenizer.vocab_size} ids"
        )
    return config, tokenizer


def sweep_trial(workdir: Path, trial: str | None) -> Path:
    """``workdir``, or for a sweep's folder (``sweep.json``) the folder of the trial that
    ``trial`` names or is the unique prefix of; ValueError, listing the trials, otherwise."""
    index = read_json(workdir / INDEX) if workdir.is_dir() else None
    if index is None:
        if trial is not None:
            raise ValueError(f"--trial {trial}: {workdir} is not a sweep's folder (no {INDEX})")
        return workdir
    trials = index.get("trials")
    if not isinstance(trials, dict) or not all(isinstance(v, str) for v in trials.values()):
        raise CheckpointError(f"{workdir / INDEX}: no 'trials' map of names to folders")
    matches = [trial] if trial in trials else [n for n in trials if trial and n.startswith(trial)]
    if len(matches) == 1:
        return workdir / trials[matches[0]]
    if trial is None:
        head = f"{workdir} is a sweep's folder; choose a trial with --trial NAME (or a prefix)"
    elif matches:
        head = f"--trial {trial}: {len(matches)} trials of {workdir} start with it"
    else:
        head = f"--trial {trial}: no trial of {workdir} starts with it; its trials"
    names = matches or list(trials)
    width = max(map(len, names))
    lines = [f"{head}:"]
    for name in names:
        folder = workdir / trials[name]
        state = status(folder)
        loss = (summary(folder) or {}).get("val_loss") if state == "finished" else None
        lines.append(
            f"  {name:<{width}}  {state}" + (f", val loss {loss:.4f}" if loss is not None else "")
        )
    raise ValueError("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmuscale.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        help=f"a built-in model, one of: {', '.join(NAMES)} (default: the workdir's, else "
        f"{DEFAULT_MODEL})",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--workdir",
        type=lambda text: Path(folder(text)),
        help="training workdir: its model and newest checkpoint; or a sweep's folder",
    )
    source.add_argument(
        "--checkpoint",
        type=lambda text: Path(folder(text)),
        help="W, W/checkpoints/N, W/checkpoints/N/state, or an orbax checkpoint of the "
        "variables (default: random init)",
    )
    parser.add_argument(
        "--trial",
        metavar="NAME",
        help="the trial of the sweep's folder --workdir (a unique prefix is enough)",
    )
    parser.add_argument("--prompt", default="", help="text to continue (default: <|endoftext|>)")
    parser.add_argument(
        "--tokens",
        type=bounded(int, 1, 2**30, says="in [1, 2**30]: the decoder's positions are int32"),
        default=64,
        help="new tokens to sample (default: %(default)s)",
    )
    parser.add_argument(
        "--temperature",
        type=bounded(float, 0, FLOAT32_MAX, says="in [0, 3.4e38]: it divides float32 logits"),
        default=1.0,
        help="0 means greedy (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=bounded(int, 0, 2**32 - 1, says="in [0, 2**32): jax.random.key keeps 32 bits"),
        default=0,
        help="sampling (and init) seed (default: %(default)s)",
    )
    parser.add_argument(
        "--tokenizer", choices=sorted(TOKENIZERS), help="(default: the workdir's, else gpt2)"
    )
    parser.add_argument(
        "--accept-unverified",
        action="store_true",
        help="read parameters that nothing can verify (a checkpoint with no files.json and no "
        "checksums, or orbax's of the variables alone), which are otherwise refused",
    )
    args = parser.parse_args(argv)
    if args.trial is not None and args.workdir is None:
        parser.error("--trial needs --workdir, the sweep's folder")
    return run_main(lambda: _generate(parser, args))


def _generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.workdir is not None:
        try:
            workdir = sweep_trial(args.workdir, args.trial)
        except ValueError as error:  # a listing of trials: not argparse's one line
            print(f"error: {error}", file=sys.stderr)
            return Exit.ARGUMENTS
        checkpoint = newest(workdir)
    elif args.checkpoint is not None:
        checkpoint = locate(args.checkpoint)
    else:
        checkpoint = None
    if args.model is None and checkpoint is not None and checkpoint.workdir is not None:
        config, tokenizer = run_config(checkpoint.workdir)
        if args.tokenizer not in (None, tokenizer.name):
            parser.error(
                f"--tokenizer {args.tokenizer}: the run in {checkpoint.workdir} was "
                f"trained with {tokenizer.name}"
            )
        what = f"the model of {checkpoint.workdir / CONFIG}"
    else:
        tokenizer = get_tokenizer(args.tokenizer or "gpt2")
        name = args.model or DEFAULT_MODEL
        try:
            config = named_config(name, vocab_size=tokenizer.vocab_size)
        except ValueError as error:
            parser.error(str(error))
        what = name
    try:  # before the weights: a prompt the tokenizer refuses needs none
        prompt_ids = tokenizer.encode(args.prompt)
    except ValueError as error:
        parser.error(f"--prompt: {error}")
    model = build(config, ops.resolve(config, training=False))  # its ops on these devices
    if checkpoint is None:
        print(f"{what}: random init (seed {args.seed}), no --checkpoint", file=sys.stderr)
        params = model.init(jax.random.key(args.seed), jnp.zeros((1, 1), jnp.int32))
    else:
        params = read_variables(checkpoint.state, model, args.accept_unverified)
        print(f"{what}, parameters from {checkpoint.state}", file=sys.stderr)
    try:
        new = sample(
            model,
            params,
            prompt_ids,
            args.tokens,
            temperature=args.temperature,
            seed=args.seed,
            start_id=tokenizer.eot,
        )
    except ValueError as error:
        parser.error(str(error))
    print(args.prompt + tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
