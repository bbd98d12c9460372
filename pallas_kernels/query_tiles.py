"""A ragged batch's queries as 64-row tiles, one pair per (query block, kv head), and back.

The Mosaic GPU attention kernel (``ragged_paged_attention_mosaic``) multiplies 64-row query tiles
(wgmma's M) by each kv head's keys. Query block ``b`` (``ragged_paged_attention_triton.
query_blocks``: up to ``2 * bq`` consecutive tokens of one sequence, ``bq = ROWS // group``) and
kv head ``h`` give two tiles, one a compute warpgroup; row ``r`` of tile ``w`` holds token
``blk_start[b] + w * bq + r // group``, q head ``h * group + r % group``. Rows past the block
(or past ``bq * group``) hold zeros, whose results nothing reads back. A decode token is a tile
of ``group`` live rows.

Gathering the tiles and reading the results back are XLA gathers outside the kernel: they write
and read ``B * kv_heads * 2 * ROWS * head_dim`` elements, ~3% of the KV bytes a b64 x 4k decode
step reads at Llama-3.1-8B's shapes (docs/decisions/0043-mosaic-gpu-attention.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROWS = 64  # rows of one compute warpgroup's tile: wgmma's M


def _rows(blk_start: jax.Array, blk_end: jax.Array, group: int, num_tokens: int):
    """Per (block, warpgroup, row): its token ``i32[B, 2, ROWS]`` (clipped) and whether it is
    live, and each row's head within the group ``i32[ROWS]``."""
    bq = ROWS // group
    w = jnp.arange(2, dtype=jnp.int32)[None, :, None]
    r = jnp.arange(ROWS, dtype=jnp.int32)[None, None, :]
    tok = blk_start[:, None, None] + w * bq + r // group
    live = (r < bq * group) & (tok < blk_end[:, None, None])
    return jnp.clip(tok, 0, num_tokens - 1), live, jnp.arange(ROWS, dtype=jnp.int32) % group


def to_tiles(q: jax.Array, blk_start: jax.Array, blk_end: jax.Array, group: int,
             dtype: jnp.dtype) -> jax.Array:
    """``q [T, kv_heads * group, head_dim]`` as tiles ``[B, kv_heads, 2, ROWS, head_dim]`` in
    ``dtype``; ``blk_start``, ``blk_end``: ``i32[B]``, each block's tokens."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = num_q_heads // group
    tok, live, g = _rows(blk_start, blk_end, group, num_tokens)
    heads = jnp.arange(num_kv_heads)[None, :, None, None]
    tiles = q.reshape(num_tokens, num_kv_heads, group, head_dim)[tok[:, None], heads,
                                                                 g[None, None, None, :]]
    return jnp.where(live[:, None, :, :, None], tiles, 0).astype(dtype)


def from_tiles(o: jax.Array, lse: jax.Array | None, blk_start: jax.Array, blk_end: jax.Array,
               group: int, num_tokens: int) -> jax.Array:
    """Each token's rows of the kernel's tiles, merged over splits: ``f32[T, q_heads,
    head_dim]`` (rows of padding tokens arbitrary).

    Args:
      o: ``[P, B, kv_heads, 2, ROWS, head_dim]``, each split's normalised output.
      lse: ``f32[P, B, kv_heads, 2, ROWS]``, each split's log2-sum-exp2 of the scores; None
        with one split.
      blk_start, blk_end: ``i32[B]``; the real blocks come first, in token order.
    """
    num_blocks, num_kv_heads, head_dim = o.shape[1], o.shape[2], o.shape[-1]
    bq = ROWS // group
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    starts = jnp.where(blk_end > blk_start, blk_start, num_tokens + 1)
    blk = jnp.clip(jnp.searchsorted(starts, t, side="right") - 1, 0, num_blocks - 1)
    within = t - blk_start[blk]
    idx = (slice(None), blk[:, None, None], jnp.arange(num_kv_heads)[None, :, None],
           (within // bq)[:, None, None],
           ((within % bq) * group)[:, None, None] + jnp.arange(group)[None, None, :])
    out = o[idx].astype(jnp.float32)  # [P, T, kv, g, d]
    if lse is None:
        out = out[0]
    else:  # flash-decoding: the splits' partials weighed by their share of the softmax sum
        w = jnp.exp2(lse[idx] - lse[idx].max(axis=0, keepdims=True))
        out = (out * w[..., None]).sum(0) / jnp.maximum(w.sum(0), 1e-30)[..., None]
    return out.reshape(num_tokens, num_kv_heads * group, head_dim)
