"""A few activation rows times an int4 weight, as a native CPU kernel (an XLA FFI custom call).

For one to a few rows (decode steps of one to a few sequences) XLA:CPU runs an int4 weight's
matmul as a dequantisation of the whole weight to float32 followed by the dot, so it writes
and reads back 8x the bytes it loaded. ``csrc/int4_matmul.cc`` sums the nibbles against the
activations group by group and applies each group's scale and zero point once, reading the
packed weight once; runs of whole groups run on XLA's intra-op thread pool. Built with the other
native kernels (``cpu_kernels.build``); without a built library ``available()`` is False.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels.build import register

_TARGET = "jaxserve_cpu_int4_matmul"


def available() -> bool:
    """Whether the kernel's library is built and loaded, and the kernel registered with XLA:CPU."""
    return register("JaxserveCpuInt4Matmul", _TARGET)


def cpu_int4_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
    """``x @ w`` for the int4 weight ``w`` of ``models.quant_formats`` (contracted along its rows).

    Args:
      x: ``[T, K]`` activations (computed in float32).
      q: ``u8[K // 2, N]``: rows ``2i`` / ``2i + 1`` of ``w`` in the low / high nibble.
      scale: ``f16[G, N]``, one per group of ``K // G`` rows (even) and column.
      zero: ``u8[G, N]``, the group's zero point in sixteenths of a step.
    Returns:
      ``f32[T, N]``: ``sum_k x[t, k] * (q[k, n] - zero[g, n] / 16) * scale[g, n]``.
    Raises:
      RuntimeError: the kernel is not available (``available()``).
      ValueError: shapes or dtypes that do not fit together (naming the argument).
    """
    if not available():
        raise RuntimeError("the native CPU int4 matmul kernel is not available")
    if x.ndim != 2 or q.ndim != 2 or scale.ndim != 2 or zero.ndim != 2:
        raise ValueError(f"x, q, scale and zero must be 2-D, got shapes {x.shape}, {q.shape}, "
                         f"{scale.shape}, {zero.shape}")
    k, n = x.shape[1], q.shape[1]
    if q.dtype != jnp.uint8 or zero.dtype != jnp.uint8 or scale.dtype != jnp.float16:
        raise ValueError(f"q and zero must be uint8 and scale float16, got {q.dtype}, "
                         f"{zero.dtype}, {scale.dtype}")
    groups = scale.shape[0]
    if (q.shape[0] * 2 != k or scale.shape != (groups, n) or zero.shape != (groups, n)
            or groups == 0 or k % groups or (k // groups) % 2):
        raise ValueError(f"q {q.shape} must be [K // 2, N] for x {x.shape} (K={k}), and scale "
                         f"{scale.shape} and zero {zero.shape} [G, N] with K / G even")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x.astype(jnp.float32), q, scale, zero)
