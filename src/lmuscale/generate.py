"""Sample text with the recurrent mode: ``python -m lmuscale.generate --model lmu-1M ...``.

The prompt is fed through ``model.step`` one token at a time (for the plain LMU this carries
only the (d, q) memories, whatever the length), then tokens are drawn one at a time from
softmax(logits / temperature); temperature 0 is greedy. Without ``--checkpoint`` the model is
randomly initialised from ``--seed``, which is useful for checking the pipeline, not the text.
A prompt that is not UTF-8 is refused, naming its first bad byte, with either tokenizer.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lmuscale.data.tokenizer import Tokenizer, get_tokenizer
from lmuscale.models import NAMES, LanguageModel, build, decode, named_config


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
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    prompt = np.asarray(list(prompt_ids) or [start_id], np.int32)[None]
    state = model.decode_state(1, max_len=prompt.shape[1] + n_tokens)
    logits_BxTxV, state = decode(model, params, prompt, state)
    key = jax.random.key(seed)
    new = _draw(model, params, state, logits_BxTxV[:, -1], n_tokens, temperature, key)
    return np.asarray(new[0])


def load_params(path: Path, model: LanguageModel):
    """Parameters from an orbax checkpoint of the variables (``{"params": ...}``) or of a
    training state that holds them under ``"params"``; checked against the model's shapes."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"--checkpoint {path}: no such checkpoint directory")
    restored = ocp.StandardCheckpointer().restore(path)
    if isinstance(restored.get("params"), dict) and "params" in restored["params"]:
        restored = restored["params"]
    expected = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree.leaves_with_path(expected)}
    got = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree.leaves_with_path(restored)}
    for key in sorted(want.keys() | got.keys()):
        if want.get(key) != got.get(key):
            raise ValueError(
                f"--checkpoint {path} does not fit the model: {key} has shape {got.get(key)} "
                f"in the checkpoint but {want.get(key)} in the model (wrong --model?)"
            )
    return jax.tree.map(jnp.asarray, restored)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmuscale.generate", description=__doc__)
    parser.add_argument("--model", default="lmu-1M", help=f"one of: {', '.join(NAMES)}")
    parser.add_argument("--checkpoint", type=Path, help="orbax checkpoint (default: random init)")
    parser.add_argument("--prompt", default="", help="text to continue (default: <|endoftext|>)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens to sample")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampling (and init) seed")
    parser.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "bytes"])
    args = parser.parse_args(argv)

    tokenizer: Tokenizer = get_tokenizer(args.tokenizer)
    try:  # before the model: a prompt the tokenizer refuses needs no weights
        prompt_ids = tokenizer.encode(args.prompt)
    except ValueError as error:
        parser.error(f"--prompt: {error}")
    try:
        config = named_config(args.model, vocab_size=tokenizer.vocab_size)
    except ValueError as error:
        parser.error(str(error))
    model = build(config)
    if args.checkpoint is None:
        print(f"{args.model}: random init (seed {args.seed}), no --checkpoint", file=sys.stderr)
        params = model.init(jax.random.key(args.seed), jnp.zeros((1, 1), jnp.int32))
    else:
        try:
            params = load_params(args.checkpoint, model)
        except (FileNotFoundError, ValueError) as error:
            parser.error(str(error))
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
