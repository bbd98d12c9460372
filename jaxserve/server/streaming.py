"""Server-sent events: a request's engine outputs as an SSE body, and the client's side of a
running request (a disconnect cancels it).

``start_stream`` awaits every prompt's first output (so engine validation errors, and the
deadline, are still plain error replies before any byte is sent), then hands the engine
generators to a ``ClosingStreamingResponse`` whose body (``sse_events``) interleaves the
prompts' outputs as they arrive, each through a formatter:
  - completions and chat (``response_bodies.StreamFormatter``): events ``data: <json>\\n\\n``,
    ending with ``data: [DONE]\\n\\n``. Completions: one chunk per text delta; the last content
    chunk carries finish_reason; a batch's prompts interleave as their outputs arrive. Chat: a role
    chunk ``{"role": "assistant", "content": ""}``, content deltas, then a chunk with an empty
    delta and the finish_reason. With ``stream_options.include_usage``, every chunk has
    ``usage: null`` and one extra chunk with ``choices: []`` and the usage follows the finish
    chunk; without it no chunk has a ``usage`` key. An engine fault mid-stream sends
    ``data: {"error": {...}}`` then ``data: [DONE]``;
  - ``/v1/responses`` (``responses.output.ResponseBuilder``): Responses API events
    (``event: <type>``, an ``error`` event on a fault, no ``[DONE]``).
On disconnect Starlette cancels the stream; the body iterator is always closed, and the
response then closes the generators of the prompts the engine has not finished, which aborts
their requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxserve.outputs import RequestOutput
from jaxserve.server import response_bodies
from jaxserve.server.gate import RequestBudget
from jaxserve.server.jobs import EngineClient, GenerationJob, first_outputs
from jaxserve.server.responses.output import ResponseBuilder

logger = logging.getLogger(__name__)


class StreamState:
    """Which prompts of a streamed request have finished in the engine (closing the stream
    aborts the others)."""

    def __init__(self) -> None:
        self.finished: set[int] = set()


class ClientGone(Exception):
    """The client disconnected before the response was sent."""


class ClosingStreamingResponse(StreamingResponse):
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


async def unless_disconnected[T](request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``; if the client disconnects first, cancel it and raise ClientGone."""
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
        raise ClientGone()
    return task.result()


async def start_stream(
    request: Request, engine: EngineClient, job: GenerationJob, rid: str,
    budget: RequestBudget, model: str,
) -> Response:
    """Start ``job`` in ``engine`` and answer with its SSE stream (response id ``rid``,
    model name ``model``). Await every prompt's first output (so engine validation errors are
    still 400s), then hand the generators to a streaming response that aborts the requests if
    it ends early.

    Raises:
      protocol.RequestError: the engine refused a prompt (the others are aborted).
      ClientGone: the client left before the first outputs.
      TimeoutError: ``budget`` ran out before the first outputs.
    """
    ids = job.engine_ids(rid)
    gens = [engine.generate(q.ids, job.params, e, prompt=q.text)
            for q, e in zip(job.prompts, ids)]
    state = StreamState()

    async def close_unfinished() -> None:
        for i, (gen, engine_id) in enumerate(zip(gens, ids)):
            if i not in state.finished:
                await gen.aclose()  # type: ignore[attr-defined]
                engine.abort(engine_id)

    handed_over = False
    try:
        firsts = await unless_disconnected(request, budget.bound(first_outputs(gens, job)))
        created = int(time.time())
        fmt: response_bodies.StreamFormatter | ResponseBuilder
        if job.response is not None:
            fmt = job.response.builder(rid, created, model, job.tools)
        else:
            fmt = response_bodies.StreamFormatter(
                job.chat, rid, created, model, job.include_usage, n=job.params.n,
                fmts=[q.fmt for q in job.prompts], tools=job.tools,
                prompt_tokens_details=job.prompt_tokens_details)
        handed_over = True  # the response owns the generators from here
        return ClosingStreamingResponse(
            sse_events(gens, firsts, fmt, state, budget),
            close_unfinished,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    finally:
        if not handed_over:
            await close_unfinished()


async def sse_events(
    gens: list[AsyncIterator[RequestOutput]],
    firsts: list[RequestOutput],
    fmt: response_bodies.StreamFormatter | ResponseBuilder,
    state: StreamState,
    budget: RequestBudget,
) -> AsyncIterator[bytes]:
    """The SSE body; adds each prompt to ``state.finished`` once it finished in the
    engine. A failure after the start is ``fmt.error``'s event, then ``fmt.terminator``."""
    try:
        for event in fmt.start():
            yield event
        last = list(firsts)
        async with contextlib.aclosing(interleave(gens, firsts, budget)) as outputs:
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


async def interleave(
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
