"""The native CPU kernels' shared library: built on first use, loaded once, targets registered.

``csrc/*.cc`` are XLA FFI handlers for XLA:CPU (``cpu_attention``: paged decode attention;
``cpu_int4_matmul``: a few rows times an int4 weight). They are compiled together into one
library with the machine's C++ compiler (``CXX``, else ``c++``/``g++``/``clang++``, C++17) for
the machine it runs on (``-march=native``), and cached under ``JAXSERVE_NATIVE_CACHE`` (default
``~/.cache/jaxserve/native``) by a hash of the sources, the flags, the compiler, the CPU's model
and flags, and jaxlib's version. Without a compiler ``library()`` is None and each kernel's
``available()`` is False, so the engine keeps its jnp paths.
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

_log = logging.getLogger(__name__)
_SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.cc")))
# Reassociation lets the reductions vectorise. Not -ffast-math (or -funsafe-math-optimizations):
# GCC before 13 then links crtfastmath.o even into a shared library, whose constructor turns on
# flush-to-zero and denormals-are-zero for the whole process on load.
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-freciprocal-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC")


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
    """Compile the kernels (once per sources, flags, compiler, CPU and jaxlib); the library.

    Raises:
      RuntimeError: no C++ compiler was found, or it failed (its output is in the message).
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++) for the native CPU "
                           "kernels")
    version = subprocess.run([cxx, "--version"], check=False, capture_output=True,
                             text=True).stdout
    key = hashlib.sha256("\0".join([*(f"{s.name}\0{s.read_text()}" for s in _SOURCES),
                                    " ".join(_FLAGS), version, _cpu_identity(),
                                    jax.lib.__version__ if hasattr(jax.lib, "__version__")
                                    else jax.__version__]).encode()).hexdigest()[:16]
    lib = _cache_dir() / key / "libjaxserve_cpu_kernels.so"
    if lib.exists() and not force:
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=lib.parent, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(tmp_path)]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if res.returncode != 0:
        tmp_path.unlink(missing_ok=True)
        raise RuntimeError(f"building the native CPU kernels failed ({' '.join(cmd)}):\n"
                           f"{res.stderr[-4000:]}")
    os.replace(tmp_path, lib)  # atomic: concurrent builders each write their own file
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (with a warning) where it cannot be built or loaded."""
    try:
        return ctypes.cdll.LoadLibrary(str(build()))
    except (RuntimeError, OSError) as e:
        _log.warning("the native CPU kernels are unavailable, using the jnp paths: %s", e)
        return None


@functools.cache
def register(symbol: str, target: str) -> bool:
    """Register the library's FFI handler ``symbol`` as XLA:CPU custom call ``target`` (once).

    Returns:
      Whether it is registered (False: the library is unavailable).
    """
    lib = library()
    if lib is None:
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True
