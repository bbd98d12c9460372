"""Accelerators (GPUs, and any other non-CPU jax backend): bfloat16, the Pallas kernel, the
powers of two.

A GPU reads all weights in every step and computes a prompt token in far less time than a
step's fixed cost, so padding a step is cheaper there than running another
(``step_overhead_tokens``), and a decode step reads the weights once whatever its rows: the
power-of-two buckets suffice. The native CPU kernels do not exist here.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.platform.base import BucketSet, Platform
from models.quant import QuantTargets

GPU_NAMES = ("gpu", "cuda", "rocm")


class GpuPlatform(Platform):
    """A jax backend other than the CPU; the Pallas Triton kernel where it is a GPU."""

    step_overhead_tokens = 256

    def __init__(self, name: str) -> None:
        self.name = name

    def resolve_dtype(self, name: str) -> jnp.dtype:
        return jnp.dtype(jnp.bfloat16 if name == "auto" else name)

    def compute_dtype(self, dtype: jnp.dtype) -> jnp.dtype:
        return jnp.dtype(dtype)

    def attention_backend(self, config: EngineConfig) -> str:
        if config.cpu_kernels == "on":
            raise ValueError(f"cpu_kernels='on' (the native CPU kernels) runs on CPUs only, "
                             f"not on {self.name!r}")
        backend = config.attention_backend
        if backend == "auto":
            return "pallas" if self.name in GPU_NAMES else "reference"
        if backend == "pallas" and self.name not in GPU_NAMES:
            raise ValueError(f"attention_backend='pallas' (the compiled Triton kernel) runs on "
                             f"GPUs only, not on {self.name!r}")
        return backend

    def prepare_weights(self, params, config: EngineConfig, dtype: jnp.dtype,
                        targets: QuantTargets | None):
        return params

    def buckets(self, config: EngineConfig) -> BucketSet:
        return BucketSet()
