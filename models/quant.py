"""Weight quantisation at load time, and the layers' matmul and lookup over any weight they hold.

Data flow: params load in the serving dtype -> ``apply_quantization`` / ``quantize_params``
replaces each target leaf (``QuantTargets``), one at a time on its device, by a
``QuantizedWeight`` (``models.quant_formats``: the formats and their error bounds) and frees the
float leaf -> the platform may replace leaves by kernel-backed weights
(``models.interface.KernelWeight``) -> layers read each weight with ``weight`` and call
``qmatmul`` / ``embed_lookup``, which take plain arrays, quantised and kernel-backed weights
alike. A checkpoint from ``jaxserve convert --quantization`` holds quantised leaves
(``quantized_shapes`` is its restore target).

Compute: int8/fp8 ``q`` converts exactly to the dot's operand dtype, the dot runs, and the scale
applies to the ``[T, out]`` result in float32; int4 dequantises to the operand dtype first. The
operand dtype is the activations', except under the CPU's mixed mode (float32 activations, the
weights' ``dot_dtype`` bfloat16) at ``NARROW_DOT_MIN_ROWS`` rows or more: there the dot takes
bfloat16 operands and accumulates in float32, as a plain bfloat16 weight's does (``qmatmul``).
A kernel-backed weight computes its own products (``KernelWeight.matmul``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from models.interface import KernelWeight
from models.quant_formats import (
    DEFAULT_GROUP_SIZE,
    METHODS,
    QuantizedWeight,
    array_nbytes,
    check_group,
    dequantize,
    divisor_hint,
    quantize,
    quantized_shape,
)

BROADCAST = "broadcast"
"""The Flax collection of the kernel-backed weights the layer scan broadcasts whole
(``flax_variables``; ``KernelWeight.scan_broadcast``)."""

# Rows (tokens) from which a quantised weight whose ``dot_dtype`` is narrower than the float32
# activations is dequantised to that dtype for the dot. Measured on XLA:CPU (2-core Zen 5 with
# AVX512-BF16; SmolLM2-135M's 30 layers of 7 matmuls, weights streamed from memory, best of 20;
# docs/decisions/0026-quant-dot-dtype.md): int8 as bfloat16 took 10.7
# against 12.9 ms at 2 rows and 32.3 against 53.6 at 64; at one row 12.2 against 12.9 there
# but 9.4-10.3 against 8.4-8.5 in an earlier run, so one row stays float32; int4 31.6 against
# 36.4 at 32 and 40.9 against 54.8 at 64, but 24.9 against 21.2 at 16 (its nibble unpacking
# costs more in the bfloat16 dot's smaller tiles).
NARROW_DOT_MIN_ROWS = {"int8": 2, "fp8": 2, "int4": 32}


@dataclass(frozen=True)
class QuantConfig:
    """What to quantise at load time; ValueError names the ``EngineConfig`` field at fault."""

    method: str = "none"  # quantization: "none", "int8", "int4" or "fp8"
    group_size: int = DEFAULT_GROUP_SIZE  # quantization_group_size: int4 rows per scale, even
    embeddings: bool = False  # quantize_embeddings: also the embedding table and LM head

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization={self.method!r} must be one of {METHODS}")
        gs = self.group_size
        if isinstance(gs, bool) or not isinstance(gs, int) or gs < 2 or gs % 2:
            raise ValueError(f"quantization_group_size={gs!r} must be an even integer >= 2 "
                             f"(int4 packs two input rows per byte)")
        if self.embeddings and self.method == "none":
            raise ValueError("quantize_embeddings=True needs quantization int8, int4 or fp8, "
                             "not 'none'")

    def describe(self) -> str:
        """``int4 (quantization_group_size=32, quantize_embeddings=False)``-style text."""
        if self.method == "none":
            return "none"
        gs = f"quantization_group_size={self.group_size}, " if self.method == "int4" else ""
        return f"{self.method} ({gs}quantize_embeddings={self.embeddings})"

    def same_layout(self, other: QuantConfig) -> bool:
        """Whether two configs give the same quantised tree."""
        return (self.method, self.embeddings) == (other.method, other.embeddings) and (
            self.method != "int4" or self.group_size == other.group_size)


def qmatmul(x: jax.Array, w: jax.Array | QuantizedWeight | KernelWeight, *,
            transpose: bool = False) -> jax.Array:
    """``x @ w`` (``x @ w.T`` with ``transpose``) -> ``[T, m]`` in ``x.dtype``.

    A plain ``w`` of another dtype than ``x`` (bfloat16 weights under float32 activations on
    the CPU, ``jaxserve.platform.cpu``) is contracted as stored: ``x`` is cast
    to ``w.dtype`` and the dot accumulates in float32. A quantised ``w`` whose ``dot_dtype``
    is such a dtype does the same from ``NARROW_DOT_MIN_ROWS[w.method]`` rows of ``x`` on
    (dequantised to it; int8 and fp8 values are exact in bfloat16); below, its dot runs in
    ``x.dtype``, which measured faster there. So a quantised model's rounding differs between
    a one-row decode step and a batch (jaxserve's outputs are not batch-invariant anyway:
    docs/architecture.md).

    A ``KernelWeight`` computes the product itself (``w.matmul``).

    Args:
      x: ``[T, k]`` activations.
      w: ``[k, m]`` (``[m, k]`` with ``transpose``), plain or quantised along that ``k``, or
        kernel-backed.

    Raises:
      ValueError: a quantised ``w`` quantised along the other axis (a ``KernelWeight``: as its
        ``matmul`` says).
    """
    if isinstance(w, KernelWeight):
        return w.matmul(x, transpose=transpose)
    if not isinstance(w, QuantizedWeight):
        if w.dtype == x.dtype:
            return x @ (w.T if transpose else w)
        # narrower stored weights (bfloat16 under float32 activations, the CPU's mixed mode):
        # the dot reads them as stored (a dot_general, not a transposed copy), in float32
        dims = (((x.ndim - 1,), (1 if transpose else 0,)), ((), ()))
        return jax.lax.dot_general(x.astype(w.dtype), w, dims,
                                   preferred_element_type=jnp.float32).astype(x.dtype)
    want = -1 if transpose else -2
    if w.axis != want:
        raise ValueError(f"weight quantised along axis {w.axis}, contracted along {want}")
    rows = math.prod(x.shape[:-1])
    narrow = jnp.dtype(w.dot_dtype)
    op = narrow if (narrow.itemsize < jnp.dtype(x.dtype).itemsize
                    and rows >= NARROW_DOT_MIN_ROWS[w.method]) else jnp.dtype(x.dtype)
    dims = (((x.ndim - 1,), (1 if transpose else 0,)), ((), ()))
    if w.method == "int4":
        y = jax.lax.dot_general(x.astype(op), dequantize(w, op), dims,
                                preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    y = jax.lax.dot_general(x.astype(op), w.q.astype(op), dims,
                            preferred_element_type=jnp.float32)
    return (y * w.scale.reshape(-1)).astype(x.dtype)


def embed_lookup(w: jax.Array | QuantizedWeight | KernelWeight, ids: jax.Array,
                 dtype: jnp.dtype) -> jax.Array:
    """Rows ``w[ids]`` of a ``[vocab, hidden]`` table (plain, quantised with ``axis=-1``, or
    kernel-backed: ``w.embed_rows``): ``i32[T]`` -> ``[T, hidden]`` in ``dtype``."""
    if isinstance(w, KernelWeight):
        return w.embed_rows(ids, dtype)
    if not isinstance(w, QuantizedWeight):
        return w[ids].astype(dtype)
    zero = None if w.zero is None else w.zero[ids]
    return dequantize(dataclasses.replace(w, q=w.q[ids], scale=w.scale[ids], zero=zero), dtype)


def weight(module, name: str, init, shape: tuple[int, ...], dtype: jnp.dtype,
           layer: jax.Array | None = None):
    """``module.param(name, ...)``, or the stored ``QuantizedWeight`` or ``KernelWeight`` (which
    Flax's leaf-wise shape check would refuse); one of the ``BROADCAST`` collection comes bound
    to ``layer`` (``i32[]``, the scan's layer index; None outside the scan).

    Raises:
      ValueError: a stored quantised or kernel-backed weight of another logical shape.
    """
    for collection in (BROADCAST, "params"):
        if not module.has_variable(collection, name):
            continue
        v = module.get_variable(collection, name)
        if isinstance(v, (QuantizedWeight, KernelWeight)):
            if v.shape != tuple(shape):
                raise ValueError(f"param {name} ({type(v).__name__}) has shape {v.shape}, the "
                                 f"model expects {tuple(shape)}")
            return v.at_layer(layer) if collection == BROADCAST else v
    return module.param(name, init, shape, dtype)


def flax_variables(params) -> dict:
    """Flax variables for ``params``: ``{"params": the rest}``, plus ``{BROADCAST: ...}`` holding
    the ``KernelWeight`` leaves the layer scan broadcasts (``scan_broadcast``) at their paths,
    when there are any."""
    flat = traverse_util.flatten_dict(params, keep_empty_nodes=True, sep="/")
    broadcast = {p: v for p, v in flat.items()
                 if isinstance(v, KernelWeight) and v.scan_broadcast}
    if not broadcast:
        return {"params": params}
    rest = {p: v for p, v in flat.items() if p not in broadcast}
    return {"params": traverse_util.unflatten_dict(rest, sep="/"),
            BROADCAST: traverse_util.unflatten_dict(broadcast, sep="/")}


# -- whole param trees ---------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantTargets:
    """The quantisable leaves of an architecture's params (None there: no quantisation)."""

    linear: tuple[str, ...]  # "/"-joined paths of [..., in, out] weights (axis -2)
    # (path, axis) of the embedding table (-1) and an untied LM head (-2); only with
    # QuantConfig.embeddings; absent paths are skipped
    embeddings: tuple[tuple[str, int], ...] = ()

    def axis_of(self, path: str, embeddings: bool) -> int | None:
        """The contraction axis if ``path`` is to be quantised, else None."""
        if path in self.linear:
            return -2
        if embeddings:
            return dict(self.embeddings).get(path)
        return None


def path_name(path) -> str:
    """``layers/wq`` from a jax key path (dict keys, attributes, indices)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _is_qw(x) -> bool:
    return isinstance(x, QuantizedWeight)


def _check_groups(named_dims: list[tuple[str, tuple[int, ...], int]], group_size: int) -> None:
    """Refuse a group size not dividing every int4 weight's contraction dim (hint: divisors).

    Args:
      named_dims: ``(param name, shape, contraction axis)`` of each weight to quantise.
    """
    dims = sorted({shape[axis] for _, shape, axis in named_dims})
    hint = None if len(dims) < 2 else (
        f"a size dividing every quantised weight's ({', '.join(map(str, dims))}), e.g. "
        f"{divisor_hint(dims)}")
    for name, shape, axis in named_dims:
        check_group(shape[axis], group_size, f" of param {name} {tuple(shape)}", hint)


_quantize_jit = jax.jit(quantize, static_argnames=("method", "group_size", "axis"))


def quantize_params(params, targets: QuantTargets, qcfg: QuantConfig, *,
                    delete_source: bool = False):
    """The params with every target leaf quantised, one at a time on its device.

    Args:
      delete_source: free each float leaf once quantised (``params`` is unusable afterwards).

    Raises:
      ValueError: naming the leaf, for a group size that does not divide its contraction dim.
    """
    if qcfg.method == "none":
        return params
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_qw)
    axes = [None if _is_qw(leaf) else targets.axis_of(path_name(path), qcfg.embeddings)
            for path, leaf in flat]
    if qcfg.method == "int4":
        _check_groups([(path_name(p), leaf.shape, a) for (p, leaf), a in zip(flat, axes)
                       if a is not None], qcfg.group_size)
    out = []
    for (path, leaf), axis in zip(flat, axes):
        if axis is None:
            out.append(leaf)
            continue
        qw = _quantize_jit(leaf, method=qcfg.method, group_size=qcfg.group_size, axis=axis)
        if delete_source and isinstance(leaf, jax.Array):
            jax.block_until_ready(qw)
            leaf.delete()
        out.append(qw)
    return jax.tree_util.tree_unflatten(treedef, out)


def quantized_shapes(shapes, targets: QuantTargets, qcfg: QuantConfig):
    """``quantize_params``'s output as ``jax.ShapeDtypeStruct`` leaves, nothing traced or run.

    Raises:
      ValueError: as ``quantize_params``.
    """
    if qcfg.method == "none":
        return shapes
    if qcfg.method == "int4":
        _check_groups([(path_name(p), x.shape, a) for p, x in
                       jax.tree_util.tree_flatten_with_path(shapes)[0]
                       if (a := targets.axis_of(path_name(p), qcfg.embeddings)) is not None],
                      qcfg.group_size)

    def one(path, s):
        axis = targets.axis_of(path_name(path), qcfg.embeddings)
        return s if axis is None else quantized_shape(s, qcfg.method, qcfg.group_size, axis)

    return jax.tree_util.tree_map_with_path(one, shapes)


def quantization_of(params, targets: QuantTargets | None = None) -> QuantConfig:
    """The ``QuantConfig`` a params tree was quantised with (embeddings default: ``embed``,
    ``lm_head``)."""
    emb_names = {p for p, _ in targets.embeddings} if targets else {"embed", "lm_head"}
    found = [(path_name(p), x) for p, x in
             jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_qw)[0] if _is_qw(x)]
    if not found:
        return QuantConfig()
    first = found[0][1]
    return QuantConfig(first.method, first.group_size or DEFAULT_GROUP_SIZE,
                       any(name in emb_names for name, _ in found))


def apply_quantization(params, targets: QuantTargets | None, qcfg: QuantConfig,
                       architecture: str, *, delete_source: bool = False):
    """Quantise float params as ``qcfg`` asks, or accept already quantised ones that match it.

    Raises:
      ValueError: quantisation asked of an architecture with ``targets`` None, or params
        quantised already in another layout than ``qcfg``.
    """
    have = quantization_of(params, targets)
    if have.method != "none":
        if not have.same_layout(qcfg):
            raise ValueError(
                f"the checkpoint holds weights quantised as {have.describe()}, but "
                f"quantization={qcfg.describe()} was asked for; serve it with the settings it "
                f"was converted with (--quantization {have.method}"
                + (f" --quantization-group-size {have.group_size}" if have.method == "int4"
                   else "") + (" --quantize-embeddings" if have.embeddings else "")
                + "), or convert the original model again")
        return params
    if qcfg.method == "none":
        return params
    if targets is None:
        raise ValueError(f"quantization={qcfg.method!r}: architecture {architecture!r} does "
                         f"not support weight quantisation (its registry entry lists no "
                         f"quant_targets); use quantization='none'")
    return quantize_params(params, targets, qcfg, delete_source=delete_source)


def param_bytes(params) -> dict[str, int | float]:
    """Memory of a params tree (arrays or ``jax.ShapeDtypeStruct`` leaves), in bytes.

    Returns:
      ``total_bytes`` and ``other_bytes`` as stored, ``quantized_bytes`` and
      ``quantized_float32_bytes`` of the quantised leaves, their ``quantized_ratio`` (0 if
      none), and ``total_float32_bytes``.
    """
    total = qbytes = qf32 = f32 = 0
    for leaf in jax.tree_util.tree_leaves(params, is_leaf=_is_qw):
        if _is_qw(leaf):
            n = int(np.prod(leaf.shape, dtype=np.int64))
            qbytes += leaf.nbytes
            qf32 += 4 * n
            total += leaf.nbytes
            f32 += 4 * n
        else:
            total += array_nbytes(leaf)
            f32 += 4 * int(np.prod(leaf.shape, dtype=np.int64))
    return {"total_bytes": total, "quantized_bytes": qbytes, "quantized_float32_bytes": qf32,
            "quantized_ratio": qbytes / qf32 if qf32 else 0.0, "other_bytes": total - qbytes,
            "total_float32_bytes": f32}
