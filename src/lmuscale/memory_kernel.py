"""The LMU's chunk products and implicit attention as one fused Pallas kernel.

(being written: the API below is fixed)
"""

from __future__ import annotations

import jax.numpy as jnp

from lmuscale import kernels

MEMORY_IMPLS = kernels.IMPLS

# Device kinds where a committed GPU benchmark (benchmarks/gpu.py's ``block`` part, results under
# benchmarks/results/) measured the kernel's forward+backward faster than the XLA chunked path.
# None has been measured on a GPU yet.
FASTER_THAN_XLA: frozenset[str] = frozenset()


def unsupported_reason(devices=None) -> str | None:
    """Why the kernel cannot run on ``devices`` (``kernels.unsupported_reason``), or None."""
    return kernels.unsupported_reason(devices)


def resolve(impl: str, devices=None) -> str:
    """What a config's ``memory_impl`` runs on ``devices`` (default: this run's): "xla" or
    "pallas", by the switch every kernel shares (``kernels.resolve``)."""
    return kernels.resolve(
        impl,
        key="memory_impl",
        kernels="the fused LMU memory kernels",
        faster=FASTER_THAN_XLA,
        devices=devices,
    )


def memory_attention(
    x_BxJxDxZ, w_3xZxKxc, bias_3xK, p_K, *, precision="exact", dtype=jnp.float32, interpret=False
):
    """``layers.implicit_attention`` of the three ``lmu.chunk_product`` outputs, fused:
    ``m_BxJxcxD`` (chunk j's step t at [:, j, t]; reshape to (B, J c, D) for positions) in
    ``dtype``. ``x_BxJxDxZ`` is ``lmu.chunk_operands``'s operand, ``w_3xZxKxc`` the three
    ``lmu.chunk_weights`` stacked, ``precision`` as in ``lmu.chunk_product``."""
    raise NotImplementedError
