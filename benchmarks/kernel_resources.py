"""What each Pallas kernel asks of an H100, found without one, and how long it should take.

    pip install "jax-cuda12-plugin==$(python -c 'import jaxlib; print(jaxlib.__version__)')"
    JAX_PLATFORMS=cpu python benchmarks/kernel_resources.py [--widths 48 204] [--out FILE]
    JAX_PLATFORMS=cpu python benchmarks/kernel_resources.py --loss-launches --widths 204 \
        --out results/kernel_resources-sm90a-loss-launches.json

Each kernel (the fused cross-entropy's three, ``ops.cross_entropy_pallas``, at d = 48 and 204,
with in bfloat16 the forward that also forms the expected embeddings, and, also in bfloat16,
every kernel with d held in power-of-two parts where that pads it less, ``split width``) is
lowered for CUDA here, its Triton module compiled to PTX for sm_90a by the Triton that the CUDA
plugin of this jaxlib carries (the compiler XLA runs on a GPU), and the PTX assembled by
``ptxas -v`` (CUDA's, on PATH). Nothing runs: no GPU is needed, only the plugin's wheel, which
imports on a machine without CUDA when ``JAX_PLATFORMS=cpu``.

The flash loss's two Mosaic GPU kernels (``ops.cross_entropy_flash``) are compiled for an H100
by XLA's Mosaic GPU pipeline here (``--flash``; the CUDA plugin's topology of an H100 stands in
for the device) and their PTX taken from ``MOSAIC_GPU_DUMP_TO``. The LMU layer's kernels
(``ops.memory_pallas``: the state kernel forward and reverse, the attention forward and its
backward's two kernels) are compiled as the loss's Triton kernels are, for one memory layer of
lmu-1M (64 x 1024 tokens, d = 204, q = 220, q' = 22); their products are ``mma.sync`` (16
rows a program), counted in the estimate at the tensor cores' ``wgmma`` peak, and
``memory_block`` adds up one block, forward and backward, with its chunk products.

Each row: the shared memory the program needs (Triton's count; the Mosaic kernels' buffers,
summed from their blocks), and from ptxas the registers per thread, the spill stores and loads
(bytes of local-memory traffic the code has, not counts of execution), the stack frame and the
``wgmma`` waits ptxas had to inject (warning C7517: each serialises the tensor cores); from the
PTX the MMA shapes (Hopper's ``wgmma`` m64nNk16, N >= 64 wanted; ``mma.sync`` is the Ampere
fallback); from the machine code (``nvdisasm``) the main loop's instruction count (and of a
loop around it, and of the loops that one holds: ``main_loops``). An H100
gives a program at most 227 KB of shared memory (``SHARED_LIMIT``): a kernel asking more is
refused when XLA compiles it, and so can never run there. Spills and stack are slow local
memory.

The time estimate (``estimate_ms``) is a model of issue and tensor-core clocks, per SM:
``steps / 132 x (loop instructions x warps / 4 + step FLOPs / peak per SM clock) x CAL /
1.83 GHz``, at 64 x 1024 tokens of GPT-2's vocabulary. ``CAL`` is fitted here to the H200
profile's times of the three Triton kernels (``MEASURED``) and each kernel's error after the
fit is printed. It adds issue and MMA time: right for the Triton kernels, whose MMAs wait on
each other; pessimistic for a warp-specialised kernel that overlaps them. Times are measured
only on a GPU: ``benchmarks/gpu.py``'s ``loss`` and ``loss_tiles`` parts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.metadata
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, print_table, versions, write_json
from cross_entropy import launch_candidates
from jax.experimental import pallas as pl

from lmuscale import ops
from lmuscale.ops import cross_entropy_flash as flash
from lmuscale.ops import cross_entropy_pallas as fused_loss
from lmuscale.ops import memory_pallas

SHARED_LIMIT = 227 * 1024  # bytes of shared memory an H100 gives one program (block)
# The time model (``estimate_ms``): an H100/H200 at its boost clock, dense bf16 peak per SM.
SMS, CLOCK = 132, 1.83e9
PEAK_PER_SM_CLOCK = 989e12 / SMS / CLOCK
TOKENS, VOCAB = 64 * 1024, 50257  # one micro-batch of the paper's runs, GPT-2's vocabulary
# The Triton kernels' times on the H200 (one lmu-1M micro-batch, 64 x 1024 x 204, bf16): what
# the model is fitted to.
PROFILE = Path(__file__).parent / "results" / "profile-lmu-1M-nvidia-h200-2026-11-28.json.gz"
ARCH = "9.0"  # the H100's compute capability; ptxas takes sm_90a, the features Triton uses
PTXAS_SECONDS = 900
# The fewest instructions a logit can take, per thread, in the two flash kernels: the forward's
# scale-and-subtract FMA, exp2, add to the sum, max, and half a bf16 pack; dw's FMA, exp2, and
# half a pack (its cotangent folded into h). What ``floor_ms`` charges.
FLOOR_INSTRUCTIONS = 4.5 + 2.5


def measured_ms() -> dict[str, float]:
    """The Triton loss kernels' mean times in ``PROFILE``, ms, by kernel name."""
    import gzip
    import json

    events = json.loads(gzip.decompress(PROFILE.read_bytes()))["traceEvents"]
    times = {}
    for kernel in ("forward_kernel", "dh_kernel", "dw_kernel"):
        found = [e["dur"] for e in events if e.get("ph") == "X" and e["name"] == f"_{kernel}"]
        times[kernel] = sum(found) / len(found) / 1e3
    return times


def model_ms(row: dict, overlapped: bool = False) -> float | None:
    """The model's uncalibrated time for a row with ``steps`` (program steps in all),
    ``step_flops`` and ``warps`` (those that issue the loop) and ``loop_instructions``: issue
    plus MMA clocks, or with ``overlapped`` the longer of the two."""
    if row.get("loop_instructions") is None or "steps" not in row:
        return None
    issue = row["loop_instructions"] * row["warps"] / 4
    mma = row["step_flops"] / PEAK_PER_SM_CLOCK
    clocks = max(issue, mma) if overlapped else issue + mma
    return row["steps"] / SMS * clocks / CLOCK * 1e3


def floor_ms(width: int, cal: float, overlapped: bool = False) -> float:
    """The model's time for the flash loss at ``width`` if its kernels issued nothing but
    ``FLOOR_INSTRUCTIONS`` per logit and ran the four products at the width rounded up only to
    the MMA's K step (16, no padding column): a bound below anything the kernels can reach,
    however written. The sum of issue and MMA clocks, or with ``overlapped`` the longer."""
    logits = TOKENS * VOCAB
    issue = logits * FLOOR_INSTRUCTIONS / (4 * 32)  # 4 schedulers of 32 lanes an SM clock
    mma = 4 * 2 * logits * -(-width // 16) * 16 / PEAK_PER_SM_CLOCK
    clocks = max(issue, mma) if overlapped else issue + mma
    return clocks / SMS / CLOCK * cal * 1e3


def calibrate(rows: list[dict]) -> dict:
    """Fits CAL to the Triton kernels of the case "loss d=204 bfloat16" against the profile,
    and gives every row its ``estimate_ms``; the fit and each kernel's error after it."""
    measured = measured_ms()
    fitted = [
        (row, measured[row["kernel"]])
        for row in rows
        if row["case"] == "loss d=204 bfloat16" and row["kernel"] in measured
    ]
    ratios = [want / model_ms(row) for row, want in fitted if model_ms(row)]
    if not ratios:
        return {"cal": None}
    cal = float(np.exp(np.mean(np.log(ratios))))
    for row in rows:
        raw = model_ms(row)
        row["estimate_ms"] = None if raw is None else round(raw * cal, 2)
        if raw is not None and row["case"].startswith("flash"):
            # Warp-specialised: its MMAs run while the other warpgroup issues, so the longer
            # of the two bounds it from below (the sum, above, from above).
            row["overlapped_ms"] = round(model_ms(row, overlapped=True) * cal, 2)
    errors = {
        row["kernel"]: {"measured_ms": want, "estimate_ms": row["estimate_ms"]}
        for row, want in fitted
    }
    return {"cal": round(cal, 3), "kernels": errors}


def _lowering_hooks():
    """The Triton lowering's module builder and the plugin's compiler, or a SystemExit that
    says what to install."""
    from jax._src.lib import triton
    from jax._src.pallas.triton import lowering

    jax.devices()  # starts the backends: the CUDA plugin registers its Triton compiler then
    if not triton.has_compilation_handler("cuda"):
        raise SystemExit(
            "no Triton compiler for CUDA in this process: install the CUDA plugin of this "
            f'jaxlib ({jax.__version__}): pip install "jax-cuda12-plugin=={jax.__version__}", '
            "and run with JAX_PLATFORMS=cpu"
        )
    if shutil.which("ptxas") is None:
        raise SystemExit("ptxas not found on PATH: it comes with the CUDA toolkit")
    return lowering, triton


def triton_modules(function, args) -> list[tuple[str, bytes]]:
    """``(kernel name, Triton module bytecode)`` of every ``pallas_call`` in ``function``,
    lowered for CUDA."""
    lowering, _ = _lowering_hooks()
    captured, build = [], lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *rest, **options):
        result = build(jaxpr, *rest, **options)
        buffer = io.BytesIO()
        result.module.operation.write_bytecode(buffer)
        captured.append((jaxpr.debug_info.func_name.lstrip("_"), buffer.getvalue()))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        ops.lowered_for_cuda(function, *args)
    finally:
        lowering.lower_jaxpr_to_triton_module = build
    return captured


def _plugin_versions() -> dict:
    """The CUDA plugin that compiled the kernels, by package name (CUDA 12's or 13's)."""
    names = ("jax-cuda12-plugin", "jax-cuda13-plugin")
    installed = {
        re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower()
        for d in importlib.metadata.distributions()
    }
    return {name: importlib.metadata.version(name) for name in names if name in installed}


def _ptxas(ptx: str, folder: Path, name: str) -> dict:
    """ptxas's counts for one kernel's PTX, its MMA shapes, and from the machine code (where
    ``nvdisasm`` is on PATH) the main loop's length."""
    path = folder / f"{name}.ptx"
    path.write_text(ptx)
    cubin = folder / f"{name}.cubin"
    command = ["ptxas", "-v", f"-arch=sm_{ARCH.replace('.', '')}a", str(path), "-o", str(cubin)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PTXAS_SECONDS)
    except subprocess.TimeoutExpired:
        return {"ptxas_error": f"ptxas ran over {PTXAS_SECONDS} s"}
    if done.returncode:
        return {"ptxas_error": done.stderr.strip()[-300:]}

    def number(pattern):
        found = re.search(pattern, done.stderr)
        return int(found.group(1)) if found else None

    shapes = re.findall(r"(?:wgmma\.mma_async|mma)\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)
    row = {
        "registers": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
        "stack_frame_bytes": number(r"(\d+) bytes stack frame"),
        "injected_waits": done.stderr.count("C7517"),
        "mma_shapes": sorted(
            set(shapes), key=lambda shape: [int(n) for n in re.findall(r"\d+", shape)]
        ),
        "wgmma": any("wgmma" in line for line in ptx.splitlines() if "mma_async" in line),
    }
    if shutil.which("nvdisasm"):
        sass = subprocess.run(["nvdisasm", "-c", str(cubin)], capture_output=True, text=True)
        loops = main_loops(sass.stdout)
        row["loop_instructions"], row["outer_loop_instructions"] = loops[:2]
        row["inner_loops_instructions"] = loops[2]
    return row


def main_loops(sass: str) -> tuple[int | None, int | None, int | None]:
    """The instructions of the main loop in ``nvdisasm -c`` output, of the loop around it, and
    of the loops within that one (None if there is no loop around it): the main loop is the
    shortest span from a label back to which a branch jumps, to that branch, that holds a
    tensor-core product (HGMMA, or HMMA on the Ampere path), or in a kernel with none any;
    the shortest, since a barrier's retry code placed after the loop branches back across all
    of it. The loop around it: the shortest span that holds it; the loops within: those it
    holds that no other loop within it holds (the main loop among them)."""
    found, labels, pending, spans = [], {}, None, []
    for line in sass.splitlines():
        text = line.strip()
        label = re.match(r"\.L_x_(\d+):", text)
        if label:
            pending = label.group(1)
            continue
        instruction = re.match(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", text)
        if not instruction:
            continue
        address = int(instruction.group(1), 16)
        found.append((address, instruction.group(2)))
        if pending is not None:
            labels[pending], pending = address, None
        branch = re.search(r"BRA.*\.L_x_(\d+)", instruction.group(2))
        if branch and labels.get(branch.group(1), address) < address:
            spans.append((labels[branch.group(1)], address))
    if not spans:
        return None, None, None
    body = {
        span: [text for address, text in found if span[0] <= address <= span[1]] for span in spans
    }

    def within(inner, outer):
        return inner != outer and outer[0] <= inner[0] and inner[1] <= outer[1]

    products = [span for span in spans if any(re.search(r"\bH[G]?MMA", t) for t in body[span])]
    main = min(products or spans, key=lambda span: len(body[span]))
    # Not a span from the main loop's own label: a barrier's retry code branching back.
    around = [span for span in spans if within(main, span) and span[0] < main[0]]
    if not around:
        return len(body[main]), None, None
    outer = min(around, key=lambda span: len(body[span]))
    inner = [span for span in spans if within(span, outer)]
    direct = [span for span in inner if not any(within(span, other) for other in inner)]
    return len(body[main]), len(body[outer]), sum(len(body[span]) for span in direct)


def compile_rows(label: str, function, args, launch) -> list[dict]:
    """One row per kernel of ``function``: Triton's shared memory, and ptxas's counts;
    ``launch(kernel name)`` is the kernel's ``(num_warps, num_stages)``."""
    _, triton = _lowering_hooks()
    rows, ptx = [], {}
    for name, module in triton_modules(function, args):
        warps, stages = launch(name)
        row = {"case": label, "kernel": name, "num_warps": warps, "num_stages": stages}
        try:
            result = triton.compile(
                "cuda", module, ARCH, num_warps=warps, num_ctas=1, num_stages=stages
            )
        except Exception as error:  # a Triton compile error: the kernel cannot run as written
            rows.append({**row, "triton_error": f"{type(error).__name__}: {error}"[:500]})
            continue
        row["shared_bytes"] = result.smem_bytes
        row["fits_h100"] = result.smem_bytes <= SHARED_LIMIT
        ptx[len(rows)] = result.asm
        rows.append(row)
    with tempfile.TemporaryDirectory() as scratch, concurrent.futures.ThreadPoolExecutor() as pool:
        done = {
            i: pool.submit(_ptxas, text, Path(scratch), f"{label}-{i}-{rows[i]['kernel']}")
            for i, text in ptx.items()
        }
        for i, future in done.items():
            rows[i].update(future.result())
    for row in rows:
        _print_row(row)
    return rows


def _loss_step(width: int, dtype, tiling, dh_from_forward: bool = False):
    """The fused loss's value and gradients under ``tiling`` at d = ``width`` (GPT-2's
    vocabulary, 2048 tokens), and its abstract arguments."""
    h = jax.ShapeDtypeStruct((2, 1024, width), dtype)
    w = jax.ShapeDtypeStruct((50257, width), jnp.float32)
    targets = jax.ShapeDtypeStruct((2, 1024), jnp.int32)

    def loss(h, w, targets):
        return jnp.mean(
            fused_loss.cross_entropy(h, w, targets, tiling=tiling, dh_from_forward=dh_from_forward)
        )

    return jax.value_and_grad(loss, argnums=(0, 1)), (h, w, targets)


def _launch_of(tiling):
    """``compile_rows``'s ``launch``: each kernel's warps and stages in ``tiling``."""

    def launch(name: str) -> tuple[int, int]:
        kernel = getattr(tiling, name.removesuffix("_kernel"))  # "dh_kernel": tiling.dh
        return kernel.warps, kernel.stages

    return launch


def loss_rows(width: int) -> list[dict]:
    """The fused cross-entropy's kernels at width d, at their default tiling; in bfloat16 also
    the forward that forms the expected embeddings (``forward_expected_kernel``), and where
    holding d in parts pads it less (``Tiling.split_width``), every kernel so, in bfloat16."""
    rows = []
    for dtype in (jnp.bfloat16, jnp.float32):
        tiling = fused_loss.default_tiling(width, dtype)
        label = f"loss d={width} {jnp.dtype(dtype).name}"
        found = compile_rows(label, *_loss_step(width, dtype, tiling), _launch_of(tiling))
        rows += _work(found, width, tiling)
    tiling = fused_loss.default_tiling(width, jnp.bfloat16)
    found = compile_rows(
        f"loss d={width} bfloat16 dh from the forward",
        *_loss_step(width, jnp.bfloat16, tiling, dh_from_forward=True),
        _launch_of(tiling),
    )
    rows += _work(_expected_forward(found), width, tiling)
    if fused_loss.padded_width(width, True) < fused_loss.padded_width(width):
        split = dataclasses.replace(tiling, split_width=True)
        label = f"loss d={width} bfloat16 split width"
        found = compile_rows(label, *_loss_step(width, jnp.bfloat16, split), _launch_of(split))
        step = _loss_step(width, jnp.bfloat16, split, dh_from_forward=True)
        found += _expected_forward(compile_rows(label, *step, _launch_of(split)))
        rows += _work(found, width, split)
    for row in rows:
        row.update(d=width)
    return rows


def _work(rows: list[dict], width: int, tiling) -> list[dict]:
    """``rows`` (one tiling's kernels) with what the time model needs at TOKENS x VOCAB: the
    program steps in all, each step's FLOPs (the width as padded) and the warps."""
    wide = fused_loss.padded_width(width, tiling.split_width)
    tokens = -(-TOKENS // tiling.token_multiple) * tiling.token_multiple
    vocab = -(-VOCAB // tiling.vocab_multiple) * tiling.vocab_multiple
    for row in rows:
        kernel = row["kernel"].removesuffix("_kernel").removesuffix("_expected")
        launch = getattr(tiling, kernel)
        products = 1 if row["kernel"] == "forward_kernel" else 2
        outer, inner = (vocab, tokens) if kernel == "dw" else (tokens, vocab)
        row.update(
            steps=outer // launch.rows * (inner // launch.step),
            step_flops=2 * launch.rows * launch.step * wide * products,
            warps=launch.warps,
        )
    return rows


def memory_rows(width=204, order=220, q_prime=22, chunk=64) -> list[dict]:
    """The LMU layer's state kernel, forward and reverse (its gradient), for one memory layer of
    TOKENS tokens (64 sequences of 1024) at d = ``width`` and order q, as a bf16 model on a GPU
    runs it: float32 states, products in three bfloat16 passes."""
    u = jax.ShapeDtypeStruct((64, TOKENS // 64, width), jnp.float32)

    def states(u):
        x = memory_pallas.chunk_operand(
            u, order, 350.0, chunk=chunk, dtype=jnp.bfloat16, exact_algorithm="bf16x3"
        )
        return jnp.sum(jnp.square(x.astype(jnp.float32)))  # its gradient needs the forward's x

    label = f"memory states d={width} q={order}"
    launch = (memory_pallas.WARPS, memory_pallas.STAGES)
    rows = compile_rows(label, jax.grad(states), (u,), lambda name: launch)
    wide = fused_loss.padded_width(order, split=True)
    blocks = -(-width // memory_pallas.CHANNEL_BLOCK)
    for row in rows:
        row.update(
            steps=64 * blocks * (TOKENS // 64 // chunk),
            step_flops=3 * 2 * memory_pallas.CHANNEL_BLOCK * wide * wide,
            warps=memory_pallas.WARPS,
            d=width,
        )
    return rows + attention_rows(width, q_prime)


def attention_rows(width: int, q_prime: int) -> list[dict]:
    """The LMU attention's kernels, forward and backward (two), for one layer of TOKENS
    positions in bfloat16, q' rows of Q, K and V a position: a step of their loops is one
    position, whose products are q' x q' (q' padded to a power of two, d to a multiple of
    16): the scores forward, dQ and dK backward. The kernels loop over the channels' whole
    parts within a position: a position counts those loops' instructions once a part."""
    qkv = jax.ShapeDtypeStruct((3, q_prime, TOKENS, width), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((3, q_prime), jnp.float32)
    p = jax.ShapeDtypeStruct((q_prime,), jnp.float32)

    dm = jax.ShapeDtypeStruct((TOKENS, width), jnp.bfloat16)

    def forward_and_backward(qkv, bias, p, dm):
        def attend(qkv, bias, p):
            return memory_pallas.attention(qkv, bias, p, jnp.bfloat16, "highest", False)

        return jax.vjp(attend, qkv, bias, p)[1](dm)

    warps = memory_pallas.ATTENTION_WARPS
    label = f"memory attention d={width} q'={q_prime}"
    args = (qkv, bias, p, dm)
    launch = (warps, memory_pallas.STAGES)
    rows = compile_rows(label, forward_and_backward, args, lambda name: launch)
    padded = max(16, pl.next_power_of_2(q_prime))
    product_flops = 2 * padded * padded * fused_loss.padded_width(width, split=True)
    products = {"attention_forward": 1, "attention_backward_scores": 2}  # scores; dQ and dK
    trips = width // memory_pallas.ATTENTION_PART  # the kernels' loops over whole parts
    for row in rows:
        outer, inner = row.get("outer_loop_instructions"), row.get("inner_loops_instructions")
        if outer is not None:  # a position: the loops over parts within it, trips times
            row.update(loop_instructions=outer - inner + trips * inner)
        flops = products.get(row["kernel"], 0) * product_flops
        row.update(steps=TOKENS, step_flops=flops, warps=warps, d=width)
    return rows


def flash_rows(width: int, blocks: flash.Blocks | None = None) -> list[dict]:
    """The flash loss's two Mosaic GPU kernels at d = ``width`` in bfloat16, on TOKENS tokens of
    VOCAB, compiled for an H100 by XLA's Mosaic GPU pipeline, their PTX dumped and read."""
    from gpu_aot import h100
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    blocks = blocks or flash.Blocks()
    sharding = NamedSharding(Mesh(h100().devices, ("x",)), PartitionSpec())
    wide, bf16 = flash.padded_width(width), jnp.bfloat16
    tokens = -(-TOKENS // blocks.token_multiple) * blocks.token_multiple
    vocab = -(-VOCAB // blocks.vocab_multiple) * blocks.vocab_multiple

    def struct(*shape, dtype=bf16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    h, w, per_token = struct(tokens, wide), struct(vocab, wide), struct(tokens, dtype=jnp.float32)
    wgs, bq, bkv, bv, bt = (
        flash.COMPUTE_WGS,
        blocks.block_q,
        blocks.block_kv,
        blocks.block_v,
        blocks.block_t,
    )
    kernels = {
        "flash_forward": (
            lambda h, w, w_target: flash.forward_call(h, w, w_target, blocks),
            (h, w, h),
            {
                "steps": tokens // (wgs * bq) * (vocab // bkv),
                "step_flops": wgs * 2 * 2 * bq * bkv * wide,
                # h per warpgroup, the vocabulary's tiles in flight, the log-sum-exps.
                "shared_bytes": wgs * bq * wide * 2 + blocks.stages * bkv * wide * 2 + wgs * bq * 4,
            },
        ),
        "flash_dw": (
            lambda w, h, lse2, g: flash.dw_call(w, h, lse2, g, blocks),
            (w, h, per_token, per_token),
            {
                "steps": vocab // (wgs * bv) * (tokens // bt),
                "step_flops": wgs * 2 * 2 * bv * bt * wide,
                # w per warpgroup, h's tiles (and lse, g) in flight, the float32 out buffer.
                "shared_bytes": wgs * bv * wide * 2
                + blocks.stages * (bt * wide * 2 + 2 * bt * 4)
                + wgs * bv * flash.ROW * 4,
            },
        ),
    }
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, (function, args, work) in kernels.items():
            row = {"case": f"flash loss d={width} bfloat16", "kernel": name, **work}
            row.update(num_warps=4 * (wgs + 1), num_stages=blocks.stages, warps=4 * wgs, d=width)
            row["fits_h100"] = row["shared_bytes"] <= SHARED_LIMIT
            folder = Path(scratch) / name
            folder.mkdir()
            dumps = {"MOSAIC_GPU_DUMP_TO": str(folder), "MOSAIC_GPU_DUMP_PTX": "1"}
            os.environ.update(dumps)
            try:
                jax.jit(function).lower(*args).compile()
            except Exception as error:  # a Mosaic GPU compile error: it cannot run as written
                rows.append({**row, "triton_error": f"{type(error).__name__}: {error}"[:500]})
                continue
            finally:
                for key in dumps:
                    os.environ.pop(key)
            dumped = sorted(folder.glob("*.ptx"))
            if not dumped:  # XLA reused a kernel this process compiled before: no new dump
                rows.append(
                    {**row, "ptxas_error": "no PTX dumped: compiled earlier in this process"}
                )
                continue
            row.update(_ptxas(dumped[0].read_text(), folder, name))
            _print_row(row)
            rows.append(row)
    return rows


def loss_launch_rows(width: int, dtype, candidates) -> list[dict]:
    """The fused cross-entropy's kernels under each launch of ``candidates`` (every kernel
    under the same one at a time, and the forward that forms the expected embeddings;
    ``cross_entropy.py --part loss-tiles`` times them on a GPU): which would not fit an H100's
    shared memory, and which spill."""
    rows = []
    for launch in candidates:
        tiling = fused_loss.Tiling(launch, launch, launch)
        label = f"loss d={width} {jnp.dtype(dtype).name} {launch.rows}x{launch.step}"
        found = compile_rows(label, *_loss_step(width, dtype, tiling), _launch_of(tiling))
        step = _loss_step(width, dtype, tiling, dh_from_forward=True)
        found += _expected_forward(compile_rows(label, *step, _launch_of(tiling)))
        for row in found:
            row.update(d=width, rows=launch.rows, step=launch.step)
        rows += found
    return rows


def _expected_forward(rows: list[dict]) -> list[dict]:
    """Of the rows of a loss with dh from the forward, the forward's, as
    ``forward_expected_kernel`` (its dw kernel is the other form's)."""
    return [
        {**row, "kernel": "forward_expected_kernel"}
        for row in rows
        if row["kernel"] == "forward_kernel"
    ]


def _print_row(row: dict) -> None:
    problem = row.get("triton_error") or row.get("ptxas_error")
    if problem:
        print(f"  {row['case']} {row['kernel']}: {problem[:200]}", file=sys.stderr, flush=True)
        return
    print(
        f"  {row['case']} {row['kernel']}: shared {row['shared_bytes'] / 1024:.0f} KB, "
        f"{row['registers']} registers, spills {row['spill_store_bytes']} B",
        file=sys.stderr,
        flush=True,
    )


def print_rows(rows: list[dict]) -> None:
    def cell(row, key, scale=1):
        value = row.get(key)
        return "-" if value is None else f"{value / scale:,.0f}"

    table = [
        (
            row["case"],
            row["kernel"],
            cell(row, "shared_bytes", 1024),
            "yes" if row.get("fits_h100") else "no",
            cell(row, "registers"),
            cell(row, "spill_store_bytes"),
            cell(row, "stack_frame_bytes"),
            cell(row, "injected_waits"),
            " ".join(row.get("mma_shapes", [])) or "-",
            cell(row, "loop_instructions"),
            "-" if row.get("estimate_ms") is None else f"{row['estimate_ms']:.2f}",
            (row.get("triton_error") or row.get("ptxas_error") or "")[:60],
        )
        for row in rows
    ]
    header = ("case", "kernel", "shared KB", "fits", "regs", "spill st B", "stack B", "waits")
    print_table(
        f"Pallas kernels compiled for sm_90a (an H100 gives a program {SHARED_LIMIT // 1024} KB "
        f"of shared memory); estimates at {TOKENS:,} tokens",
        (*header, "MMA shapes", "loop", "est. ms", "error"),
        table,
        left=2,
    )


def gate(rows: list[dict], cal: float) -> list[dict]:
    """Per width, the whole loss's estimate by the Triton kernels that run now (bf16, default
    tiling) and by the flash kernels, and whether the flash kernels pass the gate for "auto":
    no spills, no injected waits, every MMA's N >= 64, fits, and a better estimate; and the
    floor no flash kernel can beat (``floor_ms``, at calibration ``cal``)."""
    verdicts = []
    for width in sorted({row["d"] for row in rows if row["case"].startswith("flash")}):
        now = [r for r in rows if r["case"] == f"loss d={width} bfloat16"]
        new = [r for r in rows if r["case"] == f"flash loss d={width} bfloat16"]
        total = lambda group: sum(r.get("estimate_ms") or float("nan") for r in group)  # noqa: E731
        shapes = [shape for r in new for shape in r.get("mma_shapes", [])]
        smallest_n = min((int(re.search(r"n(\d+)", s).group(1)) for s in shapes), default=0)
        checks = {  # a kernel that failed to compile has none of these counts: it fails
            "compiled": len(new) == 2 and all("registers" in r for r in new),
            "no_spills": all(
                r.get("spill_store_bytes") == 0 == r.get("spill_load_bytes") for r in new
            ),
            "no_injected_waits": all(r.get("injected_waits") == 0 for r in new),
            "mma_n_at_least_64": smallest_n >= 64 and all(r.get("wgmma") for r in new),
            "fits": all(r.get("fits_h100") for r in new),
            "faster": total(new) < total(now),
        }
        overlapped = round(sum(r.get("overlapped_ms") or float("nan") for r in new), 2)
        verdict = {"d": width, "now_ms": round(total(now), 2), "flash_ms": round(total(new), 2)}
        verdict["flash_overlapped_ms"] = overlapped
        floor = (round(floor_ms(width, cal), 2), round(floor_ms(width, cal, overlapped=True), 2))
        verdict["floor_ms"], verdict["floor_overlapped_ms"] = floor
        verdicts.append({**verdict, **checks, "passes": all(checks.values())})
        failed = [name for name, ok in checks.items() if not ok]
        print(
            f"d = {width}: the loss now {total(now):.1f} ms (3 Triton kernels), flash "
            f"{total(new):.1f} ms (2 kernels, {overlapped:.1f} overlapped; dh and the one-hot "
            "part are elementwise): "
            + ("passes the gate" if not failed else f"fails the gate: {', '.join(failed)}")
            + f"; no flash kernel can beat {floor[0]:.2f} ms ({floor[1]:.2f} overlapped)",
            flush=True,
        )
    return verdicts


# cuBLAS's rate for this block's chunk products: its dW product at lmu-1M's shapes on the H200
# (PERF.md §2). M1 leaves the three chunk products (forward, dx, dW) to XLA and cuBLAS.
CUBLAS_TFLOPS = 727
BLOCK_LINE_MS = 5.5  # issue 61: one block at (64, 1024, 204) bf16, forward + backward


def memory_block(rows: list[dict], width=204, order=220, q_prime=22, chunk=64) -> dict:
    """One LMU block at (64, 1024, ``width``) bf16, forward and backward, as M1 runs it: the
    memory kernels' estimates, and the three chunk products, each 2 x tokens x d x (c + q) x
    3q' FLOPs, at ``CUBLAS_TFLOPS``; against ``BLOCK_LINE_MS``, and whether a kernel spills."""
    kernels = {r["kernel"]: r for r in rows if r["case"].startswith("memory")}
    gemm_ms = 3 * 2 * TOKENS * width * (chunk + order) * 3 * q_prime / (CUBLAS_TFLOPS * 1e9)
    estimates = {name: r.get("estimate_ms") for name, r in kernels.items()}
    block = gemm_ms + sum(e if e is not None else float("nan") for e in estimates.values())
    spills = {name: r.get("spill_store_bytes") for name, r in kernels.items()}
    print(
        f"memory block: {block:.2f} ms estimated (chunk products {gemm_ms:.2f} at cuBLAS's "
        + f"{CUBLAS_TFLOPS} TFLOP/s; "
        + ", ".join(f"{name} {e}" for name, e in estimates.items())
        + f"), line {BLOCK_LINE_MS} ms; spills: {spills}",
        flush=True,
    )
    return {
        "chunk_products_ms": round(gemm_ms, 2),
        "kernels_ms": estimates,
        "block_ms": round(block, 2),
        "line_ms": BLOCK_LINE_MS,
        "spill_store_bytes": spills,
        "passes": block <= BLOCK_LINE_MS and not any(spills.values()),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", nargs="+", type=int, default=[48, 204], help="loss: d")
    parser.add_argument(
        "--loss-launches",
        action="store_true",
        help="instead: the loss kernels at the first --widths in bfloat16 under every launch "
        "that cross_entropy.py --part loss-tiles tries",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "kernel_resources-sm90a.json",
    )
    args = parser.parse_args(argv)
    _lowering_hooks()
    rows = []
    if args.loss_launches:
        rows += loss_launch_rows(args.widths[0], jnp.bfloat16, launch_candidates())
    else:
        for width in args.widths:
            rows += loss_rows(width) + flash_rows(width)
        rows += memory_rows()
    fit = calibrate(rows)
    print_rows(rows)
    if fit["cal"] is not None:
        errors = ", ".join(
            f"{name} {e['estimate_ms']:.2f} vs {e['measured_ms']:.2f}"
            for name, e in fit["kernels"].items()
        )
        print(f"time model: CAL = {fit['cal']}, fitted to the H200's Triton kernels: {errors}")
    verdicts = gate(rows, fit["cal"]) if not args.loss_launches and fit["cal"] else []
    block = memory_block(rows) if not args.loss_launches and fit["cal"] else None
    ptxas = subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout
    record = {
        "benchmark": "kernel_resources",
        "machine": machine(),
        "versions": versions(),
        "compilers": {
            **_plugin_versions(),
            "ptxas": ptxas.strip().splitlines()[-1] if ptxas.strip() else None,
        },
        "target": f"sm_{ARCH.replace('.', '')}a",
        "shared_limit_bytes": SHARED_LIMIT,
        "time_model": {**fit, "tokens": TOKENS, "vocab": VOCAB, "profile": PROFILE.name},
        "gate": verdicts,
        "memory_block": block,
        "rows": rows,
    }
    write_json(args.out, record)


if __name__ == "__main__":
    main()
