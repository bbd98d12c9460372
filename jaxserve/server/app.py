"""The OpenAI-compatible HTTP front end (Starlette): one request's path through it.

  POST body (at most ``RequestLimits.max_request_body_bytes``, else 413)
    ─``OpenAIServer.prepare``: msgspec decode and checks (protocol.py), model check,
    SamplingParams, token ids (completions: the prompt's ids or ``tokenizer.encode(prompt)``,
    for each prompt of a batched prompt; chat: the chat template, encoded without special
    tokens)─> ``GenerationJob``
    ─> ``engine.generate(ids, params, request_id)`` per prompt, all at once (a batch's engine
    ids are ``<request_id>-<i>``).
  The first output of every prompt is awaited before any response byte is sent, so engine
  validation errors (empty prompt, prompt >= max_model_len, token id out of range:
  ``InvalidRequest``) become 400s naming ``exc.param``, for streaming requests too (the other
  prompts of the batch are aborted). Then either
    - stream=false: ``OpenAIServer.respond`` (GenerationJob -> response body, the path that
      ``jaxserve run-batch`` shares) runs in a task raced against the client's
      ``http.disconnect``; a disconnect cancels the task (closing the engine's generator aborts
      the request) and calls ``engine.abort``;
    - stream=true: SSE events ``data: <json>\\n\\n``, ending with ``data: [DONE]\\n\\n``.
      Completions: one chunk per text delta; the last content chunk carries finish_reason;
      a batch's prompts interleave as their outputs arrive (``encode.StreamFormatter``).
      Chat: a role chunk ``{"role": "assistant", "content": ""}``, content deltas, then a chunk
      with an empty delta and the finish_reason. With ``stream_options.include_usage``, every
      chunk has ``usage: null`` and one extra chunk with ``choices: []`` and the usage follows
      the finish chunk; without it no chunk has a ``usage`` key. An engine fault mid-stream sends
      ``data: {"error": {...}}`` then ``data: [DONE]``. On disconnect Starlette cancels the
      stream; the body iterator is always closed, which closes the engine's generator (abort).
  ``POST /v1/responses`` takes the chat path (``server.responses`` turns the request into a
  chat request); its reply is a response object, or Responses API events (``event: <type>``,
  an ``error`` event on a fault, no ``[DONE]``), built by ``responses_output.ResponseBuilder``.

Before any endpoint, ``gate.GateMiddleware`` picks the request id (``X-Request-Id`` or a
random hex id; echoed in the response header and carried by every log line of the request),
checks the API key, refuses requests before the model is ready, while draining or while the
waiting queue is full (503), and gives generation requests a ``RequestBudget``: every engine
output is awaited under it, and a request past its deadline is aborted and answered 504 (an
error event once a stream has started). The engine request id and the response ``id`` are
``cmpl-<id>``, ``chatcmpl-<id>`` or ``resp_<random>``. Every error is an OpenAI-style JSON body
(protocol.ErrorResponse); bad input never gives a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import msgspec
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from jaxserve.config import RequestLimits, ServerConfig
from jaxserve.engine.metrics import MODEL_LABEL, PREFIX, EngineMetrics, vllm_compat
from jaxserve.errors import InvalidRequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server import decode, encode, responses, tools
from jaxserve.server import protocol as p
from jaxserve.server.gate import Gate, GateMiddleware, RequestBudget
from jaxserve.server.gate import error_response as _error
from jaxserve.server.lifecycle import Lifecycle
from jaxserve.server.logs import install_request_id
from jaxserve.server.openapi import openapi_document
from jaxserve.server.responses_output import ResponseBuilder
from jaxserve.server.responses_protocol import DeletedResponse, ResponseObject

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    has_chat_template: bool
    chat_template: str

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    def apply_chat_template(  # template_kwargs is passed only for requests with tools
        self, messages: list[dict], add_generation_prompt: bool = True, *,
        template_kwargs: dict | None = None,
    ) -> str: ...


class EngineClient(Protocol):
    """What the server needs of ``jaxserve.engine.async_engine.AsyncEngine``."""

    tokenizer: Tokenizer
    max_model_len: int
    metrics: EngineMetrics | None
    alive: bool  # False once the engine thread has died

    def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def num_waiting(self) -> int:
        """Requests accepted but not yet running (cheap, thread-safe, approximate)."""
        ...


def _request_param(param: str | None, chat: bool) -> str | None:
    """The request field an engine ``InvalidRequest.param`` is about (a chat prompt is built
    from ``messages``)."""
    return "messages" if chat and param == "prompt" else param


class _StreamState:
    """Which prompts of a streamed request have finished in the engine (closing the stream
    aborts the others)."""

    def __init__(self) -> None:
        self.finished: set[int] = set()


class _ClientGone(Exception):
    """The client disconnected before the response was sent."""


class _NotStarted:
    """Stands in for the engine until start-up attaches it (the gate keeps every endpoint that
    would touch it closed until then)."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"the engine is not started yet (asked for {name!r})")


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
            return _error(exc.status, exc.message, exc.type, exc.param, code=exc.code)
        except Exception as exc:
            logger.exception("internal error serving %s", request.url.path)
            return _error(
                500, f"internal server error: {type(exc).__name__}: {exc}", "server_error"
            )

    return wrapper


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


@dataclass
class EnginePrompt:
    """One prompt of a job, as the engine is given it.

    Fields:
      ids: its token ids (completions: the request's ids or the encoded text; chat: the
        rendered template, encoded without special tokens).
      text: the text the ids came from (None for a token-id prompt).
      fmt: how its logprobs (and a completions ``echo``) are rendered into the response.
    """

    ids: list[int]
    text: str | None
    fmt: encode.LogprobFormat


@dataclass
class GenerationJob:
    """A generation request decoded, checked and tokenised: what the engine is given.

    Fields:
      chat: a chat completion (else a text completion).
      prompts: one engine request each, in the request's order (several only for a batched
        completions prompt); each runs ``params.n`` choices.
      params: the request's sampling parameters.
      stream: the request asked for server-sent events.
      include_usage: ``stream_options.include_usage``.
      constraint_field: the request field ``params.structured_outputs`` came from
        (``response_format``, ``structured_outputs``, ``guided_json``, ..., ``tools`` for a
        tool choice), which the engine's errors about it name; None without one.
      tools: how a chat request's replies become tool calls (``server.tools``), or None.
      response: a Responses request's part (``server.responses``): its reply is a response
        object or Responses events, not a chat completion; None for the other endpoints.
    """

    chat: bool
    prompts: list[EnginePrompt]
    params: SamplingParams
    stream: bool
    include_usage: bool
    constraint_field: str | None = None
    tools: tools.ToolPlan | None = None
    response: responses.ResponseJob | None = None

    def response_id(self, request_id: str) -> str:
        """The response ``id`` (also the engine request id): ``chatcmpl-<request_id>``,
        ``cmpl-<request_id>``, or for a Responses request ``resp_<32 random hex digits>``:
        stored responses are looked up by id, so it must not repeat when clients reuse an
        ``X-Request-Id`` (which stays the id of the log lines)."""
        if self.response is not None:
            return f"resp_{uuid.uuid4().hex}"
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"

    def engine_ids(self, request_id: str) -> list[str]:
        """The engine request id of each prompt: ``request_id`` itself for one prompt, else
        ``<request_id>-<i>``."""
        if len(self.prompts) == 1:
            return [request_id]
        return [f"{request_id}-{i}" for i in range(len(self.prompts))]


class OpenAIServer:
    """The endpoints, bound to one engine and one served model name.

    ``prepare`` (body bytes -> GenerationJob) and ``respond`` (GenerationJob -> response body)
    are the request-handling path shared by the HTTP endpoints and ``jaxserve run-batch``
    (``jaxserve.server.batch``); both raise ``protocol.RequestError`` for a client error.
    """

    def __init__(
        self, engine: EngineClient, served_model_name: str, limits: RequestLimits | None = None,
        store: responses.ResponseStore | None = None,
    ) -> None:
        self.engine = engine
        self.model = served_model_name
        self.limits = limits or RequestLimits()
        self.store = store or responses.ResponseStore(0)
        self.created = int(time.time())

    def _check_chat_template(self) -> None:
        """A base model (its tokenizer has no chat template) cannot take chat messages: 400
        rather than a guessed template the model never saw."""
        if not getattr(self.engine.tokenizer, "has_chat_template", True):
            raise p.RequestError(
                f"the model `{self.model}` has no chat template (a base model), so it cannot "
                "take chat messages; send the text as `prompt` to /v1/completions",
                param="messages")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise p.RequestError(
                f"The model `{model}` does not exist.",
                status=404,
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    async def _body(self, request: Request) -> bytes:
        """The JSON body, read up to ``limits.max_request_body_bytes`` (else 413)."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise p.RequestError(f"Content-Type must be application/json, got {ctype or 'none'!r}")
        cap = self.limits.max_request_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise _too_large(int(declared), cap)
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > cap:
                    raise _too_large(size, cap)
                parts.append(part)
        except ClientDisconnect:
            raise p.RequestError("the client disconnected while sending the body") from None
        return b"".join(parts)

    async def prepare(self, chat: bool, body: bytes) -> GenerationJob:
        """Decode and check a completions (``chat=False``) or chat-completions body, then
        tokenise its prompt (off the event loop: a long prompt must not stall other streams).

        Raises:
          protocol.RequestError: invalid body or field values (400, naming the field), caps
            exceeded (400), unknown model (404).
        """
        tok = self.engine.tokenizer
        if not chat:
            req = decode.decode_completion_request(body, self.limits)
            self._check_model(req.model)
            params = decode.to_sampling_params(req)
            prompts = decode.completion_prompts(req)
            texts = [q for q in prompts if isinstance(q, str)]
            encoded = iter(await asyncio.to_thread(lambda: [tok.encode(t) for t in texts]))
            echo, prompt_only = bool(req.echo), decode.scores_prompt_only(req)
            engine_prompts = []
            for q in prompts:
                ids, text = (next(encoded), q) if isinstance(q, str) else (q, None)
                fmt = self._logprob_format(params, echo, text, ids, prompt_only)
                engine_prompts.append(EnginePrompt(ids, text, fmt))
        else:
            return await self._prepare_chat(decode.decode_chat_request(body, self.limits))
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return GenerationJob(chat, engine_prompts, params, bool(req.stream), include_usage,
                             decode.constraint_field(req))

    async def _prepare_chat(self, req: p.ChatCompletionRequest) -> GenerationJob:
        """A checked chat request's job: sampling parameters, tool plan and the rendered,
        encoded chat template (raises RequestError as ``prepare``)."""
        tok = self.engine.tokenizer
        self._check_model(req.model)
        self._check_chat_template()
        params = decode.to_sampling_params(req)
        plan = tools.tool_plan(req, tok.chat_template)
        constraint_field = decode.constraint_field(req)
        if plan is not None:
            params, constraint_field = _with_tools(params, plan, constraint_field)
        render = tok.apply_chat_template if plan is None else functools.partial(
            tok.apply_chat_template, template_kwargs={"tools": plan.template_tools()})
        try:
            text = await asyncio.to_thread(render, decode.chat_messages(req),
                                           req.add_generation_prompt)
        except ValueError as exc:
            raise p.RequestError(f"invalid messages: {exc}", param="messages") from exc
        ids = await asyncio.to_thread(tok.encode, text, False)
        engine_prompts = [EnginePrompt(ids, text, self._logprob_format(params))]
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return GenerationJob(True, engine_prompts, params, bool(req.stream), include_usage,
                             constraint_field, plan)

    async def prepare_response(self, body: bytes) -> GenerationJob:
        """Decode and check a ``/v1/responses`` body, prepend the stored conversation of
        ``previous_response_id``, and prepare it as a chat request (``server.responses``).

        Raises:
          protocol.RequestError: as ``prepare``, naming chat's fields (``responses.
            request_error`` renames them); an unknown ``previous_response_id`` (404).
        """
        req = responses.decode_request(body)
        self._check_model(req.model)
        keep = self.store.keeps(req)
        history = self.store.history(req.previous_response_id)
        chat, items = responses.to_chat_request(req, history, self.engine.tokenizer.chat_template,
                                                self.limits)
        job = await self._prepare_chat(chat)
        job.response = responses.ResponseJob(req, items, self.store if keep else None)
        return job

    def _logprob_format(self, params: SamplingParams, echo: bool = False,
                        echo_text: str | None = None, ids: list[int] | None = None,
                        prompt_only: bool = False) -> encode.LogprobFormat:
        tok = self.engine.tokenizer
        skip = params.skip_special_tokens
        if echo and echo_text is None:  # a token-id prompt is echoed as its text
            echo_text = tok.decode(ids or [], skip_special_tokens=skip)
        return encode.LogprobFormat(params.logprobs, lambda t: tok.token_bytes(t, skip), echo=echo,
                                    echo_text=echo_text or "", prompt_only=prompt_only)

    async def _first(self, gen: AsyncIterator[RequestOutput], job: GenerationJob, index: int
                     ) -> RequestOutput:
        """The first engine output of prompt ``index``; the engine's InvalidRequest (checked
        before anything is queued) becomes a 400 naming the field (and, in a batch, the
        prompt)."""
        try:
            return await anext(gen)
        except InvalidRequest as exc:
            where = f"prompt[{index}]: " if len(job.prompts) > 1 else ""
            param = _request_param(exc.param, job.chat)
            if param == "structured_outputs" and job.constraint_field is not None:
                param = job.constraint_field
            raise p.RequestError(where + str(exc), param=param, code=exc.code) from None
        except StopAsyncIteration:
            raise RuntimeError("the engine produced no output") from None

    async def _firsts(self, gens: list[AsyncIterator[RequestOutput]], job: GenerationJob
                      ) -> list[RequestOutput]:
        """The first output of every prompt, awaited together (so the prompts are queued at
        once and share steps); if one fails, the others are cancelled (aborted)."""
        return await _all([self._first(g, job, i) for i, g in enumerate(gens)])

    async def respond(
        self, job: GenerationJob, request_id: str
    ) -> p.CompletionResponse | p.ChatCompletionResponse | ResponseObject:
        """Run a non-streamed request through the engine (its prompts at once) and return its
        response body.

        If this coroutine is cancelled (client gone, timeout), every engine request is aborted.

        Raises:
          protocol.RequestError: the engine refused a prompt (empty or too long, token ids or
            stop_token_ids outside the vocabulary); the other prompts are aborted.
          RuntimeError: the engine failed while running it.
        """
        created = int(time.time())
        runs = [self._run(job, i, rid) for i, rid in enumerate(job.engine_ids(request_id))]
        outs = await _all(runs)
        if job.response is not None:
            builder = job.response.builder(request_id, created, self.model, job.tools)
            return builder.complete(outs[0])
        return encode.final_response(job.chat, request_id, created, self.model, outs,
                                     [q.fmt for q in job.prompts], job.tools)

    async def _run(self, job: GenerationJob, index: int, engine_id: str) -> RequestOutput:
        """Prompt ``index`` run to its end: its final output (aborted if cancelled)."""
        q = job.prompts[index]
        gen = self.engine.generate(q.ids, job.params, engine_id, prompt=q.text)
        finished = False
        try:
            out = await self._first(gen, job, index)
            if not out.finished:
                out = await _collect(gen)
            finished = True
        finally:
            if not finished:
                await gen.aclose()  # type: ignore[attr-defined]
                self.engine.abort(engine_id)
        return out

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, await self.prepare(False, await self._body(request)))

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, await self.prepare(True, await self._body(request)))

    async def create_response(self, request: Request) -> Response:
        """``POST /v1/responses``: errors of the chat path name the Responses fields."""
        try:
            job = await self.prepare_response(await self._body(request))
            return await self._serve(request, job)
        except p.RequestError as exc:
            raise responses.request_error(exc) from None

    async def stored_response(self, request: Request) -> Response:
        """``GET /v1/responses/{id}``: a stored response; ``DELETE``: forget it (404 for an
        id not stored)."""
        response_id = request.path_params["response_id"]
        entry = self.store.get(response_id)
        if entry is None:
            raise p.RequestError(f"no stored response has id {response_id!r} (the server keeps "
                                 f"the last {self.store.capacity}: --max-stored-responses)",
                                 status=404, type="not_found_error", param="response_id",
                                 code="response_not_found")
        if request.method == "DELETE":
            self.store.delete(response_id)
            return _json(DeletedResponse(id=response_id))
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise p.RequestError("retrieving a response as a stream is not supported",
                                 param="stream", code=decode.UNSUPPORTED)
        return _json(entry.response)

    async def _serve(self, request: Request, job: GenerationJob) -> Response:
        rid = job.response_id(request.state.request_id)
        budget: RequestBudget = request.state.budget
        budget.queued = True  # from here the engine's waiting count covers it (see Gate)
        try:
            if not job.stream:
                body = await _unless_disconnected(request, budget.bound(self.respond(job, rid)))
                return _json(body)
            return await self._start_stream(request, job, rid, budget)
        except _ClientGone:
            return Response(status_code=499)
        except TimeoutError:
            status, message, err_type = budget.error()
            logger.warning("aborted: %s", message)
            return _error(status, message, err_type)

    async def _start_stream(
        self, request: Request, job: GenerationJob, rid: str, budget: RequestBudget
    ) -> Response:
        """Await every prompt's first output (so engine validation errors are still 400s), then
        hand the generators to a streaming response that aborts the requests if it ends
        early."""
        ids = job.engine_ids(rid)
        gens = [self.engine.generate(q.ids, job.params, e, prompt=q.text)
                for q, e in zip(job.prompts, ids)]
        state = _StreamState()

        async def close_unfinished() -> None:
            for i, (gen, engine_id) in enumerate(zip(gens, ids)):
                if i not in state.finished:
                    await gen.aclose()  # type: ignore[attr-defined]
                    self.engine.abort(engine_id)

        handed_over = False
        try:
            firsts = await _unless_disconnected(request, budget.bound(self._firsts(gens, job)))
            created = int(time.time())
            fmt: encode.StreamFormatter | ResponseBuilder
            if job.response is not None:
                fmt = job.response.builder(rid, created, self.model, job.tools)
            else:
                fmt = encode.StreamFormatter(job.chat, rid, created, self.model,
                                             job.include_usage, n=job.params.n,
                                             fmts=[q.fmt for q in job.prompts], tools=job.tools)
            handed_over = True  # the response owns the generators from here
            return _ClosingStreamingResponse(
                self._events(gens, firsts, fmt, state, budget),
                close_unfinished,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        finally:
            if not handed_over:
                await close_unfinished()

    @staticmethod
    async def _events(
        gens: list[AsyncIterator[RequestOutput]],
        firsts: list[RequestOutput],
        fmt: encode.StreamFormatter | ResponseBuilder,
        state: _StreamState,
        budget: RequestBudget,
    ) -> AsyncIterator[bytes]:
        """The SSE body; adds each prompt to ``state.finished`` once it finished in the
        engine. A failure after the start is ``fmt.error``'s event, then ``fmt.terminator``."""
        try:
            for event in fmt.start():
                yield event
            last = list(firsts)
            async with contextlib.aclosing(_interleave(gens, firsts, budget)) as outputs:
                async for i, out in outputs:
                    for event in fmt.on_output(out, i):
                        yield event
                    last[i] = out
                    if out.finished:
                        state.finished.add(i)
            for event in fmt.end(last):
                yield event
        except TimeoutError:
            _, message, err_type = budget.error()
            logger.warning("aborted mid-stream: %s", message)
            yield fmt.error(message, err_type)
        except Exception as exc:
            logger.exception("error in stream %s", fmt.id)
            bad = isinstance(exc, ValueError)
            yield fmt.error(
                str(exc) if bad else f"internal server error: {type(exc).__name__}: {exc}",
                "invalid_request_error" if bad else "server_error")
        if fmt.terminator:
            yield fmt.terminator

    async def models(self, request: Request) -> Response:
        card = p.ModelCard(id=self.model, created=self.created,
                           max_model_len=self.engine.max_model_len)
        return _json(p.ModelList(data=[card]))

    async def model_card(self, request: Request) -> Response:
        """``GET /v1/models/{model_id}``: the served model's card; another id is 404."""
        model_id = request.path_params["model_id"]
        self._check_model(model_id)
        return _json(p.ModelCard(id=self.model, created=self.created,
                                 max_model_len=self.engine.max_model_len))

    async def tokenizer_info(self, request: Request) -> Response:
        """``GET /tokenizer_info`` (vLLM's), what remote-tokenizer clients read first."""
        tok = self.engine.tokenizer

        def token(i: int | None) -> str | None:
            return None if i is None else tok.id_to_token(i)

        return _json(p.TokenizerInfoResponse(
            tokenizer_class="PreTrainedTokenizerFast", name_or_path=self.model,
            bos_token=token(tok.bos_token_id), eos_token=token(tok.eos_token_id), pad_token=None,
            add_bos_token=tok.add_bos_token, add_eos_token=tok.add_eos_token,
            model_max_length=self.engine.max_model_len,
            chat_template=tok.chat_template if tok.has_chat_template else None))

    async def tokenize(self, request: Request) -> Response:
        req = decode.decode_tokenize_request(await self._body(request), self.limits)
        self._check_model(req.model)
        tok = self.engine.tokenizer
        try:
            if req.messages is not None:
                self._check_chat_template()
                text = tok.apply_chat_template(
                    decode.chat_messages(req), add_generation_prompt=req.add_generation_prompt
                )
                special = bool(req.add_special_tokens)
            else:
                assert req.prompt is not None
                text = req.prompt
                special = req.add_special_tokens is not False
            ids = tok.encode(text, add_special_tokens=special)
        except ValueError as exc:
            raise p.RequestError(f"cannot tokenize: {exc}",
                                 param="messages" if req.messages else "prompt") from exc
        return _json(p.TokenizeResponse(tokens=ids, count=len(ids),
                                        max_model_len=self.engine.max_model_len))

    async def detokenize(self, request: Request) -> Response:
        req = decode.decode_detokenize_request(await self._body(request))
        self._check_model(req.model)
        vocab = self.engine.tokenizer.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise p.RequestError(f"tokens[{i}] = {t} is out of range [0, {vocab})",
                                     param="tokens")
        return _json(p.DetokenizeResponse(prompt=self.engine.tokenizer.decode(req.tokens)))


def _with_tools(params: SamplingParams, plan: tools.ToolPlan, constraint_field: str | None
                ) -> tuple[SamplingParams, str | None]:
    """``params`` under a tool plan: a named or required choice constrains the output (refused
    beside another constraint); ``auto`` keeps special tokens in the text, where a model's
    ``<tool_call>`` may be one."""
    constraint = plan.constraint()
    if (constraint is not None or plan.mode == "auto") and constraint_field is not None:
        raise p.RequestError(f"{constraint_field} cannot constrain the output of a request "
                             f"with tool_choice {plan.mode!r}", param=constraint_field)
    if constraint is not None:
        try:
            return dataclasses.replace(params, structured_outputs=constraint), "tools"
        except InvalidRequest as exc:
            raise p.RequestError(str(exc), param="tools") from exc
    if plan.mode == "auto":
        return dataclasses.replace(params, skip_special_tokens=False), constraint_field
    return params, constraint_field


def _too_large(size: int, cap: int) -> p.RequestError:
    return p.RequestError(
        f"the request body holds at least {size} bytes; the limit is {cap} "
        "(--max-request-body-bytes)",
        status=413,
    )


async def _collect(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    async for out in gen:
        if out.finished:
            return out
    raise RuntimeError("the engine stream ended before the request finished")


async def _all[T](aws: list[Awaitable[T]]) -> list[T]:
    """Await ``aws`` together; if one raises (or this is cancelled), cancel the others and wait
    for them (so their engine requests are aborted) before the exception propagates."""
    if len(aws) == 1:
        return [await aws[0]]
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)


async def _interleave(
    gens: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput], budget: RequestBudget
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every prompt's outputs, tagged with the prompt's index: ``firsts`` in order, then each
    next output as it arrives (awaited under ``budget``: TimeoutError once it runs out)."""
    pending: dict[asyncio.Future, int] = {}
    try:
        for i, out in enumerate(firsts):
            yield i, out
            if not out.finished:
                pending[asyncio.ensure_future(anext(gens[i]))] = i
        while pending:
            done, _ = await budget.bound(
                asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    raise RuntimeError("the engine stream ended before the request finished"
                                       ) from None
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(gens[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)


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


class _TimeToReady(Collector):
    """``jaxserve:time_to_ready_seconds``: seconds from start-up to ready
    (``Lifecycle.ready_s``), exported from the moment the server is ready; what a new replica
    costs before it serves."""

    def __init__(self, lifecycle: Lifecycle, served_model_name: str) -> None:
        self.lifecycle = lifecycle
        self.model_name = served_model_name

    def collect(self) -> Iterator[Metric]:
        ready_s = self.lifecycle.ready_s
        if ready_s is None:
            return
        g = GaugeMetricFamily(PREFIX + "time_to_ready_seconds",
                              "Seconds from start-up (the port bound) to ready.",
                              labels=(MODEL_LABEL,))
        g.add_metric((self.model_name,), ready_s)
        yield g


class _Probes:
    """``/health``, ``/ready`` and ``/metrics``: what probes and scrapers read, answered from
    process start (before an engine is attached) to exit.

    ``/metrics`` is the server's own series (``jaxserve:draining``, from ready on
    ``jaxserve:time_to_ready_seconds``, prometheus-client's ``process_*``) followed, once an
    engine is attached, by the engine's (and with ``metrics_compat="vllm"`` their ``vllm:``
    copies, ``jaxserve.engine.metrics.vllm_compat``).
    """

    def __init__(self, gate: Gate, served_model_name: str, compat: str | None) -> None:
        self.gate = gate
        self.lifecycle: Lifecycle = gate.lifecycle
        self.engine: EngineClient | None = None
        self.compat = compat
        self._compat: CollectorRegistry | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        Gauge(PREFIX + "draining", "1 from the moment a SIGTERM starts the drain, else 0.",
              (MODEL_LABEL,), registry=self.registry).labels(served_model_name).set_function(
            lambda: float(gate.draining))
        self.registry.register(_TimeToReady(self.lifecycle, served_model_name))

    def attach(self, engine: EngineClient) -> None:
        m = engine.metrics
        if self.compat == "vllm" and m is not None:
            self._compat = vllm_compat(m.registry)
        self.engine = engine

    async def health(self, request: Request) -> Response:
        if self.engine is not None and not self.engine.alive:
            return _error(500, "the engine thread has died (its error is in the log)",
                          "server_error")
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        st = self.lifecycle.status()
        return Response(msgspec.json.encode(st), status_code=200 if st.stage == "ready" else 503,
                        media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        parts = [generate_latest(self.registry)]
        m = None if self.engine is None else self.engine.metrics
        if m is not None:
            parts.append(m.render())
            if self._compat is not None:
                parts.append(generate_latest(self._compat))
        return Response(b"".join(parts), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(
    engine: EngineClient | None,
    served_model_name: str,
    config: ServerConfig | None = None,
    limits: RequestLimits | None = None,
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
    does both); with an engine it is ready at once.
    """
    config = config or ServerConfig()
    install_request_id()
    placeholder: EngineClient = _NotStarted()  # type: ignore[assignment]
    api = OpenAIServer(placeholder if engine is None else engine, served_model_name, limits,
                       responses.ResponseStore(config.max_stored_responses))
    doc = msgspec.json.encode(openapi_document(api_key=config.api_key is not None))
    gate = Gate(api.engine, config, Lifecycle(ready=engine is not None))
    probes = _Probes(gate, served_model_name, config.metrics_compat)

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
