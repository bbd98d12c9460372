"""glibc malloc thresholds for XLA:CPU's step temporaries (jaxserve/platform/host_malloc.py)."""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys

import pytest

from jaxserve.platform import host_malloc

SIZE = 48 << 20  # above glibc's largest dynamic mmap threshold (32 MiB)
HELD = 24 << 20  # with SIZE, more than one 64 MiB heap of a thread's own arena


def _touch_faults(libc) -> int:
    """Minor page faults of writing a fresh ``SIZE``-byte malloc block, which is then freed."""
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    ptr = libc.malloc(SIZE)
    assert ptr
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ctypes.memset(ptr, 1, SIZE)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(ptr)
    return faults


def test_a_freed_block_is_reused_without_faulting_its_pages_in_again(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018
    except AttributeError:
        pytest.skip("not glibc")
    assert host_malloc.keep_freed_blocks()
    _touch_faults(libc)  # the first block is faulted in once
    pages = SIZE // resource.getpagesize()
    assert _touch_faults(libc) < pages // 10


def test_the_users_glibc_tunables_are_kept(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=65536")
    assert not host_malloc.keep_freed_blocks()


_THREAD_FAULTS = f"""
import ctypes, resource, threading
from jaxserve.platform import host_malloc
host_malloc.single_malloc_arena()  # threads created from now on share the main arena
host_malloc.keep_freed_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
faults = []
def work():
    held = libc.malloc({HELD})  # what else lives in the thread's arena (kept)
    ctypes.memset(held, 1, {HELD})
    for _ in range(2):
        ptr = libc.malloc({SIZE})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ctypes.memset(ptr, 1, {SIZE})
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        libc.free(ptr)
t = threading.Thread(target=work)
t.start()
t.join()
print(faults[1])
"""


def _thread_faults(tunables: str | None, script: str = _THREAD_FAULTS) -> int:
    """Faults of a worker thread's second fresh ``SIZE`` block, in a new process (arenas are
    per process and fixed once a thread has one)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True).stdout
    return int(out.split()[-1])


def test_a_worker_threads_freed_block_stays_paged_in():
    """XLA's worker threads allocate step temporaries: with one arena (``configure_process``
    sets it) a thread's freed 48 MiB block is reused in place, and with an arena per thread
    (the user's ``arena_max`` kept) glibc gives it back and faults it in again."""
    if not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("not glibc")
    pages = SIZE // resource.getpagesize()
    assert _thread_faults(None) < pages // 10
    assert _thread_faults("glibc.malloc.arena_max=8") > pages // 2


def test_importing_jaxserve_leaves_malloc_alone():
    """Without ``configure_process`` (importing the engine only), a worker thread keeps an
    arena of its own and its freed block goes back to the system, as in any process."""
    if not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("not glibc")
    script = _THREAD_FAULTS.replace(
        "host_malloc.single_malloc_arena()", "import jaxserve.engine.llm_engine, jaxserve.llm"
    ).replace("host_malloc.keep_freed_blocks()", "")
    assert _thread_faults(None, script) > SIZE // resource.getpagesize() // 2


def test_single_arena_keeps_the_users_setting(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    assert not host_malloc.single_malloc_arena()
