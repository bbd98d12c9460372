"""The native CPU kernels' shared library: built ahead of serving, once per ISA variant; at load,
the best variant this CPU runs.

``csrc/*.cc`` are XLA FFI handlers for XLA:CPU (``attention``: paged attention, decode and
prefill rows; ``bf16_matmul``: rows times a packed bfloat16 weight; ``int4_matmul``: a few rows
times an int4 weight). ``jaxserve build-kernels`` (``build_all``; scripts/setup.sh and the
image's build stage run it) compiles them together with the C++ compiler (``CXX``, else
``c++``/``g++``/``clang++``, C++17) into one library per variant of ``VARIANTS``::

    <kernels dir>/<variant>/libjaxserve_cpu_kernels.so   + build.json (its key)

where the kernels dir is ``cpu_kernels/lib`` or ``$JAXSERVE_CPU_KERNELS_DIR``. The key is a hash
of the sources, the flags and jaxlib's version (whose FFI headers the library was built
against); a library whose key is not the current one is stale and never loaded.

``library()`` (once per process) picks the best built, current variant whose instructions the
CPU has (``/proc/cpuinfo`` flags), as vLLM's CPU ISA dispatch does; ``$JAXSERVE_CPU_ISA`` forces
one (tests, A/B). Where none is usable it logs one warning naming ``jaxserve build-kernels`` and
returns None: each kernel's ``available()`` is then False and the engine keeps its jnp paths.
Loading never runs a compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jax
import jaxlib

_log = logging.getLogger(__name__)
_PACKAGE_DIR = Path(__file__).parent
_SOURCES = tuple(sorted((_PACKAGE_DIR / "csrc").glob("*.cc")))
LIB_NAME = "libjaxserve_cpu_kernels.so"
INFO_NAME = "build.json"
DIR_ENV = "JAXSERVE_CPU_KERNELS_DIR"
ISA_ENV = "JAXSERVE_CPU_ISA"
BUILD_COMMAND = "jaxserve build-kernels"
CPUINFO = Path("/proc/cpuinfo")  # read here only (``cpu_flags``); the platform asks this module
# Reassociation lets the reductions vectorise. Not -ffast-math (or -funsafe-math-optimizations):
# GCC before 13 then links crtfastmath.o even into a shared library, whose constructor turns on
# flush-to-zero and denormals-are-zero for the whole process on load.
_FLAGS = ("-O3", "-fno-math-errno", "-fassociative-math", "-freciprocal-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC")


@dataclass(frozen=True)
class Variant:
    """One ISA build: its compiler flags and the ``/proc/cpuinfo`` flags a CPU needs to run it."""

    name: str
    march: tuple[str, ...]
    cpu_flags: frozenset[str]


# x86-64 micro-architecture levels, in /proc/cpuinfo's names ("abm" is LZCNT)
_X86_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Best first. What each turns on in csrc (#if): avx512bf16: every AVX-512 path and the bfloat16
# matmul's vdpbf16ps (__AVX512BF16__); avx512: attention's AVX-512 paths (__AVX512F__), the
# bfloat16 matmul in scalar float32; avx2: the int4 matmul's AVX2/FMA/F16C paths, attention's
# generic item; generic: the scalar code of every kernel (each has one), for any x86-64-v2 CPU.
X86_VARIANTS = (
    Variant("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16"), _X86_V4 | {"avx512_bf16"}),
    Variant("avx512", ("-march=x86-64-v4",), _X86_V4),
    Variant("avx2", ("-march=x86-64-v3",), _X86_V3),
    Variant("generic", ("-march=x86-64-v2",), _X86_V2),
)
# elsewhere (aarch64, ...): the compiler's baseline for the architecture
OTHER_VARIANTS = (Variant("generic", (), frozenset()),)


def variants() -> tuple[Variant, ...]:
    """This machine architecture's variants, best first."""
    return X86_VARIANTS if platform.machine().lower() in ("x86_64", "amd64") else OTHER_VARIANTS


def kernels_dir() -> Path:
    """Where the libraries are built and looked for: ``$JAXSERVE_CPU_KERNELS_DIR``, else
    ``cpu_kernels/lib``."""
    return Path(os.environ.get(DIR_ENV) or _PACKAGE_DIR / "lib").expanduser()


def build_key(variant: Variant) -> str:
    """The hash a current library of ``variant`` carries: sources, flags, jaxlib's version."""
    parts = [*(f"{s.name}\0{s.read_text()}" for s in _SOURCES), " ".join(_FLAGS + variant.march),
             jaxlib.__version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _compiler() -> str | None:
    for c in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _is_current(variant: Variant, directory: Path) -> bool:
    try:
        info = json.loads((directory / variant.name / INFO_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (directory / variant.name / LIB_NAME).is_file() and info.get("key") == build_key(variant)


def build(variant: Variant, directory: Path | None = None, force: bool = False) -> Path:
    """Compile the kernels for ``variant`` into ``directory/<variant>/`` (default
    ``kernels_dir()``), unless a current build is there; the library's path.

    Raises:
      RuntimeError: no C++ compiler was found, or it failed (its output is in the message).
    """
    out = (directory or kernels_dir()) / variant.name
    lib = out / LIB_NAME
    if not force and _is_current(variant, out.parent):
        return lib
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++) for the native CPU "
                           "kernels")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    cmd = [cxx, *_FLAGS, *variant.march, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES),
           "-o", str(tmp_path)]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if res.returncode != 0:
        tmp_path.unlink(missing_ok=True)
        raise RuntimeError(f"building the native CPU kernels ({variant.name}) failed "
                           f"({' '.join(cmd)}):\n{res.stderr[-4000:]}")
    os.replace(tmp_path, lib)  # atomic: concurrent builders each write their own file
    version = subprocess.run([cxx, "--version"], check=False, capture_output=True,
                             text=True).stdout.splitlines()[:1]
    info = {"key": build_key(variant), "variant": variant.name, "jaxlib": jaxlib.__version__,
            "flags": [*_FLAGS, *variant.march], "compiler": version[0] if version else cxx}
    tmp_info = out / f".{INFO_NAME}.{os.getpid()}"
    tmp_info.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp_info, out / INFO_NAME)
    return lib


def build_all(directory: Path | None = None, force: bool = False,
              names: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Build every variant of this architecture (or those ``names``), whatever this CPU runs:
    a build machine may lack instructions the serving machine has. Variants compile in
    parallel. Returns each variant's library path.

    Raises:
      ValueError: an unknown variant name.
      RuntimeError: as ``build`` (the first failure).
    """
    known = {v.name: v for v in variants()}
    if names is not None and (unknown := [n for n in names if n not in known]):
        raise ValueError(f"unknown CPU kernel variants {unknown}; this machine's are "
                         f"{list(known)}")
    todo = [known[n] for n in names] if names is not None else list(known.values())
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        paths = list(pool.map(lambda v: build(v, directory, force), todo))
    return {v.name: p for v, p in zip(todo, paths, strict=True)}


def cpu_flags(cpuinfo: Path | str = CPUINFO) -> frozenset[str] | None:
    """The CPU's feature flags from ``cpuinfo`` (x86 "flags", arm "Features"); None where they
    cannot be read (not Linux)."""
    try:
        lines = Path(cpuinfo).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for ln in lines:
        key, _, value = ln.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def runnable(variant: Variant, flags: frozenset[str] | None) -> bool:
    """Whether a CPU with ``flags`` executes ``variant``'s instructions (unknown flags: only a
    variant that needs none)."""
    return variant.cpu_flags <= flags if flags is not None else not variant.cpu_flags


def choose_variant(flags: frozenset[str] | None, directory: Path | None = None,
                   isa: str | None = None) -> tuple[Variant | None, list[str]]:
    """The variant to load: the best one the CPU runs (``flags``) that is built and current in
    ``directory``; with ``isa``, that one only. Returns it (None: none fits) and the reasons the
    better runnable variants (or the forced one) were passed over.

    Raises:
      ValueError: ``isa`` is not a variant of this architecture.
    """
    directory = directory or kernels_dir()
    cands = variants()
    if isa is not None:
        cands = tuple(v for v in cands if v.name == isa)
        if not cands:
            raise ValueError(f"{ISA_ENV}={isa!r} must be one of {[v.name for v in variants()]}")
    skipped = []
    for v in cands:
        if not runnable(v, flags):
            if isa is not None:
                skipped.append(f"{v.name} needs CPU flags this CPU lacks: "
                               f"{sorted(v.cpu_flags - (flags or frozenset()))}")
            continue
        if _is_current(v, directory):
            return v, skipped
        state = "stale" if (directory / v.name / LIB_NAME).exists() else "not built"
        skipped.append(f"{v.name} is {state} in {directory}")
    return None, skipped


def load(directory: Path | None = None, isa: str | None = None,
         flags: frozenset[str] | None = None) -> tuple[Variant, ctypes.CDLL] | None:
    """Load the library ``choose_variant`` picks (``flags`` default to this CPU's); None, with
    one warning naming ``jaxserve build-kernels``, where none is usable. Runs no compiler.

    Raises:
      ValueError: ``isa`` is not a variant of this architecture.
    """
    variant, skipped = choose_variant(cpu_flags() if flags is None else flags, directory, isa)
    directory = directory or kernels_dir()
    if variant is None:
        _log.warning("the native CPU kernels are unavailable, using the jnp paths (%s; run `%s`)",
                     "; ".join(skipped) or f"no variant for this CPU in {directory}",
                     BUILD_COMMAND)
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(directory / variant.name / LIB_NAME))
    except OSError as e:
        _log.warning("the native CPU kernels are unavailable, using the jnp paths (loading %s "
                     "failed: %s; run `%s`)", variant.name, e, BUILD_COMMAND)
        return None
    if skipped:
        _log.warning("the native CPU kernels run their %s build (%s; run `%s`)", variant.name,
                     "; ".join(skipped), BUILD_COMMAND)
    else:
        _log.info("the native CPU kernels run their %s build", variant.name)
    return variant, lib


@functools.cache
def _loaded() -> tuple[Variant, ctypes.CDLL] | None:
    return load(isa=os.environ.get(ISA_ENV) or None)


def library() -> ctypes.CDLL | None:
    """This process's library (loaded once, as ``load`` with ``$JAXSERVE_CPU_ISA``), or None."""
    loaded = _loaded()
    return None if loaded is None else loaded[1]


def loaded_variant() -> str | None:
    """The name of the variant ``library()`` loaded (None: none)."""
    loaded = _loaded()
    return None if loaded is None else loaded[0].name


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


def main(force: bool = False, names: tuple[str, ...] | None = None) -> int:
    """``jaxserve build-kernels``: build, print each library, and say which this CPU loads."""
    try:
        built = build_all(force=force, names=names)
    except RuntimeError as e:
        print(f"jaxserve build-kernels: error: {e}", file=sys.stderr)
        return 1
    for name, path in built.items():
        print(f"{name}: {path}")
    chosen, _ = choose_variant(cpu_flags())
    print(f"this CPU loads: {chosen.name if chosen else 'none (the jnp paths run)'}")
    return 0
