"""glibc malloc settings for XLA:CPU's per-execution temporaries.

XLA:CPU allocates each execution's temporary buffers afresh (12.7 MiB for SmolLM2-135M's
64-row decode program, 48 MiB for its 64-row sampler). glibc serves a block above its mmap
threshold (dynamic, at most 32 MiB) with a fresh ``mmap`` and gives back a freed heap top above
its trim threshold, so without these settings every step faults its temporaries' pages in again
(~6,000 minor faults per 64-row decode step). Raising both thresholds to
``THRESHOLD_BYTES`` keeps freed blocks in the heap for the next step: a 64-row decode step
took 181 -> 168 ms (-7%) in an in-process A/B, and the 64-row top-p sampler alone 19.0 ->
5.2 ms (docs/decisions/0009-host-allocator.md). The settings are glibc's ``mallopt(3)``
``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD``. The cost is that up to ``THRESHOLD_BYTES`` of
freed memory per malloc arena stays in the process instead of going back to the system.

The thresholds hold only in glibc's main arena: a thread with an arena of its own grows it in
heaps of at most 64 MiB, and a block that leaves such a heap empty goes back when freed. The
64-row top-p sampler's 48 MiB of temporaries were mapped afresh on every call in two of five
engine processes (12,304 faults, 19 ms a call against ~7 ms;
docs/decisions/0028-native-decode-attention-zen3.md), so ``jaxserve.platform.configure_process`` (before jax starts its threads) makes every thread
created later share the main arena (``single_malloc_arena``).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
THRESHOLD_BYTES = 1 << 30
"""Both thresholds (1 GiB, below ``mallopt``'s int limit). Blocks above 64 MiB allocated on
XLA's worker threads are still mapped afresh: glibc's per-thread arenas grow in heaps of at
most 64 MiB (a 1024-token SmolLM2-135M prefill has 388 MiB of temporaries, faulted in at
about 2% of its step time)."""


def _mallopt():
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def keep_freed_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds to ``THRESHOLD_BYTES`` for this process.

    Returns True when set; False (nothing changed) where the C library is not glibc or where
    ``GLIBC_TUNABLES`` already names either threshold (the user's setting is kept).
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables:
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1 and \
        mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES) == 1
    log.debug("glibc mmap/trim thresholds %s to %d bytes", "raised" if ok else "not raised",
              THRESHOLD_BYTES)
    return ok


def single_malloc_arena() -> bool:
    """Let threads created from now on allocate from glibc's main arena (``M_ARENA_MAX`` 1),
    where the raised thresholds of ``keep_freed_blocks`` hold. Threads that already have an
    arena keep it, so call it before jax starts its threads.

    Returns True when set; False (nothing changed) where the C library is not glibc or where
    ``GLIBC_TUNABLES`` sets ``glibc.malloc.arena_max`` (the user's setting is kept).
    """
    if "malloc.arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_ARENA_MAX, 1) == 1
