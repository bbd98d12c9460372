"""The decode rows of ragged paged attention as a native CPU kernel (an XLA FFI custom call).

XLA:CPU runs the pure-jnp decode path as page gathers that copy every key and value of a chunk
before the score and value reductions read them again; on a 2-core CPU that path took 60% of a
64-sequence decode step of SmolLM2-135M. ``csrc/cpu_decode_attention.cc`` reads the pages in
place through the block table, one (sequence, kv head) item per task on XLA's intra-op thread
pool. It is compiled on first use with the machine's C++ compiler (``CXX``, else ``c++``/``g++``)
for the machine it runs on (``-march=native``), and cached under ``JAXSERVE_NATIVE_CACHE``
(default ``~/.cache/jaxserve/native``) by a hash of the source, the flags, the compiler, the
CPU's model and flags, and jaxlib's version. Without a compiler ``available()`` is False and the
engine keeps the jnp path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_log = logging.getLogger(__name__)
_TARGET = "jaxserve_cpu_decode_attention"
_SOURCE = Path(__file__).parent / "csrc" / "cpu_decode_attention.cc"
# Reassociation lets the reductions vectorise. Not -ffast-math (or -funsafe-math-optimizations):
# GCC before 13 then links crtfastmath.o even into a shared library, whose constructor turns on
# flush-to-zero and denormals-are-zero for the whole process on load.
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-freciprocal-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC")
SUPPORTED_CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                          jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8))


def _compiler() -> str | None:
    for c in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_NATIVE_CACHE",
                               Path.home() / ".cache" / "jaxserve" / "native")).expanduser()


def _cpu_identity() -> str:
    """The CPU's model and feature flags: ``-march=native`` output is only valid on the same."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(dict.fromkeys(keep))


def build(force: bool = False) -> Path:
    """Compile the kernel (once per source, flags, compiler and jaxlib) and return the library.

    Raises:
      RuntimeError: no C++ compiler was found, or it failed (its output is in the message).
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++) for the CPU attention "
                           "kernel")
    version = subprocess.run([cxx, "--version"], check=False, capture_output=True,
                             text=True).stdout
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), " ".join(_FLAGS), version,
                                    _cpu_identity(),
                                    jax.lib.__version__ if hasattr(jax.lib, "__version__")
                                    else jax.__version__]).encode()).hexdigest()[:16]
    lib = _cache_dir() / key / "libjaxserve_cpu_attention.so"
    if lib.exists() and not force:
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=lib.parent, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(tmp_path)]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if res.returncode != 0:
        tmp_path.unlink(missing_ok=True)
        raise RuntimeError(f"building the CPU attention kernel failed ({' '.join(cmd)}):\n"
                           f"{res.stderr[-4000:]}")
    os.replace(tmp_path, lib)  # atomic: concurrent builders each write their own file
    return lib


@functools.cache
def _register() -> bool:
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
    except (RuntimeError, OSError) as e:
        _log.warning("the native CPU attention kernel is unavailable, using the jnp path: %s", e)
        return False
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxserveCpuDecodeAttention),
                                platform="cpu")
    return True


def available() -> bool:
    """Whether the kernel built (or was cached) and is registered with XLA:CPU."""
    return _register()


def cpu_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                         block_tables: jax.Array, seq_lens: jax.Array,
                         query_start_loc: jax.Array, num_seqs: jax.Array, *,
                         v_scale: jax.Array | None = None,
                         sliding_window: int | jax.Array | None = None,
                         logit_soft_cap: float | None = None) -> jax.Array:
    """Attention of each one-row (decode) sequence's row over its paged context.

    Args:
      q: ``f32[T, num_q_heads, head_dim]``, already multiplied by the softmax scale (and by
        the layer's K scale for an 8-bit cache).
      k_cache, v_cache: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``,
        float32, bfloat16, int8 or uint8 (float8_e4m3fn bits).
      layer, block_tables, seq_lens, query_start_loc, num_seqs: as ``ragged_paged_attention``.
      v_scale: ``f32[num_kv_heads]``, the layer's V scale (8-bit caches); None: 1.
      sliding_window: attend to the last ``sliding_window`` positions only (traced or int).
      logit_soft_cap: ``cap * tanh(s / cap)`` on the scores, if set.
    Returns:
      ``f32[T, num_q_heads, head_dim]``: the decode rows' outputs, every other row 0.
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
                soft_cap=np.float32(logit_soft_cap or 0.0))
