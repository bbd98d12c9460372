"""``AsyncEngine``: the ``LLMEngine`` on a background thread, fed by asyncio callers.

Data flow: ``generate()`` validates the request on the caller's thread (so a bad request fails at
once, with a ValueError, and nothing reaches the engine), compiles its structured-output
constraint, if any, in a worker thread (``LLMEngine.compile_grammar``: cached, bounded in time),
then sends an "add" command through a thread-safe queue and awaits its own ``asyncio.Queue``.
The engine thread drains commands (adds, aborts) between steps, runs ``step()``, and hands each
``RequestOutput`` to the owning event loop with ``call_soon_threadsafe``. Closing or cancelling
the generator sends an "abort", which frees the request's blocks before the next step. The
engine state is touched by the engine thread only; ``num_waiting()`` (the server's queue bound)
reads counts the engine thread publishes under a lock.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from jaxserve import request_ids
from jaxserve.device.warmup import BackgroundCompile
from jaxserve.engine.compile_events import counting_compiles
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.outputs import RequestOutput
from jaxserve.platform.process import lower_compile_priority
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Async front of an ``LLMEngine``; what the HTTP server talks to.

    Attributes: ``tokenizer``, ``max_model_len``, ``metrics``, ``model_name``, ``ready`` (True
    once warm-up has compiled the programs it compiles first and the probe step ran),
    ``background`` (the ``BackgroundCompile`` of the programs left for after ready; None when
    warm-up compiled them all).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.metrics = engine.metrics
        self.model_name = engine.model_name
        self.ready = False
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._num_queued = 0  # "add" commands not yet applied (under _lock)
        self._num_engine_waiting = 0  # the scheduler's waiting list, published by the engine thread
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.warmup_stats: dict[str, float] = {}
        self.background: BackgroundCompile | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, warmup: bool = True, progress: bool = True,
              on_compiled: Callable[[int, int], None] | None = None,
              background: bool = True) -> None:
        """Compile the step programs and run one probe step (blocking; ``on_compiled(done,
        total)`` follows the compiles, as ``LLMEngine.warmup``), then start the engine thread.
        With ``EngineConfig.background_compile`` (and a platform that defers) only the ready
        buckets' programs compile here; the others compile on a background thread
        (``jaxserve.device.warmup``), started here unless ``background`` is False (then
        ``start_background_compile`` starts it)."""
        if warmup:
            self.warmup_stats = self.engine.warmup(
                progress, on_compiled, defer=self.engine.config.background_compile)
            self.warmup_stats["probe_s"] = self.engine.probe()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()
        if background:
            self.start_background_compile()
        self.ready = True

    def start_background_compile(self) -> None:
        """Start compiling the programs warm-up left out, if any, on a background thread
        (``self.background``); the ``jaxserve:step_programs_pending`` gauge follows it."""
        pending = int(self.warmup_stats.get("pending_programs", 0))
        if not pending or self.background is not None:
            return
        gauge = None if self.metrics is None else self.metrics.step_programs_pending
        if gauge is not None:
            gauge.set(pending)
        self.background = BackgroundCompile(
            self.engine.runner, on_start=lower_compile_priority,
            on_end=None if gauge is None else gauge.set).start()

    @property
    def alive(self) -> bool:
        """False once the engine thread has ended without ``shutdown()`` (it died; the error
        is logged); True before it starts."""
        thread = self._thread
        return thread is None or thread.is_alive() or self._stop.is_set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread (in-flight requests are left unfinished), then the engine's
        KV-cache events publisher, if any; a background compile stops after its program."""
        self._stop.set()
        if self.background is not None:
            self.background.stop(timeout_s)
        self._cmds.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()

    def num_unfinished(self) -> int:
        """Requests not yet finished (queued, waiting or running)."""
        with self._lock:
            return len(self._streams)

    def num_waiting(self) -> int:
        """Requests accepted but not yet running: queued for the engine thread, or waiting in
        the scheduler (preempted ones included). Cheap and thread-safe; the scheduler's part is
        as of the engine thread's last step."""
        with self._lock:
            return self._num_queued + self._num_engine_waiting

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str, prompt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last has ``finished=True``.

        Raises:
          ValueError: before anything is queued, for an invalid request (empty or too long
            prompt, ids out of range, bad sampling values, a structured-output constraint
            that does not compile).
        A request_id already running gets a ``#N`` suffix inside the engine.
          RuntimeError: if the engine failed while running this request.
        If the consumer stops early (``aclose()``, cancellation), the request is aborted.
        The request arrives now (``time.monotonic()``), as vLLM's front end stamps it: its
        first-token deadline and its TTFT count the wait for the step in flight.
        """
        arrival_time = time.monotonic()
        max_tokens = self.engine.validate(prompt_token_ids, sampling_params)
        grammar = None
        if sampling_params.structured_outputs is not None:
            grammar = await asyncio.to_thread(self.engine.compile_grammar, sampling_params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            # two clients may send the same X-Request-Id
            request_id = request_ids.unique(request_id, self._streams)
            self._streams[request_id] = stream
            self._num_queued += 1
        self._cmds.put(("add", (request_id, list(prompt_token_ids), sampling_params, prompt,
                                grammar, max_tokens, arrival_time)))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._cmds.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request; unknown or finished ids are ignored."""
        self._cmds.put(("abort", request_id))

    # -- the engine thread ---------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _apply(self, cmd: str, arg) -> None:
        eng = self.engine
        if cmd == "add":
            rid, ids, params, prompt, grammar, max_tokens, arrival_time = arg
            with self._lock:
                live = rid in self._streams
            try:
                if live:  # else the caller went away before the engine saw the request
                    eng.add_request(rid, ids, params, prompt, arrival_time=arrival_time,
                                    grammar=grammar, max_tokens=max_tokens)
            except ValueError as e:
                self._deliver(rid, e)
            finally:
                with self._lock:  # one update: the request moves from queued to waiting
                    self._num_queued -= 1
                    self._num_engine_waiting = eng.num_waiting
        elif cmd == "abort":
            eng.abort_request(arg)
            self._publish_waiting()

    def _publish_waiting(self) -> None:
        with self._lock:
            self._num_engine_waiting = self.engine.num_waiting

    def _run(self) -> None:
        try:
            with counting_compiles(self.metrics):  # warm-up is done: serving compiles nothing
                self._loop()
        except Exception:
            log.exception("the engine thread died; /health reports it")

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            block = not eng.has_unfinished_requests()
            try:
                while True:
                    cmd, arg = self._cmds.get(block=block)
                    block = False
                    self._apply(cmd, arg)
            except queue.Empty:
                pass
            if self._stop.is_set() or not eng.has_unfinished_requests():
                continue
            try:
                outputs = eng.step()
            except Exception as e:  # keep serving: fail the requests in flight, not the engine
                log.exception("engine step failed; aborting the requests in flight")
                ids = eng.request_ids()
                eng.abort_request(ids)
                for rid in ids:
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                self._publish_waiting()
                continue
            self._publish_waiting()
            for out in outputs:
                self._deliver(out.request_id, out)
