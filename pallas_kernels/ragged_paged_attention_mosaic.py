"""Ragged paged attention as a Pallas Mosaic GPU kernel (Hopper and newer: TMA, wgmma).

Same contract as ``pallas_kernels/ragged_paged_attention.py:ragged_paged_attention`` (and its
reference ``ref_ragged_paged_attention``): ``T`` flattened query tokens of ``S`` sequences, prefill
chunks and decode tokens mixed, each sequence's context read from the paged KV cache
``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` through its block-table row;
causal, optional sliding window and logit soft cap; rows past ``query_start_loc[num_seqs]`` are 0.

The wrapper cuts each real sequence's rows into query blocks of up to ``2 * (64 // group)``
tokens (``group = num_q_heads // num_kv_heads``; ``query_blocks``) and gathers each block's
queries of one kv head into two 64-row tiles (``query_tiles``); grid ``(blocks, num_kv_heads,
num_kv_splits)``, one CTA of three warpgroups each (``mosaic_attention_kernel``: a TMA producer
walking the block table page by page into a shared-memory ring, two wgmma consumers).
With ``num_kv_splits > 1`` (flash-decoding: decode batches too small to fill the GPU) each split
writes a normalised partial output and its log-sum-exp; the wrapper merges them.

Roofline, per layer, H100 SXM (3.35 TB/s HBM3, 989 dense bf16 TFLOP/s), bf16 cache:

  ===============================  ==========  ==========  =======  ===========================
  case                             bytes       FLOPs       floor    bound
  ===============================  ==========  ==========  =======  ===========================
  decode b64 x 4k, 32/8/128        1.074 GB    4.29 G      320 us   KV read (FLOPs: 4.3 us)
  decode b64 x 4k, 9/3/64          201 MB      0.60 G      60 us    KV read
  decode b256 x 16k, 32/8/128      17.2 GB     68.7 G      5.13 ms  KV read
  prefill 512 at 4k, 32/8/128      25 MB       32.2 G      32.6 us  tensor cores (bytes: 7.5 us)
  prefill 512 at 4k, 9/3/64        4.3 MB      4.53 G      4.6 us   tensor cores
  ===============================  ==========  ==========  =======  ===========================

(decode bytes ``b * ctx * kv_heads * head_dim * 2 * 2``; prefill FLOPs ``4 * head_dim * q_heads
* pairs``, 1.97 M query-key pairs a head for 512 tokens ending at 4096.) Why the tiling should
reach >= 0.8 of the decode floor: one step of 128 keys (Llama) moves 64 KB per CTA, 2.6 us at an
SM's share of HBM, while its two 64x128x128 wgmmas (the 64-row tile padded from 4 live rows)
take 0.6 us at the SM's tensor rate: the compute hides under the copy of the next step, and the
ring keeps 64-128 KB in flight per SM, 4-7x what Little's law asks (17.5 KB at ~0.7 us latency).
512 CTAs make 3.9 waves. What is not at the floor: the wrapper's query gather and output
tiles (~36 MB, 3.3%), each CTA's first copy (~1 us of ~83 us), the launch. For prefill the
structure is FA3's warp specialisation without its softmax/GEMM ping-pong, which its ablation
puts at 582 of 661 TFLOP/s (hdim 128): ~0.59 of peak, against a goal of 0.5. Unmeasured on a GPU
(docs/decisions/0043-mosaic-gpu-attention.md).

Dtypes: the cache in bfloat16 or float16 (dots in that dtype), or 8-bit (float8 e4m3 bits in
``uint8``, ``int8``) with ``k_scale`` / ``v_scale`` ``f32[num_layers, num_kv_heads]``: converted in
shared memory to q's 16-bit dtype (bfloat16 for float32 q), the K scale folded into the score
scale, the V scale into the output. q is cast to the compute dtype; accumulation in float32; the
output in q's dtype. A float32 cache is refused (the Triton kernel takes it: wgmma would round
it to TF32). ``head_dim``: 16, 32 or a multiple of 64 up to 256 (32, 64, 128 or 256 for an
8-bit cache); ``block_size``: a multiple of 8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_cache import is_quantized_dtype
from pallas_kernels.mosaic_attention_kernel import (
    SMEM_MAX,
    KernelConfig,
    build,
    default_tiling,
    smem_bytes,
)
from pallas_kernels.query_tiles import ROWS, from_tiles, to_tiles
from pallas_kernels.ragged_paged_attention import check_kv_scales
from pallas_kernels.ragged_paged_attention_triton import default_num_kv_splits, query_blocks


@functools.partial(jax.jit, static_argnames=("sm_scale", "logit_soft_cap", "block_k", "stages",
                                             "stages8", "num_kv_splits", "p_in_smem",
                                             "interpret"))
def _ragged_mosaic(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc,
                   num_seqs, window, scales, *, sm_scale: float, logit_soft_cap: float | None,
                   block_k: int, stages: int, stages8: int, num_kv_splits: int | None,
                   p_in_smem: bool, interpret: bool) -> jax.Array:
    """The jitted body of ``ragged_paged_attention_mosaic`` (arguments checked there;
    ``window``: None or an ``i32`` scalar; ``scales``: None or ``f32[2, num_layers,
    num_kv_heads]``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    dt = compute_dtype(q.dtype, k_cache.dtype)
    bq = ROWS // group
    blk_seq, blk_start, blk_end, tok_valid, num_q_blocks = query_blocks(
        query_start_loc, num_seqs, num_tokens, 2 * bq)
    splits = num_kv_splits or default_num_kv_splits(
        num_tokens, num_kv_heads, max_blocks * block_size, block_k, num_q_blocks)
    pad = block_k // block_size + 1  # a step may read this many entries past the last page
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pad)))
    c = KernelConfig(group=group, head_dim=head_dim, block_size=block_size, block_k=block_k,
             stages=stages, stages8=stages8, num_splits=splits, max_blocks=max_blocks + pad,
             windowed=window is not None, soft_cap=logit_soft_cap, quantized=scales is not None,
             sm_scale=float(sm_scale), p_in_smem=interpret or p_in_smem)

    q_tiles = to_tiles(q, blk_start, blk_end, group, dt)
    meta = jnp.stack([blk_seq, blk_start, blk_end]).astype(jnp.int32)
    if window is not None:  # a window past every context is none (and keeps the mask in int32)
        window = jnp.minimum(window.reshape(()), max_blocks * block_size + 1)
    scal = jnp.stack([jnp.asarray(layer, jnp.int32).reshape(()),
                      jnp.int32(0) if window is None else window])
    kernel = build(c, dt, k_cache.dtype, num_q_blocks, num_kv_heads)(
        interpret=plgpu.InterpretGPUParams(detect_races=True) if interpret else False)
    outs = kernel(meta, seq_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32),
                  tables.reshape(-1), scal,
                  jnp.ones((2, 1, 1), jnp.float32) if scales is None else scales,
                  q_tiles, k_cache, v_cache)

    out = from_tiles(outs[0], outs[1] if splits > 1 else None, blk_start, blk_end, group,
                     num_tokens)
    return jnp.where(tok_valid[:, None, None], out, 0.0).astype(q.dtype)


def compute_dtype(q_dtype, kv_dtype) -> jnp.dtype:
    """The dtype of the kernel's dots: a 16-bit cache's own; for an 8-bit cache, float16 for
    float16 queries, else bfloat16."""
    if not is_quantized_dtype(kv_dtype):
        return jnp.dtype(kv_dtype)
    return jnp.dtype(jnp.float16 if jnp.dtype(q_dtype) == jnp.float16 else jnp.bfloat16)


def ragged_paged_attention_mosaic(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
    block_tables: jax.Array, seq_lens: jax.Array, query_start_loc: jax.Array,
    num_seqs: jax.Array, *, sm_scale: float, sliding_window: int | jax.Array | None = None,
    logit_soft_cap: float | None = None, k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None, block_k: int | None = None, stages: int | None = None,
    num_kv_splits: int | None = None, p_in_smem: bool = False, interpret: bool = False,
) -> jax.Array:
    """Attention of a ragged token batch over the paged KV cache (Pallas Mosaic GPU kernel).

    Args:
      q: ``[T, num_q_heads, head_dim]``, float32, bfloat16 or float16.
      k_cache, v_cache: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``,
        bfloat16, float16, or 8-bit (e4m3 bits in ``uint8``, ``int8``) with scales.
      layer: i32 scalar (or ``i32[1]``), the layer to read.
      block_tables: ``i32[S, max_blocks_per_seq]``.
      seq_lens: ``i32[S]``, context length including this step's tokens.
      query_start_loc: ``i32[S + 1]``; padded sequences repeat the last real value.
      num_seqs: ``i32[1]``, the number of real sequences.
      sm_scale, sliding_window, logit_soft_cap: as ``ragged_paged_attention`` (the window, a
        Python int or an ``i32`` scalar, is a kernel input: layers of different windows share
        one compiled kernel).
      k_scale, v_scale: ``f32[num_layers, num_kv_heads]``, for (and only for) an 8-bit cache.
      block_k: keys a pipeline step (64, 128 or 256, a multiple of ``block_size``); None:
        ``default_tiling``'s, or ``block_size`` where that is larger.
      stages: the 16-bit shared-memory ring's depth (>= 2); None: ``default_tiling``.
      num_kv_splits: flash-decoding splits along the keys; None picks by grid size.
      p_in_smem: pass the probabilities to the P.V wgmma through shared memory instead of
        registers (always so in interpret mode, whose wgmma takes operands from memory only).
      interpret: run in Mosaic GPU interpret mode on the CPU, with the race detector on and
        out-of-bounds reads raising (``plgpu.InterpretGPUParams``).
    Returns:
      ``[T, num_q_heads, head_dim]`` in q's dtype; padding rows are 0.
    Raises:
      ValueError: naming the offending shape, dtype or knob.
    """
    tiling = default_tiling(q.shape[-1], k_cache.dtype)
    block_k = block_k or max(tiling[0], k_cache.shape[2] if k_cache.ndim == 5 else 0)
    stages = stages or tiling[1]
    _validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
              block_k=block_k, stages=stages, num_kv_splits=num_kv_splits,
              sliding_window=sliding_window)
    smem = smem_bytes(q.shape[-1], block_k, stages, tiling[2], 2, p_in_smem or interpret)
    if smem > SMEM_MAX:
        raise ValueError(f"block_k={block_k} and stages={stages} at head_dim={q.shape[-1]} ask "
                         f"for {smem} bytes of shared memory, more than {SMEM_MAX}")
    scales = None
    if check_kv_scales(k_cache, k_scale, v_scale):
        scales = jnp.stack([k_scale, v_scale]).astype(jnp.float32)
    window = None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32)
    run = functools.partial(
        _ragged_mosaic, sm_scale=sm_scale, logit_soft_cap=logit_soft_cap, block_k=block_k,
        stages=stages, stages8=tiling[2], num_kv_splits=num_kv_splits, p_in_smem=p_in_smem,
        interpret=interpret)
    args = (q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), block_tables, seq_lens,
            query_start_loc, num_seqs, window, scales)
    if not interpret:
        return run(*args)
    # GPU interpret mode orders its simulation with effectful callbacks, which a caller's
    # ``nn.scan`` (the models' layer loop) cannot hold: run it from an effect-free host callback
    return jax.pure_callback(lambda *a: np.asarray(run(*a)),
                             jax.ShapeDtypeStruct(q.shape, q.dtype), *args)


# -- input validation ----------------------------------------------------------------------------
def _swizzles(head_dim: int, itemsize: int) -> bool:
    """Whether rows of ``head_dim`` elements fill whole spans of a 32-128 byte swizzle."""
    row = head_dim * itemsize
    return row in (32, 64) or (row >= 128 and row % 128 == 0)


def _validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *,
              block_k: int, stages: int, num_kv_splits: int | None,
              sliding_window: int | jax.Array | None) -> None:
    """Shape, dtype and knob checks; messages name the offending value."""
    if q.ndim != 3 or k_cache.ndim != 5:
        raise ValueError(f"q.shape={q.shape} must be [T, num_q_heads, head_dim] and "
                         f"k_cache.shape={k_cache.shape} [num_layers, num_blocks, block_size, "
                         "num_kv_heads, head_dim]")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {v_cache.shape} {v_cache.dtype} must match k_cache "
                         f"{k_cache.shape} {k_cache.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or head_dim > 256 or not _swizzles(head_dim, 2):
        raise ValueError(f"head_dim={head_dim} (cache {cache_head_dim}) must match and be 16, "
                         "32 or a multiple of 64 up to 256 for the Mosaic GPU kernel (its rows "
                         "fill whole swizzle spans); --attention-backend pallas takes others")
    if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > ROWS:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads}, at most {ROWS} times it")
    if jnp.dtype(q.dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q.dtype={q.dtype} must be float32, bfloat16 or float16")
    kv = jnp.dtype(k_cache.dtype)
    if kv not in (jnp.bfloat16, jnp.float16) and not is_quantized_dtype(kv):
        raise ValueError(f"k_cache.dtype={kv} must be bfloat16, float16, uint8 (float8 e4m3 "
                         "bits) or int8 (a float32 cache runs in the Triton kernel)")
    if is_quantized_dtype(kv) and not _swizzles(head_dim, 1):
        raise ValueError(f"head_dim={head_dim} must be 32, 64 or a multiple of 128 for an "
                         "8-bit cache (its rows fill whole swizzle spans)")
    if block_size % 8:
        raise ValueError(f"block_size={block_size} must be a multiple of 8 (TMA tile rows); "
                         "--attention-backend pallas takes any")
    if block_k not in (64, 128, 256) or block_k % block_size:
        raise ValueError(f"block_k={block_k} must be 64, 128 or 256 and a multiple of "
                         f"block_size={block_size}")
    if stages < 2:
        raise ValueError(f"stages={stages} must be >= 2")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1")
    num_slots = block_tables.shape[0] if block_tables.ndim == 2 else -1
    if (block_tables.ndim != 2 or seq_lens.shape != (num_slots,)
            or query_start_loc.shape != (num_slots + 1,) or num_seqs.shape != (1,)):
        raise ValueError(f"block_tables {block_tables.shape}, seq_lens {seq_lens.shape}, "
                         f"query_start_loc {query_start_loc.shape}, num_seqs {num_seqs.shape} "
                         "must be [S, max_blocks], [S], [S + 1], [1]")
    if not num_tokens:
        raise ValueError(f"q.shape={q.shape} must not be empty")
