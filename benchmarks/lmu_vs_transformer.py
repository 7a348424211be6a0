"""The LMU against the transformer of the same size, in one run: time, bytes and long sequences.

    python benchmarks/lmu_vs_transformer.py [--pairs 7] [--long-lens 8192 65536]
        [--memory-limit-gb 8] [--out FILE]

1. time: forward+backward of the loss (jitted ``value_and_grad``) of lmu-1M and
   transformer-1M on one 1024-token sequence, measured side by side: the two alternate
   --pairs times after a warm-up pair, and the result is the median of the pairwise ratios (the
   machine's drift cancels within a pair). Two cut-down lmu-1M models run in the same rounds
   (``LMU_PARTS``), to show where the LMU's time goes: one whose implicit attention only reads
   the chunk products' outputs once (the least an attention that takes them from memory must
   do, as the XLA path's does), and one without its memory. Each row also gives XLA's GFLOP
   for its program and its minor page faults per call (run under
   ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` to see the times with few).
2. bytes: XLA's ``cost_analysis()`` bytes accessed and ``memory_analysis()`` temporaries of
   the compiled train step of ``lmuscale.train`` (Adam, schedule, norms, the chunked loss) at
   (8, 1024) in float32, the cut-down models too, and at the paper configs' micro-batch,
   (64, 1024) in bfloat16 (a proxy for a GPU's memory traffic, compiled only), the LMU with
   ``batch_chunk = 0``. XLA's cost analysis counts a loop's body once, whatever its trips: the
   loss's scan over 1024-token chunks (8 trips at (8, 1024), 43% of lmu-1M's bytes and 58% of
   transformer-1M's) and the LMU memory's state scans (15 trips). So beside it,
   ``bytes_all_trips``: the same program's kernels with each loop's counted at every trip
   (``gpu_aot.kernels_of``, which the GPU estimates use).
3. long: lmu-55k and transformer-55k train steps on one sequence of each --long-lens, each in
   its own child process. XLA's buffer estimate (temporaries + arguments + outputs) comes
   from compiling; where it exceeds --memory-limit-gb the step is not run and the row says
   so. Otherwise one step runs and the child's peak memory is reported (peak RSS on a CPU,
   the device's peak bytes in use on an accelerator).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import (
    abstract_step_inputs,
    compiled_figures,
    machine,
    peak_memory,
    print_table,
    train_step_for,
    versions,
    write_json,
)
from gpu_aot import kernels_of

from lmuscale import lmu, ops
from lmuscale.layers import ImplicitSelfAttention
from lmuscale.models import LMULanguageModel, build, named_config
from lmuscale.models.lmu import LMUBlock
from lmuscale.train import step as step_lib

GB = 1e9


class _AttentionReadingItsInputsOnce(ImplicitSelfAttention):
    """The chunked memory with an attention that reads Q, K and V once and does nothing else:
    the least an attention that reads the chunk products' outputs from memory can cost."""

    def _attend(self, x_BxTxD):
        exact = {"exact_algorithm": self.impls.exact_algorithm}
        x_BxJxDxZ, _ = lmu.chunk_operands(
            x_BxTxD.astype(jnp.float32), self.q, self.theta, chunk=self.memory_chunk, **exact
        )
        c = x_BxJxDxZ.shape[-1] - self.q
        q_k_v = (
            lmu.chunk_product(x_BxJxDxZ, lmu.chunk_weights(self.q, self.theta, c, l_KxQ, **exact))
            for l_KxQ in self.l
        )
        m_BxJxDxc = jnp.sum(sum(q_k_v), axis=-2).astype(self.dtype)
        return lmu.sequence_from_chunks(m_BxJxDxc, x_BxTxD.shape[1])


class _NoMemory(ImplicitSelfAttention):
    def setup(self):  # no parameters
        pass

    def __call__(self, x_BxTxD):
        return jnp.zeros_like(x_BxTxD)


def _lmu_with(memory_class):
    """The LMU language model with ``memory_class`` in place of each block's memory."""

    class Block(LMUBlock):
        pass

    Block.memory_class = memory_class

    class Model(LMULanguageModel):
        block_class = Block

    return Model


# The LMU's parts, by the model that leaves one out: its cost is then the model's cost without
# that part. The label is a row of the tables and a key of the JSON.
LMU_PARTS = {
    "lmu-1M": LMULanguageModel,
    "lmu-1M, attention reads Q, K, V once": _lmu_with(_AttentionReadingItsInputsOnce),
    "lmu-1M without its memory": _lmu_with(_NoMemory),
}


def _model(config, model_class=None):
    """``config``'s model (as ``model_class``, a cut-down one), its ops as a run resolves them."""
    impls = ops.resolve(config)
    return build(config, impls) if model_class is None else model_class(config, impls=impls)


def loss_and_grad_program(name: str, seq_len: int, model_class=None, **overrides):
    """Forward+backward of ``name``'s loss on one random sequence, its model a
    ``model_class`` (as ``LMU_PARTS``'s; None: the family's): ``(lowered, init)``, ``init()``
    its parameters."""
    config = named_config(name, **overrides)
    model = _model(config, model_class)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, seq_len + 1)), jnp.int32)

    def init():
        return jax.jit(model.init)(jax.random.key(0), tokens[:, :4])

    def loss(params):
        return model.apply(params, tokens[:, :-1], tokens[:, 1:], method=model.loss)[0]

    params = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :4])
    return jax.jit(jax.value_and_grad(loss)).lower(params), init


def minor_faults() -> int:
    """This process's minor page faults so far (a first touch of a page the allocator has
    just mapped, which the kernel then zeroes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def loss_and_grad(name: str, seq_len: int, model_class=None, **overrides):
    """A timed call: forward+backward of ``name``'s loss on one random sequence, ``(run,
    flops)``: ``run()`` returns its seconds and the minor page faults it took; ``flops`` is
    XLA's count for the program (at one sequence of 1024 tokens every loop has one trip,
    but for the memory's state scans, which are small)."""
    lowered, init = loss_and_grad_program(name, seq_len, model_class, **overrides)
    grad, params = lowered.compile(), init()
    jax.block_until_ready(grad(params))

    def run() -> tuple[float, int]:
        faults, start = minor_faults(), time.perf_counter()
        jax.block_until_ready(grad(params))
        return time.perf_counter() - start, minor_faults() - faults

    return run, compiled_figures(grad)["flops"]


def time_ratio(pairs: int) -> dict:
    """lmu-1M's parts (``LMU_PARTS``) and transformer-1M, each timed once a round for
    ``pairs`` rounds; the ratios pair each LMU time with the transformer's of its round.
    Beside the times, each program's GFLOP and its minor page faults per call (median): on a
    CPU, XLA's buffers for a call are mapped afresh and each page's first touch is a fault."""
    runs = {label: loss_and_grad("lmu-1M", 1024, model) for label, model in LMU_PARTS.items()}
    transformer, transformer_flops = loss_and_grad("transformer-1M", 1024)
    for run, _ in (*runs.values(), (transformer, None)):
        run()  # the first calls after compiling run slow on a CPU: not counted
    calls = {label: [] for label in runs}
    transformer_calls = []
    for _ in range(pairs):
        for label, (run, _) in runs.items():
            calls[label].append(run())
        transformer_calls.append(transformer())
    transformer_s = [seconds for seconds, _ in transformer_calls]
    parts = {}
    for label, timed in calls.items():
        lmu_s = [seconds for seconds, _ in timed]
        ratios = [a / b for a, b in zip(lmu_s, transformer_s, strict=True)]
        flops = runs[label][1]
        parts[label] = {
            "lmu_s": lmu_s,
            "ratios": ratios,
            "median_ratio": statistics.median(ratios),
            "gflop": flops / 1e9,
            "flop_ratio": flops / transformer_flops,
            "minor_faults_per_call": statistics.median(faults for _, faults in timed),
        }
    return {
        **parts["lmu-1M"],
        "transformer_s": transformer_s,
        "transformer_gflop": transformer_flops / 1e9,
        "transformer_minor_faults_per_call": statistics.median(f for _, f in transformer_calls),
        "parts": parts,
    }


def compiled_step(name: str, batch: int, seq_len: int, model_class=None, **overrides):
    """The compiled train step of ``lmuscale.train`` (of a ``model_class``, as
    ``loss_and_grad_program``'s) and a state and batch to run it on."""
    positions = {"max_len": seq_len} if name.startswith("transformer") else {}
    config = named_config(name, **positions, **overrides)
    model = _model(config, model_class)
    train_step, init, mesh, abstract = train_step_for(config, seq_len, model=model)
    state, tokens = abstract_step_inputs(mesh, abstract, batch, seq_len)
    compiled = train_step.lower(state, tokens).compile()

    def make_inputs():
        rng = np.random.default_rng(0)
        rows = rng.integers(0, config.vocab_size, tokens.shape, dtype=np.int32)
        return step_lib.init_state(init, mesh), step_lib.to_global(rows, tokens.sharding)

    return compiled, make_inputs


def analysis(compiled) -> dict:
    figures = compiled_figures(compiled)
    return {
        "bytes_accessed": figures["bytes_accessed"],
        "bytes_all_trips": sum(kernel["bytes"] for kernel in kernels_of(compiled.as_text())),
        "flops": figures["flops"],
        "temp_bytes": figures["temp_size_in_bytes"],
        "buffer_bytes": figures["temp_size_in_bytes"]
        + figures["argument_size_in_bytes"]
        + figures["output_size_in_bytes"],
    }


def bytes_ratio(batch: int = 8, dtype: str = "float32", parts: bool = False) -> dict:
    """The train steps' figures (``analysis``); with ``parts``, also each of ``LMU_PARTS``."""
    labels = list(LMU_PARTS) if parts else ["lmu-1M"]
    lmu = {
        label: analysis(
            compiled_step("lmu-1M", batch, 1024, LMU_PARTS[label], batch_chunk=0, dtype=dtype)[0]
        )
        for label in labels
    }
    transformer = analysis(compiled_step("transformer-1M", batch, 1024, dtype=dtype)[0])
    record = {
        "lmu": lmu["lmu-1M"],
        "transformer": transformer,
        "ratio": lmu["lmu-1M"]["bytes_accessed"] / transformer["bytes_accessed"],
        "ratio_all_trips": lmu["lmu-1M"]["bytes_all_trips"] / transformer["bytes_all_trips"],
    }
    if parts:
        record["parts"] = {
            label: {**figures, "ratio": figures["bytes_accessed"] / transformer["bytes_accessed"]}
            for label, figures in lmu.items()
        }
    return {**record, "batch": batch, "dtype": dtype}


def long_child(name: str, seq_len: int, limit_bytes: float) -> dict:
    start = time.perf_counter()
    compiled, make_inputs = compiled_step(name, 1, seq_len)
    record = {"model": name, "seq_len": seq_len, "compile_s": time.perf_counter() - start}
    record.update(analysis(compiled))
    if record["buffer_bytes"] > limit_bytes:
        record["ran"] = False
        return record
    state, tokens = make_inputs()
    start = time.perf_counter()
    state, metrics = compiled(state, tokens)
    jax.block_until_ready(metrics)
    record.update(
        ran=True,
        step_s=time.perf_counter() - start,
        loss=float(metrics["loss"]),
        peak_bytes=peak_memory(),
    )
    return record


def long_sequences(lengths: list[int], limit_bytes: float) -> list[dict]:
    records = []
    for seq_len in lengths:
        for name in ("lmu-55k", "transformer-55k"):
            command = [sys.executable, __file__, "--child", name, str(seq_len), str(limit_bytes)]
            done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
            if done.returncode:
                record = {"model": name, "seq_len": seq_len, "error": f"exit {done.returncode}"}
            else:
                record = json.loads(done.stdout.strip().splitlines()[-1])
            records.append(record)
            print(f"  {name} n={seq_len}: {record}", file=sys.stderr, flush=True)
    return records


def _or_dash(value, unit: float = 1.0) -> str:
    return "-" if value is None else f"{value / unit:.2f}"  # "-": a file from before the field


def _faults(count) -> str:
    return "-" if count is None else f"{count:,.0f}"


def show(result: dict, limit_gb: float) -> None:
    t = result["time"]
    print_table(
        "lmu-1M / transformer-1M, forward+backward at (1, 1024), alternating",
        ("lmu s (median)", "transformer s (median)", "median of pairwise ratios"),
        [
            (
                f"{statistics.median(t['lmu_s']):.3f}",
                f"{statistics.median(t['transformer_s']):.3f}",
                f"{t['median_ratio']:.2f}",
            )
        ],
        left=0,
    )
    if "parts" in t:
        transformer_row = (
            "transformer-1M",
            f"{statistics.median(t['transformer_s']):.3f}",
            "1",
            _or_dash(t.get("transformer_gflop")),
            "1",
            _faults(t.get("transformer_minor_faults_per_call")),
        )
        print_table(
            "where lmu-1M's time goes: its parts against transformer-1M in the same rounds",
            ("model", "s (median)", "time ratio", "GFLOP", "FLOP ratio", "page faults/call"),
            [
                (
                    label,
                    f"{statistics.median(p['lmu_s']):.3f}",
                    f"{p['median_ratio']:.2f}",
                    _or_dash(p.get("gflop")),
                    _or_dash(p.get("flop_ratio")),
                    _faults(p.get("minor_faults_per_call")),
                )
                for label, p in t["parts"].items()
            ]
            + [transformer_row],
        )
    for b in (result["bytes"], result.get("bytes_paper")):
        if b is None:  # a file written before the paper's micro-batch was measured
            continue
        print_table(
            f"train step at ({b.get('batch', 8)}, 1024) in {b.get('dtype', 'float32')}, "
            "XLA's cost and memory analysis; bytes with every loop trip counted",
            ("model", "bytes accessed GB", "all loop trips GB", "GFLOP", "temporaries GB"),
            [
                (
                    name,
                    f"{b[key]['bytes_accessed'] / GB:.2f}",
                    _or_dash(b[key].get("bytes_all_trips"), GB),
                    f"{b[key]['flops'] / 1e9:.0f}",
                    f"{b[key]['temp_bytes'] / GB:.2f}",
                )
                for name, key in (("lmu-1M", "lmu"), ("transformer-1M", "transformer"))
            ]
            + [("ratio", f"{b['ratio']:.2f}", _or_dash(b.get("ratio_all_trips")), "", "")]
            + [
                (
                    f"{label} (ratio {p['ratio']:.2f})",
                    f"{p['bytes_accessed'] / GB:.2f}",
                    _or_dash(p.get("bytes_all_trips"), GB),
                    f"{p['flops'] / 1e9:.0f}",
                    f"{p['temp_bytes'] / GB:.2f}",
                )
                for label, p in b.get("parts", {}).items()
                if label != "lmu-1M"
            ],
        )
    rows = []
    for r in result["long"]:
        if "error" in r:
            rows.append((r["model"], r["seq_len"], "-", "-", "-", r["error"]))
            continue
        peak = r.get("peak_bytes")
        rows.append(
            (
                r["model"],
                f"{r['seq_len']:,}",
                f"{r['buffer_bytes'] / GB:.2f}",
                f"{r['step_s']:.1f}" if r["ran"] else "-",
                "-" if not r["ran"] or peak is None else f"{peak / GB:.2f}",
                "ran" if r["ran"] else f"does not fit in {limit_gb:g} GB (estimate)",
            )
        )
    print_table(
        "one train step on one long sequence",
        ("model", "n", "XLA estimate GB", "step s", "peak GB", ""),
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--long-lens", nargs="*", type=int, default=[8192, 65536])
    parser.add_argument("--memory-limit-gb", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, seq_len, limit = args.child
        print(json.dumps(long_child(name, int(seq_len), float(limit))))
        return
    info = machine()
    default = f"lmu_vs_transformer-{info['platform']}.json"
    out = args.out or Path(__file__).parent / "results" / default
    result = {
        "time": time_ratio(args.pairs),
        "bytes": bytes_ratio(parts=True),
        "bytes_paper": bytes_ratio(64, "bfloat16"),
        "long": long_sequences(args.long_lens, args.memory_limit_gb * GB),
    }
    show(result, args.memory_limit_gb)
    write_json(
        out,
        {
            "benchmark": "lmu_vs_transformer",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": info,
            "versions": versions(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            # glibc's malloc settings change the page faults above: a run under
            # GLIBC_TUNABLES=glibc.malloc.hugetlb=1 maps XLA's buffers in huge pages
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
            **result,
        },
    )


if __name__ == "__main__":
    main()
