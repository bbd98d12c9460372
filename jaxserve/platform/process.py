"""Process settings for serving: applied by the entry points (``jaxserve`` commands, ``LLM()``),
never by ``import jaxserve``.

``configure_process()`` is the one function that changes the process: a researcher who imports
jaxserve into their own program keeps their ``XLA_FLAGS``, malloc and allocator settings until
they build an ``LLM`` or run a ``jaxserve`` command. It applies, each only where the user has not
set it already:

- ``XLA_FLAGS``: ``CPU_XLA_FLAGS`` (XLA reads the variable once, when jax opens its first
  backend: a process that ran jax code before keeps XLA's own; docs/configuration.md#xla-cpu-flags);
- ``XLA_PYTHON_CLIENT_MEM_FRACTION`` 0.95: JAX preallocates 75% of accelerator memory by
  default; the KV budget (``kv_cache_memory_fraction`` of the free memory after weights) needs
  the rest;
- on the CPU backend (no jax GPU plugin installed, or ``JAX_PLATFORMS`` naming cpu first): one
  glibc malloc arena for the threads created from now on, and raised mmap/trim thresholds
  (``host_malloc``), so XLA:CPU's per-step temporaries stay paged in
  (docs/configuration.md#host-malloc-on-the-cpu).

``lower_compile_priority`` changes only the threads of a compile that runs while the server
serves (the serving engine calls it on its background-compile thread). ``freeze_heap`` and
``freeze_heap_when`` move the objects that live as long as a server into the garbage
collector's permanent generation: ``jaxserve serve`` calls them once it is ready and once its
background compile ends (docs/configuration.md#the-garbage-collector-in-a-server).

This module imports no jax: it must be able to run before jax starts its threads.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import pkgutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.platform.host_malloc import keep_freed_blocks, single_malloc_arena

log = logging.getLogger(__name__)

# XLA:CPU's concurrency-optimised HLO scheduler (its default) made every step program of
# SmolLM2-135M slower on a 2-core CPU: decode 12-19% and 512-token prefill 6% (wall and CPU
# seconds alike), with the same tokens (docs/configuration.md#xla-cpu-flags).
CPU_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)
ACCELERATOR_MEM_FRACTION = "0.95"


@dataclass(frozen=True)
class ProcessSettings:
    """What ``configure_process`` changed (False / empty: left as it was)."""

    xla_flags_added: tuple[str, ...]  # flags appended to XLA_FLAGS
    mem_fraction_set: bool  # XLA_PYTHON_CLIENT_MEM_FRACTION set to ACCELERATOR_MEM_FRACTION
    single_malloc_arena: bool  # glibc M_ARENA_MAX 1 for threads created from now on
    malloc_thresholds: bool  # glibc mmap/trim thresholds raised (host_malloc)


_applied: ProcessSettings | None = None


def add_cpu_xla_flags() -> tuple[str, ...]:
    """Append ``CPU_XLA_FLAGS`` to ``XLA_FLAGS``, each only where ``XLA_FLAGS`` does not name that
    flag already (a value the user set wins); returns the flags added."""
    flags = os.environ.get("XLA_FLAGS", "")
    extra = tuple(f for f in CPU_XLA_FLAGS if f.split("=")[0] not in flags)
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
    return extra


def gpu_plugin_installed() -> bool:
    """Whether a jax GPU plugin (``jax_plugins.xla_cuda*`` / ``xla_rocm*``) is installed, found
    without importing jax."""
    spec = importlib.util.find_spec("jax_plugins")
    return spec is not None and spec.submodule_search_locations is not None and any(
        m.name.startswith(("xla_cuda", "xla_rocm"))
        for m in pkgutil.iter_modules(list(spec.submodule_search_locations)))


def expects_cpu_backend() -> bool:
    """Whether jax will run on the CPU, judged before it starts: ``JAX_PLATFORMS`` names cpu
    first, or no GPU plugin is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not gpu_plugin_installed()


def configure_process() -> ProcessSettings:
    """Apply jaxserve's process settings (the module docstring lists them) once per process;
    later calls return the first call's record. Logs what it changed, once."""
    global _applied
    if _applied is not None:
        return _applied
    on_cpu = expects_cpu_backend()
    mem = "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
    if mem:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = ACCELERATOR_MEM_FRACTION
    _applied = ProcessSettings(
        xla_flags_added=add_cpu_xla_flags(),
        mem_fraction_set=mem,
        single_malloc_arena=on_cpu and single_malloc_arena(),
        malloc_thresholds=on_cpu and keep_freed_blocks())
    log.info("process settings: %s", _applied)
    return _applied


def lower_compile_priority(nice: int = 10) -> None:
    """Lower the calling thread's CPU priority, and that of XLA's LLVM code-generation workers
    (threads named ``llvm-worker-*``, which run only compiles), by ``nice``: for a thread that
    compiles while steps run (``jaxserve.device.warmup.BackgroundCompile``). Linux, where a
    thread is a task with its own niceness; elsewhere, or where a thread refuses, nothing
    changes. Errors are ignored."""
    if not hasattr(os, "setpriority"):
        return
    ids = [threading.get_native_id()]
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as fh:
                if fh.read().startswith("llvm-worker"):
                    ids.append(int(tid))
    except OSError:
        pass
    for tid in ids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        except OSError:
            pass


def freeze_heap(full: bool = True) -> int:
    """Collect, then move every object the cyclic garbage collector tracks into its permanent
    generation (``gc.freeze``), which no later collection scans; returns the objects frozen in
    all (``gc.get_freeze_count()``).

    A serving process holds ~340k long-lived objects once its step programs are compiled
    (jax's traces and caches, the loader's and the server's), and a collection of the oldest
    generation walks them all while holding the GIL: 0.2-0.45 s on a 2-core CPU, in which the
    engine thread cannot prepare or finish a step, so every stream's gap grows by as much
    (docs/decisions/0047-gc-freeze.md).
    Frozen, they cost a collection nothing. vLLM freezes its heap after start-up the same way
    (``freeze_gc_heap``). An object frozen here that later becomes part of a reference cycle
    is never freed; the objects of requests in flight are few at the two points serve calls it.

    Args:
      full: collect every generation first (``gc.collect()``: the pause of one such
        collection, for a server not yet ready); False collects only the two young ones (36-38 ms
        after SmolLM2-135M's background compile), for a server that already serves.
    """
    t0 = time.perf_counter()
    if full:
        gc.collect()
    else:
        gc.collect(1)
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("garbage collector: %d objects frozen (%.0f ms)", frozen,
             (time.perf_counter() - t0) * 1e3)
    return frozen


def freeze_heap_when(done: Sequence[threading.Event]) -> threading.Thread | None:
    """Run ``freeze_heap(full=False)`` on a daemon thread once every event in ``done`` is set
    (the serving engines' background compiles, whose traces stay alive); returns the thread,
    or None when ``done`` is empty (nothing to wait for)."""
    if not done:
        return None

    def wait_then_freeze() -> None:
        for event in done:
            event.wait()
        freeze_heap(full=False)

    thread = threading.Thread(target=wait_then_freeze, name="jaxserve-gc-freeze", daemon=True)
    thread.start()
    return thread
