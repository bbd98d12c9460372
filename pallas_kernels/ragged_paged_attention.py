"""Ragged paged attention: mixed prefill and decode tokens attending through block tables.

All scheduled tokens of all sequences are flattened into one ragged batch of ``T`` tokens
(vLLM v1 / tpu-inference layout). Sequence ``s`` owns query rows
``query_start_loc[s] : query_start_loc[s + 1]``; its context (cached tokens plus this step's new
ones, whose K/V ``write_kv`` has already stored) has ``seq_lens[s]`` tokens, so the query row
``query_start_loc[s] + i`` sits at position ``seq_lens[s] - q_len_s + i`` and attends causally to
positions ``0 .. that position``. Rows past ``query_start_loc[num_seqs]`` are padding and return 0.

This module holds the pure-jnp implementation the engine runs on CPUs, and ``ref_*`` in plain
numpy (a Python loop over sequences) that tests compare against. The Pallas GPU kernel with the
same signature is a separate issue. Algorithm: the online-softmax recurrence of FlashAttention
(Dao et al., 2022, arXiv:2205.14135) over chunks of KV pages, as in vLLM's PagedAttention
(Kwon et al., 2023, arXiv:2309.06180).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_MASK_VALUE = -1e30


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys and values into the paged cache at (layer, slot).

    Args:
      k_cache, v_cache: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
      layer: i32 scalar, the layer to write.
      k_new, v_new: ``[T, num_kv_heads, head_dim]`` (cast to the cache dtype).
      slot_mapping: ``i32[T]``, ``block_id * block_size + offset``; padding rows point into
        reserved block 0.
    Returns:
      The updated ``(k_cache, v_cache)``; in place when the caller donates or carries them.
    """
    block_size = k_cache.shape[2]
    blk = slot_mapping // block_size
    off = slot_mapping % block_size
    k_cache = k_cache.at[layer, blk, off].set(k_new.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, blk, off].set(v_new.astype(v_cache.dtype))
    return k_cache, v_cache


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "logit_soft_cap",
                                             "pages_per_chunk"))
def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    pages_per_chunk: int | None = None,
) -> jax.Array:
    """Attention of a ragged token batch over the paged KV cache (pure jnp).

    Args:
      q: ``[T, num_q_heads, head_dim]``.
      k_cache, v_cache: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
      layer: i32 scalar, the layer to read.
      block_tables: ``i32[S, max_blocks_per_seq]``; unused entries 0.
      seq_lens: ``i32[S]``, context length including this step's tokens.
      query_start_loc: ``i32[S + 1]``, cumulative query lengths; padded sequences repeat the
        last real value (zero query rows).
      num_seqs: ``i32[1]``, the number of real sequences.
      sm_scale: softmax scale (usually ``head_dim ** -0.5``).
      sliding_window: attend only to the last ``sliding_window`` positions, if set.
      logit_soft_cap: ``cap * tanh(s / cap)`` on scores, if set.
      pages_per_chunk: KV pages per online-softmax step (default: 64 tokens' worth).
    Returns:
      ``[T, num_q_heads, head_dim]`` in q's dtype; padding rows are 0.

    Every key read is masked, so NaN or garbage in pages a sequence does not own never reaches
    the output. The loop runs ``cdiv(max(seq_lens), chunk)`` times, so its cost follows the
    longest live context, not ``max_blocks_per_seq``.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    num_slots, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    ppc = pages_per_chunk or max(1, 64 // block_size)
    num_chunks_max = -(-max_blocks // ppc)
    chunk_len = ppc * block_size

    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    n = num_seqs[0]
    total = query_start_loc[n]
    seq_of_tok = jnp.clip(jnp.searchsorted(query_start_loc[1:], tok, side="right"), 0,
                          num_slots - 1)
    tok_valid = tok < total
    q_end = query_start_loc[seq_of_tok + 1]
    q_pos = seq_lens[seq_of_tok] - (q_end - tok)  # [T] position of each query row
    tables = block_tables[seq_of_tok]  # [T, max_blocks]
    pad = num_chunks_max * ppc - max_blocks
    if pad:
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    live = jnp.arange(num_slots) < n
    max_len = jnp.max(jnp.where(live, seq_lens, 0))
    num_chunks = (max_len + chunk_len - 1) // chunk_len

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale

    def body(c, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, c * ppc, ppc, axis=1)  # [T, ppc]
        k = k_cache[layer, pages].reshape(num_tokens, chunk_len, num_kv_heads, head_dim)
        v = v_cache[layer, pages].reshape(num_tokens, chunk_len, num_kv_heads, head_dim)
        kpos = c * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)
        mask = (kpos[None, :] <= q_pos[:, None]) & tok_valid[:, None]  # [T, chunk]
        if sliding_window is not None:
            mask &= kpos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.einsum("tkgd,tckd->tkgc", qg, k.astype(jnp.float32))
        if logit_soft_cap is not None:
            s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
        mask4 = mask[:, None, None, :]
        s = jnp.where(mask4, s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask4, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        v = jnp.where(mask[:, :, None, None], v.astype(jnp.float32), 0.0)
        acc = acc * alpha[..., None] + jnp.einsum("tkgc,tckd->tkgd", p, v)
        return m_new, l * alpha + p.sum(axis=-1), acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), _MASK_VALUE, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def ref_ragged_paged_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    layer: int,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    num_seqs: np.ndarray,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
) -> np.ndarray:
    """Deliberately naive float64 numpy reference: a Python loop over sequences.

    Same arguments and result as ``ragged_paged_attention``; for tests only.
    """
    q = np.asarray(q, np.float64)
    k_cache = np.asarray(k_cache, np.float64)
    v_cache = np.asarray(v_cache, np.float64)
    out = np.zeros_like(q)
    block_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    for s in range(int(np.asarray(num_seqs).reshape(-1)[0])):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        ctx = int(seq_lens[s])
        pos = np.arange(ctx)
        blocks = block_tables[s][pos // block_size]
        k = k_cache[layer, blocks, pos % block_size]  # [ctx, kv, d]
        v = v_cache[layer, blocks, pos % block_size]
        for i, t in enumerate(range(start, end)):
            qp = ctx - (end - start) + i
            keep = pos <= qp
            if sliding_window is not None:
                keep &= pos > qp - sliding_window
            for h in range(q.shape[1]):
                kh = h // group
                sc = k[keep, kh] @ q[t, h] * sm_scale
                if logit_soft_cap is not None:
                    sc = logit_soft_cap * np.tanh(sc / logit_soft_cap)
                w = np.exp(sc - sc.max())
                out[t, h] = (w / w.sum()) @ v[keep, kh]
    return out
