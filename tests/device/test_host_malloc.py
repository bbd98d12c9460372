"""glibc malloc thresholds for XLA:CPU's step temporaries (jaxserve/device/host_malloc.py)."""

from __future__ import annotations

import ctypes
import resource

import pytest

from jaxserve.device import host_malloc

SIZE = 48 << 20  # above glibc's largest dynamic mmap threshold (32 MiB)


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
