"""The quantised weight formats: how one weight is quantised, stored and dequantised.

A ``QuantizedWeight`` holds one weight (a stack of layers' ``[L, in, out]`` keeps the layer
axis first: ``q [L, in, out]``, ``scale [L, G, out]``, so ``nn.scan`` slices them). Formats, for
contraction axis ``axis`` of length ``n`` (-2 for a linear ``[in, out]``, -1 for an embedding
``[vocab, hidden]`` used as a tied LM head):

- ``int8``: symmetric per output channel, ``scale = amax / 127``, ``q`` in ``[-127, 127]``;
  error <= amax/254. LLM.int8()'s absmax (arXiv:2208.07339) without outlier decomposition.
- ``int4``: asymmetric, groups of ``group_size`` input rows (GPTQ/AWQ layout, arXiv:2210.17323,
  arXiv:2306.00978). ``lo = min(min(w), 0)``, ``hi = max(max(w), 0)``; ``scale = (hi - lo) / 15``
  as ``f16`` clipped to ``[2**-14, 65504]``; ``zero = round(-lo / scale * 16)`` as ``u8`` (in
  sixteenths of a step); ``q = round(w / scale + zero / 16)`` in ``[0, 15]``; error <= scale/2,
  nothing clipped. Rows ``2i`` / ``2i+1`` in the low / high nibble of a ``u8``. ``scale`` and
  ``zero`` are ``[..., n // group_size, ...]``. A ``group_size`` not dividing ``n`` is refused
  (ValueError). Why groups of 32: docs/quantization.md.
- ``fp8``: ``float8_e4m3fn`` (arXiv:2209.05433) per output channel, ``scale = amax / 448``;
  error <= ``max(|w| * 2**-4, scale * 2**-10)``.

Whole params trees, and the matmul over a quantised weight: ``models.quant``.
"""

from __future__ import annotations

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


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """A quantised weight of logical shape ``[..., n, m]`` or ``[..., m, n]`` (``n`` at ``axis``)."""

    q: jax.Array  # i8 | f8e4m3fn logical shape; int4: u8, n halved (two nibbles per byte)
    scale: jax.Array  # f32 (int8, fp8) | f16 (int4); n replaced by 1 | n // group_size
    method: str = field(metadata={"static": True})  # "int8", "int4" or "fp8"
    group_size: int = field(metadata={"static": True})  # int4's; 0 for per-channel formats
    axis: int = field(metadata={"static": True})  # contraction axis, negative (-2 or -1)
    zero: jax.Array | None = None  # int4: u8 of scale's shape, sixteenths of a step; else None
    # the dtype of the float weight this replaced (``qmatmul``'s narrow operands); not stored
    dot_dtype: str = field(default="float32", metadata={"static": True})

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
        return array_nbytes(self.q) + array_nbytes(self.scale) + (
            0 if self.zero is None else array_nbytes(self.zero))


def array_nbytes(a: jax.Array | jax.ShapeDtypeStruct) -> int:
    """Bytes of an array (or of the array a ``jax.ShapeDtypeStruct`` describes)."""
    return int(np.prod(a.shape, dtype=np.int64)) * jnp.dtype(a.dtype).itemsize


def check_group(n: int, group_size: int, where: str = "", hint: str | None = None) -> None:
    """Refuse (ValueError) an int4 ``group_size`` that is odd or does not divide ``n``; the
    message names ``where`` and suggests ``hint`` (default: divisors of ``n``)."""
    if group_size < 2 or group_size % 2 or n % group_size:
        raise ValueError(
            f"quantization_group_size={group_size} must be even and divide the contraction "
            f"dim {n}{where} (int4 groups input rows; choose "
            f"{hint or f'a divisor of {n}, e.g. {divisor_hint([n])}'})")


def divisor_hint(dims: list[int]) -> str:
    """The powers of two up to 128 that divide every one of ``dims``, as text."""
    ds = [d for d in (128, 64, 32, 16, 8, 4, 2) if all(n % d == 0 for n in dims)]
    return ", ".join(map(str, ds)) if ds else "none (a dim is odd)"


def pack_int4(q: jax.Array, axis: int) -> jax.Array:
    """``u8`` with ``axis`` halved: rows ``2i`` in the low nibble, ``2i+1`` in the high one.

    Args:
      q: integers in ``[0, 15]`` (or ``[-8, 7]``, two's complement), even length along ``axis``.
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
    """Quantise one weight (formats and error bounds: module docstring).

    Args:
      w: float weight, any leading dims (e.g. ``[L, in, out]``).
      method: "int8", "int4" or "fp8".
      group_size: int4's group length along ``axis`` (even, divides ``w.shape[axis]``).
      axis: the contraction axis (-2 for ``[in, out]`` linears, -1 for embeddings).

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
        return QuantizedWeight(q, scale, method, 0, axis, dot_dtype=_float_name(w.dtype))
    n = w.shape[ax]
    check_group(n, group_size)
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
                           group_size, axis, jnp.squeeze(zero, ax + 1).astype(jnp.uint8),
                           _float_name(w.dtype))


def _float_name(dtype) -> str:
    """``dtype``'s name if a float dtype, else "float32" (what integer sources compute in)."""
    dtype = jnp.dtype(dtype)
    return dtype.name if jnp.issubdtype(dtype, jnp.floating) else "float32"


def dequantize(qw: QuantizedWeight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The logical weight (``qw.shape``) in ``dtype``."""
    ax = qw.axis % qw.q.ndim
    if qw.method in ("int8", "fp8"):
        return (qw.q.astype(jnp.float32) * qw.scale).astype(dtype)
    q = unpack_int4(qw.q, ax)
    n, gs = q.shape[ax], qw.group_size
    g = q.reshape(*q.shape[:ax], n // gs, gs, *q.shape[ax + 1:]).astype(jnp.float32)
    zero = jnp.expand_dims(qw.zero.astype(jnp.float32) / INT4_ZERO_STEPS, ax + 1)
    w = (g - zero) * jnp.expand_dims(qw.scale.astype(jnp.float32), ax + 1)
    return w.reshape(q.shape).astype(dtype)


def quantized_shape(s: jax.ShapeDtypeStruct, method: str, group_size: int, axis: int
                    ) -> QuantizedWeight:
    """``quantize(w, method, group_size, axis)``'s result for ``w`` of shape and dtype ``s``, as
    ``jax.ShapeDtypeStruct`` leaves (nothing traced or run; ``group_size`` checked by the
    caller)."""
    ax = axis % len(s.shape)
    qs, ss = list(s.shape), list(s.shape)
    if method == "int4":
        qs[ax] //= 2
        ss[ax] //= group_size
        return QuantizedWeight(jax.ShapeDtypeStruct(tuple(qs), jnp.uint8),
                               jax.ShapeDtypeStruct(tuple(ss), INT4_SCALE_DTYPE), "int4",
                               group_size, axis, jax.ShapeDtypeStruct(tuple(ss), jnp.uint8),
                               _float_name(s.dtype))
    ss[ax] = 1
    qdt = jnp.int8 if method == "int8" else FP8_DTYPE
    return QuantizedWeight(jax.ShapeDtypeStruct(tuple(qs), qdt),
                           jax.ShapeDtypeStruct(tuple(ss), jnp.float32), method, 0, axis,
                           dot_dtype=_float_name(s.dtype))
