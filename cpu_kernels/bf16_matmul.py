"""Activation rows times one layer of a stacked bfloat16 weight, as a native CPU kernel (an XLA
FFI custom call), reading the weight packed for AVX512-BF16.

In the model's scan over layers, XLA:CPU copies each layer's slice of a stacked weight before
its dot, and its bfloat16 dot repacks the weight again at small row counts: a decode step moved
each weight byte about three times. ``csrc/bf16_matmul.cc`` takes the whole stack and the
layer index, and reads that layer's weight once, where it lies, in the layout ``vdpbf16ps``
takes (``pack``). Measured on a 2-core Zen 4, the 210 matmuls of SmolLM2-135M's 30 layers in a
scan: 8.6 against 20.9-24.4 ms at 1 row, 15 against 25-33 at 16, 40 against 53-56 at 64, 82
against 93-101 at 128 (docs/decisions/0029-bf16-packed-matmul.md). Built with the other
native kernels (``cpu_kernels.build``); without a built library ``available()`` is False, and
unless the loaded build is the avx512bf16 one (a CPU with AVX512-BF16) ``vectorized()`` is False
(the kernel then runs scalar float32 sums: correct, slow).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import library, register

_TARGET = "jaxserve_cpu_bf16_matmul"
BLOCK = 16  # columns per packed block (one 512-bit vector of float32 sums)


def available() -> bool:
    """Whether the kernel's library is built and loaded, and the kernel registered with XLA:CPU."""
    return register("JaxserveCpuBf16Matmul", _TARGET)


@functools.cache
def vectorized() -> bool:
    """Whether the kernel runs AVX512-BF16's ``vdpbf16ps`` (the avx512bf16 build is loaded)."""
    return available() and bool(library().JaxserveBf16MatmulVectorized())


def packed_shape(k: int, n: int) -> tuple[int, int, int]:
    """``(NB, KP, 32)``: the packed layout of one ``[k, n]`` weight."""
    return (-(-n // BLOCK), -(-k // 2), 2 * BLOCK)


def pack(w: jax.Array | np.ndarray) -> jax.Array:
    """``bf16[..., K, N]`` -> ``bf16[..., NB, KP, 32]`` with
    ``out[..., b, p, 2c + j] = w[..., 2p + j, 16b + c]`` (zeros beyond K and N): each 64-byte
    row of a block holds the row pair ``(2p, 2p + 1)`` of 16 columns, interleaved as
    ``vdpbf16ps`` pairs them."""
    w = jnp.asarray(w, jnp.bfloat16)
    *lead, k, n = w.shape
    nb, kp, _ = packed_shape(k, n)
    w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, 2 * kp - k), (0, nb * BLOCK - n)])
    w = w.reshape(*lead, kp, 2, nb, BLOCK)
    nd = len(lead)
    perm = (*range(nd), nd + 2, nd, nd + 3, nd + 1)  # -> [..., NB, KP, 16, 2]
    return jnp.transpose(w, perm).reshape(*lead, nb, kp, 2 * BLOCK)


def unpack(packed: jax.Array, k: int, n: int) -> jax.Array:
    """The inverse of ``pack``: ``bf16[..., NB, KP, 32]`` -> ``bf16[..., k, n]``."""
    *lead, nb, kp, _ = packed.shape
    nd = len(lead)
    w = packed.reshape(*lead, nb, kp, BLOCK, 2)
    w = jnp.transpose(w, (*range(nd), nd + 1, nd + 3, nd, nd + 2))  # -> [..., KP, 2, NB, 16]
    return w.reshape(*lead, 2 * kp, nb * BLOCK)[..., :k, :n]


def unpack_columns(packed: jax.Array, cols: jax.Array, k: int) -> jax.Array:
    """Columns ``cols`` of the packed ``[k, n]`` matrix, as rows: ``bf16[NB, KP, 32]``,
    ``i32[C]`` -> ``bf16[C, k]`` (a tied embedding table packed as the LM head's ``[hidden,
    vocab]`` gives its rows back so)."""
    # column c is in block c // 16, lanes 2 (c % 16) + (0, 1) of each row pair
    lanes = 2 * (cols % BLOCK)[:, None] + jnp.arange(2)
    rows = packed[(cols // BLOCK)[:, None, None], jnp.arange(packed.shape[1])[None, :, None],
                  lanes[:, None, :]]
    return rows.reshape(cols.shape[0], -1)[:, :k]


def cpu_bf16_matmul(x: jax.Array, packed: jax.Array, layer: jax.Array | int, n: int
                    ) -> jax.Array:
    """``x @ w[layer]`` for the packed stack ``packed = pack(w)``, ``x`` rounded to bfloat16
    and the products summed in float32 (as ``dot_general(x.astype(bfloat16), w[layer],
    preferred_element_type=float32)``, up to the order of the sums).

    Args:
      x: ``[M, K]`` activations (cast to float32).
      packed: ``bf16[L, NB, KP, 32]`` (a stack of L layers) or ``bf16[NB, KP, 32]``.
      layer: ``i32[]``, which layer (0 for an unstacked weight); out of range is an error the
        kernel reports at run time.
      n: the weight's columns, N.
    Returns:
      ``f32[M, n]``.
    Raises:
      RuntimeError: the kernel is not available (``available()``).
      ValueError: shapes or dtypes that do not fit together (naming the argument).
    """
    if not available():
        raise RuntimeError("the native CPU bfloat16 matmul kernel is not available")
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if packed.dtype != jnp.bfloat16 or packed.ndim not in (3, 4):
        raise ValueError(f"packed must be bf16[L, NB, KP, 32] or bf16[NB, KP, 32], got "
                         f"{packed.dtype}{list(packed.shape)}")
    if packed.shape[-3:] != packed_shape(x.shape[1], n):
        raise ValueError(f"packed's blocks {packed.shape[-3:]} do not fit x's K={x.shape[1]} "
                         f"and n={n} (want {packed_shape(x.shape[1], n)})")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x.astype(jnp.float32), packed, jnp.asarray(layer, jnp.int32))
