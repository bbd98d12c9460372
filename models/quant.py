"""Weight quantisation at load time: quantised weights are pytree leaves that the matmul
dequantises on the fly inside the jitted step.

Data flow: a checkpoint loads in the serving dtype (any format) -> ``quantize_params`` replaces
each listed weight, one leaf at a time on its device, by a ``QuantizedWeight`` (``q``,
``scale`` and, for int4, ``zero``) and frees the float leaf -> the model's layers call
``qmatmul`` / ``embed_lookup``, which take plain arrays too, so a model written against them serves
both. Stacked layer weights keep the layer axis first (``q [L, in, out]``, ``scale [L, G, out]``),
so ``nn.scan`` slices them like any other param. A checkpoint written by
``jaxserve convert --quantization`` holds the quantised leaves and loads without quantising again
(``quantized_shapes`` gives orbax its restore target by shape arithmetic alone).

Formats (``w`` is a weight whose *contraction axis* ``axis`` has length ``n``; a linear weight
``[in, out]`` contracts over ``in`` (axis -2), an embedding table ``[vocab, hidden]`` used as a
tied LM head contracts over ``hidden`` (axis -1), so its scales are per row):

- ``int8``: symmetric, one scale per output channel, ``scale = amax / 127`` over the
  contraction axis, ``q = round(w / scale)`` in ``[-127, 127]``; ``|w - q*scale| <= amax/254``
  per channel. Per-channel absmax as in LLM.int8() (Dettmers et al. 2022, arXiv:2208.07339)
  without its outlier decomposition.
- ``int4``: asymmetric (zero point), group-wise along the contraction axis (``group_size``
  consecutive input rows share a scale and a zero point per output channel, the GPTQ/AWQ layout:
  Frantar et al. 2022, arXiv:2210.17323; Lin et al. 2023, arXiv:2306.00978). Per group, with
  ``lo = min(min(w), 0)`` and ``hi = max(max(w), 0)``: ``scale = (hi - lo) / 15`` stored as
  ``f16`` (at least ``2**-14``, f16's least normal number, so its rounding is at most ``2**-11``
  relative and never pushes a value out of the 16 levels; at most 65504, so weights beyond
  about ``±4.9e5`` are not representable), ``zero = round(-lo / scale * 16)`` stored as
  ``u8`` (the zero point in sixteenths of a step, ``0..240``), ``q = round(w / scale + zero /
  16)`` in ``[0, 15]`` and ``w ~ (q - zero / 16) * scale``; ``|w - deq| <= scale / 2`` (the
  fractional zero point keeps every value of ``[lo, hi]`` inside the 16 levels, so nothing is
  clipped). Two values per byte (``u8``): input rows ``2i`` (low nibble) and ``2i+1`` (high
  nibble), so a shard of the packed axis is a contiguous range of input rows. ``scale`` and
  ``zero`` are ``[..., n // group_size, ...]``; 4 + 24 / group_size bits per weight (0.148x
  of float32 at the default group of 32). Why asymmetric groups of 32: a group's 16 levels
  then span its actual range (symmetric ``amax / 7`` wastes one level and half the grid on a
  skewed group), and llama.cpp's 4-bit files (Q4_0/Q4_1, and Q4_K's sub-blocks) quantise
  blocks of 32 input rows, so re-quantising such a checkpoint lands on its own grid (measured
  with ``jaxserve eval``, table in the README: SmolLM2's Q4_1 GGUF, +0.29% perplexity at group
  32, +29.5% at group 64, +44% with the earlier symmetric format at group 64). A ``group_size`` that
  does not divide ``n`` is refused (ValueError naming ``quantization_group_size`` and the numbers):
  padding would need the activations padded too.
- ``fp8``: ``float8_e4m3fn`` (Micikevicius et al. 2022, "FP8 formats for deep learning",
  arXiv:2209.05433), one scale per output channel, ``scale = amax / 448``; round to nearest
  even, so ``|w - deq| <= max(|w| * 2**-4, scale * 2**-10)`` (3 mantissa bits; the second term
  covers e4m3's subnormals below ``2**-6``).

Weights are quantised from the params as loaded, i.e. in the serving dtype (float32 on the CPU;
bfloat16 on accelerators, whose rounding of the source adds at most 2**-9 relative error before
quantisation), so no float32 copy of the whole model is ever held.

Compute: int8/fp8 weights are converted to the activation dtype (exact: |q| <= 448 with at
most 4 significant bits, or integers <= 127), multiplied, and the per-channel scale applied to
the ``[T, out]`` result in float32; int4 weights are unpacked, shifted by the zero point and
scaled to the activation dtype (XLA fuses these into one elementwise pass before the dot).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

METHODS = ("none", "int8", "int4", "fp8")
INT8_MAX = 127
INT4_LEVELS = 15  # q in [0, 15]
INT4_ZERO_STEPS = 16  # the zero point is stored in sixteenths of a step
INT4_SCALE_DTYPE = jnp.float16
INT4_FORMAT = "asym-zp16"  # the int4 layout this module writes (recorded in checkpoints)
DEFAULT_GROUP_SIZE = 32
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class QuantConfig:
    """What to quantise at load time (the ``EngineConfig`` fields of the same meaning).

    Fields:
      method: ``quantization``: "none", "int8", "int4" or "fp8".
      group_size: ``quantization_group_size``: input rows per int4 scale (even, >= 2; must
        divide every quantised weight's contraction dim). Ignored by int8/fp8.
      embeddings: ``quantize_embeddings``: also the embedding table and the LM head.

    Raises:
      ValueError: naming the field, for an unknown method, a bad group size, or embeddings
        without a method.
    """

    method: str = "none"
    group_size: int = DEFAULT_GROUP_SIZE
    embeddings: bool = False

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
        """Whether two configs give the same quantised tree (group size matters for int4
        only)."""
        return (self.method, self.embeddings) == (other.method, other.embeddings) and (
            self.method != "int4" or self.group_size == other.group_size)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """A quantised weight: a pytree with data ``q``, ``scale`` (and int4's ``zero``) and static
    method/group/axis.

    Fields (logical weight ``[..., n, m]`` or ``[..., m, n]`` with contraction dim ``n`` at
    ``axis``; leading dims such as the layer axis come first and are kept):
      q: ``i8`` (int8), ``u8`` with the contraction dim halved (int4, two unsigned nibbles per
        byte) or ``float8_e4m3fn`` (fp8), otherwise the logical shape.
      scale: ``f32`` (int8, fp8) or ``f16`` (int4), the logical shape with the contraction dim
        replaced by ``n // group_size`` (int4) or 1 (int8, fp8).
      method: "int8", "int4" or "fp8".
      group_size: int4's group size; 0 for the per-channel formats.
      axis: the contraction axis, negative (-2: a linear ``[in, out]``; -1: an embedding
        ``[vocab, hidden]`` whose rows are gathered and which a tied LM head contracts over
        ``hidden``), so slicing leading axes keeps it valid.
      zero: int4's zero points, ``u8`` of ``scale``'s shape, in sixteenths of a step (module
        docstring); None for int8 and fp8.
    """

    q: jax.Array
    scale: jax.Array
    method: str = field(metadata={"static": True})
    group_size: int = field(metadata={"static": True})
    axis: int = field(metadata={"static": True})
    zero: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantised) shape."""
        s = list(self.q.shape)
        if self.method == "int4":
            s[self.axis] *= 2
        return tuple(s)

    @property
    def nbytes(self) -> int:
        """Bytes of ``q``, ``scale`` and ``zero`` together."""
        return _nbytes(self.q) + _nbytes(self.scale) + (
            0 if self.zero is None else _nbytes(self.zero))


def _nbytes(a) -> int:
    return int(np.prod(a.shape, dtype=np.int64)) * jnp.dtype(a.dtype).itemsize


def _check_group(n: int, group_size: int, where: str = "", hint: str | None = None) -> None:
    if group_size < 2 or group_size % 2 or n % group_size:
        raise ValueError(
            f"quantization_group_size={group_size} must be even and divide the contraction "
            f"dim {n}{where} (int4 groups input rows; choose "
            f"{hint or f'a divisor of {n}, e.g. {_divisor_hint([n])}'})")


def _divisor_hint(dims) -> str:
    ds = [d for d in (128, 64, 32, 16, 8, 4, 2) if all(n % d == 0 for n in dims)]
    return ", ".join(map(str, ds)) if ds else "none (a dim is odd)"


def _check_groups(named_dims: list[tuple[str, tuple[int, ...], int]], group_size: int) -> None:
    """Refuse a group size that does not divide every int4 weight's contraction dim, before
    any is quantised; the hint lists the powers of two up to 128 that divide all of them.

    Args:
      named_dims: ``(param name, shape, contraction axis)`` of each weight to quantise.
    """
    dims = sorted({shape[axis] for _, shape, axis in named_dims})
    hint = None if len(dims) < 2 else (
        f"a size dividing every quantised weight's ({', '.join(map(str, dims))}), e.g. "
        f"{_divisor_hint(dims)}")
    for name, shape, axis in named_dims:
        _check_group(shape[axis], group_size, f" of param {name} {tuple(shape)}", hint)


def pack_int4(q: jax.Array, axis: int) -> jax.Array:
    """``u8`` with ``axis`` halved: rows ``2i`` in the low nibble, ``2i+1`` in the high one.

    Args:
      q: integers in ``[0, 15]`` (any int dtype; ``[-8, 7]`` keeps its two's-complement
        nibble), even length along ``axis``.
    """
    ax = axis % q.ndim
    pairs = q.astype(jnp.uint8).reshape(*q.shape[:ax], q.shape[ax] // 2, 2, *q.shape[ax + 1:])
    lo = jax.lax.index_in_dim(pairs, 0, ax + 1, keepdims=False)
    hi = jax.lax.index_in_dim(pairs, 1, ax + 1, keepdims=False)
    return (lo & jnp.uint8(0x0F)) | (hi << jnp.uint8(4))


def unpack_int4(packed: jax.Array, axis: int) -> jax.Array:
    """Inverse of ``pack_int4``: ``u8`` in ``[0, 15]`` with ``axis`` doubled."""
    ax = axis % packed.ndim
    lo = packed & jnp.uint8(0x0F)
    hi = packed >> jnp.uint8(4)
    out = jnp.stack([lo, hi], axis=ax + 1)
    shape = list(packed.shape)
    shape[ax] *= 2
    return out.reshape(shape)


def quantize(w: jax.Array, method: str, group_size: int = DEFAULT_GROUP_SIZE, axis: int = -2
             ) -> QuantizedWeight:
    """Quantise one weight (see the module docstring for the formats and error bounds).

    Args:
      w: float weight, any leading dims (e.g. ``[L, in, out]``).
      method: "int8", "int4" or "fp8".
      group_size: int4's group length along ``axis`` (even, divides ``w.shape[axis]``).
      axis: the contraction axis (-2 for ``[in, out]`` linears, -1 for embeddings).

    Returns:
      A ``QuantizedWeight``; all-zero channels get scale 1 and all-zero int4 groups scale
      ``2**-14``, with q (and zero) 0.

    Raises:
      ValueError: unknown method, or (int4) a group size that is odd or does not divide.
    """
    if method not in METHODS[1:]:
        raise ValueError(f"quantization={method!r} must be one of {METHODS[1:]}")
    axis = axis - w.ndim if axis >= 0 else axis
    ax = axis % w.ndim
    wf = w.astype(jnp.float32)
    if method in ("int8", "fp8"):
        top = INT8_MAX if method == "int8" else FP8_MAX
        amax = jnp.max(jnp.abs(wf), axis=ax, keepdims=True)
        scale = jnp.where(amax > 0, amax / top, 1.0)
        x = wf / scale
        if method == "int8":
            q = jnp.clip(jnp.round(x), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        else:
            q = jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
        return QuantizedWeight(q, scale, method, 0, axis)
    n = w.shape[ax]
    _check_group(n, group_size)
    g = wf.reshape(*w.shape[:ax], n // group_size, group_size, *w.shape[ax + 1:])
    lo = jnp.minimum(jnp.min(g, axis=ax + 1, keepdims=True), 0.0)
    hi = jnp.maximum(jnp.max(g, axis=ax + 1, keepdims=True), 0.0)
    f16 = jnp.finfo(INT4_SCALE_DTYPE)
    scale = jnp.clip((hi - lo) / INT4_LEVELS, float(f16.smallest_normal), float(f16.max))
    scale = scale.astype(INT4_SCALE_DTYPE).astype(jnp.float32)  # quantise with the stored scale
    zero = jnp.clip(jnp.round(-lo / scale * INT4_ZERO_STEPS), 0, 255)
    q = jnp.clip(jnp.round(g / scale + zero / INT4_ZERO_STEPS), 0, INT4_LEVELS)
    return QuantizedWeight(pack_int4(q.astype(jnp.uint8).reshape(w.shape), ax),
                           jnp.squeeze(scale, ax + 1).astype(INT4_SCALE_DTYPE), method,
                           group_size, axis, jnp.squeeze(zero, ax + 1).astype(jnp.uint8))


def dequantize(qw: QuantizedWeight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The logical weight (``qw.shape``) in ``dtype``: ``q * scale`` per channel (int8, fp8),
    ``(q - zero / 16) * scale`` per group (int4)."""
    ax = qw.axis % qw.q.ndim
    if qw.method in ("int8", "fp8"):
        return (qw.q.astype(jnp.float32) * qw.scale).astype(dtype)
    q = unpack_int4(qw.q, ax)
    n, gs = q.shape[ax], qw.group_size
    g = q.reshape(*q.shape[:ax], n // gs, gs, *q.shape[ax + 1:]).astype(jnp.float32)
    zero = jnp.expand_dims(qw.zero.astype(jnp.float32) / INT4_ZERO_STEPS, ax + 1)
    w = (g - zero) * jnp.expand_dims(qw.scale.astype(jnp.float32), ax + 1)
    return w.reshape(q.shape).astype(dtype)


def qmatmul(x: jax.Array, w: jax.Array | QuantizedWeight, *, transpose: bool = False
            ) -> jax.Array:
    """``x @ w`` (``x @ w.T`` with ``transpose``) in ``x``'s dtype, for a plain or quantised
    2-D ``w``.

    Args:
      x: ``[T, k]`` activations (the serving dtype).
      w: ``[k, m]`` (or ``[m, k]`` with ``transpose``): a plain array (then exactly ``x @ w``)
        or a ``QuantizedWeight`` whose contraction axis is the one contracted here (-2, or -1
        with ``transpose``).

    Returns:
      ``[T, m]`` in ``x.dtype``.

    Raises:
      ValueError: a quantised ``w`` quantised along the other axis.
    """
    if not isinstance(w, QuantizedWeight):
        return x @ (w.T if transpose else w)
    want = -1 if transpose else -2
    if w.axis != want:
        raise ValueError(f"weight quantised along axis {w.axis}, contracted along {want}")
    if w.method == "int4":
        d = dequantize(w, x.dtype)
        return x @ (d.T if transpose else d)
    q = w.q.astype(x.dtype)
    y = jnp.matmul(x, q.T if transpose else q, preferred_element_type=jnp.float32)
    return (y * w.scale.reshape(-1)).astype(x.dtype)


def embed_lookup(w: jax.Array | QuantizedWeight, ids: jax.Array, dtype: jnp.dtype
                 ) -> jax.Array:
    """Rows ``w[ids]`` in ``dtype``: ``ids i32[T]`` of a ``[vocab, hidden]`` table (plain, or
    quantised with per-row scales / row groups, ``axis=-1``) -> ``[T, hidden]``."""
    if not isinstance(w, QuantizedWeight):
        return w[ids].astype(dtype)
    zero = None if w.zero is None else w.zero[ids]
    return dequantize(dataclasses.replace(w, q=w.q[ids], scale=w.scale[ids], zero=zero), dtype)


def weight(module, name: str, init, shape: tuple[int, ...], dtype: jnp.dtype):
    """A Flax module's weight param ``name`` of logical ``shape``: the stored
    ``QuantizedWeight`` when the params hold one (Flax's own shape check compares leaf by
    leaf, which a packed int4 leaf cannot pass), else ``module.param(name, init, shape,
    dtype)``.

    Raises:
      ValueError: a stored quantised weight of another logical shape.
    """
    if module.has_variable("params", name):
        v = module.get_variable("params", name)
        if isinstance(v, QuantizedWeight):
            if v.shape != tuple(shape):
                raise ValueError(f"quantised param {name} has shape {v.shape}, the model "
                                 f"expects {tuple(shape)}")
            return v
    return module.param(name, init, shape, dtype)


# -- whole param trees ---------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantTargets:
    """Which leaves of an architecture's params tree are quantisable (``Architecture``'s
    capability; None there means no quantisation support).

    Fields:
      linear: "/"-joined paths of ``[..., in, out]`` linear weights (contraction axis -2).
      embeddings: ``(path, contraction axis)`` of the embedding table (-1) and an untied LM
        head (-2); quantised only with ``QuantConfig.embeddings``. Absent paths are skipped.
    """

    linear: tuple[str, ...]
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


_quantize_jit = jax.jit(quantize, static_argnames=("method", "group_size", "axis"))


def quantize_params(params, targets: QuantTargets, qcfg: QuantConfig, *,
                    delete_source: bool = False):
    """The params tree with every target leaf replaced by ``quantize(leaf)`` (on the leaf's
    device, one leaf at a time).

    Args:
      delete_source: free each float leaf once its quantised copy exists, so the peak is the
        float model plus one quantised leaf (the caller must not use ``params`` afterwards).

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
    """``quantize_params``'s output structure as ``jax.ShapeDtypeStruct`` leaves, by shape
    arithmetic alone (nothing traced or run): the restore target of a quantised checkpoint.

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
        name = path_name(path)
        axis = targets.axis_of(name, qcfg.embeddings)
        if axis is None:
            return s
        ax = axis % len(s.shape)
        qs, ss = list(s.shape), list(s.shape)
        if qcfg.method == "int4":
            qs[ax] //= 2
            ss[ax] //= qcfg.group_size
            return QuantizedWeight(jax.ShapeDtypeStruct(tuple(qs), jnp.uint8),
                                   jax.ShapeDtypeStruct(tuple(ss), INT4_SCALE_DTYPE), "int4",
                                   qcfg.group_size, axis,
                                   jax.ShapeDtypeStruct(tuple(ss), jnp.uint8))
        ss[ax] = 1
        qdt = jnp.int8 if qcfg.method == "int8" else FP8_DTYPE
        return QuantizedWeight(jax.ShapeDtypeStruct(tuple(qs), qdt),
                               jax.ShapeDtypeStruct(tuple(ss), jnp.float32), qcfg.method, 0,
                               axis)

    return jax.tree_util.tree_map_with_path(one, shapes)


def quantization_of(params, targets: QuantTargets | None = None) -> QuantConfig:
    """The ``QuantConfig`` a params tree was quantised with ("none" when it holds no
    ``QuantizedWeight``). ``embeddings`` is True when a leaf listed in ``targets.embeddings``
    (default: ``embed`` or ``lm_head``) is quantised."""
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
    """Load-time quantisation as the engine and ``jaxserve convert`` run it: quantise float
    params as ``qcfg`` asks, or accept params that a quantised checkpoint already holds when
    they match ``qcfg``.

    Raises:
      ValueError: the architecture has no quantisation support (``targets`` is None) and
        quantisation was asked for; or the params are quantised already in another layout
        than ``qcfg`` (naming both).
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
      ``total_bytes`` (everything as stored), ``quantized_bytes`` (``q``, ``scale`` and
      ``zero`` of the quantised leaves), ``quantized_float32_bytes`` (what those leaves take as
      float32), ``quantized_ratio`` (the two before, 0 when nothing is quantised), ``other_bytes``
      (the remaining leaves as stored) and ``total_float32_bytes`` (the whole tree as float32).
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
            total += _nbytes(leaf)
            f32 += 4 * int(np.prod(leaf.shape, dtype=np.int64))
    return {"total_bytes": total, "quantized_bytes": qbytes, "quantized_float32_bytes": qf32,
            "quantized_ratio": qbytes / qf32 if qf32 else 0.0, "other_bytes": total - qbytes,
            "total_float32_bytes": f32}
