"""jaxserve: a JAX/XLA serving engine for LLMs.

``from jaxserve import LLM, SamplingParams`` for offline use; ``jaxserve serve`` for the
OpenAI-compatible server. Attributes load lazily so that the engine core (models, runner,
scheduler, kernels) imports with jax, flax and numpy alone.

Importing it also sets jaxserve's XLA:CPU defaults in ``XLA_FLAGS`` (``CPU_XLA_FLAGS``), each only
where ``XLA_FLAGS`` does not name that flag already; XLA reads the variable once, when jax opens
its first backend, so a process that ran jax code before importing jaxserve keeps XLA's own.
For the same reason it makes the threads created later share glibc's main malloc arena
(``_single_malloc_arena``), where XLA:CPU's freed temporaries stay paged in.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

# XLA:CPU's concurrency-optimised HLO scheduler (its default) made every step program of
# SmolLM2-135M slower on a 2-core CPU: decode 12-19% and 512-token prefill 6% (wall and CPU
# seconds alike), with the same tokens (docs/configuration.md#xla-cpu-flags).
CPU_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def _set_cpu_xla_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in CPU_XLA_FLAGS if f.split("=")[0] not in flags]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


_set_cpu_xla_flags()

_M_ARENA_MAX = -8  # glibc's mallopt parameter


def _single_malloc_arena() -> bool:
    """Let threads created from now on allocate from glibc's main arena (``M_ARENA_MAX`` 1).

    The raised mmap/trim thresholds of ``jaxserve.device.host_malloc`` hold only in the main
    arena: a thread's own arena grows in heaps of at most 64 MiB that go back when emptied, so
    the 64-row top-p sampler's 48 MiB of temporaries were mapped afresh on every call in two of
    five engine processes (docs/configuration.md#host-malloc-on-the-cpu). Threads that already
    have an arena keep it, hence at import, before jax starts its threads. Returns True when
    set; False (nothing changed) where the C library is not glibc, where ``GLIBC_TUNABLES``
    sets ``glibc.malloc.arena_max`` (the user's setting is kept), or where a jax GPU plugin
    (``jax_plugins.xla_cuda*`` / ``xla_rocm*``) is installed: only the CPU backend was measured.
    """
    import ctypes
    import importlib.util
    import pkgutil

    if "malloc.arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations is not None and any(
            m.name.startswith(("xla_cuda", "xla_rocm"))
            for m in pkgutil.iter_modules(list(spec.submodule_search_locations))):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_ARENA_MAX, 1) == 1


_single_malloc_arena()

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "SamplingParams": "jaxserve.sampling_params",
    "StructuredOutputsParams": "jaxserve.sampling_params",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "EngineConfig": "jaxserve.config",
    "LLMEngine": "jaxserve.engine.llm_engine",
    "AsyncEngine": "jaxserve.engine.async_engine",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")


__all__ = list(_EXPORTS)
