"""Accelerators (GPUs, and any other non-CPU jax backend): bfloat16, the Pallas kernels, the
powers of two, and a step-cost prior from the device's own figures.

**Attention.** "auto" is the Mosaic GPU kernel (``pallas_kernels.ragged_paged_attention_mosaic``:
TMA and wgmma, Hopper and newer) on compute capability >= 9.0 with a 16-bit or 8-bit KV cache
and pages of a multiple of 8 tokens, and the Triton kernel (``ragged_paged_attention_triton``)
below 9.0, for a float32 cache (which wgmma would round to TF32) or smaller pages. Any other
accelerator runs the jnp op.

**Step cost.** A GPU reads all weights in every step and computes a prompt token in far less
time than that read, so padding a step is cheaper there than running another and a decode step
costs what its weights take to read whatever its rows: the power-of-two buckets suffice. The
prior of the step-cost model (``step_cost_prior``; the engine refits it from timed probe steps at
start-up and from every measured step) is the roofline of the device's datasheet figures
(``DEVICE_FIGURES``) at assumed efficiencies (``BANDWIDTH_EFFICIENCY``,
``MATMUL_EFFICIENCY``): a step's fixed cost is the weights' bytes over the bandwidth, a prompt
token ``2 * params`` FLOPs over the matmul rate, a prompt query-key pair ``4 * q_heads *
head_dim * layers`` FLOPs. None of it is measured on a GPU yet
(docs/decisions/0043-mosaic-gpu-attention.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxserve.config import DEFAULT_SLOS_MS, EngineConfig
from jaxserve.platform.base import BucketSet, Platform, StepCostPrior
from models.config import ModelConfig
from models.quant import QuantTargets

log = logging.getLogger(__name__)
GPU_NAMES = ("gpu", "cuda", "rocm")
MOSAIC_MIN_CAPABILITY = (9, 0)  # TMA and wgmma: Hopper
MOSAIC_BLOCK_SIZE_MULTIPLE = 8  # a page's rows land in shared-memory tiles of 8 rows


@dataclass(frozen=True)
class DeviceFigures:
    """A GPU's datasheet peaks: HBM bandwidth (bytes/s) and dense bfloat16 tensor FLOP/s
    (float32 accumulation, no sparsity)."""

    memory_bytes_s: float
    bf16_flops: float


# ``device_kind`` substring -> figures, first match wins (so "H100 PCIe" before "H100").
# Sources: NVIDIA datasheets: H100 (SXM 3.35 TB/s, 989 TF; PCIe 2.0 TB/s, 756 TF; NVL 3.9 TB/s,
# 835 TF) and H200 (SXM 4.8 TB/s, 989 TF; NVL 4.8 TB/s, 835 TF), nvidia.com/en-us/data-center/
# h100/ and /h200/ (the tables list bf16 "with sparsity", twice these); A100 (80GB SXM 2.039
# TB/s, 40GB 1.555 TB/s, 80GB PCIe 1.935 TB/s; 312 TF), nvidia-a100-datasheet-us-nvidia-1758950-
# r4-web.pdf; L40S (864 GB/s, 362 TF), L40S product brief; L4 (300 GB/s, 121 TF), L4 datasheet;
# RTX 4090 (1008 GB/s, 165.2 TF bf16 with float32 accumulation), NVIDIA Ada GPU architecture
# whitepaper v2.1, appendix A; B200 (8 TB/s, 2.25 PF), HGX B200 datasheet.
DEVICE_FIGURES: tuple[tuple[str, DeviceFigures], ...] = (
    ("H200 NVL", DeviceFigures(4.8e12, 835e12)),
    ("H200", DeviceFigures(4.8e12, 989e12)),
    ("H100 PCIe", DeviceFigures(2.0e12, 756e12)),
    ("H100 NVL", DeviceFigures(3.9e12, 835e12)),
    ("H100", DeviceFigures(3.35e12, 989e12)),
    ("A100-SXM4-40GB", DeviceFigures(1.555e12, 312e12)),
    ("A100-PCIE-40GB", DeviceFigures(1.555e12, 312e12)),
    ("A100 80GB PCIe", DeviceFigures(1.935e12, 312e12)),
    ("A100", DeviceFigures(2.039e12, 312e12)),
    ("L40S", DeviceFigures(864e9, 362e12)),
    ("L4", DeviceFigures(300e9, 121e12)),
    ("RTX 4090", DeviceFigures(1.008e12, 165.2e12)),
    ("B200", DeviceFigures(8.0e12, 2250e12)),
)
UNKNOWN_DEVICE = DeviceFigures(1.0e12, 100e12)  # a device kind not listed: a modest guess
BANDWIDTH_EFFICIENCY = 0.8  # share of the HBM peak a weight read reaches (assumed)
MATMUL_EFFICIENCY = 0.5  # share of the bf16 peak a prompt step's matmuls reach (assumed)


class Device(Protocol):
    """What the platform reads of a jax device (a stub in tests)."""

    device_kind: str
    compute_capability: str


def device_figures(device_kind: str) -> DeviceFigures | None:
    """The ``DEVICE_FIGURES`` row whose name ``device_kind`` contains; None if none does."""
    for name, figures in DEVICE_FIGURES:
        if name in device_kind:
            return figures
    return None


class GpuPlatform(Platform):
    """A jax backend other than the CPU; the Pallas kernels where it is a GPU.

    Args:
      name: jax's backend name ("gpu", "cuda", "rocm", "tpu", ...).
      device: the device whose kind and compute capability decide (default: the backend's
        first device, asked when first needed).
    """

    default_slos_ms = DEFAULT_SLOS_MS["gpu"]  # unmeasured on a GPU (docs/configuration.md#slos)

    def __init__(self, name: str, device: Device | None = None) -> None:
        self.name = name
        self._device = device

    @property
    def device(self) -> Device:
        if self._device is None:  # asked late: constructing the platform starts no backend
            self._device = jax.devices(self.name)[0]
        return self._device

    @property
    def figures(self) -> DeviceFigures:
        """The device's ``DEVICE_FIGURES`` (``UNKNOWN_DEVICE``, logged, for an unlisted kind)."""
        kind = getattr(self.device, "device_kind", "?")
        figures = device_figures(kind)
        if figures is None:
            log.warning("no datasheet figures for device kind %r: the step-cost prior assumes "
                        "%s until steps are measured", kind, UNKNOWN_DEVICE)
            return UNKNOWN_DEVICE
        return figures

    @property
    def step_overhead_tokens(self) -> int:  # the ridge point of bfloat16 weights
        f = self.figures
        return round(f.bf16_flops * MATMUL_EFFICIENCY / (f.memory_bytes_s * BANDWIDTH_EFFICIENCY))

    def compute_capability(self) -> tuple[int, ...]:
        """The device's CUDA compute capability, e.g. ``(9, 0)``; ``(0,)`` where unknown."""
        cc = getattr(self.device, "compute_capability", None)
        try:
            return tuple(int(x) for x in str(cc).split("."))
        except ValueError:
            return (0,)

    def resolve_dtype(self, name: str) -> jnp.dtype:
        return jnp.dtype(jnp.bfloat16 if name == "auto" else name)

    def compute_dtype(self, dtype: jnp.dtype) -> jnp.dtype:
        return jnp.dtype(dtype)

    def attention_backend(self, config: EngineConfig) -> str:
        if config.cpu_kernels == "on":
            raise ValueError(f"cpu_kernels='on' (the native CPU kernels) runs on CPUs only, "
                             f"not on {self.name!r}")
        backend = config.attention_backend
        gpu = self.name in GPU_NAMES
        if backend in ("pallas", "mosaic") and not gpu:
            raise ValueError(f"attention_backend={backend!r} (a compiled Pallas kernel) runs on "
                             f"GPUs only, not on {self.name!r}")
        float32_cache = (config.kv_cache_dtype == "auto"
                         and self.resolve_dtype(config.dtype) == jnp.float32)
        small_pages = config.block_size % MOSAIC_BLOCK_SIZE_MULTIPLE != 0
        if backend == "mosaic":
            if self.compute_capability() < MOSAIC_MIN_CAPABILITY:
                raise ValueError(f"attention_backend='mosaic' needs compute capability >= 9.0 "
                                 f"(TMA, wgmma); this {self.device.device_kind} has "
                                 f"{self.device.compute_capability}: use 'pallas'")
            if float32_cache:
                raise ValueError("attention_backend='mosaic' takes a 16-bit or 8-bit KV cache, "
                                 "not dtype='float32' with kv_cache_dtype='auto': use 'pallas'")
            if small_pages:
                raise ValueError(f"attention_backend='mosaic' needs block_size a multiple of "
                                 f"{MOSAIC_BLOCK_SIZE_MULTIPLE} (TMA tile rows), not "
                                 f"{config.block_size}: use 'pallas'")
        if backend != "auto":
            return backend
        if not gpu:
            return "reference"
        mosaic = (self.compute_capability() >= MOSAIC_MIN_CAPABILITY and not float32_cache
                  and not small_pages)
        return "mosaic" if mosaic else "pallas"

    def step_cost_prior(self, model_config: ModelConfig, dtype: jnp.dtype
                        ) -> StepCostPrior | None:
        """The roofline of ``figures`` (module docstring); None off GPUs."""
        if self.name not in GPU_NAMES:
            return None
        f, mc = self.figures, model_config
        weight_bytes = mc.num_params * jnp.dtype(dtype).itemsize
        token_s = 2 * mc.num_params / (f.bf16_flops * MATMUL_EFFICIENCY)
        fixed_s = weight_bytes / (f.memory_bytes_s * BANDWIDTH_EFFICIENCY)
        pair_s = 4 * mc.num_heads * mc.head_dim * mc.num_layers / (
            f.bf16_flops * MATMUL_EFFICIENCY)
        return StepCostPrior(step_overhead_tokens=max(1, round(fixed_s / token_s)),
                             prompt_token_s=token_s, prefill_pair_s=pair_s)

    def prepare_weights(self, params, config: EngineConfig, dtype: jnp.dtype,
                        targets: QuantTargets | None):
        return params

    def buckets(self, config: EngineConfig) -> BucketSet:
        return BucketSet()
