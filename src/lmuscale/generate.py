"""Sample text with the recurrent mode: ``python -m lmuscale.generate --workdir runs/tiny ...``
for a model trained there, or ``--model lmu-1M [--checkpoint DIR]`` for a built-in size.

The prompt is fed through ``model.step`` one token at a time (for the plain LMU this carries
only the (d, q) memories, whatever the length), then tokens are drawn one at a time from
softmax(logits / temperature); temperature 0 is greedy. A prompt that is not UTF-8 is refused,
naming its first bad byte, with either tokenizer.

Where the parameters come from:
- ``--workdir W``: a training workdir. The model and tokenizer are those of ``W/config.json``,
  the parameters those of the newest checkpoint in ``W/checkpoints``.
- ``--checkpoint P``: the workdir, one of its checkpoints (``W/checkpoints/N``) or that
  checkpoint's ``state`` folder all mean the same; the workdir's config gives the model unless
  ``--model`` is given. ``P`` may also be an orbax checkpoint of the variables alone, for
  which ``--model`` names the model (default lmu-1M).
- Neither: ``--model`` randomly initialised from ``--seed``, which is useful for checking the
  pipeline, not the text.

Only the parameters are read from a training checkpoint, never the optimiser state.

Exit status: 0 when the text was printed; 1 for a workdir, checkpoint or config.json that
cannot be used (missing, truncated or corrupt, or of another model: the message names the
path); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lmuscale.data.tokenizer import TOKENIZERS, Tokenizer, get_tokenizer
from lmuscale.models import NAMES, LanguageModel, ModelConfig, build, decode, named_config
from lmuscale.outcomes import StorageError, report
from lmuscale.train.config import model_config, upgrade
from lmuscale.train.workdir import CHECKPOINTS, CONFIG

STATE = "state"  # the train state's item in each checkpoint (train.checkpoint)
DEFAULT_MODEL = "lmu-1M"


class CheckpointError(StorageError):
    """A workdir, checkpoint or config.json that cannot be sampled from; the message names the
    path and what is wrong with it."""


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
    """``n_tokens`` ids continuing ``prompt_ids``; an empty prompt starts from ``start_id``.

    Returns only the new ids. The same (params, prompt, temperature, seed) give the same ids.
    """
    if n_tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {n_tokens}")
    if not (np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature must be >= 0 and finite, got {temperature}")
    prompt = np.asarray(list(prompt_ids) or [start_id], np.int32)[None]
    state = model.decode_state(1, max_len=prompt.shape[1] + n_tokens)
    logits_BxTxV, state = decode(model, params, prompt, state)
    key = jax.random.key(seed)
    new = _draw(model, params, state, logits_BxTxV[:, -1], n_tokens, temperature, key)
    return np.asarray(new[0])


EXPECTED = (
    "expected a training workdir, its checkpoints/N folder, checkpoints/N/state, or an orbax "
    "checkpoint of the variables"
)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The orbax folder to read parameters from, and the training workdir it belongs to (whose
    config.json describes the model), or None for a folder saved outside one."""

    state: Path
    workdir: Path | None


def find_checkpoint(path) -> Checkpoint:
    """``--checkpoint``: a training workdir (its newest checkpoint), ``W/checkpoints/N``,
    ``W/checkpoints/N/state``, or an orbax checkpoint of the variables alone."""
    path = Path(os.path.abspath(path))  # "." and ".." resolved, so the folder names can be read
    if path.name == STATE and path.parent.name.isdigit() and path.parent.is_dir():
        return _step(path.parent)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not path.is_dir():
        raise CheckpointError(f"{path}: a file, not a checkpoint folder ({EXPECTED})")
    if (path / CHECKPOINTS).is_dir() or (path / CONFIG).is_file():
        return newest_checkpoint(path)
    if path.name == CHECKPOINTS and (path.parent / CONFIG).is_file():
        return newest_checkpoint(path.parent)
    if path.name.isdigit() and (path.parent.name == CHECKPOINTS or (path / STATE).is_dir()):
        return _step(path)
    if (path / "_METADATA").is_file():
        return Checkpoint(path, None)
    raise CheckpointError(f"{path}: not a checkpoint ({EXPECTED})")


def newest_checkpoint(workdir) -> Checkpoint:
    """The newest checkpoint of a training workdir (``--workdir``)."""
    workdir = Path(os.path.abspath(workdir))
    if not workdir.is_dir():
        what = "not a folder" if workdir.exists() else "no such folder"
        raise CheckpointError(f"{workdir}: {what} (expected a training workdir)")
    folder = workdir / CHECKPOINTS
    steps = _steps(folder)
    if not steps:
        raise CheckpointError(
            f"{folder}: no checkpoint yet (training saves one every checkpoint.every steps)"
        )
    return _step(folder / str(steps[-1]))


def _steps(folder: Path) -> list[int]:
    """The steps of the complete checkpoints in ``folder``, oldest first: orbax writes each
    under a temporary name and renames it to its step when complete."""
    try:
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as error:
        raise CheckpointError(f"{folder}: cannot be listed ({error.strerror})") from None


def _step(folder: Path) -> Checkpoint:
    state = folder / STATE
    if not state.is_dir():
        raise CheckpointError(
            f"{folder}: no {STATE}/ folder (an incomplete or damaged checkpoint){_older(folder)}"
        )
    return Checkpoint(state, folder.parent.parent if folder.parent.name == CHECKPOINTS else None)


def _older(step_folder: Path) -> str:
    """A hint for a damaged checkpoint: the one saved before it, when there is one."""
    if not step_folder.name.isdigit():
        return ""
    earlier = [s for s in _steps(step_folder.parent) if s < int(step_folder.name)]
    return (
        f"; try the one before: --checkpoint {step_folder.parent / str(earlier[-1])}"
        if earlier
        else ""
    )


def run_config(workdir: Path) -> tuple[ModelConfig, Tokenizer]:
    """The model config and tokenizer of the run a workdir's config.json describes (upgraded
    as a resumed run would be, so an older run's config still loads)."""
    path = Path(workdir) / CONFIG
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: not found; give --model (and --tokenizer) to sample from a checkpoint "
            "without its workdir's config"
        ) from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror})") from None
    except ValueError as error:  # not UTF-8, or not JSON
        raise CheckpointError(f"{path}: not JSON ({error})") from None
    sections = saved if isinstance(saved, dict) else {}
    model, data = sections.get("model"), sections.get("data")
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


def load_params(path: Path, model: LanguageModel):
    """The variables (``{"params": ...}``) from an orbax checkpoint of them, or of a training
    state that holds them under ``"params"`` (only they are read, not the optimiser state),
    each array on the default device. Raises ``CheckpointError`` naming the folder when it
    cannot be read or does not fit the model's shapes."""
    import orbax.checkpoint as ocp
    from etils import epath

    from lmuscale.train.checkpoint import quiet_failed_reads

    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    quiet_failed_reads(path)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        try:
            saved = handler.metadata(epath.Path(path)).tree
        except Exception as error:  # orbax and tensorstore raise many kinds
            raise CheckpointError(_unreadable(path, error)) from None
        in_state = isinstance(saved.get("params"), dict) and "params" in saved["params"]
        expected = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
        _check_shapes(path, expected, saved["params"] if in_state else saved)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), expected
        )
        item = {"params": target} if in_state else target
        args = ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True,
        )
        try:
            restored = handler.restore(epath.Path(path), args=args)
        except Exception as error:
            raise CheckpointError(_unreadable(path, error)) from None
    finally:
        handler.close()
    if not in_state:
        return restored
    _verify(path, restored)
    return restored["params"]


def _verify(path: Path, restored) -> None:
    """Check the parameters read from a training checkpoint's ``state`` folder against the
    CRC-32s that training saved beside it (``N/meta``); checkpoints from before checksums
    have none and are taken as they are (and arrays split over processes have none)."""
    from lmuscale.train.checkpoint import CHECKSUMS, checksums, mismatched

    try:
        meta = json.loads((path.parent / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return  # no JSON beside the state: not written by our training loop
    saved = meta.get(CHECKSUMS) if isinstance(meta, dict) else None
    if not saved:
        return
    bad = mismatched(saved, checksums(restored))
    if bad:
        raise CheckpointError(
            f"{path}: does not match the checksums saved with it ({len(bad)} arrays differ, "
            f"e.g. {bad[0]}): its files were damaged{_older(path.parent)}"
        )


def _check_shapes(path: Path, expected, saved) -> None:
    def shapes(tree):
        leaves = jax.tree.leaves_with_path(tree)
        return {jax.tree_util.keystr(k): tuple(getattr(v, "shape", ())) for k, v in leaves}

    want, got = shapes(expected), shapes(saved)
    for key in sorted(want.keys() | got.keys()):
        if want.get(key) != got.get(key):
            raise CheckpointError(
                f"{path} does not fit the model: {key} has shape {got.get(key)} in the "
                f"checkpoint but {want.get(key)} in the model (a checkpoint of another model?)"
            )


def _unreadable(path: Path, error: BaseException) -> str:
    """One line for a checkpoint that orbax could not read: the first line of the innermost
    error, which says what tensorstore found (the outer ones only say where it was reading)."""
    seen = set()
    while (error.__cause__ or error.__context__) is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    lines = str(error).strip().splitlines()
    reason = lines[0] if lines else type(error).__name__
    # tensorstore names the folder in every clause: once, at the start, is enough
    reason = re.sub(r' in OCDBT database at local file "[^"]*"', "", reason)
    reason = reason.replace(f"{path}/", "")
    reason = re.sub(r" \[(tensorstore_spec|source locations)=.*", "", reason)
    if len(reason) > 400:
        reason = reason[:397] + "..."
    hint = _older(path.parent) if path.name == STATE else ""
    return f"{path}: cannot be read (truncated or corrupt?): {reason}{hint}"


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
        "--workdir", type=Path, help="training workdir: its model and newest checkpoint"
    )
    source.add_argument(
        "--checkpoint",
        type=Path,
        help="W, W/checkpoints/N, W/checkpoints/N/state, or an orbax checkpoint of the "
        "variables (default: random init)",
    )
    parser.add_argument("--prompt", default="", help="text to continue (default: <|endoftext|>)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens to sample")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampling (and init) seed")
    parser.add_argument(
        "--tokenizer", choices=sorted(TOKENIZERS), help="default: the workdir's, else gpt2"
    )
    args = parser.parse_args(argv)

    try:
        if args.workdir is not None:
            checkpoint = newest_checkpoint(args.workdir)
        elif args.checkpoint is not None:
            checkpoint = find_checkpoint(args.checkpoint)
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
        model = build(config)
        if checkpoint is None:
            print(f"{what}: random init (seed {args.seed}), no --checkpoint", file=sys.stderr)
            params = model.init(jax.random.key(args.seed), jnp.zeros((1, 1), jnp.int32))
        else:
            params = load_params(checkpoint.state, model)
            print(f"{what}, parameters from {checkpoint.state}", file=sys.stderr)
    except (CheckpointError, KeyboardInterrupt) as error:
        return report(error)
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
    except KeyboardInterrupt as error:
        return report(error)
    print(args.prompt + tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
