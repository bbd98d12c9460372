"""The native CPU kernels' library (``pallas_kernels.native``): built once into the cache,
clear errors without a working compiler, and loading it changes no process-wide float state."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest

from pallas_kernels import native

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or native.library() is None,
                                reason="the native kernels build for XLA:CPU with a C++ compiler")


def test_build_is_cached(tmp_path, monkeypatch) -> None:
    """The library is compiled once per source and compiler, then found in the cache."""
    monkeypatch.setenv("JAXSERVE_NATIVE_CACHE", str(tmp_path))
    lib = native.build()
    assert lib.is_file() and lib.parent.parent == tmp_path
    mtime = lib.stat().st_mtime_ns
    assert native.build() == lib and lib.stat().st_mtime_ns == mtime


def test_build_without_a_compiler_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("JAXSERVE_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        native.build()


def test_a_failing_compiler_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
    cxx = tmp_path / "bin" / "broken-c++"
    cxx.parent.mkdir()
    cxx.write_text("#!/bin/sh\necho 'broken-c++: error: nothing works' >&2\nexit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("JAXSERVE_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(cxx))
    with pytest.raises(RuntimeError, match="nothing works"):
        native.build()
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_loading_the_library_keeps_subnormals(tmp_path, monkeypatch) -> None:
    """Loading the kernel must not switch on flush-to-zero for the whole process.

    GCC's -ffast-math links crtfastmath.o even into a shared library; its constructor sets
    FTZ/DAZ, which silently changes every float computation in the server (and broke
    hypothesis). Checked in a fresh process, since the state is process-wide.
    """
    monkeypatch.setenv("JAXSERVE_NATIVE_CACHE", str(tmp_path))
    lib = native.build()
    code = ("import ctypes, sys; tiny = sys.float_info.min; assert tiny / 2 > 0; "
            f"ctypes.CDLL({str(lib)!r}); print(tiny / 2 > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "True"
