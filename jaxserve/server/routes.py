"""The OpenAI-compatible HTTP front end (Starlette): the app, its route table and the error
bodies of requests that reach no endpoint.

Before any endpoint, ``gate.GateMiddleware`` picks the request id (``X-Request-Id`` or a
random hex id; echoed in the response header and carried by every log line of the request),
checks the API key, refuses requests before the model is ready, while draining or while the
waiting queue is full (503), and gives generation requests a ``RequestBudget``: every engine
output is awaited under it, and a request past its deadline is aborted and answered 504 (an
error event once a stream has started). Then:
  - the generation and tokenizer endpoints are ``handlers.OpenAIServer``'s methods (a body is
    prepared into a ``jobs.GenerationJob`` and answered whole, or streamed by
    ``streaming.start_stream``);
  - ``/health``, ``/ready`` and ``/metrics`` are ``probes.Probes``'s, answered from process
    start to exit.
The engine request id and the response ``id`` are ``cmpl-<id>``, ``chatcmpl-<id>`` or
``resp_<random>``. Every error is an OpenAI-style JSON body (protocol.ErrorResponse); bad input
never gives a 500.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxserve.server import protocol as p
from jaxserve.server.gate import Gate, GateMiddleware
from jaxserve.server.gate import error_response as _error
from jaxserve.server.handlers import OpenAIServer
from jaxserve.server.jobs import EngineClient
from jaxserve.server.lifecycle import Lifecycle
from jaxserve.server.logs import install_request_id
from jaxserve.server.openapi import openapi_document
from jaxserve.server.probes import Probes
from jaxserve.server.responses import handler as responses
from jaxserve.server_config import RequestLimits, ServerConfig

logger = logging.getLogger(__name__)


class _NotStarted:
    """Stands in for the engine until start-up attaches it (the gate keeps every endpoint that
    would touch it closed until then)."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"the engine is not started yet (asked for {name!r})")



def _endpoint(
    fn: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """Turn RequestError into its 4xx JSON body and any other exception into a 500 JSON body."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except p.RequestError as exc:
            return _error(exc.status, exc.message, exc.type, exc.param, code=exc.code)
        except Exception as exc:
            logger.exception("internal error serving %s", request.url.path)
            return _error(
                500, f"internal server error: {type(exc).__name__}: {exc}", "server_error"
            )

    return wrapper


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        msg, type = f"Not found: {request.method} {request.url.path}", "not_found_error"
    elif exc.status_code == 405:
        msg = f"Method {request.method} is not allowed for {request.url.path}"
        type = "invalid_request_error"
    else:
        msg, type = str(exc.detail), "invalid_request_error"
    return _error(exc.status_code, msg, type, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error serving %s", request.url.path, exc_info=exc)
    return _error(500, f"internal server error: {type(exc).__name__}", "server_error")


def build_app(
    engine: EngineClient | None,
    served_model_name: str,
    config: ServerConfig | None = None,
    limits: RequestLimits | None = None,
    started: float | None = None,
) -> Starlette:
    """The OpenAI-compatible Starlette app serving ``engine`` as ``served_model_name``.

    Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET and
    DELETE /v1/responses/{id} (the responses kept: ``--max-stored-responses``), GET
    /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /tokenizer_info,
    GET /health (liveness: 200 unless the engine thread died, then 500), GET /ready
    (``lifecycle.ReadyStatus``; 200 in stage "ready", else 503), GET /metrics (Prometheus
    text), GET /openapi.json. ``config`` supplies the API key, queue bound and
    timeouts (default: ``ServerConfig()``), ``limits`` the per-request caps (default:
    ``RequestLimits()``); ``app.state.gate`` is the admission state that
    ``gate.run_server`` drains.

    With ``engine`` None the app starts in stage "loading" (model endpoints 503) until
    ``app.state.attach_engine(engine)`` and ``lifecycle.set_ready()`` (``gate.run_server``
    does both); with an engine it is ready at once. ``started``: when start-up began
    (``time.monotonic()``; default: now), the origin of ``/ready``'s ``elapsed_s`` and of the
    time to ready (``Lifecycle``).
    """
    config = config or ServerConfig()
    install_request_id()
    placeholder: EngineClient = _NotStarted()  # type: ignore[assignment]
    api = OpenAIServer(placeholder if engine is None else engine, served_model_name, limits,
                       responses.ResponseStore(config.max_stored_responses),
                       config.enable_prompt_tokens_details)
    doc = msgspec.json.encode(openapi_document(api_key=config.api_key is not None))
    gate = Gate(api.engine, config, Lifecycle(ready=engine is not None, started=started))
    probes = Probes(gate, served_model_name, config.metrics_compat)

    def attach_engine(eng: EngineClient) -> None:
        api.engine = gate.engine = eng
        probes.attach(eng)

    if engine is not None:
        attach_engine(engine)

    async def openapi(request: Request) -> Response:
        return Response(doc, media_type="application/json")

    routes = [
        Route("/v1/completions", _endpoint(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(api.chat_completions), methods=["POST"]),
        Route("/v1/responses", _endpoint(api.create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", _endpoint(api.stored_response),
              methods=["GET", "DELETE"]),
        Route("/v1/models", _endpoint(api.models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _endpoint(api.model_card), methods=["GET"]),
        Route("/tokenizer_info", _endpoint(api.tokenizer_info), methods=["GET"]),
        Route("/tokenize", _endpoint(api.tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(api.detokenize), methods=["POST"]),
        Route("/health", _endpoint(probes.health), methods=["GET"]),
        Route("/ready", _endpoint(probes.ready), methods=["GET"]),
        Route("/metrics", _endpoint(probes.metrics), methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(GateMiddleware, gate=gate)],
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.gate = gate
    app.state.attach_engine = attach_engine
    return app
