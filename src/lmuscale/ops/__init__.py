"""The ops whose implementation a run chooses, and ``resolve``, the one place that chooses.

Each op's reference is plain JAX with its custom VJP; a fused GPU kernel (Pallas) stands beside
it where one has been written:
- ``cross_entropy``: XLA's chunked loss; ``cross_entropy_pallas``: the fused Triton kernels,
  whose logits never leave the chip; ``cross_entropy_flash``: the loss as flash attention over
  the vocabulary, two Mosaic GPU kernels for Hopper (``model.loss_impl``);
- ``implicit_attention``: the LMU's implicit self-attention and ``gelu`` in XLA, in the layout
  the chunk products write Q, K and V on a CPU ("steps-last") or on a GPU ("channels-last");
  ``memory_pallas``: the LMU layer's Triton kernels around XLA's chunk products, the chunk
  states' recurrence and the implicit attention (``model.memory_impl``);
- ``attention``: causal attention, XLA's or cuDNN's flash attention.

A config's switch is "auto", "xla", or a kernel family's name ("pallas"; the loss's "flash"
too): a family runs or is refused by name; "auto" takes one only on a device kind, in a compute
dtype, where a committed benchmark measured it faster than XLA (``Kernels.faster``).
``resolve`` decides every op once per run from the model config and the devices, into an
``Impls`` that the run logs, writes to plan.json and summary.json, and passes to the model
(``models.build``): no op, layer or model chooses for itself. The Triton kernels need NVIDIA
GPUs of compute capability >= 8.0 (the loss's one GPU; the LMU layer's one or several, each on
its share of the batch); the flash kernels compute capability 9.0, one GPU or several.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from lmuscale.outcomes import ConfigError

if TYPE_CHECKING:
    from lmuscale.ops.cross_entropy_pallas import Tiling

IMPLS = ("auto", "xla", "pallas")
MIN_CAPABILITY = (8, 0)  # bf16 tensor-core products in Triton: Ampere and newer
# The GPU the kernels are lowered for when there is none (``lowered_for_cuda``).
CUDA_TARGET = "NVIDIA H100 80GB HBM3"


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A family of fused kernels a switch can run: ``name`` (for messages); ``capability``, the
    least NVIDIA compute capability they need; ``sharded``: several devices run them, each on its
    share of the batch (else one device only); ``half``: they take bfloat16 or float16 alone;
    ``faster``: the (device kind, compute dtype) pairs where a committed benchmark measured them
    faster than XLA, what "auto" takes."""

    name: str
    capability: tuple[int, int] = MIN_CAPABILITY
    sharded: bool = False
    half: bool = False
    faster: frozenset[tuple[str, str]] = frozenset()

    def unsupported(self, dtype, devices) -> str | None:
        """Why they cannot run in ``dtype`` on ``devices``, or None."""
        reason = unsupported_reason(devices, self.capability, self.sharded)
        if reason is not None:
            need = "NVIDIA GPUs" if self.sharded else "one NVIDIA GPU"
            return f"{self.name} need {need} of compute capability >= " + (
                f"{'.'.join(map(str, self.capability))}, but {reason}"
            )
        name = jnp.dtype(dtype).name
        if self.half and name not in ("bfloat16", "float16"):
            return f"{self.name} take bfloat16 or float16, and the model's dtype is {name}"
        return None


@dataclasses.dataclass(frozen=True)
class Switch:
    """A model config's kernel switch: its ``key``, the values it takes (``choices``), and the
    kernel families its values other than "auto" and "xla" run (``kernels``; a value with none
    in this version is refused when a run starts)."""

    key: str
    kernels: dict[str, Kernels]
    choices: tuple[str, ...] = IMPLS

    def __hash__(self):
        return hash(self.key)

    def check(self, name: str, impl) -> None:
        """A ``ValueError`` naming ``name`` unless ``impl`` is one of ``choices``."""
        if impl not in self.choices:
            raise ValueError(f"{name} must be one of {self.choices}, got {impl!r}")

    def choose(self, impl: str, dtype, devices) -> str:
        """What ``impl`` runs in ``dtype`` on ``devices``: "xla" or a kernel family's value; a
        ``ConfigError`` where that family cannot run. "auto" takes the first family measured
        faster here that can run here."""
        self.check(self.key, impl)
        devices = list(devices)
        if impl == "auto":
            measured = (devices[0].device_kind, jnp.dtype(dtype).name)
            for name, kernels in self.kernels.items():
                if measured in kernels.faster and kernels.unsupported(dtype, devices) is None:
                    return name
        if impl in ("auto", "xla"):
            return "xla"
        kernels = self.kernels.get(impl)
        if kernels is None:
            reason = "this version has no Pallas kernels for it"
        else:
            reason = kernels.unsupported(dtype, devices)
        if reason is not None:
            raise ConfigError(f'model.{self.key}="{impl}": {reason}; use "auto" or "xla"')
        return impl


# The kernels' measurements are in the README's "Benchmarks" and benchmarks/results/. The
# flash kernels have not run on a GPU yet: "auto" takes them nowhere until one measures them.
LOSS = Switch(
    "loss_impl",
    {
        "pallas": Kernels(
            "the fused cross-entropy kernels",
            faster=frozenset({("NVIDIA H200", "bfloat16"), ("NVIDIA H100 80GB HBM3", "bfloat16")}),
        ),
        "flash": Kernels("the flash cross-entropy kernels", (9, 0), sharded=True, half=True),
    },
    (*IMPLS, "flash"),
)
# The first fused memory kernels were retired (slower than XLA on every GPU measured); these
# have not run on a GPU: "auto" takes them nowhere until one measures them.
MEMORY = Switch("memory_impl", {"pallas": Kernels("the LMU layer's Pallas kernels", sharded=True)})


@dataclasses.dataclass(frozen=True)
class MemoryKernels:
    """How the LMU layer's kernels run: ``interpret``, in Pallas's interpret mode, on any
    backend (the tests). Set by a test or benchmark, never by a config."""

    interpret: bool = False


@dataclasses.dataclass(frozen=True)
class LossKernels:
    """How the fused cross-entropy runs: ``tiling`` (None: ``default_tiling``),
    ``dh_from_forward`` (dh from the forward's expected embeddings, no dh kernel) and
    ``interpret`` (Pallas's interpret mode, on any backend: the tests). Experiments no GPU has
    timed: a benchmark sets them, a config never does."""

    tiling: Tiling | None = None
    dh_from_forward: bool = False
    interpret: bool = False


FORMS = {
    "memory_layout": ("steps-last", "channels-last"),
    "attention": ("xla", "cudnn"),
    "gelu": ("erfc", "erf"),
    "exact_algorithm": ("highest", "bf16x3"),
    "q_prime_precision": ("highest", "default"),
}
OPTIONAL = ("loss", "memory", "memory_layout")  # None: not run, or not resolved (decoding)


@dataclasses.dataclass(frozen=True)
class Impls:
    """What each op runs, decided by ``resolve``; the defaults are XLA's forms for a CPU.

    - ``loss``: the cross-entropy, "xla", "pallas" (the fused Triton kernels) or "flash" (the
      flash kernels, ``cross_entropy_flash``); ``loss_kernels``: the kernels' options; None: not
      resolved, for decoding;
    - ``memory``: the LMU memory and its attention, "xla" or "pallas" (``memory_pallas``'s
      kernels around XLA's chunk products, which take the "channels-last" layout; None for a
      family without one, or for decoding); ``memory_kernels``: the kernels' options;
    - ``memory_layout``: how XLA's chunked memory writes Q, K and V for the attention:
      "steps-last", (B, J, d, q', c), which XLA's CPU backend reduces fastest, or
      "channels-last", one product for the three, (3 q', c, B, J, d), for a GPU, whose
      reductions want the summed axis minor (in the other order it transposes them);
    - ``attention``: causal attention, "xla" or "cudnn" (flash attention: no n x n scores);
    - ``gelu``: "erfc" (``jax.nn.gelu``'s form; on a CPU it keeps the forward's gelu apart
      from ``gelu_grad``'s erf, which XLA would otherwise keep alive) or "erf" (a GPU's: XLA
      split erfc's expansion over several kernels, each writing Q-sized temporaries);
    - ``exact_algorithm``: how products at float32 accuracy run: "highest" (float32 products)
      or "bf16x3" (three bf16 passes on the tensor cores that XLA's highest would leave,
      1.1e-5 of max|m| at the paper's largest layer);
    - ``q_prime_precision``: what the channels-last attention's products over the positions
      ask XLA for on bf16 operands, "highest" or "default" (the same sums: a product of two
      bf16 numbers is exact in float32). An experiment no GPU has timed, as ``loss_kernels``;
    - ``mesh``: the run's device mesh, whose axes split the batch, for kernels that run on each
      device's share of it (the flash loss, the LMU layer's); None: one device. Not a choice:
      not recorded.
    """

    loss: str | None = "xla"
    memory: str | None = "xla"
    memory_layout: str | None = "steps-last"
    attention: str = "xla"
    gelu: str = "erfc"
    exact_algorithm: str = "highest"
    loss_kernels: LossKernels = LossKernels()
    memory_kernels: MemoryKernels = MemoryKernels()
    q_prime_precision: str = "highest"
    mesh: object = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        loss = ("xla", *LOSS.kernels)
        memory = ("xla", *MEMORY.kernels)
        for name, allowed in {**FORMS, "loss": loss, "memory": memory}.items():
            value = getattr(self, name)
            if value not in allowed and not (value is None and name in OPTIONAL):
                raise ValueError(f"Impls.{name} must be one of {allowed}, got {value!r}")
        if self.memory == "pallas" and self.memory_layout != "channels-last":
            raise ValueError(
                'Impls.memory "pallas" writes Q, K and V channels last, got the '
                f"memory_layout {self.memory_layout!r}"
            )

    def record(self) -> dict:
        """What plan.json, summary.json and the benchmarks' rows say ran (the experiments only
        where they are not the defaults)."""
        record = {
            "loss_impl": self.loss,
            "memory_impl": self.memory,
            "memory_layout": self.memory_layout,
            "attention_impl": self.attention,
            "gelu": self.gelu,
            "exact_algorithm": self.exact_algorithm,
        }
        if self.loss_kernels != LossKernels():
            record["loss_kernels"] = dataclasses.asdict(self.loss_kernels)
        if self.memory_kernels != MemoryKernels():
            record["memory_kernels"] = dataclasses.asdict(self.memory_kernels)
        if self.q_prime_precision != "highest":
            record["q_prime_precision"] = self.q_prime_precision
        return {key: value for key, value in record.items() if value is not None}

    def describe(self) -> str:
        """``cross-entropy: xla; LMU memory: xla, steps-last; ...``, for the log."""
        memory = f"; LMU memory: {self.memory}, {self.memory_layout}" if self.memory_layout else ""
        return (
            f"cross-entropy: {self.loss}{memory}; attention: {self.attention}; gelu: "
            f"{self.gelu}; exact products: {self.exact_algorithm}"
        )


def resolve(model_config, devices=None, *, training: bool = True) -> Impls:
    """What each op of ``model_config`` runs on ``devices`` (default: this process's), once per
    run. ``training`` false (decoding: no loss, no chunked memory) leaves their switches
    unresolved (None). A ``ConfigError`` names a switch that cannot run here."""
    if devices is None:
        devices, platform = jax.devices(), jax.default_backend()
    else:
        devices = list(devices)
        platform = devices[0].platform
    dtype = jnp.dtype(model_config.dtype)
    loss = LOSS.choose(model_config.loss_impl, dtype, devices) if training else None
    memory = layout = None
    if hasattr(model_config, "memory_impl"):  # the LMU families
        memory = MEMORY.choose(model_config.memory_impl, dtype, devices) if training else None
        if memory == "pallas" and model_config.memory_mode != "chunked":
            raise ConfigError(
                f'model.memory_impl="pallas": its kernels run the chunked memory, and '
                f'model.memory_mode is "{model_config.memory_mode}"; use "auto" or "xla"'
            )
        if memory == "pallas" and len(devices) > 1 and model_config.batch_chunk > 0:
            raise ConfigError(
                f'model.memory_impl="pallas": on {len(devices)} devices its kernels split a '
                f"batch over them, and model.batch_chunk={model_config.batch_chunk} runs the "
                "layer on one sequence at a time; use model.batch_chunk=0"
            )
        layout = "channels-last" if platform == "gpu" else "steps-last"
    return Impls(
        loss=loss,
        memory=memory,
        memory_layout=layout,
        attention=attention_implementation(dtype, devices[0]),
        gelu="erf" if platform == "gpu" else "erfc",
        exact_algorithm="highest" if platform == "cpu" else "bf16x3",
    )


def attention_implementation(dtype, device) -> str:
    """``"cudnn"`` on an NVIDIA GPU of compute capability >= 8.0 in bfloat16 or float16,
    ``"xla"`` elsewhere."""
    half = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    return "cudnn" if half and _capability(device) >= MIN_CAPABILITY else "xla"


def _capability(device) -> tuple[int, ...]:
    """An NVIDIA GPU's compute capability, (0,) for any other device (a ROCm GPU has its gfx
    name there)."""
    capability = str(getattr(device, "compute_capability", ""))
    if device.platform != "gpu" or not re.fullmatch(r"\d+\.\d+", capability):
        return (0,)
    return tuple(int(part) for part in capability.split("."))


def unsupported_reason(
    devices=None, capability: tuple[int, int] = MIN_CAPABILITY, sharded: bool = False
) -> str | None:
    """Why kernels that need NVIDIA GPUs of ``capability`` cannot run on ``devices`` (default:
    this run's), or None. Unless ``sharded`` (each device runs them on its share of the batch),
    one device only: under a sharded ``jit`` XLA would gather every device's inputs onto each."""
    devices = jax.devices() if devices is None else list(devices)
    device = devices[0]
    if device.platform != "gpu":
        return f"this run's devices are {device.platform} ({device.device_kind})"
    if _capability(device) == (0,):
        found = getattr(device, "compute_capability", "") or "no"
        return f"the GPU is not an NVIDIA one ({device.device_kind}, {found} capability)"
    if _capability(device) < capability:
        least = ".".join(map(str, capability))
        return (
            f"the GPU {device.device_kind} has compute capability {device.compute_capability}, "
            f"below {least}"
        )
    if len(devices) > 1 and not sharded:
        return f"this run has {len(devices)} devices, and the kernels are not partitioned"
    return None


def check_operands(h_BxTxD, w_VxD, targets_BxT) -> None:
    """A ValueError unless h is (B, T, D), w (V, D) with V > 0, and targets (B, T): the
    cross-entropy kernels' operands."""
    if h_BxTxD.shape[:-1] != targets_BxT.shape or h_BxTxD.shape[-1] != w_VxD.shape[-1]:
        raise ValueError(
            f"h {h_BxTxD.shape}, w {w_VxD.shape} and targets {targets_BxT.shape} do not fit: "
            "h is (B, T, D), w (V, D), targets (B, T)"
        )
    if w_VxD.shape[0] == 0:
        raise ValueError(f"w {w_VxD.shape} has no rows: the vocabulary is empty")


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
