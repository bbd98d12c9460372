"""Operating the HTTP server: how it starts, who gets in, for how long, and how it stops.

Every HTTP request passes ``GateMiddleware`` first, which
  1. picks the request id (``X-Request-Id``, else a random hex id), stores it in
     ``request.state.request_id`` and ``logs.request_id_var`` (so every log line of the request
     carries it), and echoes it on the response beside ``Keep-Alive: timeout=N``
     (``timeout_keep_alive``, uvicorn's idle limit);
  2. with an API key set, answers 401 on the protected paths (``/v1/*``, ``/tokenize``,
     ``/detokenize``) unless ``Authorization: Bearer <key>`` is sent;
  3. while draining, answers 503 to everything but ``/health``, ``/ready`` and ``/metrics``;
  4. until the model is ready (``lifecycle.Lifecycle``), answers 503 with ``Retry-After`` (the
     estimated seconds to ready, at least 1) to everything but those and ``/openapi.json``;
  5. on the generation routes, answers 503 with ``Retry-After`` while the engine already holds
     ``max_waiting_requests`` requests not yet running; otherwise gives the request a
     ``RequestBudget`` (``request.state.budget``) and counts it in flight until its response
     has been sent completely (for a stream: until ``[DONE]``).
The endpoints await engine outputs through ``RequestBudget.bound``: once the deadline passes, the
awaited output is cancelled (closing the engine's generator aborts the request) and TimeoutError
is raised, which the endpoint answers with 504 (or 503 when the drain cut it short).

Start-up: ``run_server(app, start)`` binds the port first (probes get answers from then on),
then runs ``start(lifecycle)`` on a thread: it loads and compiles, reporting its stage, and
returns the engine, which is attached to the app before the stage becomes "ready". If ``start``
raises, the server stops and ``run_server`` raises the same error.

Drain: ``run_server`` runs uvicorn with a SIGTERM handler that starts draining instead of
stopping. New requests get 503 while the requests in flight run on; when none is left, or once
``shutdown_timeout`` has passed (then every budget is expired at once, so the remaining requests
are answered with 503 / an error event and aborted, and get ``_ABORT_GRACE_S`` to end), uvicorn
shuts down (waiting up to ``_ABORT_GRACE_S`` more for open connections) and ``run_server``
returns normally (exit status 0). A second SIGTERM, or SIGINT, stops at once as uvicorn does.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Protocol

import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.server import protocol as p
from jaxserve.server.lifecycle import Lifecycle
from jaxserve.server.logs import request_id_var
from jaxserve.server_config import ServerConfig

logger = logging.getLogger(__name__)

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json"})
_PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})  # answered while draining
_MAX_REQUEST_ID_LEN = 128
_RETRY_AFTER_S = "1"
_ABORT_GRACE_S = 5.0  # after the drain aborts, how long the aborted responses may take to end


class WaitingCounter(Protocol):
    def num_waiting(self) -> int: ...


def error_response(
    status: int,
    message: str,
    type: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> Response:
    """An OpenAI-style JSON error response (``code``: OpenAI's string code, or None)."""
    return Response(
        p.error_body(message, type, param, code),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def is_protected(path: str) -> bool:
    """Whether ``path`` needs the API key (when one is set)."""
    return path not in _OPEN_PATHS


class RequestBudget:
    """The deadline of one admitted generation request (event-loop time; None: no limit).

    ``bound(aw)`` awaits ``aw`` under the deadline; ``expire(reason)`` moves the deadline to now,
    also for awaits already under way (the drain uses it with reason "drain").
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        now = asyncio.get_running_loop().time()
        self.deadline = None if timeout_s is None else now + timeout_s
        self.reason = "timeout"
        self.queued = False  # handed to the engine (until then the gate counts it as waiting)
        self._scopes: set[asyncio.Timeout] = set()

    async def bound[T](self, aw: Awaitable[T]) -> T:
        """Await ``aw``; raises TimeoutError (``aw`` cancelled) once the deadline has passed."""
        async with asyncio.timeout_at(self.deadline) as scope:
            self._scopes.add(scope)
            try:
                return await aw
            finally:
                self._scopes.discard(scope)

    def expire(self, reason: str) -> None:
        now = asyncio.get_running_loop().time()
        self.reason, self.deadline = reason, now
        for scope in list(self._scopes):
            if not scope.expired():
                scope.reschedule(now)

    def error(self) -> tuple[int, str, str]:
        """(status, message, type) of the answer to a request whose budget ran out."""
        if self.reason == "drain":
            return 503, "the server shut down before the request finished", "server_error"
        message = f"the request did not finish within the request timeout ({self.timeout_s:g} s)"
        return 504, message, "timeout_error"


class Gate:
    """Admission state shared by the middleware and the drain (event-loop side only, except
    ``start_drain``, which only sets flags and may run in a signal handler).

    Args:
      engine: the engine's waiting count (replaced once start-up attaches the engine).
      config: the server settings.
      lifecycle: the start-up / shut-down stage; the model endpoints open in stage "ready".
    """

    def __init__(self, engine: WaitingCounter, config: ServerConfig,
                 lifecycle: Lifecycle) -> None:
        self.engine = engine
        self.config = config
        self.lifecycle = lifecycle
        self.inflight: set[RequestBudget] = set()
        self.draining = False
        self._drain_started = 0.0  # time.monotonic()
        self._drain_logged = False
        self._aborted_at: float | None = None

    def refusal(self, scope: Scope) -> Response | None:
        """The error response for a request not let in, or None to let it in."""
        path = scope["path"]
        if self.config.api_key is not None and is_protected(path) and not self._authorized(scope):
            return error_response(
                401,
                "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                "invalid_request_error",
                headers={"WWW-Authenticate": "Bearer"},
                code="invalid_api_key",
            )
        if self.draining and path not in _PROBE_PATHS:
            return error_response(
                503, "the server is shutting down", "server_error",
                headers={"Retry-After": _RETRY_AFTER_S},
            )  # fmt: skip
        if not self.lifecycle.ready and path not in _OPEN_PATHS:
            st = self.lifecycle.status()
            eta = "" if st.eta_s is None else f", about {st.eta_s:.0f} s left"
            retry = "1" if st.eta_s is None else str(max(1, math.ceil(st.eta_s)))
            return error_response(
                503, f"the model is not ready yet ({st.stage}, {st.progress:.0%} done{eta}); "
                "GET /ready tells when it is", "server_error", headers={"Retry-After": retry})
        if path in GENERATE_PATHS:
            # admitted requests still reading their body or tokenising count as waiting too,
            # else a simultaneous burst passes the gate before any of it reaches the engine
            admitting = sum(1 for b in self.inflight if not b.queued)
            n, cap = self.engine.num_waiting() + admitting, self.config.max_waiting_requests
            if n >= cap:
                return error_response(
                    503,
                    f"the server is overloaded: {n} requests are waiting (the limit is {cap}); "
                    "retry later",
                    "server_error",
                    headers={"Retry-After": _RETRY_AFTER_S},
                )
        return None

    def _authorized(self, scope: Scope) -> bool:
        assert self.config.api_key is not None
        for key, value in scope["headers"]:
            if key == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self.config.api_key.encode()
                )
        return False

    # -- the drain -----------------------------------------------------------------------------
    def start_drain(self) -> None:
        """Stop admitting; ``drain_tick`` then finishes the drain. Safe in a signal handler."""
        if not self.draining:
            self._drain_started = time.monotonic()
            self.draining = True
            self.lifecycle.start_drain(self.config.shutdown_timeout)

    def drain_tick(self) -> bool:
        """Advance the drain (on the event loop, every 0.1 s); True once it is over."""
        now = time.monotonic()
        if not self._drain_logged:
            self._drain_logged = True
            logger.info("draining: %d request(s) in flight, up to %g s",
                        len(self.inflight), self.config.shutdown_timeout)
        if not self.inflight:
            logger.info("drained in %.1f s", now - self._drain_started)
            return True
        if self._aborted_at is None and now >= self._drain_started + self.config.shutdown_timeout:
            logger.warning("drain timeout: aborting %d request(s) in flight", len(self.inflight))
            for budget in list(self.inflight):
                budget.expire("drain")
            self._aborted_at = now
        return self._aborted_at is not None and now >= self._aborted_at + _ABORT_GRACE_S


class GateMiddleware:
    """ASGI middleware: request id, API key, drain, admission and in-flight tracking (above)."""

    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = ""
        for key, value in scope["headers"]:
            if key == b"x-request-id":
                rid = value.decode("latin-1").strip()
        if not rid or len(rid) > _MAX_REQUEST_ID_LEN or not rid.isprintable():
            rid = p.random_id()
        scope.setdefault("state", {})["request_id"] = rid
        keep_alive = f"timeout={self.gate.config.timeout_keep_alive}".encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k not in (b"x-request-id", b"keep-alive")]
                headers += [(b"x-request-id", rid.encode("latin-1")), (b"keep-alive", keep_alive)]
                message = {**message, "headers": headers}
            await send(message)

        token = request_id_var.set(rid)
        try:
            refusal = self.gate.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send_with_id)
            elif scope["path"] in GENERATE_PATHS:
                budget = RequestBudget(self.gate.config.request_timeout_s)
                scope["state"]["budget"] = budget
                self.gate.inflight.add(budget)
                try:
                    await self.app(scope, receive, send_with_id)
                finally:
                    self.gate.inflight.discard(budget)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM turned into a drain and start-up run on a thread once the
    port is bound (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, gate: Gate,
                 start: Callable[[Lifecycle], object] | None,
                 attach: Callable[[object], None]) -> None:
        super().__init__(config)
        self.gate = gate
        self.start = start
        self.attach = attach
        self.start_error: BaseException | None = None
        self.start_done = start is None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.start is not None and self.started and not self.should_exit:
            threading.Thread(target=self._start, name="jaxserve-start", daemon=True).start()

    def _start(self) -> None:
        assert self.start is not None
        lifecycle = self.gate.lifecycle
        try:
            engine = self.start(lifecycle)
        except BaseException as exc:  # noqa: BLE001 (raised again by run_server)
            self.start_error = exc
            self.should_exit = True
            return
        self.attach(engine)
        lifecycle.set_ready()
        self.start_done = True
        logger.info("ready: %s s after start-up began", f"{lifecycle.ready_s:.1f}")

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.gate.draining:
            self.gate.start_drain()  # not recorded as a captured signal: exit status 0
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.gate.draining and self.gate.drain_tick()


def run_server(app: Starlette, start: Callable[[Lifecycle], object] | None = None) -> bool:
    """Serve ``app`` (made by ``app.build_app``) with uvicorn on its ServerConfig's host and
    port until a SIGTERM has drained it (then return normally) or SIGINT stops it. Logging is
    left as configured (``logs.configure_logging``); uvicorn's loggers propagate to it.

    Args:
      app: the app; built without an engine when ``start`` is given.
      start: called on a thread once the port is bound, with the app's ``Lifecycle`` to
        report its stage in; returns the engine to serve (the module docstring).
    Returns:
      False if the server stopped while ``start`` was still running (its thread is left to
      the caller: end the process), else True.
    Raises:
      whatever ``start`` raised, once the server has stopped.
    """
    gate: Gate = app.state.gate
    cfg = gate.config
    uv_config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, log_config=None,
        timeout_graceful_shutdown=int(_ABORT_GRACE_S), timeout_keep_alive=cfg.timeout_keep_alive,
    )  # fmt: skip
    server = _DrainingServer(uv_config, gate, start, app.state.attach_engine)
    server.run()
    if server.start_error is not None:
        raise server.start_error
    return server.start_done
