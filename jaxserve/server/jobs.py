"""A generation request as the engine runs it: what the server needs of the engine
(``EngineClient``), the prepared request (``GenerationJob``: one ``EnginePrompt`` per engine
request) and how its engine outputs are awaited.

A job's prompts are queued together (their first outputs awaited at once, so they share steps);
the first output of each is awaited before any response byte is sent, so the engine's
``InvalidRequest`` (checked before anything is queued) becomes a 400 naming the request field
(``first_output``). If one prompt fails or the caller is cancelled, the others are cancelled,
which closes their engine generators and aborts their requests (``gather_or_cancel``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Protocol

from jaxserve import request_ids
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.errors import InvalidRequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server import protocol as p
from jaxserve.server import response_bodies, tools
from jaxserve.server.responses import handler as responses


class Tokenizer(Protocol):
    """What the server needs of ``jaxserve.tokenizer.Tokenizer``."""

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
    fmt: response_bodies.LogprobFormat


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
      response: a Responses request's part (``server.responses.handler``): its reply is a response
        object or Responses events, not a chat completion; None for the other endpoints.
      prompt_tokens_details: the usage says how many prompt tokens the prefix cache held
        (``--enable-prompt-tokens-details``).
    """

    chat: bool
    prompts: list[EnginePrompt]
    params: SamplingParams
    stream: bool
    include_usage: bool
    constraint_field: str | None = None
    tools: tools.ToolPlan | None = None
    response: responses.ResponseJob | None = None
    prompt_tokens_details: bool = False

    def response_id(self, request_id: str) -> str:
        """The response ``id`` (also the engine request id): ``chatcmpl-<request_id>``,
        ``cmpl-<request_id>``, or for a Responses request ``resp_<32 random hex digits>``:
        stored responses are looked up by id, so it must not repeat when clients reuse an
        ``X-Request-Id`` (which stays the id of the log lines)."""
        if self.response is not None:
            return request_ids.item_id("resp")
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"

    def engine_ids(self, request_id: str) -> list[str]:
        """The engine request id of each prompt (``request_ids.prompt_ids``)."""
        return request_ids.prompt_ids(request_id, len(self.prompts))


async def first_output(gen: AsyncIterator[RequestOutput], job: GenerationJob, index: int
                       ) -> RequestOutput:
    """The first engine output of prompt ``index``; the engine's InvalidRequest (checked
    before anything is queued) becomes a 400 naming the field (and, in a batch, the
    prompt).

    Raises:
      protocol.RequestError: the engine refused the prompt.
      RuntimeError: the engine's stream ended without an output.
    """
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


async def first_outputs(gens: list[AsyncIterator[RequestOutput]], job: GenerationJob
                        ) -> list[RequestOutput]:
    """The first output of every prompt, awaited together (so the prompts are queued at
    once and share steps); if one fails, the others are cancelled (aborted)."""
    return await gather_or_cancel([first_output(g, job, i) for i, g in enumerate(gens)])


async def run_prompt(engine: EngineClient, job: GenerationJob, index: int, engine_id: str
                     ) -> RequestOutput:
    """Prompt ``index`` run to its end: its final output (aborted if cancelled)."""
    q = job.prompts[index]
    gen = engine.generate(q.ids, job.params, engine_id, prompt=q.text)
    finished = False
    try:
        out = await first_output(gen, job, index)
        if not out.finished:
            out = await _collect(gen)
        finished = True
    finally:
        if not finished:
            await gen.aclose()  # type: ignore[attr-defined]
            engine.abort(engine_id)
    return out


async def _collect(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    async for out in gen:
        if out.finished:
            return out
    raise RuntimeError("the engine stream ended before the request finished")


async def gather_or_cancel[T](aws: list[Awaitable[T]]) -> list[T]:
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


