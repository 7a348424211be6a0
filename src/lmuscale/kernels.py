"""The switch every Pallas kernel shares: a config key "auto", "xla" or "pallas".

- "xla" runs the XLA path everywhere.
- "pallas" runs the kernels, and is a ``ValueError`` naming why where they cannot run.
- "auto" runs the kernels only on a device kind, in a compute dtype, where a committed GPU
  benchmark measured them faster than the XLA path (each kernel's ``FASTER_THAN_XLA``), the XLA
  path elsewhere (a CPU, a TPU, another GPU, another dtype). It never falls back silently from
  a run that asked for "pallas".

The kernels (``models.fused_loss``, ``memory_kernel``) are written for Pallas's Triton lowering:
one NVIDIA GPU of compute capability >= 8.0.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "pallas")
MIN_CAPABILITY = (8, 0)  # bf16 tensor-core products in Triton: Ampere and newer


def unsupported_reason(devices=None) -> str | None:
    """Why the kernels cannot run on ``devices`` (default: this run's), or None: they need one
    NVIDIA GPU of compute capability >= 8.0. They are not partitioned, so under a sharded
    ``jit`` XLA would gather every device's inputs onto each device."""
    devices = jax.devices() if devices is None else list(devices)
    device = devices[0]
    if device.platform != "gpu":
        return f"this run's devices are {device.platform} ({device.device_kind})"
    # NVIDIA's "major.minor"; a ROCm GPU has its gfx name here.
    capability = str(getattr(device, "compute_capability", ""))
    if not re.fullmatch(r"\d+\.\d+", capability):
        return (
            f"the GPU is not an NVIDIA one ({device.device_kind}, {capability or 'no'} capability)"
        )
    if tuple(int(part) for part in capability.split(".")) < MIN_CAPABILITY:
        return f"the GPU {device.device_kind} has compute capability {capability}, below 8.0"
    if len(devices) > 1:
        return f"this run has {len(devices)} devices, and the kernels are not partitioned yet"
    return None


def check(key: str, impl: str) -> None:
    """A ``ValueError`` naming ``key`` unless ``impl`` is one of ``IMPLS``."""
    if impl not in IMPLS:
        raise ValueError(f"{key} must be one of {IMPLS}, got {impl!r}")


def resolve(
    impl: str,
    *,
    key: str,
    kernels: str,
    faster: frozenset[tuple[str, str]],
    dtype,
    devices=None,
) -> str:
    """What a config's ``key`` = ``impl`` runs in compute ``dtype`` on ``devices`` (default:
    this run's): "xla" or "pallas". ``kernels`` names them in the error for "pallas" where they
    cannot run; ``faster`` is the (device kind, dtype name) pairs where a benchmark measured
    them faster than XLA (what "auto" takes)."""
    check(key, impl)
    if impl == "xla":
        return "xla"
    devices = jax.devices() if devices is None else list(devices)
    reason = unsupported_reason(devices)
    if impl == "pallas" and reason is not None:
        raise ValueError(
            f'{key}="pallas": {kernels} need one NVIDIA GPU of compute capability >= 8.0, '
            f'but {reason}; use "auto" or "xla"'
        )
    measured = (devices[0].device_kind, jnp.dtype(dtype).name)
    measured_faster = reason is None and measured in faster
    return "pallas" if impl == "pallas" or measured_faster else "xla"


# The GPU the kernels are lowered for when there is none (``lowered_for_cuda``).
CUDA_TARGET = "NVIDIA H100 80GB HBM3"


def lowered_for_cuda(function, *args, device_kind: str = CUDA_TARGET):
    """``jax.jit(function)`` traced at ``args`` (arrays or ``ShapeDtypeStruct``) and lowered for
    CUDA on any machine, a CPU one included: the checks that every kernel has a Triton lowering,
    and ``benchmarks/kernel_resources.py``'s compile for an H100. Pallas's Triton lowering reads
    the target GPU from the abstract mesh (jax >= 0.11 refuses to lower with no GPU otherwise),
    so the lowering runs under a one-device mesh of ``device_kind``."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    target = AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=target)
    with use_abstract_mesh(mesh):
        return jax.jit(function).trace(*args).lower(lowering_platforms=("cuda",))
