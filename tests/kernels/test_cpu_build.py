"""The native CPU kernels' libraries (``cpu_kernels.build``): every ISA variant built ahead of
serving into a fresh directory, each variant this CPU executes running a representative subset
of the kernels' own tests, the choice of variant from the CPU's flags, stale and missing
libraries (one warning, the jnp paths), clear errors without a working compiler, and a library
that changes no process-wide float state on load."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from cpu_kernels import build
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or build._compiler() is None,
                                reason="the native kernels build for XLA:CPU with a C++ compiler")
X86 = build.variants() == build.X86_VARIANTS
# Per variant, a subset of each kernel's correctness tests: the attention items for decode and
# prefill rows (AVX-512 ones for head sizes 64/128/256, the generic one for 48), every cache
# dtype, the batch-invariant decode rows (the AVX-512 invariant item, one-row tiles elsewhere)
# against the reference and bit for bit against prefill rows, the int4 and bfloat16 matmuls'
# sums at row counts on and off their tiles.
_ATTN, _INV, _INT4, _BF16 = (f"tests/kernels/test_cpu_{k}.py::" for k in
                             ("attention", "attention_invariance", "int4_matmul", "bf16_matmul"))
VARIANT_TESTS = (
    _ATTN + "test_kernel_alone_writes_only_decode_rows",
    _ATTN + "test_kernel_alone_fills_prefill_rows",
    *(_ATTN + f"test_8bit_cache_with_scales[{c}]" for c in ("fp8-True", "int8-False")),
    *(_ATTN + f"test_decode_rows_by_group_head_dim_and_cache[{c}]"
      for c in ("64-4-bfloat16", "128-2-fp8", "256-1-float32", "64-5-int8")),
    *(_ATTN + f"test_prefill_rows_by_group_head_dim_and_cache[{c}]"
      for c in ("64-4-int8", "128-2-bfloat16", "256-1-fp8", "48-3-float32")),
    *(_ATTN + f"test_invariant_decode_rows_by_group_head_dim_and_cache[{c}]"
      for c in ("bfloat16-64-3", "fp8-64-8")),
    *(_INV + f"test_rows_bit_identical_however_computed[{c}]"
      for c in ("40-30.0-64-3-bfloat16", "None-None-128-2-int8", "40-30.0-16-2-float32")),
    *(_INT4 + f"test_matches_the_dequantised_weight[{c}]"
      for c in ("1-576-192-32", "3-96-200-16", "8-64-7-64", "11-128-40-2")),
    _INT4 + "test_every_float16_scale_class",
    *(_BF16 + f"test_matches_xla_bfloat16_dot_per_layer[{c}]"
      for c in ("1-576-192", "16-1536-576", "17-33-40", "129-33-40")),
)
# In the child: the forced variant is the one loaded, the bfloat16 matmul's vdpbf16ps is there
# exactly in the avx512bf16 build, then the tests.
_CHILD = """import sys, pytest
from cpu_kernels import bf16_matmul, build
name = sys.argv[1]
assert build.loaded_variant() == name, (build.loaded_variant(), name)
assert bf16_matmul.vectorized() == (name == "avx512bf16"), name
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Every variant of this architecture, built into a fresh directory (as build-kernels)."""
    directory = tmp_path_factory.mktemp("cpu_kernels")
    paths = build.build_all(directory)
    assert set(paths) == {v.name for v in build.variants()}
    return directory


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (build.DIR_ENV, build.ISA_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env | extra


@pytest.mark.parametrize("name", [v.name for v in build.variants()])
def test_each_variant_runs_the_kernels_tests(built: Path, name: str) -> None:
    (variant,) = [v for v in build.variants() if v.name == name]
    if not build.runnable(variant, build.cpu_flags()):
        pytest.skip(f"this CPU cannot execute the {name} build")
    proc = subprocess.run([sys.executable, "-c", _CHILD, name, *VARIANT_TESTS], check=False,
                          cwd=REPO_ROOT,
                          env=_env(**{build.DIR_ENV: str(built), build.ISA_ENV: name}),
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and " skipped" not in out, out[-3000:]


def test_build_is_kept_while_current_and_redone_when_stale(built: Path, tmp_path: Path,
                                                          monkeypatch) -> None:
    """A current library is not rebuilt; one whose key (sources, flags, jaxlib) is not the
    current one is never loaded and is rebuilt (here by a stand-in compiler)."""
    variant = build.variants()[-1]
    lib = build.build(variant, built)
    mtime = lib.stat().st_mtime_ns
    assert build.build(variant, built) == lib and lib.stat().st_mtime_ns == mtime
    shutil.copytree(built / variant.name, tmp_path / variant.name)
    info = tmp_path / variant.name / build.INFO_NAME
    info.write_text(json.dumps(json.loads(info.read_text()) | {"key": "0" * 16}))
    chosen, why = build.choose_variant(frozenset(variant.cpu_flags), tmp_path)
    assert chosen is None and why == [f"{variant.name} is stale in {tmp_path}"]
    cxx = tmp_path / "fake-c++"
    cxx.write_text('#!/bin/sh\nwhile [ $# -gt 1 ] && [ "$1" != "-o" ]; do shift; done\n'
                   '[ "$1" = "-o" ] && echo built > "$2"\nexit 0\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    assert build.build(variant, tmp_path).read_text() == "built\n"
    assert build.choose_variant(frozenset(variant.cpu_flags), tmp_path)[0] == variant


@pytest.mark.skipif(not X86, reason="the x86-64 variants")
def test_the_best_variant_the_cpu_executes_is_chosen(built: Path, tmp_path: Path) -> None:
    v2, v3, v4 = (build.X86_VARIANTS[i].cpu_flags for i in (3, 2, 1))
    cases = {v4 | {"avx512_bf16"}: "avx512bf16", v4: "avx512", v3 | {"avx512f"}: "avx2",
             v3: "avx2", v2: "generic", None: None, frozenset({"sse2"}): None}
    for flags, want in cases.items():
        chosen, _ = build.choose_variant(flags, built)
        assert (chosen.name if chosen else None) == want, (flags, want)
    # a forced variant the CPU cannot execute is refused, not loaded
    chosen, why = build.choose_variant(v3, built, isa="avx512")
    assert chosen is None and "avx512f" in why[0]
    assert build.choose_variant(v4, built, isa="avx2")[0].name == "avx2"
    with pytest.raises(ValueError, match="JAXSERVE_CPU_ISA='avx9'"):
        build.choose_variant(v4, built, isa="avx9")
    # a better variant missing: the next one runs, with a warning naming the command
    shutil.copytree(built / "avx2", tmp_path / "avx2")
    chosen, why = build.choose_variant(v4 | {"avx512_bf16"}, tmp_path)
    assert chosen.name == "avx2" and len(why) == 2 and "avx512bf16 is not built" in why[0]


def test_no_library_warns_once_and_loads_nothing(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="cpu_kernels.build"):
        assert build.load(tmp_path, flags=build.cpu_flags()) is None
    (record,) = caplog.records
    assert "jaxserve build-kernels" in record.getMessage()


def test_without_a_library_the_engine_keeps_the_jnp_paths(tmp_path: Path) -> None:
    """In a fresh process with an empty kernels directory: no kernel is available, one warning,
    and the CPU platform's attention under ``cpu_kernels="auto"`` is the jnp op."""
    code = ("import logging; logging.basicConfig()\n"
            "from cpu_kernels import attention, bf16_matmul, int4_matmul\n"
            "from jaxserve.config import EngineConfig\n"
            "from jaxserve.platform.cpu import CpuPlatform\n"
            "assert not (attention.available() or bf16_matmul.available() "
            "or int4_matmul.available() or bf16_matmul.vectorized())\n"
            "assert CpuPlatform().attention_backend(EngineConfig()) == 'reference'\n")
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO_ROOT,
                          capture_output=True,
                          text=True, env=_env(**{build.DIR_ENV: str(tmp_path)}), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("jaxserve build-kernels") == 1, proc.stderr


def test_build_without_a_compiler_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        build.build(build.variants()[-1], tmp_path)


def test_a_failing_compiler_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
    cxx = tmp_path / "bin" / "broken-c++"
    cxx.parent.mkdir()
    cxx.write_text("#!/bin/sh\necho 'broken-c++: error: nothing works' >&2\nexit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    with pytest.raises(RuntimeError, match="nothing works"):
        build.build_all(tmp_path / "out")
    assert not list((tmp_path / "out").rglob("*.so"))


def test_loading_the_library_keeps_subnormals(built: Path) -> None:
    """Loading a kernel library must not switch on flush-to-zero for the whole process.

    GCC's -ffast-math links crtfastmath.o even into a shared library; its constructor sets
    FTZ/DAZ, which silently changes every float computation in the server (and broke
    hypothesis). Checked in a fresh process per variant, since the state is process-wide.
    """
    for v in build.variants():
        if not build.runnable(v, build.cpu_flags()):
            continue
        lib = built / v.name / build.LIB_NAME
        code = ("import ctypes, sys; tiny = sys.float_info.min; assert tiny / 2 > 0; "
                f"ctypes.CDLL({str(lib)!r}); print(tiny / 2 > 0)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
        assert out.strip() == "True", v.name
