"""A fast reader of GGUF metadata and tensor views (the subset of ``gguf.GGUFReader`` we use).

``gguf.GGUFReader`` builds several numpy views per element of every metadata array, so a file
with a 262k-token vocabulary (Gemma 3) takes 10-50 s to open. This reader walks the same
layout once with ``struct`` and turns arrays into Python lists / numpy arrays directly (well
under a second), and exposes what the loaders and ``Tokenizer.from_gguf`` read:
``fields[key].contents()`` (the value: str, int, float, bool, list or numpy array),
``len(fields[key].data)`` (array length), and ``tensors`` with ``name``, ``tensor_type``
(``gguf.GGMLQuantizationType``), ``shape`` (GGUF order, innermost first) and ``data`` (a
read-only memory-mapped view, shaped and typed as ``gguf.GGUFReader`` gives it, so
``gguf.quants.dequantize(t.data, t.tensor_type)`` works unchanged).

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64
metadata count; metadata entries (string key, u32 value type, value); tensor infos (string
name, u32 n_dims, u64 dims, u32 ggml type, u64 offset); tensor data from the next multiple of
``general.alignment`` (32 by default). Source: the GGUF specification in ggml's
``docs/gguf.md``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import gguf
import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
       6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFField:
    """One metadata value; ``contents()`` returns it, ``data`` has one entry per element."""

    value: object

    def contents(self) -> object:
        """The value: str, int, float, bool, list[str] or a numpy array."""
        return self.value

    @property
    def data(self) -> object:
        return self.value if isinstance(self.value, (list, np.ndarray)) else [self.value]


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: name, ggml type, GGUF shape (innermost first) and a memory-mapped view."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """Metadata (``fields``) and tensors (``tensors``) of a GGUF file, read once.

    Raises:
      ValueError: not a GGUF file (bad magic), an unsupported version, or a truncated or
        malformed header (naming the offset).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(mm)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        self._buf, self._pos = buf, 24
        try:
            self.fields: dict[str, GGUFField] = {}
            for _ in range(n_kv):
                key = self._string()
                self.fields[key] = GGUFField(self._value(self._u32()))
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                n_dims = self._u32()
                dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
                self._pos += 8 * n_dims
                kind = self._u32()
                (offset,) = struct.unpack_from("<Q", buf, self._pos)
                self._pos += 8
                infos.append((name, dims, kind, offset))
        except struct.error as e:
            raise ValueError(f"{path}: malformed GGUF header near byte {self._pos}: {e}") from e
        align = int(self.fields.get("general.alignment", GGUFField(32)).value)
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
            qtype = gguf.GGMLQuantizationType(kind)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(reversed(dims))  # numpy order: outermost first
            n = int(np.prod(dims))
            lo = start + offset
            plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                     "I16": np.int16, "I32": np.int32, "I64": np.int64}.get(qtype.name)
            if plain is not None:
                data = mm[lo:lo + n * np.dtype(plain).itemsize].view(plain).reshape(shape)
            else:  # quantised: rows of packed blocks, as bytes
                row_bytes = dims[0] // block * type_size
                data = mm[lo:lo + n // block * type_size].reshape(*shape[:-1], row_bytes)
            self.tensors.append(GGUFTensor(name, qtype, tuple(dims), data))

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._buf, self._pos)
        self._pos += 4
        return v

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        s = bytes(self._buf[self._pos + 8:self._pos + 8 + n]).decode("utf-8")
        self._pos += 8 + n
        return s

    def _value(self, kind: int) -> object:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item = self._u32()
            (count,) = struct.unpack_from("<Q", self._buf, self._pos)
            self._pos += 8
            if item in _NP:
                dt = np.dtype(_NP[item])
                arr = np.frombuffer(self._buf, dt, count, self._pos).copy()
                self._pos += dt.itemsize * count
                return arr
            return [self._value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind} at byte {self._pos}")
        (v,) = struct.unpack_from(_SCALARS[kind], self._buf, self._pos)
        self._pos += struct.calcsize(_SCALARS[kind])
        return v
