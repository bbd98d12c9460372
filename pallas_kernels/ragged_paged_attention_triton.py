"""Ragged paged attention as a Pallas GPU kernel (Triton backend).

Same contract as ``pallas_kernels/ragged_paged_attention.py:ragged_paged_attention``: ``T``
flattened query tokens of ``S`` sequences (prefill chunks and decode tokens mixed), each sequence's
context read from the paged KV cache ``[num_layers, num_blocks, block_size, num_kv_heads,
head_dim]`` through its block-table row; causal within the sequence, optional sliding window and
logit soft cap; rows past ``query_start_loc[num_seqs]`` return 0.

Work decomposition (the "unified" Triton attention of vLLM v1, ``triton_unified_attention.py``):

* The wrapper cuts every real sequence's query rows into *query blocks* of up to ``block_q``
  consecutive tokens (a decode token is a block of one). There are at most
  ``cdiv(T, block_q) + S`` blocks, a static bound, so the grid is static; spare programs do
  nothing. Per block the wrapper passes, as ordinary int32 inputs (the GPU backends have no scalar
  prefetch): its sequence, first and end token.
* Grid ``(num_q_blocks_max, num_kv_heads, num_kv_splits)``. One program computes one query block
  for the ``group = num_q_heads // num_kv_heads`` q heads sharing one kv head. Its tile has
  ``block_q * group_pad`` rows (row ``r``: token ``r // group_pad``, head ``r % group_pad``), with
  ``group_pad`` the next power of two of the group (Triton wants power-of-two tiles: SmolLM2's 3
  q heads per kv head become 4 rows, the pad rows are masked on load and store). q is read
  straight from ``[T, num_q_heads, head_dim]`` and the output written straight into it, so no
  padded copy exists outside the kernel.
* The program walks its sequence's keys ``[lo, hi)`` (``hi`` = last row's position + 1, ``lo``
  from the sliding window of the first row, else 0) in tiles of ``block_k`` positions: each key's
  cache row ``(layer * num_blocks + block_tables[seq, pos // block_size]) * block_size +
  pos % block_size`` is gathered with a masked load (nothing outside the context is read, so NaN
  in unused pages never reaches the result), scores ``q @ k^T`` accumulate in float32 with the
  online softmax of FlashAttention (Dao et al. 2022, arXiv:2205.14135), masked causally per row.
  Since each key is gathered by row, any ``block_size`` works and ``block_k`` is a free knob.
* Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"): with
  ``num_kv_splits > 1`` each split takes an equal share of the program's key tiles and writes an
  unnormalised partial output with its running max and sum; a small jnp epilogue merges them.
  The default picks splits only when the grid would otherwise be too small to fill the GPU
  (small token buckets = decode batches), so long-context decode at small batch is not serialised.

Decode steps take the same path as prefill at no extra cost: each decode sequence is one query
block and its KV pages are read once per kv head.

Dtypes: q and the cache in float32, bfloat16 or float16; dots in the input dtype with float32
accumulation (probabilities are cast to the value dtype for the second dot, as FlashAttention
does); the output in q's dtype. ``head_dim`` must be a power of two (64, 128, 256 in practice).

8-bit cache (float8 e4m3 bit patterns in ``uint8``, or ``int8`` pages with ``k_scale`` / ``v_scale``
``f32[num_layers, num_kv_heads]``, see ``kv_cache``): the program loads its kv head's two scales
once, reads 1-byte keys and values (half the bytes of bf16: decode is bound by these reads),
converts each tile to q's dtype in registers (exact: e4m3 and int8 values fit bf16), folds the
K scale into ``sm_scale`` and multiplies the accumulator by the V scale before it is stored.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_cache import is_quantized_dtype
from pallas_kernels.ragged_paged_attention import check_kv_scales

_MASK_VALUE = -1e30
_GPU_NUM_SMS = 132  # H100/H200; only used to size the default number of KV splits


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# -- kernel body --------------------------------------------------------------------------------
def _kernel(
    blk_seq_ref,  # i32[B] sequence of each query block (any value for spare blocks)
    blk_start_ref,  # i32[B] first token of the block
    blk_end_ref,  # i32[B] end token (== start for spare blocks)
    seq_lens_ref,  # i32[S]
    qsl_ref,  # i32[S + 1]
    bt_ref,  # i32[S * max_blocks_per_seq] block tables, flattened
    layer_ref,  # i32[1]
    window_ref,  # i32[1] sliding window (read only when ``windowed``)
    k_scale_ref,  # f32[num_layers * num_kv_heads] (read only when ``quantized``)
    v_scale_ref,  # same
    q_ref,  # [T * num_q_heads, head_dim]
    k_ref,  # [num_layers * num_blocks * block_size, num_kv_heads, head_dim]
    v_ref,  # same
    *out_refs,  # o [P * T * num_q_heads, head_dim] (+ m, l f32[P * T * num_q_heads] if P > 1)
    sm_scale: float,
    windowed: bool,
    quantized: bool,
    logit_soft_cap: float | None,
    num_tokens: int,
    num_q_heads: int,
    group: int,
    group_pad: int,
    block_q: int,
    block_k: int,
    block_size: int,
    num_blocks: int,
    max_blocks_per_seq: int,
    num_splits: int,
    exact: bool,
):
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = block_q * group_pad
    seq = blk_seq_ref[b]
    start = blk_start_ref[b]
    end = blk_end_ref[b]
    seq_len = seq_lens_ref[seq]
    q_end = qsl_ref[seq + 1]

    r = jnp.arange(rows, dtype=jnp.int32)
    tok = start + r // group_pad  # [rows]
    g = r % group_pad
    row_ok = (tok < end) & (g < group)
    q_pos = seq_len - (q_end - tok)  # [rows] position of each row's token
    q_row = jnp.where(row_ok, tok * num_q_heads + h * group + g, 0)

    dd = jnp.arange(q_ref.shape[1], dtype=jnp.int32)[None, :]
    q = plgpu.load(q_ref.at[q_row[:, None], dd], mask=row_ok[:, None], other=0)  # [rows, D]

    # keys this block may see: [lo, hi)
    hi = seq_len - (q_end - end)  # last token's position + 1
    sliding_window = window_ref[0] if windowed else None
    if sliding_window is None:
        lo = jnp.int32(0)
    else:
        lo = jnp.maximum(seq_len - (q_end - start) + 1 - sliding_window, 0)
    hi = jnp.where(end > start, hi, lo)  # spare blocks: empty range
    num_tiles = pl.cdiv(hi - lo, block_k)
    per_split = pl.cdiv(num_tiles, num_splits)
    t_begin = split * per_split
    t_end = jnp.minimum(t_begin + per_split, num_tiles)

    layer_base = layer_ref[0] * num_blocks
    bt_base = seq * max_blocks_per_seq
    kk = jnp.arange(block_k, dtype=jnp.int32)
    kv_zero = 0.0 if jnp.issubdtype(k_ref.dtype, jnp.floating) else 0
    score_scale = sm_scale
    if quantized:  # this program's kv head: fold the K scale into the softmax scale
        num_kv_heads = k_ref.shape[1]
        score_scale = k_scale_ref[layer_ref[0] * num_kv_heads + h] * sm_scale

    def body(i, carry):
        m, l, acc = carry
        pos = lo + i * block_k + kk  # [block_k]
        k_ok = pos < hi
        page = plgpu.load(bt_ref.at[jnp.where(k_ok, bt_base + pos // block_size, 0)],
                          mask=k_ok, other=0)
        slot = jnp.where(k_ok, (layer_base + page) * block_size + pos % block_size, 0)
        k = plgpu.load(k_ref.at[slot[:, None], h, dd], mask=k_ok[:, None], other=kv_zero)
        v = plgpu.load(v_ref.at[slot[:, None], h, dd], mask=k_ok[:, None], other=kv_zero)
        if quantized:  # 8-bit pages to q's dtype, exactly (e4m3 and int8 values fit)
            if k.dtype == jnp.uint8:  # e4m3 bit patterns
                k = jax.lax.bitcast_convert_type(k, jnp.float8_e4m3fn)
                v = jax.lax.bitcast_convert_type(v, jnp.float8_e4m3fn)
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        # float32 inputs: full-precision dots (Triton would otherwise use TF32, whose 10-bit
        # mantissa gave 1.4e-3 scaled errors against the float64 reference on an H200)
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=not exact).astype(jnp.float32) * score_scale
        if logit_soft_cap is not None:
            s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
        mask = (pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if sliding_window is not None:
            mask &= pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask, s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v,
                                               allow_tf32=not exact).astype(jnp.float32)
        return m_new, l_new, acc

    head_dim = q.shape[1]
    init = (jnp.full((rows,), _MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = jax.lax.fori_loop(t_begin, t_end, body, init)
    if quantized:  # the output (and each split's partial) is linear in the values
        acc = acc * v_scale_ref[layer_ref[0] * k_ref.shape[1] + h]

    # masked-out rows point one past the end: never written on a GPU (masked store), dropped by
    # the interpreter's scatter (which would otherwise write them back over a real row)
    rows_out = num_splits * num_tokens * num_q_heads
    out_row = jnp.where(row_ok, split * (num_tokens * num_q_heads) + q_row, rows_out)
    if num_splits == 1:
        (o_ref,) = out_refs
        out = jnp.where(l[:, None] > 0, acc / jnp.maximum(l, 1e-30)[:, None], 0.0)
        plgpu.store(o_ref.at[out_row[:, None], dd], out.astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[out_row[:, None], dd], acc, mask=row_ok[:, None])
        plgpu.store(m_ref.at[out_row], m, mask=row_ok)
        plgpu.store(l_ref.at[out_row], l, mask=row_ok)


# -- pallas_call builder -------------------------------------------------------------------------
def query_blocks(query_start_loc: jax.Array, num_seqs: jax.Array, num_tokens: int,
                  block_q: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, int]:
    """Cut every real sequence's rows into blocks of <= block_q tokens.

    Returns ``(blk_seq, blk_start, blk_end)`` each ``i32[B]`` with the static bound
    ``B = cdiv(T, block_q) + S`` (spare blocks have ``end == start``), ``tok_valid bool[T]`` and B.
    """
    num_slots = query_start_loc.shape[0] - 1
    n = num_seqs[0]
    live = jnp.arange(num_slots) < n
    q_lens = jnp.where(live, query_start_loc[1:] - query_start_loc[:-1], 0)
    nblk = (q_lens + block_q - 1) // block_q
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nblk).astype(jnp.int32)])
    num_q_blocks = -(-num_tokens // block_q) + num_slots
    b = jnp.arange(num_q_blocks, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cum[1:], b, side="right"), 0, num_slots - 1).astype(jnp.int32)
    valid = b < cum[-1]
    start = query_start_loc[seq] + (b - cum[seq]) * block_q
    end = jnp.where(valid, jnp.minimum(start + block_q, query_start_loc[seq + 1]), start)
    tok_valid = jnp.arange(num_tokens) < query_start_loc[n]
    return seq, start.astype(jnp.int32), end.astype(jnp.int32), tok_valid, num_q_blocks


def default_num_kv_splits(num_tokens: int, num_kv_heads: int, max_context: int, block_k: int,
                          num_q_blocks: int) -> int:
    """Splits along the KV axis so that small grids (decode batches) still fill the GPU."""
    programs = num_q_blocks * num_kv_heads
    target = 2 * _GPU_NUM_SMS
    if programs >= target:
        return 1
    max_tiles = max(1, -(-max_context // block_k))
    splits = min(_next_pow2(-(-target // programs)), max(1, max_tiles // 4), 16)
    return max(1, splits)


# shared memory the pipelined K and V tiles may take: an H100/H200 block has 227 KiB; the rest is
# left for q, the score tile and Triton's own buffers (f32 at head_dim 256 with block_k 64 and two
# stages asked for 256 KiB and failed to launch on an H200)
_KV_TILE_SMEM_BYTES = 160 * 1024


def default_block_k(head_dim: int, itemsize: int, num_stages: int) -> int:
    """Largest ``block_k`` in (64, 32, 16) whose K and V tiles over ``num_stages`` pipeline
    stages (``2 * num_stages * block_k * head_dim * itemsize`` bytes) fit ``_KV_TILE_SMEM_BYTES``;
    16 if none does."""
    for bk in (64, 32):
        if 2 * max(num_stages, 1) * bk * head_dim * itemsize <= _KV_TILE_SMEM_BYTES:
            return bk
    return 16


def ragged_paged_attention_pallas(
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
    block_q_rows: int = 64,
    block_k: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Attention of a ragged token batch over the paged KV cache (Pallas Triton kernel).

    Args:
      q: ``[T, num_q_heads, head_dim]``.
      k_cache, v_cache: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
      layer: i32 scalar (or ``i32[1]``), the layer to read.
      block_tables: ``i32[S, max_blocks_per_seq]``.
      seq_lens: ``i32[S]``, context length including this step's tokens.
      query_start_loc: ``i32[S + 1]``; padded sequences repeat the last real value.
      num_seqs: ``i32[1]``, the number of real sequences.
      sm_scale, sliding_window, logit_soft_cap: as ``ragged_paged_attention`` (the window, a
        Python int or an ``i32`` scalar array, reaches the kernel as an input, not a constant,
        so layers of different windows share one compiled kernel).
      k_scale, v_scale: ``f32[num_layers, num_kv_heads]``, required for (and only for) an
        8-bit cache (e4m3 bits in ``uint8`` / ``int8``); keys read as ``k * k_scale[layer, head]``.
      block_q_rows: tile rows per program (query tokens x padded heads of one kv group); a
        power of two >= 16 (Triton's smallest dot).
      block_k: key positions per online-softmax step, a power of two >= 16; None picks the
        largest of 64, 32, 16 whose pipelined K and V tiles fit shared memory
        (``default_block_k``).
      num_kv_splits: flash-decoding splits along the KV axis; None picks by grid size.
      num_warps, num_stages: Triton CompilerParams.
      interpret: run the kernel in the Pallas interpreter (CPU tests).
    Returns:
      ``[T, num_q_heads, head_dim]`` in q's dtype; padding rows are 0.
    Raises:
      ValueError: naming the offending shape, dtype or knob.
    """
    if block_k is None:
        block_k = default_block_k(q.shape[-1], jnp.dtype(k_cache.dtype).itemsize, num_stages)
    _validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
              block_q_rows=block_q_rows, block_k=block_k, num_kv_splits=num_kv_splits,
              sliding_window=sliding_window)
    check_kv_scales(k_cache, k_scale, v_scale)
    window = None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32)
    return _ragged_paged_attention_pallas(
        q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs, window,
        k_scale, v_scale, sm_scale=sm_scale, logit_soft_cap=logit_soft_cap, block_q_rows=block_q_rows,
        block_k=block_k, num_kv_splits=num_kv_splits, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "logit_soft_cap", "block_q_rows", "block_k", "num_kv_splits", "num_warps",
    "num_stages", "interpret"))
def _ragged_paged_attention_pallas(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
    block_tables: jax.Array, seq_lens: jax.Array, query_start_loc: jax.Array,
    num_seqs: jax.Array, window: jax.Array | None, k_scale: jax.Array | None,
    v_scale: jax.Array | None, *, sm_scale: float,
    logit_soft_cap: float | None, block_q_rows: int, block_k: int, num_kv_splits: int | None,
    num_warps: int, num_stages: int, interpret: bool,
) -> jax.Array:
    """The jitted body of ``ragged_paged_attention_pallas`` (arguments checked there;
    ``window``: None or an ``i32`` scalar; scales: None or ``f32[num_layers, num_kv_heads]``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_slots, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    group_pad = _next_pow2(group)
    block_q = max(1, block_q_rows // group_pad)
    blk_seq, blk_start, blk_end, tok_valid, num_q_blocks = query_blocks(
        query_start_loc, num_seqs, num_tokens, block_q)
    splits = num_kv_splits or default_num_kv_splits(
        num_tokens, num_kv_heads, max_blocks * block_size, block_k, num_q_blocks)

    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), windowed=window is not None,
        quantized=k_scale is not None,
        logit_soft_cap=logit_soft_cap, num_tokens=num_tokens, num_q_heads=num_q_heads,
        group=group, group_pad=group_pad, block_q=block_q, block_k=block_k,
        block_size=block_size, num_blocks=num_blocks, max_blocks_per_seq=max_blocks,
        num_splits=splits, exact=jnp.dtype(q.dtype) == jnp.float32)
    rows_out = splits * num_tokens * num_q_heads
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((rows_out, head_dim), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((rows_out, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((rows_out,), jnp.float32),
                     jax.ShapeDtypeStruct((rows_out,), jnp.float32))
    flat_cache = (num_layers * num_blocks * block_size, num_kv_heads, head_dim)
    res = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, num_kv_heads, splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_g{group}_d{head_dim}_bq{block_q}_bk{block_k}_p{splits}",
    )(
        blk_seq, blk_start, blk_end,
        seq_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(num_slots * max_blocks),
        jnp.asarray(layer, jnp.int32).reshape(1),
        (jnp.zeros((1,), jnp.int32) if window is None else window.reshape(1)),
        *((jnp.ones((1,), jnp.float32),) * 2 if k_scale is None else
          (k_scale.astype(jnp.float32).reshape(-1), v_scale.astype(jnp.float32).reshape(-1))),
        q.reshape(num_tokens * num_q_heads, head_dim),
        k_cache.reshape(flat_cache), v_cache.reshape(flat_cache),
    )
    if splits == 1:
        out = res.reshape(num_tokens, num_q_heads, head_dim)
    else:  # flash-decoding epilogue: merge the partial softmaxes
        o, m, l = (x.reshape(splits, num_tokens, num_q_heads, *x.shape[1:]) for x in res)
        m_max = m.max(axis=0)
        w = jnp.exp(m - m_max[None])
        l_tot = (l * w).sum(axis=0)
        o_tot = (o * w[..., None]).sum(axis=0)
        out = (o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]).astype(q.dtype)
    # rows no real query block covers (padding tokens) were never written
    return jnp.where(tok_valid[:, None, None], out, jnp.zeros((), q.dtype))


# -- input validation ----------------------------------------------------------------------------
def _validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *,
              block_q_rows: int, block_k: int, num_kv_splits: int | None,
              sliding_window: int | jax.Array | None) -> None:
    """Shape, dtype and knob checks; messages name the offending value."""
    if q.ndim != 3:
        raise ValueError(f"q.shape={q.shape} must be [num_tokens, num_q_heads, head_dim]")
    if k_cache.ndim != 5:
        raise ValueError(f"k_cache.shape={k_cache.shape} must be [num_layers, num_blocks, "
                         "block_size, num_kv_heads, head_dim]")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {v_cache.shape} {v_cache.dtype} must match k_cache "
                         f"{k_cache.shape} {k_cache.dtype}")
    _, num_q_heads, head_dim = q.shape
    _, _, _, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache head_dim={cache_head_dim} != q head_dim={head_dim}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 for the Triton kernel")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    floats = (jnp.float32, jnp.bfloat16, jnp.float16)
    if jnp.dtype(q.dtype) not in floats:
        raise ValueError(f"q.dtype={q.dtype} must be float32, bfloat16 or float16")
    if jnp.dtype(k_cache.dtype) not in floats and not is_quantized_dtype(k_cache.dtype):
        raise ValueError(f"k_cache.dtype={k_cache.dtype} must be float32, bfloat16, float16, "
                         "uint8 (float8 e4m3 bits) or int8")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables.shape={block_tables.shape} must be [S, max_blocks]")
    num_slots = block_tables.shape[0]
    if seq_lens.shape != (num_slots,):
        raise ValueError(f"seq_lens.shape={seq_lens.shape} must be ({num_slots},)")
    if query_start_loc.shape != (num_slots + 1,):
        raise ValueError(f"query_start_loc.shape={query_start_loc.shape} must be "
                         f"({num_slots + 1},)")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs.shape={num_seqs.shape} must be (1,)")
    for name, x in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc), ("num_seqs", num_seqs)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={x.dtype} must be int32")
    group_pad = _next_pow2(num_q_heads // num_kv_heads)
    if block_q_rows & (block_q_rows - 1) or block_q_rows < max(16, group_pad):
        raise ValueError(f"block_q_rows={block_q_rows} must be a power of two >= "
                         f"max(16, {group_pad}) (q heads per kv head, padded)")
    if block_k & (block_k - 1) or block_k < 16:
        raise ValueError(f"block_k={block_k} must be a power of two >= 16")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1")
    if not math.prod(q.shape):
        raise ValueError(f"q.shape={q.shape} must not be empty")
