"""Accelerators (GPUs, and any other non-CPU jax backend): bfloat16, the Pallas kernels, the
powers of two.

**Attention.** "auto" is the Mosaic GPU kernel (``pallas_kernels.ragged_paged_attention_mosaic``:
TMA and wgmma, Hopper and newer) on compute capability >= 9.0 with a 16-bit or 8-bit KV cache,
and the Triton kernel (``ragged_paged_attention_triton``) below 9.0 or for a float32 cache, which
wgmma would round to TF32. Any other accelerator runs the jnp op.

A GPU reads all weights in every step and computes a prompt token in far less time than a
step's fixed cost, so padding a step is cheaper there than running another
(``step_overhead_tokens``), and a decode step reads the weights once whatever its rows: the
power-of-two buckets suffice. The native CPU kernels do not exist here.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.platform.base import BucketSet, Platform
from models.quant import QuantTargets

GPU_NAMES = ("gpu", "cuda", "rocm")
MOSAIC_MIN_CAPABILITY = (9, 0)  # TMA and wgmma: Hopper


class Device(Protocol):
    """What the platform reads of a jax device (a stub in tests)."""

    device_kind: str
    compute_capability: str


class GpuPlatform(Platform):
    """A jax backend other than the CPU; the Pallas kernels where it is a GPU.

    Args:
      name: jax's backend name ("gpu", "cuda", "rocm", "tpu", ...).
      device: the device whose kind and compute capability decide (default: the backend's
        first device, asked when first needed).
    """

    step_overhead_tokens = 256

    def __init__(self, name: str, device: Device | None = None) -> None:
        self.name = name
        self._device = device

    @property
    def device(self) -> Device:
        if self._device is None:  # asked late: constructing the platform starts no backend
            self._device = jax.devices(self.name)[0]
        return self._device

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
        if backend == "mosaic":
            if self.compute_capability() < MOSAIC_MIN_CAPABILITY:
                raise ValueError(f"attention_backend='mosaic' needs compute capability >= 9.0 "
                                 f"(TMA, wgmma); this {self.device.device_kind} has "
                                 f"{self.device.compute_capability}: use 'pallas'")
            if float32_cache:
                raise ValueError("attention_backend='mosaic' takes a 16-bit or 8-bit KV cache, "
                                 "not dtype='float32' with kv_cache_dtype='auto': use 'pallas'")
        if backend != "auto":
            return backend
        if not gpu:
            return "reference"
        mosaic = self.compute_capability() >= MOSAIC_MIN_CAPABILITY and not float32_cache
        return "mosaic" if mosaic else "pallas"

    def prepare_weights(self, params, config: EngineConfig, dtype: jnp.dtype,
                        targets: QuantTargets | None):
        return params

    def buckets(self, config: EngineConfig) -> BucketSet:
        return BucketSet()
