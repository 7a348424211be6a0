"""The paper's train step compiled for an H100 on a machine without one: where its traffic goes.

    pip install "jax-cuda12-plugin==$(python -c 'import jaxlib; print(jaxlib.__version__)')"
    JAX_PLATFORMS=cpu python benchmarks/gpu_aot.py [--models lmu-1M transformer-1M]
        [--batch 64] [--dtype bfloat16] [--impl auto] [--layout channels-last] [--top 10]
        [--out FILE]

XLA's GPU compiler compiles the train step of ``lmuscale.train`` (Adam, the chunked loss; one
micro-batch of --batch sequences of 1024 tokens) for a one-device H100 topology
(``jax.experimental.topologies``: no GPU and no driver, only the CUDA plugin's wheel, as for
``kernel_resources.py``). The model's ops run as ``ops.resolve`` decides for an H100
(``H100_DEVICE``: the GPU's memory layout, gelu and exact products; the fused cross-entropy
where --impl, the configs' ``loss_impl``, takes it: "auto" in bfloat16, or "pallas"), but
for causal attention, which stays XLA's (cuDNN's is a library call, outside the estimate).
The fused kernels are lowered for the H100; their FLOPs are inside Triton's calls, not in
the HLO, so their floors count their bytes only. Triton's GEMM fusions are off: their tiles
come from the autotuner, which needs a GPU, so cuBLAS's calls stand in. XLA is this
jaxlib's, which need not be the GPU machine's. --layout steps-last compiles the LMUs with
their memory in a CPU's layout.

From the compiled HLO, each kernel's HBM traffic is estimated as its operands plus its
outputs (an operand a fusion only slices counts its slices; an update in place counts the
update, twice), its FLOPs from its matmuls, and a loop body's kernels are counted once per
trip. A kernel's floor is the longer of its bytes at 3.35 TB/s and its FLOPs at 989 TFLOP/s;
their sum is a lower bound on the step's time, launch gaps and imperfect kernels aside. On
the code of 2026-11-23 (``results/train_throughput-h100.json``), lmu-1M's measured micro-batch
took 1.24x this estimate; on the H200 on 2026-11-27 (``results/gpu-nvidia-h200.json``), 2.0x
(lmu-1M: its transposes run far below the bandwidth the floor assumes) and 1.34x
(transformer-1M). The estimate is for comparing two versions of the code, or the
parts of one; the time itself is ``gpu.py``'s to measure on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from common import abstract_step_inputs, machine, print_table, train_step_for, versions, write_json

from lmuscale import ops
from lmuscale.models import named_config
from lmuscale.train.metrics import PEAK_FLOPS

# The H100 SXM as XLA's GPU compiler describes a device (its GpuTargetConfig, text format).
H100_TARGET = (
    """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 }
"""
    + f'device_description_str: "{ops.CUDA_TARGET}"\n'
)
# The device ``ops.resolve`` decides for, as JAX would describe that H100.
H100_DEVICE = SimpleNamespace(platform="gpu", device_kind=ops.CUDA_TARGET, compute_capability="9.0")
HBM_BYTES_PER_S = float(re.search(r"memory_bandwidth: (\d+)", H100_TARGET).group(1))
BF16_FLOPS_PER_S = dict(PEAK_FLOPS)["H100"]["bfloat16"]  # dense


def h100():
    """A one-device H100 topology to compile for, without a GPU."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        platform="cuda", target_config=H100_TARGET, topology="1x1x1"
    )


def compiled_step_text(
    name: str, batch: int, dtype: str, devices, impl: str = "auto", layout: str = ""
) -> str:
    """The HLO text of ``name``'s train step on one micro-batch, compiled for ``devices``, its
    ops as ``ops.resolve`` decides for ``H100_DEVICE`` with the config's ``loss_impl`` =
    ``impl`` (causal attention XLA's; ``layout``: an LMU memory's, if given)."""
    positions = {"max_len": 1024} if name.startswith("transformer") else {}
    memory = {"batch_chunk": 0} if name.startswith("lmu") else {}
    config = named_config(name, dtype=dtype, loss_impl=impl, **positions, **memory)
    impls = dataclasses.replace(ops.resolve(config, [H100_DEVICE]), attention="xla")
    if layout and impls.memory_layout:
        impls = dataclasses.replace(impls, memory_layout=layout)
    train_step, _, mesh, abstract = train_step_for(config, 1024, devices, impls)
    lowered = train_step.lower(*abstract_step_inputs(mesh, abstract, batch, 1024))
    # Triton's GEMM tiles come from the autotuner, which needs a GPU.
    return lowered.compile({"xla_gpu_enable_triton_gemm": False}).as_text()


# ---------------------------------------------------------------- the HLO's kernels

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_HEADER = re.compile(r"(ENTRY )?%(\S+) \((.*?)\) -> .* \{$")
_INSTRUCTION = re.compile(r"\s*(ROOT )?%(\S+) = (\([^=]*?\)|\S+) ([\w-]+)\((.*)$")
# Instructions that move no data of their own (a while, call or conditional is walked into).
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all"}
_FREE |= {"partition-id", "replica-id", "opt-barrier", "add-dependency"}


def _elements(dims: str) -> int:
    count = 1
    for n in dims.split(","):
        count *= int(n) if n else 1
    return count


def nbytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (a tuple's elements summed)."""
    return sum(_elements(dims) * _BYTES[dtype] for dtype, dims in _ARRAY.findall(shape))


def _dims(shape: str) -> list[int]:
    match = _ARRAY.search(shape)
    return [int(n) for n in match.group(2).split(",") if n] if match else []


def _operands(text: str) -> list[str]:
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        if ch == ")":
            if depth == 0:
                return re.findall(r"%([^\s,)]+)", text[:i])
            depth -= 1
    return []


def computations(hlo: str) -> dict:
    """``{name: {"entry", "params": {name: shape}, "instructions": [...]}}`` of an HLO text."""
    hlo = re.sub(r"/\*index=\d+\*/", "", hlo)
    found = {}
    for block in re.split(r"\n(?=\S)", hlo):
        header = _HEADER.match(block.split("\n", 1)[0])
        if not header:
            continue
        params = dict(re.findall(r"(\S+?): (\([^)]*\)|\S+\[[0-9,]*\])", header.group(3)))
        instructions = []
        for line in block.split("\n")[1:]:
            match = _INSTRUCTION.match(line)
            if match:
                root, name, shape, op, rest = match.groups()
                instructions.append(
                    {"name": name, "shape": shape, "op": op, "operands": _operands(rest)}
                    | {"root": bool(root), "line": line}
                )
        found[header.group(2)] = {
            "entry": bool(header.group(1)),
            "params": params,
            "instructions": instructions,
        }
    return found


def _fusion_bytes(instruction: dict, shapes: dict, body: dict) -> int:
    written = nbytes(instruction["shape"])
    inner = body["instructions"]
    users = collections.defaultdict(list)
    for i in inner:
        for name in i["operands"]:
            users[name].append(i)
    in_place = set()
    root = next((i for i in inner if i["root"]), None)
    if root is not None and root["op"] == "dynamic-update-slice":
        update = next(i for i in inner if i["name"] == root["operands"][1])
        written = 2 * nbytes(update["shape"])
        in_place.add(root["operands"][0])
    read = 0
    for i in inner:
        if i["op"] != "parameter" or i["name"] in in_place:
            continue
        index = int(re.search(r"parameter\((\d+)\)", i["line"]).group(1))
        whole = nbytes(shapes.get(instruction["operands"][index], ""))
        sliced = users[i["name"]]
        if sliced and all(u["op"] in ("slice", "dynamic-slice") for u in sliced):
            whole = min(whole, sum(nbytes(u["shape"]) for u in sliced))
        read += whole
    return written + read


def _dot_flops(dot: dict, shapes: dict) -> int:
    lhs = _dims(shapes.get(dot["operands"][0], ""))
    contracted = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", dot["line"])
    depth = 1
    for axis in contracted.group(1).split(",") if contracted and contracted.group(1) else []:
        depth *= lhs[int(axis)]
    return 2 * _elements(",".join(map(str, _dims(dot["shape"])))) * depth


def _gemm_flops(call: dict, shapes: dict) -> int:
    lhs = _dims(shapes.get(call["operands"][0], ""))
    contracted = re.search(r'"lhs_contracting_dimensions":\[([0-9",]*)\]', call["line"])
    depth = 1
    for axis in contracted.group(1).replace('"', "").split(",") if contracted else []:
        depth *= lhs[int(axis)] if axis else 1
    return 2 * _elements(",".join(map(str, _dims(call["shape"])))) * depth


def kernels_of(hlo: str) -> list[dict]:
    """Each kernel of a compiled HLO module: ``{"name", "op", "bytes", "flops", "launches",
    "shape", "source"}``, bytes and FLOPs summed over its launches (a loop's trips)."""
    found = computations(hlo)
    rows = []

    def walk(name: str, trips: int) -> None:
        computation = found[name]
        shapes = dict(computation["params"])
        shapes.update({i["name"]: i["shape"] for i in computation["instructions"]})
        for i in computation["instructions"]:
            op, line = i["op"], i["line"]
            if op in _FREE:
                continue
            if op == "while":
                body = re.search(r"body=%([^\s,]+)", line).group(1)
                count = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                walk(body, trips * (int(count.group(1)) if count else 1))
                continue
            if op in ("call", "conditional"):
                for callee in re.findall(r"(?:to_apply|calls|computations)=\{?%([^\s,}]+)", line):
                    walk(callee, trips)
                continue
            callee = re.search(r"calls=%([^\s,]+)", line)
            body = found.get(callee.group(1)) if callee else None
            flops = 0
            if op == "fusion" and body is not None:
                moved = _fusion_bytes(i, shapes, body)
                inner = {**body["params"], **{j["name"]: j["shape"] for j in body["instructions"]}}
                flops = sum(_dot_flops(j, inner) for j in body["instructions"] if j["op"] == "dot")
                kind = re.search(r"kind=(\w+)", line)
                op = f"fusion ({kind.group(1)})" if kind else op
            else:
                moved = nbytes(i["shape"]) + sum(nbytes(shapes.get(n, "")) for n in i["operands"])
                if op == "dot":
                    flops = _dot_flops(i, shapes)
                target = re.search(r'custom_call_target="([^"]+)"', line)
                if target:
                    op = target.group(1)
                    if "gemm" in op or "matmul" in op:
                        flops = _gemm_flops(i, shapes)
            # A fusion's own line may name no source; then the first of its body's that does.
            lines = [line] + ([j["line"] for j in body["instructions"]] if body else [])
            source = next(
                (m for m in (re.search(r'op_name="([^"]*)"', x) for x in lines) if m), None
            )
            rows.append(
                {
                    "name": i["name"],
                    "op": op,
                    "bytes": moved * trips,
                    "flops": flops * trips,
                    "launches": trips,
                    "shape": i["shape"].split("{")[0],
                    "source": source.group(1) if source else "",
                }
            )

    walk(next(n for n, c in found.items() if c["entry"]), 1)
    return rows


def floor_seconds(row: dict) -> float:
    return max(row["bytes"] / HBM_BYTES_PER_S, row["flops"] / BF16_FLOPS_PER_S)


# The part of a model a kernel belongs to: the first whose pattern its source matches, else
# "other" (the optimizer, the embedding, and kernels whose source XLA did not keep). An LMU's
# "pre" is its pre-FFN, or in lmu_g its global attention (projections "qkv" and "out").
PARTS = (
    ("memory", r"/memory/"),
    ("attention", r"/attention/|/pre/(qkv|out|vmap)"),
    ("feed-forward", r"/(pre|post|mlp|ffn)/"),
    ("other layers", r"\.hidden/"),  # recurrences, norms, residuals
    ("loss", r"LanguageModel\.loss\)+/(while/|pallas_call|[^/]*$)"),
)


def part_of(source: str) -> str:
    return next((part for part, pattern in PARTS if re.search(pattern, source)), "other")


def summary(rows: list[dict]) -> dict:
    parts = collections.defaultdict(lambda: {"bytes": 0, "flops": 0, "floor_seconds": 0.0})
    for row in rows:
        part = parts[part_of(row["source"])]
        part["bytes"] += row["bytes"]
        part["flops"] += row["flops"]
        part["floor_seconds"] += floor_seconds(row)
    return {
        "kernels": len(rows),
        "launches": sum(r["launches"] for r in rows),
        "bytes": sum(r["bytes"] for r in rows),
        "flops": sum(r["flops"] for r in rows),
        "floor_seconds": sum(floor_seconds(r) for r in rows),
        "parts": dict(parts),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["lmu-1M", "transformer-1M"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--impl", default="auto", choices=ops.LOSS.choices, help="model.loss_impl")
    parser.add_argument(
        "--layout",
        default="channels-last",
        choices=ops.FORMS["memory_layout"],
        help="the LMUs' memory layout (a GPU's: channels-last)",
    )
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument(
        "--out", type=Path, help="default: results/gpu_aot-h100.json (-pallas.json for pallas)"
    )
    args = parser.parse_args(argv)
    suffix = "" if args.impl == "auto" else f"-{args.impl}"
    suffix += "" if args.layout == "channels-last" else f"-{args.layout}"
    out = args.out or Path(__file__).parent / "results" / f"gpu_aot-h100{suffix}.json"
    devices = h100().devices
    records = {}
    for name in args.models:
        start = time.perf_counter()
        text = compiled_step_text(name, args.batch, args.dtype, devices, args.impl, args.layout)
        rows = kernels_of(text)
        record = summary(rows) | {"compile_seconds": time.perf_counter() - start}
        record["top"] = sorted(rows, key=floor_seconds, reverse=True)[: args.top]
        records[name] = record
        print_table(
            f"{name}, one micro-batch of {args.batch} x 1024 in {args.dtype}, compiled for an "
            f"H100: {record['kernels']} kernels, {record['launches']} launches",
            ("part", "GB", "TFLOP", "floor ms"),
            [
                (
                    p,
                    f"{v['bytes'] / 1e9:.1f}",
                    f"{v['flops'] / 1e12:.2f}",
                    f"{v['floor_seconds'] * 1e3:.1f}",
                )
                for p, v in sorted(record["parts"].items(), key=lambda kv: -kv[1]["floor_seconds"])
            ]
            + [
                (
                    "all",
                    f"{record['bytes'] / 1e9:.1f}",
                    f"{record['flops'] / 1e12:.2f}",
                    f"{record['floor_seconds'] * 1e3:.1f}",
                )
            ],
        )
        print_table(
            f"{name}: the {args.top} kernels with the longest floors",
            ("kernel", "op", "shape", "GB", "floor ms", "source"),
            [
                (
                    r["name"],
                    r["op"],
                    r["shape"],
                    f"{r['bytes'] / 1e9:.2f}",
                    f"{floor_seconds(r) * 1e3:.2f}",
                    r["source"][-60:],
                )
                for r in record["top"]
            ],
        )
    write_json(
        out,
        {
            "benchmark": "gpu_aot",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "target": "NVIDIA H100 80GB HBM3 (deviceless compile)",
            "machine": machine(),
            "versions": versions(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "models": records,
        },
    )


if __name__ == "__main__":
    main()
