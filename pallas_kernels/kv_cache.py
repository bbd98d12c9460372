"""The paged KV cache layout, defined once for the kernels and the engine.

One K and one V array, each ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
Position ``p`` of a sequence with block table ``bt`` lives in block ``bt[p // block_size]`` at
offset ``p % block_size``, flat *slot* ``block_id * block_size + offset``. Block 0 is reserved:
padding tokens and padded table entries point at it, so kernels need no padding branch. The
cache is a pytree carried through the layer scan and donated across steps (updated in place).

8-bit cache (``kv_cache_dtype`` "fp8" / "int8"): static symmetric scales ``k_scale``, ``v_scale``
``f32[num_layers, num_kv_heads]``, a stored ``x_q`` standing for ``x_q * scale``. ``write_kv``
divides, rounds (int8) and saturates to ``QUANT_MAX``; attention folds the K scale into the
scores and the V scale into the output. The scales are fixed at engine start
(``jaxserve.device.kv_calibration``), so moving blocks moves only pages. Per-tensor static
scaling as in vLLM's FP8 and TensorRT-LLM's INT8/FP8 KV caches, here per (layer, kv head).
fp8 pages are ``uint8`` bit patterns (XLA's CPU float8 scatter copies the whole cache;
docs/quantization.md#8-bit-kv-cache); ``fp8_bits`` / ``kv_to_float`` convert at the edges.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

PADDING_SLOT = 0  # slot of padding tokens (inside reserved block 0)

FP8_STORAGE = jnp.dtype(jnp.uint8)  # holds float8_e4m3fn bit patterns
# ``kv_cache_dtype`` names of the 8-bit formats -> the cache arrays' storage dtypes
KV_QUANT_DTYPES: dict[str, jnp.dtype] = {
    "fp8": FP8_STORAGE,
    "int8": jnp.dtype(jnp.int8),
}
KV_FORMAT_NAMES: dict[jnp.dtype, str] = {
    FP8_STORAGE: "float8_e4m3fn bits in uint8",
    jnp.dtype(jnp.int8): "int8",
}
# largest magnitude each storage dtype holds (e4m3fn: 448; int8: symmetric, -128 unused)
QUANT_MAX: dict[jnp.dtype, float] = {
    FP8_STORAGE: 448.0,
    jnp.dtype(jnp.int8): 127.0,
}


def is_quantized_dtype(dtype: jnp.dtype) -> bool:
    """Whether a cache storage dtype is one of the 8-bit formats (stored with scales)."""
    return jnp.dtype(dtype) in QUANT_MAX


def fp8_bits(x: jax.Array) -> jax.Array:
    """``float8_e4m3fn`` values as their ``uint8`` bit patterns, or back (a bitcast)."""
    to = jnp.uint8 if x.dtype == jnp.float8_e4m3fn else jnp.float8_e4m3fn
    return jax.lax.bitcast_convert_type(x, to)


def kv_to_float(x_q: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Stored values (not yet scaled) in a float ``dtype``, exactly (e4m3 bits decoded)."""
    if jnp.dtype(x_q.dtype) == FP8_STORAGE:
        x_q = fp8_bits(x_q)
    return x_q.astype(dtype)


def kv_to_numpy(x_q) -> np.ndarray:
    """A stored cache (any dtype) as float64 numpy, not yet scaled (references, tests)."""
    a = np.asarray(x_q)
    if a.dtype == np.uint8:
        a = a.view(jnp.float8_e4m3fn)  # ml_dtypes' numpy type
    return a.astype(np.float64)


def quantize_kv(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x / scale`` in an 8-bit storage dtype, saturated to ``QUANT_MAX[dtype]``.

    Args:
      x: ``[..., num_kv_heads, head_dim]`` float.
      scale: ``f32[num_kv_heads]`` (broadcast over head_dim).
      dtype: ``uint8`` (e4m3 bit patterns) or ``int8``; both round to nearest even.
    """
    dtype = jnp.dtype(dtype)
    qmax = QUANT_MAX[dtype]
    y = jnp.clip(x.astype(jnp.float32) / scale[:, None], -qmax, qmax)
    if dtype == FP8_STORAGE:
        return fp8_bits(y.astype(jnp.float8_e4m3fn))
    return jnp.round(y).astype(dtype)


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Paged K and V arrays, with their scales when stored at 8 bits."""

    k: jax.Array  # [num_layers, num_blocks, block_size, num_kv_heads, head_dim], cache dtype
    v: jax.Array  # as k
    # f32[num_layers, num_kv_heads], 8-bit caches only (else None); steps pass them unchanged
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

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
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    scale_sharding: jax.sharding.Sharding | None = None,
) -> KVCache:
    """Zero-filled K and V arrays, created on the device (no host copy).

    Args:
      k_scale, v_scale: ``[num_layers, num_kv_heads]`` > 0, required for an 8-bit ``dtype``.
      scale_sharding: where the f32 scales go (under TP: split over kv heads like the cache).

    Raises:
      ValueError: num_blocks < 2; scales missing for an 8-bit cache, given for a float one, of
        the wrong shape, or not finite and positive.
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is reserved)")
    shape = kv_cache_shape(num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    if not is_quantized_dtype(dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are for an 8-bit cache, not dtype={dtype}")
        return KVCache(k=make(), v=make())
    scales = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{name} is required for an 8-bit cache (dtype={jnp.dtype(dtype)})")
        host = np.asarray(s, np.float32)
        if host.shape != (num_layers, num_kv_heads):
            raise ValueError(f"{name}.shape={host.shape} must be "
                             f"(num_layers, num_kv_heads)=({num_layers}, {num_kv_heads})")
        if not np.all(np.isfinite(host) & (host > 0)):
            raise ValueError(f"{name} must be finite and > 0, got min {host.min()}")
        # a jitted constant, so that every process of a multi-host mesh places its own shards
        scales.append(jax.jit(lambda h=host: jnp.asarray(h), out_shardings=scale_sharding)())
    return KVCache(k=make(), v=make(), k_scale=scales[0], v_scale=scales[1])
