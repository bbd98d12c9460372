"""Attention kernels and the paged KV-cache layout; importable with jax alone.

``ragged_paged_attention`` / ``write_kv`` have one signature (``pallas_kernels/
ragged_paged_attention.py``) and, per backend, one implementation: the pure-jnp one
(``ragged_paged_attention``) runs everywhere; the Pallas Triton kernel
(``ragged_paged_attention_pallas``) runs on NVIDIA GPUs and, in interpret mode, on the CPU; the
Pallas Mosaic GPU kernel (``ragged_paged_attention_mosaic``: TMA, wgmma) on Hopper and newer, and
in GPU interpret mode on the CPU. The
jnp op's decode and prefill rows can run in another kernel (its ``rows_kernel`` hook): the native
CPU kernels live in the ``cpu_kernels`` package, which builds on this one (never the reverse).
The platform layer (``jaxserve.platform``) picks one for the engine
(docs/architecture.md#attention-op).
"""

from __future__ import annotations

from pallas_kernels.kv_cache import KVCache, allocate_kv_cache, kv_cache_bytes_per_block
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ref_ragged_paged_attention,
    write_kv,
)
from pallas_kernels.ragged_paged_attention_mosaic import ragged_paged_attention_mosaic
from pallas_kernels.ragged_paged_attention_triton import ragged_paged_attention_pallas

__all__ = [
    "KVCache",
    "allocate_kv_cache",
    "kv_cache_bytes_per_block",
    "ragged_paged_attention",
    "ragged_paged_attention_mosaic",
    "ragged_paged_attention_pallas",
    "ref_ragged_paged_attention",
    "write_kv",
]
