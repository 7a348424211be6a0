"""Every named model: parallel-vs-recurrent error, and one Adam step's speed and peak memory.

    python benchmarks/models.py [--models lmu-1M ...] [--batch 16] [--seq-len 1024]
                                [--steps 3] [--no-speed] [--no-check] [--out FILE]

Each model runs in its own child process, so its peak resident memory (ru_maxrss) is its own.
- check: max |logits(parallel) - logits(512 recurrent steps)| in float32, for the initial
  parameters and for the initial parameters plus N(0, 0.1^2) noise (larger weights, larger
  logits, as after training). One sequence of --check-tokens random tokens.
- speed: a jitted Adam step (forward + backward + update, the chunked loss) on a
  (--batch, --seq-len) batch; tokens/s is the median over --steps timed steps after one warm-up
  (compile) step. Also XLA's buffer estimate (temp + arguments + outputs) and the child's peak
  RSS, which includes the ~0.8 GB of the JAX runtime.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import machine, print_table, versions, write_json

from lmuscale import ops
from lmuscale.models import NAMES, build, count_params, decode, flops_per_token, named_config


def noisy(params, scale: float, seed: int = 1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + scale * rng.standard_normal(x.shape, np.float32), params)


def check(name: str, tokens: int) -> dict:
    config = named_config(name)
    model = build(config, ops.resolve(config))  # its ops as a run here would
    ids = jax.random.randint(jax.random.key(1), (1, tokens), 0, config.vocab_size)
    params = jax.jit(model.init)(jax.random.key(0), ids[:, :4])
    result = {}
    for label, p in (("init", params), ("noisy", noisy(params, 0.1))):
        parallel = jax.jit(model.apply)(p, ids)
        recurrent, _ = decode(model, p, ids)
        result[label] = {
            "max_abs_error": float(jnp.abs(parallel - recurrent).max()),
            "max_abs_logit": float(jnp.abs(parallel).max()),
        }
    return result


def speed(name: str, batch: int, seq_len: int, steps: int) -> dict:
    config = named_config(name)
    model = build(config, ops.resolve(config))  # its ops as a run here would
    tokens = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, config.vocab_size)
    params = jax.jit(model.init)(jax.random.key(0), tokens[:, :4])
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            return model.apply(p, tokens[:, :-1], tokens[:, 1:], method=model.loss)[0]

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    xla_bytes = (
        memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    )
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, tokens)
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
        print(f"  {name}: step {i} {times[-1]:.1f} s", file=sys.stderr, flush=True)
    median = statistics.median(times[1:])
    train_flops = flops_per_token(config, seq_len).train
    return {
        "compile_s": compile_s,
        "step_s": times[1:],
        "tokens_per_s": batch * seq_len / median,
        "model_tflops_per_s": train_flops * batch * seq_len / median / 1e12,
        "xla_bytes": xla_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "loss": float(loss),
    }


def child(args) -> None:
    config = named_config(args.child)
    count = count_params(config)
    record = {
        "model": args.child,
        "non_embedding": count.non_embedding,
        "total": count.total,
        "train_flops_per_token": flops_per_token(config, args.seq_len).train,
    }
    if args.check:
        record["check"] = check(args.child, args.check_tokens)
    if args.speed:
        record["speed"] = speed(args.child, args.batch, args.seq_len, args.steps)
    print(json.dumps(record))


def run_child(name: str, argv: list[str]) -> dict:
    command = [sys.executable, __file__, "--child", name, *argv]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        return {"model": name, "error": f"child exited with {result.returncode} (see stderr)"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def show(records: list[dict], args) -> None:
    rows = []
    for r in records:
        if "error" in r:
            rows.append((r["model"], r["error"], *[""] * 7))
            continue
        check_ = r.get("check", {})
        speed_ = r.get("speed", {})

        def err(label, check_=check_):
            return f"{check_[label]['max_abs_error']:.1e}" if label in check_ else "-"

        rows.append(
            (
                r["model"],
                f"{r['non_embedding']:,}",
                f"{r['total'] / 1e6:.3f}M",
                f"{r['train_flops_per_token'] / 1e6:.1f}M",
                err("init"),
                err("noisy"),
                f"{speed_['tokens_per_s']:,.0f}" if speed_ else "-",
                f"{speed_['xla_bytes'] / 1e9:.2f}" if speed_ else "-",
                f"{speed_['peak_rss_bytes'] / 1e9:.2f}" if speed_ else "-",
            )
        )
    header = ("model", "N", "total", "train FLOP/tok", "err init", "err noisy")
    header += ("tokens/s", "XLA GB", "peak RSS GB")
    title = f"models: float32, Adam step on ({args.batch}, {args.seq_len}), "
    title += f"parallel vs {args.check_tokens} recurrent steps"
    print_table(title, header, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=NAMES, default=list(NAMES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--check-tokens", type=int, default=512)
    parser.add_argument("--no-speed", dest="speed", action="store_false")
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--child", choices=NAMES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return

    passed = ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    passed += ["--steps", str(args.steps), "--check-tokens", str(args.check_tokens)]
    passed += [] if args.speed else ["--no-speed"]
    passed += [] if args.check else ["--no-check"]
    info = machine()
    out = args.out or Path(__file__).parent / "results" / f"models-{info['platform']}.json"
    record = {
        "benchmark": "models",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "versions": versions(),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "check_tokens": args.check_tokens,
        "dtype": "float32",
        "results": [],
    }
    for name in args.models:
        print(f"{name} ...", file=sys.stderr, flush=True)
        record["results"].append(run_child(name, passed))
        write_json(out, record, quiet=True)  # a long run keeps what it has measured so far
    show(record["results"], args)
    write_json(out, record)


if __name__ == "__main__":
    main()
