"""Attention kernels and the paged KV-cache layout; importable with jax alone.

``ragged_paged_attention`` / ``write_kv`` have one signature (design.md) and, per backend, one
implementation: the pure-jnp one here runs everywhere; the Pallas GPU kernel is a later issue.
"""

from pallas_kernels.kv_cache import KVCache, allocate_kv_cache, kv_cache_bytes_per_block
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ref_ragged_paged_attention,
    write_kv,
)

__all__ = [
    "KVCache",
    "allocate_kv_cache",
    "kv_cache_bytes_per_block",
    "ragged_paged_attention",
    "ref_ragged_paged_attention",
    "write_kv",
]
