"""Ragged paged attention: mixed prefill and decode tokens attending through block tables.

All scheduled tokens of all sequences are flattened into one ragged batch of ``T`` tokens
(vLLM v1 / tpu-inference layout). Sequence ``s`` owns query rows
``query_start_loc[s] : query_start_loc[s + 1]``; its context (cached tokens plus this step's new
ones, whose K/V ``write_kv`` has already stored) has ``seq_lens[s]`` tokens, so the query row
``query_start_loc[s] + i`` sits at position ``seq_lens[s] - q_len_s + i`` and attends causally to
positions ``0 .. that position``. Rows past ``query_start_loc[num_seqs]`` are padding and return 0.

This module holds the pure-jnp implementation the engine runs on CPUs, and ``ref_*`` in plain
numpy (a Python loop over sequences) that tests compare against. The Pallas GPU kernel with the
same signature is ``ragged_paged_attention_triton.ragged_paged_attention_pallas``; the jnp op's
decode rows, and its prefill rows, can run in a kernel passed as ``rows_kernel`` (the native CPU
one: ``cpu_kernels.attention.native_attention_fn``). Algorithm:
the online-softmax recurrence of FlashAttention (Dao et al., 2022, arXiv:2205.14135) over
chunks of KV pages, as in vLLM's PagedAttention (Kwon et al., 2023, arXiv:2309.06180).

An 8-bit cache (float8 e4m3 bits in ``uint8``, or ``int8``; see ``kv_cache``) comes with ``k_scale``
/ ``v_scale`` ``f32[num_layers, num_kv_heads]``: ``write_kv`` quantises, and attention reads the
8-bit pages, folding the per-head K scale into the queries (``q . (s_k k) = (s_k q) . k``) and the
V scale into the output (``sum_j p_j s_v v_j = s_v sum_j p_j v_j``), which is exact and costs
no per-element multiply.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_cache import is_quantized_dtype, kv_to_float, kv_to_numpy, quantize_kv

_MASK_VALUE = -1e30


def check_kv_scales(k_cache: jax.Array, k_scale: jax.Array | None,
                    v_scale: jax.Array | None) -> bool:
    """Whether the cache is quantised; raises ValueError when its scales are missing, given
    for a float cache, or of the wrong shape (``[num_layers, num_kv_heads]``)."""
    quantized = is_quantized_dtype(k_cache.dtype)
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale given for a {k_cache.dtype} cache; they belong "
                             "to an 8-bit (fp8 bits in uint8 / int8) cache")
        return False
    want = (k_cache.shape[0], k_cache.shape[3])
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is None:
            raise ValueError(f"{name} is required to read or write a {k_cache.dtype} KV cache")
        if tuple(sc.shape) != want:
            raise ValueError(f"{name}.shape={tuple(sc.shape)} must be (num_layers, "
                             f"num_kv_heads)={want}")
    return True


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys and values into the paged cache at (layer, slot).

    Args:
      k_cache, v_cache: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
      layer: i32 scalar, the layer to write.
      k_new, v_new: ``[T, num_kv_heads, head_dim]`` (cast to the cache dtype; for an 8-bit
        cache divided by the layer's scales, rounded for int8 and saturated, see
        ``kv_cache.quantize_kv``).
      slot_mapping: ``i32[T]``, ``block_id * block_size + offset``; padding rows point into
        reserved block 0.
      k_scale, v_scale: ``f32[num_layers, num_kv_heads]``, required for (and only for) an
        8-bit cache.
    Returns:
      The updated ``(k_cache, v_cache)``; in place when the caller donates or carries them.
    Raises:
      ValueError: scales missing for an 8-bit cache or given for a float one.
    """
    block_size = k_cache.shape[2]
    blk = slot_mapping // block_size
    off = slot_mapping % block_size
    if check_kv_scales(k_cache, k_scale, v_scale):
        k_new = quantize_kv(k_new, k_scale[layer], k_cache.dtype)
        v_new = quantize_kv(v_new, v_scale[layer], v_cache.dtype)
    k_cache = k_cache.at[layer, blk, off].set(k_new.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, blk, off].set(v_new.astype(v_cache.dtype))
    return k_cache, v_cache


def _online_softmax_step(carry, s, v, mask, pv_eq: str):
    """One FlashAttention update. s: scores [..., C] (masked entries arbitrary), v:
    values already zeroed where no query may read them, mask: broadcastable to s, or None
    where every query reads every key, pv_eq: the einsum of probabilities and values."""
    m, l, acc = carry
    if mask is not None:
        s = jnp.where(mask, s, _MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None] + jnp.einsum(pv_eq, p, v)


def _finish(l, acc):
    return jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)


def decode_chunk_for(num_slots: int) -> int:
    """The decode path's keys per loop step for ``num_slots`` sequence slots: 512 up to 16
    slots, 128 above.

    Measured in the engine's decode step on XLA:CPU (SmolLM2-135M, bfloat16 cache, context
    ~300; ``docs/decisions/0023-decode-step-16-seqs.md``) against the 64 keys every bucket
    used before: 512 keys took 8% less time a step at 1 slot and 5% at 4; at 16, 256 keys took
    12% less and 512 another 6%; at 64 slots 128 keys took 9% less, and 256 22% more than 128.
    Few slots gather little per step, so a longer step saves loop iterations' fixed costs.
    """
    return 512 if num_slots <= 16 else 128


@functools.partial(jax.jit, static_argnames=("sm_scale", "logit_soft_cap", "q_tile", "kv_chunk",
                                             "decode_kv_chunk", "rows_kernel",
                                             "rows_kernel_prefill"))
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
    sliding_window: int | jax.Array | None = None,
    logit_soft_cap: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    q_tile: int = 128,
    kv_chunk: int = 128,
    decode_kv_chunk: int | None = None,
    rows_kernel: Callable[..., jax.Array] | None = None,
    rows_kernel_prefill: bool = False,
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
      sliding_window: attend only to the last ``sliding_window`` positions (the query's own
        included), if set: a Python int or an ``i32`` scalar array. It is traced, not static,
        so one compiled program serves layers of different windows (Gemma 3 passes each
        layer's window through its layer scan; a window >= the context is no window).
      logit_soft_cap: ``cap * tanh(s / cap)`` on scores, if set.
      k_scale, v_scale: ``f32[num_layers, num_kv_heads]`` scales of an 8-bit cache (required
        for one, None for a float cache): keys are read as ``k * k_scale[layer, head]``.
      q_tile: query rows per tile on the prefill path.
      kv_chunk: keys per online-softmax step (rounded to whole pages).
      decode_kv_chunk: the decode path's step in keys (rounded to whole pages); its gathers
        are ``S x chunk`` pages. None: ``decode_chunk_for(S)``, by the number of sequence
        slots ``S``.
      rows_kernel: runs the decode rows instead of the jnp decode path (a hashable callable,
        e.g. the native CPU kernel ``cpu_kernels.attention.cpu_decode_attention``), called as
        ``rows_kernel(q_scaled, k_cache, v_cache, layer, block_tables, seq_lens,
        query_start_loc, num_seqs, sliding_window=, logit_soft_cap=, prefill=)`` with
        ``q_scaled`` ``f32[T, num_q_heads, head_dim]`` (times ``sm_scale`` and an 8-bit
        cache's K scale), returning ``f32[T, num_q_heads, head_dim]``: the decode rows (and
        with ``prefill`` the multi-row sequences' rows), 0 elsewhere, before the V scale.
      rows_kernel_prefill: with ``rows_kernel``, the prefill rows too (``prefill=True``)
        instead of the jnp prefill path.
    Returns:
      ``[T, num_q_heads, head_dim]`` in q's dtype; padding rows are 0.

    Two paths, so that no key is fetched once per query row:
      * decode (sequences with one query row): the sequences' rows together, ``[S, ...]``,
        each gathering its own pages chunk by chunk — ``S x context`` reads;
      * prefill (more than one row): a loop over those sequences and over tiles of ``q_tile``
        rows; a tile gathers one chunk of its sequence's pages and all its rows share it, and
        stops at the tile's last position (causal) — reads are ``context / q_tile`` per row.
    Loop trip counts follow the live data, not ``max_blocks_per_seq``. Every key read is
    masked, so NaN or garbage in pages a sequence does not own never reaches the output.

    Raises:
      ValueError: ``rows_kernel_prefill`` without ``rows_kernel``; scales missing for an
        8-bit cache or given for a float one.
    """
    if rows_kernel_prefill and rows_kernel is None:
        raise ValueError("rows_kernel_prefill=True needs a rows_kernel (one kernel call "
                         "does both)")
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    num_slots, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    ppc = max(1, kv_chunk // block_size)  # pages per chunk
    chunk = ppc * block_size
    if decode_kv_chunk is None:
        decode_kv_chunk = decode_chunk_for(num_slots)
    ppc_d = max(1, decode_kv_chunk // block_size)  # the decode path's
    chunk_d = ppc_d * block_size
    pad = -max_blocks % math.lcm(ppc, ppc_d)
    tables = jnp.pad(block_tables, ((0, 0), (0, pad))) if pad else block_tables
    qt_rows = min(q_tile, num_tokens)
    n = num_seqs[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    live = jnp.arange(num_slots) < n
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    quantized = check_kv_scales(k_cache, k_scale, v_scale)
    if quantized:  # scores on dequantised keys == scores of scaled queries on the stored keys
        qf = qf * k_scale[layer].astype(jnp.float32)[None, :, None, None]
    kpos0 = jnp.arange(chunk, dtype=jnp.int32)
    kpos0_d = jnp.arange(chunk_d, dtype=jnp.int32)

    def keys(pages, shape):
        k = k_cache[layer, pages].reshape(shape + (num_kv_heads, head_dim))
        v = v_cache[layer, pages].reshape(shape + (num_kv_heads, head_dim))
        return kv_to_float(k), kv_to_float(v)

    def scores(s):
        return logit_soft_cap * jnp.tanh(s / logit_soft_cap) if logit_soft_cap else s

    def zero_state(lead):
        return (jnp.full(lead + (num_kv_heads, group), _MASK_VALUE, jnp.float32),
                jnp.zeros(lead + (num_kv_heads, group), jnp.float32),
                jnp.zeros(lead + (num_kv_heads, group, head_dim), jnp.float32))

    # -- decode path: the last (only) row of each one-row sequence ---------------------------
    if rows_kernel is not None:  # zeros on every other row; the V scale is applied below
        out = rows_kernel(
            qf.reshape(num_tokens, num_q_heads, head_dim), k_cache, v_cache, layer,
            block_tables, seq_lens, query_start_loc, num_seqs, sliding_window=sliding_window,
            logit_soft_cap=logit_soft_cap, prefill=rows_kernel_prefill,
        ).reshape(num_tokens, num_kv_heads, group, head_dim)
    else:
        last = jnp.clip(query_start_loc[1:] - 1, 0, num_tokens - 1)
        dec = live & (q_lens == 1)
        ctx_d = jnp.where(dec, seq_lens, 0)
        qd = qf[last]  # [S, kv, g, d]
        qpos_d = ctx_d - 1

        # Scores against the gathered pages in their own [S, C, kv * d] layout (no transpose of the
        # big operand): q becomes block-diagonal [S, kv * d, kv * g], so one batched matmul gives
        # [S, C, kv * g]; the kv-fold extra flops are cheap next to moving the keys (3-6x faster on
        # XLA's CPU backend than a dot with kv as a batch dimension).
        eye = jnp.eye(num_kv_heads, dtype=jnp.float32)
        width = num_kv_heads * group
        q_blk = jnp.einsum("skgd,kj->skdjg", qd, eye).reshape(num_slots, num_kv_heads * head_dim,
                                                              width)
        # a bfloat16 cache: the score dot takes bfloat16 operands (the queries rounded to
        # bfloat16, accumulation in float32), as the model's bfloat16 matmuls do
        bf16_scores = jnp.dtype(k_cache.dtype) == jnp.bfloat16
        q_blk_dot = q_blk.astype(jnp.bfloat16) if bf16_scores else q_blk

        def dec_body(c, carry):
            m, l, acc = carry  # [S, kv * g], [S, kv * g], [S, kv, g, d]
            pages = jax.lax.dynamic_slice_in_dim(tables, c * ppc_d, ppc_d, axis=1)
            flat = (num_slots, chunk_d, num_kv_heads * head_dim)
            v = kv_to_float(v_cache[layer, pages].reshape(flat))
            kpos = c * chunk_d + kpos0_d
            mask = kpos[None, :] <= qpos_d[:, None]  # [S, C]
            if sliding_window is not None:
                mask &= kpos[None, :] > qpos_d[:, None] - sliding_window
            mask3 = mask[:, :, None]
            k = k_cache[layer, pages].reshape(flat)  # bf16: to the dot as stored, no f32 copy
            qk = jnp.einsum("scx,sxy->scy", k if bf16_scores else kv_to_float(k), q_blk_dot,
                            preferred_element_type=jnp.float32)
            s = jnp.where(mask3, scores(qk), _MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(mask3, jnp.exp(s - m_new[:, None, :]), 0.0)
            alpha = jnp.exp(m - m_new)
            # p . v as a broadcast multiply summed over the chunk, not a second block-diagonal
            # matmul: XLA fuses the masking (and an 8-bit or bf16 cache's conversion) into the
            # reduction, so the gathered values are read once and never copied to float32, and no
            # kv-fold wasted products are made (~10% of the decode attention on XLA CPU).
            vm = jnp.where(mask3, v, 0.0).reshape(num_slots, chunk_d, num_kv_heads, 1, head_dim)
            o = jnp.sum(p.reshape(num_slots, chunk_d, num_kv_heads, group, 1) * vm, axis=1)
            acc = acc * alpha.reshape(num_slots, num_kv_heads, group)[..., None] + o
            return m_new, l * alpha + p.sum(axis=1), acc

        n_dec_chunks = (jnp.max(ctx_d) + chunk_d - 1) // chunk_d
        first_dec_chunk = 0
        if sliding_window is not None:  # chunks wholly before every decode row's window are skipped
            first_key = jnp.where(dec, jnp.maximum(qpos_d + 1 - sliding_window, 0),
                                  jnp.iinfo(jnp.int32).max)
            first_dec_chunk = jnp.min(first_key) // chunk_d
            first_dec_chunk = jnp.minimum(first_dec_chunk, n_dec_chunks)
        init = (jnp.full((num_slots, width), _MASK_VALUE, jnp.float32),
                jnp.zeros((num_slots, width), jnp.float32),
                jnp.zeros((num_slots, num_kv_heads, group, head_dim), jnp.float32))
        _, l_d, acc_d = jax.lax.fori_loop(first_dec_chunk, n_dec_chunks, dec_body, init)
        l_d = l_d.reshape(num_slots, num_kv_heads, group)
        out = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)
        out = out.at[jnp.where(dec, last, num_tokens)].set(_finish(l_d, acc_d), mode="drop")

    # -- prefill path: tiles of rows of each multi-row sequence --------------------------------
    # only the multi-row sequences, compacted to the front, so a decode step runs no iteration
    is_pf = live & (q_lens > 1)
    pf_seqs = jnp.nonzero(is_pf, size=num_slots, fill_value=0)[0]

    def seq_body(i, out):
        si = pf_seqs[i]
        q_len, start, ctx = q_lens[si], query_start_loc[si], seq_lens[si]
        first_pos = ctx - q_len
        n_tiles = (q_len + qt_rows - 1) // qt_rows
        table = tables[si]

        def tile_body(ti, out):
            row0 = start + ti * qt_rows
            r0 = jnp.minimum(row0, num_tokens - qt_rows)  # keep the slice in bounds
            rows = r0 + jnp.arange(qt_rows)
            valid = (rows >= row0) & (rows < start + q_len)
            qpos = first_pos + rows - start
            # [kv, R * g, d]: one plain batched matmul per chunk, batch = kv heads
            qtile = jax.lax.dynamic_slice_in_dim(qf, r0, qt_rows).transpose(1, 0, 2, 3) \
                .reshape(num_kv_heads, qt_rows * group, head_dim)
            last_pos = first_pos + jnp.minimum(q_len, (ti + 1) * qt_rows) - 1

            def full_body(c, carry):  # a chunk before the tile's first row: no mask
                k, v = keys(jax.lax.dynamic_slice_in_dim(table, c * ppc, ppc), (chunk,))
                s = scores(jnp.einsum("kqd,ckd->kqc", qtile, k))
                return _online_softmax_step(carry, s, v, None, "kqc,ckd->kqd")

            def kv_body(c, carry):
                pages = jax.lax.dynamic_slice_in_dim(table, c * ppc, ppc)
                k, v = keys(pages, (chunk,))  # [C, kv, d]
                kpos = c * chunk + kpos0
                mask = (kpos[None, :] <= qpos[:, None]) & valid[:, None]  # [R, C]
                if sliding_window is not None:
                    mask &= kpos[None, :] > qpos[:, None] - sliding_window
                k = k.transpose(1, 0, 2)  # [kv, C, d]
                v = jnp.where((kpos <= last_pos)[:, None, None], v, 0.0).transpose(1, 0, 2)
                s = scores(jnp.einsum("kqd,kcd->kqc", qtile, k))  # [kv, R * g, C]
                mask = jnp.repeat(mask, group, axis=0)[None]  # [1, R * g, C]
                return _online_softmax_step(carry, s, v, mask, "kqc,kcd->kqd")

            init = (jnp.full((num_kv_heads, qt_rows * group), _MASK_VALUE, jnp.float32),
                    jnp.zeros((num_kv_heads, qt_rows * group), jnp.float32),
                    jnp.zeros((num_kv_heads, qt_rows * group, head_dim), jnp.float32))
            n_chunks = last_pos // chunk + 1
            if sliding_window is not None:  # the tile's first row sees nothing earlier
                first = jnp.maximum(first_pos + ti * qt_rows + 1 - sliding_window, 0) // chunk
            else:
                # chunks whose keys all precede the tile's first row: every real row reads
                # all of them (they are the sequence's own written keys), and rows outside
                # the tile are dropped below, so these run without a mask
                first = jnp.minimum((first_pos + ti * qt_rows + 1) // chunk, n_chunks)
                init = jax.lax.fori_loop(0, first, full_body, init)
            _, l, acc = jax.lax.fori_loop(first, n_chunks, kv_body, init)
            res = _finish(l, acc).reshape(num_kv_heads, qt_rows, group, head_dim) \
                .transpose(1, 0, 2, 3)
            cur = jax.lax.dynamic_slice_in_dim(out, r0, qt_rows)
            new = jnp.where(valid[:, None, None, None], res, cur)
            return jax.lax.dynamic_update_slice_in_dim(out, new, r0, axis=0)

        return jax.lax.fori_loop(0, n_tiles, tile_body, out)

    if not rows_kernel_prefill:
        out = jax.lax.fori_loop(0, jnp.sum(is_pf), seq_body, out)
    if quantized:  # the output is linear in the values
        out = out * v_scale[layer].astype(jnp.float32)[None, :, None, None]
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
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
) -> np.ndarray:
    """Deliberately naive float64 numpy reference: a Python loop over sequences.

    Same arguments and result as ``ragged_paged_attention``; for tests only. An 8-bit cache is
    dequantised page by page first (``stored * scale[layer, head]``), no scale folding.
    """
    q = np.asarray(q, np.float64)
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale, or neither")
    k_cache = kv_to_numpy(k_cache)  # fp8 bit patterns decoded exactly
    v_cache = kv_to_numpy(v_cache)
    if k_scale is not None:
        k_cache = k_cache * np.asarray(k_scale, np.float64)[:, None, None, :, None]
        v_cache = v_cache * np.asarray(v_scale, np.float64)[:, None, None, :, None]
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
