"""The paged KV cache layout, defined once for the kernels and the engine.

One K and one V array, each ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
A token at position ``p`` of a sequence with block table ``bt`` lives at block ``bt[p // block_size]``,
offset ``p % block_size``; its flat *slot* is ``block_id * block_size + offset``. Block 0 is
reserved: padding tokens write to slot 0.. of block 0 and padded block-table entries point at it,
so kernels need no branch for padding.

The cache is a pytree carried through the layer scan and donated across steps: it is updated in
place and never copied (the benchmark ``scripts/bench_kv_size.py`` checks that decode step time
does not depend on ``num_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

PADDING_SLOT = 0  # slot of padding tokens (inside reserved block 0)


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Paged K and V arrays.

    Fields:
      k: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``, the cache dtype.
      v: the same shape and dtype as ``k``.
    """

    k: jax.Array
    v: jax.Array

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


def kv_cache_shape(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """The shape of each of K and V."""
    return (num_layers, num_blocks, block_size, num_kv_heads, head_dim)


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype
) -> int:
    """Bytes one block takes across all layers, K and V together."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype,
    sharding: jax.sharding.Sharding | None = None,
) -> KVCache:
    """Zero-filled K and V arrays, created on the device (no host copy).

    Raises:
      ValueError: if num_blocks < 2 (block 0 is reserved).
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is reserved)")
    shape = kv_cache_shape(num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return KVCache(k=make(), v=make())
