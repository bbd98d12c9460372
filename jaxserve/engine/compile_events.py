"""XLA compiles on an engine's step thread, counted into its metrics.

Serving compiles nothing: warm-up compiles every step program before the engine thread starts,
so a compile on that thread is a program warm-up missed, and its seconds stall the whole batch
(``jaxserve:num_compiles_after_warmup_total``, which an alert expects to stay 0). jax reports
compiles through ``jax.monitoring`` listeners, which are process-wide and run on the compiling
thread: one listener, registered once, counts each backend compile (a persistent-cache hit
included: a program was still asked for) into the metrics of the engine whose thread it ran on,
so data-parallel replicas in one process each count their own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

from jaxserve.engine.metrics import EngineMetrics

# jax's event around every backend compile or persistent-cache lookup (jax._src.dispatch)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_by_thread: dict[int, EngineMetrics] = {}
_lock = threading.Lock()
_registered = False


def _on_duration(event: str, duration_s: float, **kwargs: object) -> None:
    if event == BACKEND_COMPILE_EVENT:
        metrics = _by_thread.get(threading.get_ident())
        if metrics is not None:
            metrics.record_compile()


@contextlib.contextmanager
def counting_compiles(metrics: EngineMetrics | None) -> Iterator[None]:
    """While inside, count the calling thread's XLA compiles into ``metrics`` (None: nothing
    is counted)."""
    global _registered
    if metrics is None:
        yield
        return
    me = threading.get_ident()
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True
        _by_thread[me] = metrics
    try:
        yield
    finally:
        with _lock:
            _by_thread.pop(me, None)
