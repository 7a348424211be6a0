"""What each Pallas kernel asks of an H100, found without one: registers, spills, shared memory.

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

Each row: the shared memory the program needs (Triton's count), and from ptxas the registers
per thread, the spill stores and loads (bytes of local-memory traffic the code has, not
counts of execution) and the stack frame. An H100 gives a program at most 227 KB of shared
memory (``SHARED_LIMIT``): a kernel asking more is refused when XLA compiles it, and so can
never run there. Spills and stack are slow local memory. Times are not measured here:
``benchmarks/gpu.py``'s ``loss`` and ``loss_tiles`` parts measure them on a GPU.
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
from common import machine, print_table, versions, write_json
from cross_entropy import launch_candidates

from lmuscale import ops
from lmuscale.ops import cross_entropy_pallas as fused_loss

SHARED_LIMIT = 227 * 1024  # bytes of shared memory an H100 gives one program (block)
ARCH = "9.0"  # the H100's compute capability; ptxas takes sm_90a, the features Triton uses
PTXAS_SECONDS = 900


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
    path = folder / f"{name}.ptx"
    path.write_text(ptx)
    command = ["ptxas", "-v", f"-arch=sm_{ARCH.replace('.', '')}a", str(path), "-o", os.devnull]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PTXAS_SECONDS)
    except subprocess.TimeoutExpired:
        return {"ptxas_error": f"ptxas ran over {PTXAS_SECONDS} s"}
    if done.returncode:
        return {"ptxas_error": done.stderr.strip()[-300:]}

    def number(pattern):
        found = re.search(pattern, done.stderr)
        return int(found.group(1)) if found else None

    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
        "stack_frame_bytes": number(r"(\d+) bytes stack frame"),
    }


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
            i: pool.submit(_ptxas, text, Path(scratch), f"{label}-{rows[i]['kernel']}")
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
        rows += compile_rows(label, *_loss_step(width, dtype, tiling), _launch_of(tiling))
    tiling = fused_loss.default_tiling(width, jnp.bfloat16)
    rows += _expected_forward(
        compile_rows(
            f"loss d={width} bfloat16 dh from the forward",
            *_loss_step(width, jnp.bfloat16, tiling, dh_from_forward=True),
            _launch_of(tiling),
        )
    )
    if fused_loss.padded_width(width, True) < fused_loss.padded_width(width):
        split = dataclasses.replace(tiling, split_width=True)
        label = f"loss d={width} bfloat16 split width"
        rows += compile_rows(label, *_loss_step(width, jnp.bfloat16, split), _launch_of(split))
        step = _loss_step(width, jnp.bfloat16, split, dh_from_forward=True)
        rows += _expected_forward(compile_rows(label, *step, _launch_of(split)))
    for row in rows:
        row.update(d=width)
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
            cell(row, "spill_load_bytes"),
            cell(row, "stack_frame_bytes"),
            (row.get("triton_error") or row.get("ptxas_error") or "")[:60],
        )
        for row in rows
    ]
    header = ("case", "kernel", "shared KB", "fits", "regs", "spill st B", "spill ld B", "stack B")
    print_table(
        f"Pallas kernels compiled for sm_90a (an H100 gives a program {SHARED_LIMIT // 1024} KB "
        "of shared memory)",
        (*header, "error"),
        table,
        left=2,
    )


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
            rows += loss_rows(width)
    print_rows(rows)
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
        "rows": rows,
    }
    write_json(args.out, record)


if __name__ == "__main__":
    main()
