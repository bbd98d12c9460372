"""Running the step programs' compiles: before the server is ready, or after it on a thread.

``run_compiles`` runs a runner's compiles in order, with a progress bar and the collector
paused. ``BackgroundCompile`` runs ``ModelRunner.compile_pending`` on a daemon thread once the
engine serves: a start-up that compiles only the ready buckets (``buckets.ready_buckets``,
where the platform's ``BucketSet.defer_compile`` allows) is ready sooner, and until the others are compiled a step pads up to the
smallest compiled bucket that holds it (slower, never wrong: the largest bucket holds any step).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)


def run_compiles(todo: Sequence[Callable[[], None]], progress: bool,
                 on_compiled: Callable[[int, int], None] | None) -> None:
    """Run ``todo`` in order; ``on_compiled(done, total)`` before the first (``done`` 0) and
    after each; a tqdm bar when ``progress``. The garbage collector is paused meanwhile:
    tracing allocates many short-lived objects, and its passes took ~0.6 s of a warm start's
    ~2.3 s of tracing and lowering (7 programs, 2-core CPU)."""
    gc_was_on = gc.isenabled()
    gc.disable()
    bar = None
    try:
        if progress:
            # imported here: the runner stays importable with jax alone (scripts/gpu_check.py)
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc="compiling step programs", unit="program")
        if on_compiled is not None:
            on_compiled(0, len(todo))
        for i, compile_one in enumerate(todo):
            compile_one()
            if bar is not None:
                bar.update(1)
            if on_compiled is not None:
                on_compiled(i + 1, len(todo))
    finally:
        if bar is not None:
            bar.close()
        if gc_was_on:
            gc.enable()


class BackgroundCompile:
    """Compiles a runner's pending programs (``ModelRunner.compile_pending``) on a daemon
    thread. ``on_start()`` is called on the thread first (the engine passes the platform's
    ``lower_compile_priority``, so that steps running meanwhile keep the cores first), and
    ``on_end(num_left)`` as it ends, with the programs still pending (0 unless it was stopped
    or failed).

    Attributes: ``done`` (an Event, set when the thread has ended), ``num_programs`` and
    ``seconds`` (compiled so far, and the wall seconds they took, once done), ``error`` (the
    exception that ended it, if any: logged; the buckets compiled before it stay usable).
    """

    def __init__(self, runner, on_start: Callable[[], None] | None = None,
                 on_end: Callable[[int], None] | None = None) -> None:
        self._runner, self._on_start, self._on_end = runner, on_start, on_end
        self._stop = threading.Event()
        self.done = threading.Event()
        self.num_programs, self.seconds = 0, 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxserve-compile", daemon=True)

    def start(self) -> BackgroundCompile:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Ask the thread to stop after the program it is compiling and wait up to
        ``timeout_s``; returns whether it ended."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._on_start is not None:
                self._on_start()
            self.num_programs = self._runner.compile_pending(self._stop)
            self.seconds = time.perf_counter() - t0
            if self._stop.is_set():
                log.info("background compile stopped after %d step program(s) (%.1f s)",
                         self.num_programs, self.seconds)
            elif self.num_programs:
                log.info("compiled %d more step program(s) in %.1f s in the background",
                         self.num_programs, self.seconds)
        except BaseException as e:  # logged; steps go on in the compiled buckets
            self.error = e
            log.exception("background compile failed; steps keep to the compiled buckets")
        finally:
            if self._on_end is not None:
                try:
                    self._on_end(self._runner.num_pending_programs())
                except Exception:  # a report must not keep the thread from ending
                    log.exception("background compile: on_end failed")
            self.done.set()
