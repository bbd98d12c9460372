"""The OpenAI-compatible HTTP front end (Starlette): one request's path through it.

  POST body ─msgspec decode (protocol.py)─> model check ─> SamplingParams ─> token ids
    (completions: the prompt's ids or ``tokenizer.encode(prompt)``; chat: the chat template,
    encoded without special tokens) ─> ``engine.generate(ids, params, request_id)``.
  The first output is awaited before any response byte is sent, so engine validation errors
  (empty prompt, prompt >= max_model_len, token id out of range: ValueError) become 400s, for
  streaming requests too. Then either
    - stream=false: the rest is collected in a task, raced against the client's
      ``http.disconnect``; a disconnect cancels the task (closing the engine's generator aborts
      the request) and calls ``engine.abort``;
    - stream=true: SSE events ``data: <json>\\n\\n``, ending with ``data: [DONE]\\n\\n``.
      Completions: one chunk per text delta; the last content chunk carries finish_reason.
      Chat: a role chunk ``{"role": "assistant", "content": ""}``, content deltas, then a chunk
      with an empty delta and the finish_reason. With ``stream_options.include_usage``, every
      chunk has ``usage: null`` and one extra chunk with ``choices: []`` and the usage follows
      the finish chunk; without it no chunk has a ``usage`` key. An engine fault mid-stream sends
      ``data: {"error": {...}}`` then ``data: [DONE]``. On disconnect Starlette cancels the
      stream; the body iterator is always closed, which closes the engine's generator (abort).

Request ids: an incoming ``X-Request-Id`` header (else a random hex id) is echoed in the response
header; the engine request id and the response ``id`` are ``cmpl-<id>`` / ``chatcmpl-<id>``.
Every error is an OpenAI-style JSON body (protocol.ErrorResponse); bad input never gives a 500.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from jaxserve import protocol as p
from jaxserve.metrics import EngineMetrics
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_MAX_REQUEST_ID_LEN = 128
_DONE = b"data: [DONE]\n\n"


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


class EngineClient(Protocol):
    """What the server needs of ``jaxserve.async_engine.AsyncEngine``."""

    tokenizer: Tokenizer
    max_model_len: int
    metrics: EngineMetrics
    ready: bool

    def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...


class _StreamState:
    """Whether a streamed request has finished in the engine (else closing the stream aborts it)."""

    finished: bool = False


class _ClientGone(Exception):
    """The client disconnected before the response was sent."""


def _error(
    status: int,
    message: str,
    type: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        p.error_body(message, type, status, param),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _json(obj: msgspec.Struct, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json", headers=headers)


def _endpoint(
    fn: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """Turn RequestError into its 4xx JSON body and any other exception into a 500 JSON body."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except p.RequestError as exc:
            return _error(exc.status, exc.message, exc.type, exc.param)
        except Exception as exc:
            logger.exception("internal error serving %s", request.url.path)
            return _error(
                500, f"internal server error: {type(exc).__name__}: {exc}", "server_error"
            )

    return wrapper


class _RequestIdMiddleware:
    """Pick the request id (``X-Request-Id`` or random), store it in ``request.state.request_id``
    and echo it on the response."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

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

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close`` once sending ends, however it ends:
    the client may leave while the body iterator is suspended at a ``yield``, or before it was
    ever started, and the engine request must then be aborted now, not at garbage collection."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        **kwargs: object,
    ) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.on_close()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected[T](request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``; if the client disconnects first, cancel it and raise _ClientGone."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # let the cancellation reach the engine's generator
    if task.cancelled():
        raise _ClientGone()
    return task.result()


class _OpenAIServer:
    """The endpoints, bound to one engine and one served model name."""

    def __init__(self, engine: EngineClient, served_model_name: str) -> None:
        self.engine = engine
        self.model = served_model_name
        self.created = int(time.time())

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise p.RequestError(
                f"The model `{model}` does not exist.",
                status=404,
                type="not_found_error",
                param="model",
            )

    @staticmethod
    async def _body(request: Request) -> bytes:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise p.RequestError(f"Content-Type must be application/json, got {ctype or 'none'!r}")
        return await request.body()

    async def completions(self, request: Request) -> Response:
        req = p.decode_completion_request(await self._body(request))
        self._check_model(req.model)
        params = p.to_sampling_params(req)
        prompt = p.completion_prompt(req)
        if isinstance(prompt, str):
            ids, text = self.engine.tokenizer.encode(prompt), prompt
        else:
            ids, text = prompt, None
        return await self._serve(
            request, "cmpl", ids, text, params, req.stream, req.stream_options, chat=False
        )

    async def chat_completions(self, request: Request) -> Response:
        req = p.decode_chat_request(await self._body(request))
        self._check_model(req.model)
        params = p.to_sampling_params(req)
        try:
            rendered = self.engine.tokenizer.apply_chat_template(
                p.chat_messages(req), add_generation_prompt=req.add_generation_prompt
            )
        except ValueError as exc:
            raise p.RequestError(f"invalid messages: {exc}", param="messages") from exc
        ids = self.engine.tokenizer.encode(rendered, add_special_tokens=False)
        return await self._serve(
            request, "chatcmpl", ids, rendered, params, req.stream, req.stream_options, chat=True
        )

    async def _serve(
        self,
        request: Request,
        kind: str,
        ids: list[int],
        text: str | None,
        params: SamplingParams,
        stream: bool,
        stream_options: p.StreamOptions | None,
        chat: bool,
    ) -> Response:
        rid = f"{kind}-{request.state.request_id}"
        created = int(time.time())
        gen = self.engine.generate(ids, params, rid, prompt=text)
        finished = False
        try:
            try:
                first = await _unless_disconnected(request, _first(gen))
            except ValueError as exc:
                raise p.RequestError(str(exc), param="prompt" if "prompt" in str(exc) else None)
            except StopAsyncIteration:
                raise RuntimeError("the engine produced no output") from None
            if stream:
                include_usage = stream_options is not None and stream_options.include_usage
                fmt = p.StreamFormatter(chat, rid, created, self.model, include_usage)
                state = _StreamState()

                async def on_close() -> None:
                    if not state.finished:
                        await gen.aclose()  # type: ignore[attr-defined]
                        self.engine.abort(rid)

                finished = True  # the response owns the generator from here
                return _ClosingStreamingResponse(
                    self._events(gen, first, fmt, state),
                    on_close,
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            final = first if first.finished else await _unless_disconnected(request, _collect(gen))
            finished = True
        except _ClientGone:
            return Response(status_code=499)
        finally:
            if not finished:
                await gen.aclose()
                self.engine.abort(rid)
        return _json(p.final_response(chat, rid, created, self.model, final))

    @staticmethod
    async def _events(
        gen: AsyncIterator[RequestOutput],
        first: RequestOutput,
        fmt: p.StreamFormatter,
        state: _StreamState,
    ) -> AsyncIterator[bytes]:
        """The SSE body; sets ``state.finished`` once the engine request has finished."""
        try:
            for event in fmt.start():
                yield event
            out = first
            while True:
                for event in fmt.on_output(out):
                    yield event
                if out.finished:
                    state.finished = True
                    break
                try:
                    out = await anext(gen)
                except StopAsyncIteration:
                    raise RuntimeError("the engine stream ended before the request finished")
            for event in fmt.end(out):
                yield event
        except Exception as exc:
            logger.exception("error in stream %s", fmt.id)
            bad = isinstance(exc, ValueError)
            yield (
                b"data: "
                + p.error_body(
                    str(exc) if bad else f"internal server error: {type(exc).__name__}: {exc}",
                    "invalid_request_error" if bad else "server_error",
                    400 if bad else 500,
                )
                + b"\n\n"
            )
        yield _DONE

    async def models(self, request: Request) -> Response:
        card = p.ModelCard(
            id=self.model, created=self.created, max_model_len=self.engine.max_model_len
        )
        return _json(p.ModelList(data=[card]))

    async def health(self, request: Request) -> Response:
        if not self.engine.ready:
            return _error(503, "the engine is still warming up", "server_error")
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        m = self.engine.metrics
        return Response(m.render(), headers={"Content-Type": m.content_type})


async def _first(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await anext(gen)


async def _collect(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    async for out in gen:
        if out.finished:
            return out
    raise RuntimeError("the engine stream ended before the request finished")


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


def build_app(engine: EngineClient, served_model_name: str) -> Starlette:
    """The OpenAI-compatible Starlette app serving ``engine`` as ``served_model_name``.

    Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health
    (503 until ``engine.ready``), GET /metrics (Prometheus text).
    """
    api = _OpenAIServer(engine, served_model_name)
    routes = [
        Route("/v1/completions", _endpoint(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(api.chat_completions), methods=["POST"]),
        Route("/v1/models", _endpoint(api.models), methods=["GET"]),
        Route("/health", _endpoint(api.health), methods=["GET"]),
        Route("/metrics", _endpoint(api.metrics), methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(_RequestIdMiddleware)],
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
