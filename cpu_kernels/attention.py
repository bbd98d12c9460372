"""Ragged paged attention as a native CPU kernel (an XLA FFI custom call): the decode rows, and
optionally the prefill rows too.

XLA:CPU runs the pure-jnp decode path as page gathers that copy every key and value of a chunk
before the score and value reductions read them again; on a 2-core CPU that path took 60% of a
64-sequence decode step of SmolLM2-135M. Its prefill path (tiles of rows, an online softmax
over gathered chunks) took ~20% of a 1024-token prefill step. ``csrc/attention.cc`` reads the
pages in place through the block table, one (sequence, kv head) item per decode row and one
(sequence, kv head, 16-row tile) item per prefill tile, on XLA's intra-op thread pool.

``native_attention_fn`` is the attention op the engine runs with it: ``pallas_kernels``' jnp op
with its decode (and prefill) rows in this kernel (its ``rows_kernel`` hook), so the rows the
kernel does not take, and the 8-bit cache's scales, run exactly as in the jnp op. The library is
built ahead of serving (``cpu_kernels.build``); where none is built ``available()`` is False and
the engine keeps the jnp paths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import register
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

_TARGET = "jaxserve_cpu_decode_attention"
SUPPORTED_CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                          jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8))


def available() -> bool:
    """Whether the kernel's library is built and loaded, and the kernel registered with XLA:CPU."""
    return register("JaxserveCpuDecodeAttention", _TARGET)


def cpu_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                         block_tables: jax.Array, seq_lens: jax.Array,
                         query_start_loc: jax.Array, num_seqs: jax.Array, *,
                         v_scale: jax.Array | None = None,
                         sliding_window: int | jax.Array | None = None,
                         logit_soft_cap: float | None = None,
                         prefill: bool = False, invariant: bool = False) -> jax.Array:
    """Attention of each one-row (decode) sequence's row over its paged context, and with
    ``prefill`` of every row of the multi-row sequences too (causal: row ``i`` of a sequence
    with ``q_len`` rows and ``seq_lens`` context sits at position ``seq_lens - q_len + i``).

    Args:
      q: ``f32[T, num_q_heads, head_dim]``, already multiplied by the softmax scale (and by
        the layer's K scale for an 8-bit cache).
      k_cache, v_cache: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``,
        float32, bfloat16, int8 or uint8 (float8_e4m3fn bits).
      layer, block_tables, seq_lens, query_start_loc, num_seqs: as ``ragged_paged_attention``.
      v_scale: ``f32[num_kv_heads]``, the layer's V scale (8-bit caches); None: 1.
      sliding_window: attend to the last ``sliding_window`` positions only (traced or int).
      logit_soft_cap: ``cap * tanh(s / cap)`` on the scores, if set.
      prefill: also the rows of sequences with more than one query row.
      invariant: with ``prefill``, sum each decode row in the order of a prefill tile's rows,
        so that every row's result is bit-identical whether it is a decode row or in a prompt
        chunk, and whatever rows share its step (``csrc/attention.cc``; batch invariance,
        docs/configuration.md#batch-invariance). Ignored without ``prefill``.
    Returns:
      ``f32[T, num_q_heads, head_dim]``: the decode rows' outputs (and with ``prefill`` the
      multi-row sequences'), every other row (padding) 0.
    Raises:
      RuntimeError: the kernel is not available (``available()``).
      ValueError: a cache dtype the kernel does not read.
    """
    if not available():
        raise RuntimeError("the native CPU attention kernel is not available")
    if jnp.dtype(k_cache.dtype) not in SUPPORTED_CACHE_DTYPES:
        raise ValueError(f"k_cache.dtype={k_cache.dtype} must be one of "
                         f"{[str(d) for d in SUPPORTED_CACHE_DTYPES]}")
    num_kv_heads = k_cache.shape[3]
    if v_scale is None:
        v_scale = jnp.ones((num_kv_heads,), jnp.float32)
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(())
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_cache, v_cache,
                jnp.asarray(layer, jnp.int32).reshape(()), block_tables.astype(jnp.int32),
                seq_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32),
                num_seqs.astype(jnp.int32).reshape(1), v_scale.astype(jnp.float32), window,
                soft_cap=np.float32(logit_soft_cap or 0.0), prefill=np.int32(bool(prefill)),
                invariant=np.int32(bool(prefill and invariant)))


def native_attention_fn(prefill: bool = True, invariant: bool = False
                        ) -> Callable[..., jax.Array]:
    """The attention op (``pallas_kernels.ragged_paged_attention``'s signature) with its decode
    rows, and with ``prefill`` its prefill rows too, in this kernel; the jnp path runs the rest.
    ``invariant`` (needs ``prefill``): every row in one reduction order (``cpu_decode_attention``).
    XLA:CPU only. Check ``available()`` first: calling the op without it raises RuntimeError.

    Raises:
      ValueError: ``invariant`` without ``prefill`` (the jnp path would run the prefill rows).
    """
    if invariant and not prefill:
        raise ValueError("invariant=True needs prefill=True: the jnp path's prefill rows sum "
                         "in another order than the kernel's decode rows")
    kernel = functools.partial(cpu_decode_attention, invariant=True) if invariant \
        else cpu_decode_attention
    return functools.partial(ragged_paged_attention, rows_kernel=kernel,
                             rows_kernel_prefill=prefill)
