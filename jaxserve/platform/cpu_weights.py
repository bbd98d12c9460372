"""The CPU's kernel-backed weights: params leaves whose matmuls the native CPU kernels run
(``cpu_kernels``), behind the model layer's interface for them (``models.interface.KernelWeight``).

``CpuPlatform.prepare_weights`` swaps them in once at load, after quantisation, for unsharded
params on XLA:CPU only (the kernels are custom calls that XLA cannot partition):

- ``use_packed_bf16``: plain bfloat16 layer weights and the LM head -> ``PackedWeight``, in the
  layout of ``cpu_kernels.bf16_matmul.pack``. The layer scan broadcasts it whole and the model
  binds the scan's layer index to it; the kernel reads that layer where it lies.
- ``use_native_int4``: int4 weights contracted along their rows -> ``NativeInt4Weight``, whose
  matmuls of up to ``NATIVE_INT4_MAX_ROWS`` rows run in ``cpu_kernels.int4_matmul`` and larger
  ones as ``models.quant.qmatmul``'s XLA path. The scan slices it per layer as it does the
  ``QuantizedWeight`` inside.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import traverse_util

from cpu_kernels import bf16_matmul as bf16_kernel
from cpu_kernels import int4_matmul as int4_kernel
from models.interface import KernelWeight
from models.quant import QuantTargets, embed_lookup, qmatmul
from models.quant_formats import QuantizedWeight

# Rows up to which an int4 weight's matmul runs in the native CPU kernel (``use_native_int4``)
# rather than as XLA:CPU's dequantise-then-dot. Measured on a 2-core Zen 3 (AVX2;
# docs/decisions/0033-int4-native-matmul.md): SmolLM2-135M's 210 int4 matmuls in a scan, native
# against XLA, 7.8 / 19.7 ms at 1 row, 13.4 / 30.2 at 4, 24.0 / 36.8 at 8; whole decode steps
# (two engines interleaved in one process) 18.5 / 28.5 ms at 1 sequence, 27.2 / 36.2 at 4, and
# at 8 in four runs 54.7 / 89.8, 59.5 / 59.9, 47.5 / 53.5 and 44.6 / 50.9. At 16 rows the
# matmuls alone were 54.9 / 57.4 (the kernel unpacks the nibbles again for every 4-row tile).
NATIVE_INT4_MAX_ROWS = 8
# Rows up to which a packed bfloat16 weight's matmul runs in the native kernel
# (``use_packed_bf16``); more go to XLA's dot of the layer's weight unpacked (a strided copy per
# layer and step). Measured on a 2-core Zen 4 (docs/decisions/0029-bf16-packed-matmul.md), SmolLM2's
# 210 matmuls in a 30-layer scan, kernel against XLA: 8.6 / 21-24 ms at 1 row, 15 / 25-33 at
# 16, 40 / 53-56 at 64, 82 / 93-101 at 128, 151-154 / 168-188 at 256, 602-708 / 616-706 at
# 1024; so every bucket up to this bound runs in the kernel.
NATIVE_BF16_MAX_ROWS = 8192


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight(KernelWeight):
    """A bfloat16 ``[..., k, n]`` weight (a stack of layers' ``[L, k, n]`` in the params) in the
    native CPU kernel's layout (``cpu_kernels.bf16_matmul.pack``), set by ``use_packed_bf16``.
    The layer scan broadcasts it whole, and ``at_layer`` binds the layer index: ``matmul`` runs
    up to ``max_rows`` rows in the kernel, reading the layer's weight where it lies, and more
    rows as XLA's dot of the layer's weight unpacked."""

    scan_broadcast: ClassVar[bool] = True

    packed: jax.Array  # bf16[..., NB, KP, 32], ``pack`` of a [..., k, n] matrix
    k: int = field(metadata={"static": True})
    n: int = field(metadata={"static": True})
    max_rows: int = field(metadata={"static": True})
    layer: jax.Array | None = None  # i32[]: the layer of a stack, bound by ``at_layer``
    # the logical weight is the [n, k] transpose of the packed matrix (a tied embedding table:
    # ``matmul(..., transpose=True)`` is the LM head, ``embed_rows`` gathers its rows)
    transposed: bool = field(default=False, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape of one layer's weight: ``(k, n)``, or ``(n, k)`` transposed."""
        return (self.n, self.k) if self.transposed else (self.k, self.n)

    def matmul(self, x: jax.Array, *, transpose: bool) -> jax.Array:
        """``x [..., k] @ w`` -> ``[..., n]`` in ``x.dtype`` (``transpose`` must equal
        ``transposed``).

        Raises:
          ValueError: ``transpose`` other than ``transposed``; a stack without its layer bound.
        """
        if transpose != self.transposed:
            raise ValueError(f"a PackedWeight with transposed={self.transposed} is contracted "
                             f"with transpose={self.transposed} only")
        rows = math.prod(x.shape[:-1])
        stacked = self.packed.ndim == 4
        if stacked and self.layer is None:
            raise ValueError("a stacked PackedWeight needs its layer bound (at_layer)")
        layer = jnp.int32(0) if self.layer is None else self.layer
        if 0 < rows <= self.max_rows:
            y = bf16_kernel.cpu_bf16_matmul(x.reshape(rows, self.k), self.packed, layer, self.n)
            return y.reshape(*x.shape[:-1], self.n).astype(x.dtype)
        one = (jax.lax.dynamic_index_in_dim(self.packed, layer, keepdims=False) if stacked
               else self.packed)
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        return jax.lax.dot_general(x.astype(jnp.bfloat16), bf16_kernel.unpack(one, self.k, self.n),
                                   dims, preferred_element_type=jnp.float32).astype(x.dtype)

    def embed_rows(self, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """Rows ``ids`` of the embedding table packed transposed: ``i32[T]`` -> ``[T, k]``.

        Raises:
          ValueError: the weight is not packed transposed.
        """
        if not self.transposed:
            raise ValueError("embed_rows needs a PackedWeight packed transposed (an embedding "
                             "table)")
        return bf16_kernel.unpack_columns(self.packed, ids, self.k).astype(dtype)

    def at_layer(self, layer: jax.Array | None) -> PackedWeight:
        return dataclasses.replace(self, layer=layer)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class NativeInt4Weight(KernelWeight):
    """An int4 ``QuantizedWeight`` contracted along its rows (``axis=-2``) whose matmuls of up to
    ``max_rows`` rows run in the native CPU kernel (``cpu_kernels.int4_matmul``), and larger
    ones (or an empty batch) as ``models.quant.qmatmul`` runs ``base``. Set by
    ``use_native_int4``; the scan slices ``base`` per layer as it does a plain one's."""

    scan_broadcast: ClassVar[bool] = False

    base: QuantizedWeight
    max_rows: int = field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    def matmul(self, x: jax.Array, *, transpose: bool) -> jax.Array:
        """``x [..., k] @ w`` -> ``[..., n]`` in ``x.dtype``.

        Raises:
          ValueError: ``transpose`` (as ``qmatmul`` of ``base``).
        """
        rows = math.prod(x.shape[:-1])
        w = self.base
        if not transpose and w.q.ndim == 2 and 0 < rows <= self.max_rows:
            y = int4_kernel.cpu_int4_matmul(x.reshape(rows, x.shape[-1]), w.q, w.scale, w.zero)
            return y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype)
        return qmatmul(x, w, transpose=transpose)

    def embed_rows(self, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
        return embed_lookup(self.base, ids, dtype)

    def at_layer(self, layer: jax.Array | None) -> NativeInt4Weight:
        return self


def use_native_int4(params, max_rows: int = NATIVE_INT4_MAX_ROWS):
    """``params`` with every int4 weight contracted along its rows (``[..., in, out]``) run as a
    ``NativeInt4Weight`` with ``max_rows`` (an existing one gets that ``max_rows``).

    Raises:
      ValueError: ``max_rows`` < 1.
      RuntimeError: the kernel is not available (no library built).
    """
    if max_rows < 1:
        raise ValueError(f"{max_rows=} must be >= 1")
    if not int4_kernel.available():
        raise RuntimeError("the native CPU int4 matmul kernel could not be built (see the "
                           "log; set CXX to a C++17 compiler)")

    def one(leaf):
        if isinstance(leaf, NativeInt4Weight):
            return dataclasses.replace(leaf, max_rows=max_rows)
        if isinstance(leaf, QuantizedWeight) and leaf.method == "int4" and leaf.axis == -2:
            return NativeInt4Weight(leaf, max_rows)
        return leaf

    return jax.tree_util.tree_map(
        one, params, is_leaf=lambda x: isinstance(x, (QuantizedWeight, NativeInt4Weight)))


def use_packed_bf16(params, targets: QuantTargets, max_rows: int = NATIVE_BF16_MAX_ROWS):
    """``params`` with every plain bfloat16 weight at ``targets.linear`` (``[L, in, out]``
    stacks), and the LM head (an untied ``lm_head``, else the tied ``embed`` table, packed
    transposed), replaced by a ``PackedWeight`` that runs its matmuls of up to ``max_rows`` rows
    in the native CPU kernel (``cpu_kernels.bf16_matmul``).

    Raises:
      RuntimeError: the kernel is not available (no library built).
    """
    if not bf16_kernel.available():
        raise RuntimeError("the native CPU bfloat16 matmul kernel could not be built (see the "
                           "log; set CXX to a C++17 compiler)")
    flat = traverse_util.flatten_dict(params, keep_empty_nodes=True, sep="/")
    plain = lambda v: v is not None and not isinstance(v, (QuantizedWeight, KernelWeight)) and (
        v.dtype == jnp.bfloat16)
    for path in targets.linear:
        v = flat.get(path)
        if plain(v):
            flat[path] = PackedWeight(bf16_kernel.pack(v), k=v.shape[-2], n=v.shape[-1],
                                      max_rows=max_rows)
    # the LM head: an untied [hidden, vocab] one as stored; a tied embedding table [vocab,
    # hidden] packed transposed (its rows are gathered from that layout, so no second copy)
    head = {p: a for p, a in targets.embeddings}
    lm_head, embed = flat.get("lm_head"), flat.get("embed")
    if head.get("lm_head") == -2 and plain(lm_head) and lm_head.ndim == 2:
        flat["lm_head"] = PackedWeight(bf16_kernel.pack(lm_head), k=lm_head.shape[0],
                                       n=lm_head.shape[1], max_rows=max_rows)
    elif head.get("embed") == -1 and "lm_head" not in flat and plain(embed) and embed.ndim == 2:
        flat["embed"] = PackedWeight(bf16_kernel.pack(embed.T), k=embed.shape[1],
                                     n=embed.shape[0], max_rows=max_rows, transposed=True)
    return traverse_util.unflatten_dict(flat, sep="/")
