"""The endpoint functions: ``OpenAIServer``, bound to one engine and one served model name.

A generation request's path through them: the body (at most
``RequestLimits.max_request_body_bytes``, else 413) ─``prepare``: msgspec decode and checks
(protocol.py, request_parsing.py), model check, SamplingParams, token ids (completions: the
prompt's ids or ``tokenizer.encode(prompt)``, for each prompt of a batched prompt; chat: the chat
template, encoded without special tokens)─> ``jobs.GenerationJob`` ─> ``engine.generate(ids,
params, request_id)`` per prompt, all at once (a batch's engine ids are ``<request_id>-<i>``).
Then either
  - stream=false: ``respond`` (GenerationJob -> response body, the path that ``jaxserve
    run-batch`` shares) runs in a task raced against the client's ``http.disconnect``; a
    disconnect cancels the task (closing the engine's generator aborts the request) and the
    reply is 499;
  - stream=true: ``streaming.start_stream``.
``POST /v1/responses`` takes the chat path (``server.responses.handler`` turns the request into a
chat request); its reply is a response object, or Responses API events, built by
``responses.output.ResponseBuilder``. The other endpoints read the model card and the
tokenizer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from jaxserve.errors import InvalidRequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.server import output_protocol as o
from jaxserve.server import protocol as p
from jaxserve.server import request_parsing, response_bodies, tools
from jaxserve.server.gate import RequestBudget
from jaxserve.server.gate import error_response as _error
from jaxserve.server.jobs import (
    EngineClient,
    EnginePrompt,
    GenerationJob,
    gather_or_cancel,
    run_prompt,
)
from jaxserve.server.responses import handler as responses
from jaxserve.server.responses.protocol import DeletedResponse, ResponseObject
from jaxserve.server.streaming import ClientGone, start_stream, unless_disconnected
from jaxserve.server_config import RequestLimits

logger = logging.getLogger(__name__)


def _json(obj: msgspec.Struct, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json", headers=headers)


class OpenAIServer:
    """The endpoints, bound to one engine and one served model name.

    ``prepare`` (body bytes -> GenerationJob) and ``respond`` (GenerationJob -> response body)
    are the request-handling path shared by the HTTP endpoints and ``jaxserve run-batch``
    (``jaxserve.server.batch``); both raise ``protocol.RequestError`` for a client error.
    """

    def __init__(
        self, engine: EngineClient, served_model_name: str, limits: RequestLimits | None = None,
        store: responses.ResponseStore | None = None, prompt_tokens_details: bool = False,
    ) -> None:
        self.engine = engine
        self.model = served_model_name
        self.limits = limits or RequestLimits()
        self.store = store or responses.ResponseStore(0)
        self.prompt_tokens_details = prompt_tokens_details  # usage.prompt_tokens_details
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
            req = request_parsing.decode_completion_request(body, self.limits)
            self._check_model(req.model)
            params = request_parsing.to_sampling_params(req)
            prompts = request_parsing.completion_prompts(req)
            texts = [q for q in prompts if isinstance(q, str)]
            encoded = iter(await asyncio.to_thread(lambda: [tok.encode(t) for t in texts]))
            echo, prompt_only = bool(req.echo), request_parsing.scores_prompt_only(req)
            engine_prompts = []
            for q in prompts:
                ids, text = (next(encoded), q) if isinstance(q, str) else (q, None)
                fmt = self._logprob_format(params, echo, text, ids, prompt_only)
                engine_prompts.append(EnginePrompt(ids, text, fmt))
        else:
            return await self._prepare_chat(request_parsing.decode_chat_request(body, self.limits))
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return GenerationJob(chat, engine_prompts, params, bool(req.stream), include_usage,
                             request_parsing.constraint_field(req),
                             prompt_tokens_details=self.prompt_tokens_details)

    async def _prepare_chat(self, req: p.ChatCompletionRequest) -> GenerationJob:
        """A checked chat request's job: sampling parameters, tool plan and the rendered,
        encoded chat template (raises RequestError as ``prepare``)."""
        tok = self.engine.tokenizer
        self._check_model(req.model)
        self._check_chat_template()
        params = request_parsing.to_sampling_params(req)
        plan = tools.tool_plan(req, tok.chat_template)
        constraint_field = request_parsing.constraint_field(req)
        if plan is not None:
            params, constraint_field = _with_tools(params, plan, constraint_field)
        render = tok.apply_chat_template if plan is None else functools.partial(
            tok.apply_chat_template, template_kwargs={"tools": plan.template_tools()})
        try:
            text = await asyncio.to_thread(render, request_parsing.chat_messages(req),
                                           req.add_generation_prompt)
        except ValueError as exc:
            raise p.RequestError(f"invalid messages: {exc}", param="messages") from exc
        ids = await asyncio.to_thread(tok.encode, text, False)
        engine_prompts = [EnginePrompt(ids, text, self._logprob_format(params))]
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return GenerationJob(True, engine_prompts, params, bool(req.stream), include_usage,
                             constraint_field, plan,
                             prompt_tokens_details=self.prompt_tokens_details)

    async def prepare_response(self, body: bytes) -> GenerationJob:
        """Decode and check a ``/v1/responses`` body, prepend the stored conversation of
        ``previous_response_id``, and prepare it as a chat request (``server.responses.handler``).

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
                        prompt_only: bool = False) -> response_bodies.LogprobFormat:
        tok = self.engine.tokenizer
        skip = params.skip_special_tokens
        if echo and echo_text is None:  # a token-id prompt is echoed as its text
            echo_text = tok.decode(ids or [], skip_special_tokens=skip)
        return response_bodies.LogprobFormat(
            params.logprobs, lambda t: tok.token_bytes(t, skip), echo=echo,
            echo_text=echo_text or "", prompt_only=prompt_only)

    async def respond(
        self, job: GenerationJob, request_id: str
    ) -> o.CompletionResponse | o.ChatCompletionResponse | ResponseObject:
        """Run a non-streamed request through the engine (its prompts at once) and return its
        response body.

        If this coroutine is cancelled (client gone, timeout), every engine request is aborted.

        Raises:
          protocol.RequestError: the engine refused a prompt (empty or too long, token ids or
            stop_token_ids outside the vocabulary); the other prompts are aborted.
          RuntimeError: the engine failed while running it.
        """
        created = int(time.time())
        runs = [run_prompt(self.engine, job, i, rid)
                for i, rid in enumerate(job.engine_ids(request_id))]
        outs = await gather_or_cancel(runs)
        if job.response is not None:
            builder = job.response.builder(request_id, created, self.model, job.tools)
            return builder.complete(outs[0])
        return response_bodies.final_response(job.chat, request_id, created, self.model, outs,
                                              [q.fmt for q in job.prompts], job.tools,
                                              job.prompt_tokens_details)

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
                                 param="stream", code=request_parsing.UNSUPPORTED)
        return _json(entry.response)

    async def _serve(self, request: Request, job: GenerationJob) -> Response:
        rid = job.response_id(request.state.request_id)
        budget: RequestBudget = request.state.budget
        budget.queued = True  # from here the engine's waiting count covers it (see Gate)
        try:
            if not job.stream:
                body = await unless_disconnected(request, budget.bound(self.respond(job, rid)))
                return _json(body)
            return await start_stream(request, self.engine, job, rid, budget, self.model)
        except ClientGone:
            return Response(status_code=499)
        except TimeoutError:
            status, message, err_type = budget.error()
            logger.warning("aborted: %s", message)
            return _error(status, message, err_type)

    async def models(self, request: Request) -> Response:
        card = o.ModelCard(id=self.model, created=self.created,
                           max_model_len=self.engine.max_model_len)
        return _json(o.ModelList(data=[card]))

    async def model_card(self, request: Request) -> Response:
        """``GET /v1/models/{model_id}``: the served model's card; another id is 404."""
        model_id = request.path_params["model_id"]
        self._check_model(model_id)
        return _json(o.ModelCard(id=self.model, created=self.created,
                                 max_model_len=self.engine.max_model_len))

    async def tokenizer_info(self, request: Request) -> Response:
        """``GET /tokenizer_info`` (vLLM's), what remote-tokenizer clients read first."""
        tok = self.engine.tokenizer

        def token(i: int | None) -> str | None:
            return None if i is None else tok.id_to_token(i)

        return _json(o.TokenizerInfoResponse(
            tokenizer_class="PreTrainedTokenizerFast", name_or_path=self.model,
            bos_token=token(tok.bos_token_id), eos_token=token(tok.eos_token_id), pad_token=None,
            add_bos_token=tok.add_bos_token, add_eos_token=tok.add_eos_token,
            model_max_length=self.engine.max_model_len,
            chat_template=tok.chat_template if tok.has_chat_template else None))

    async def tokenize(self, request: Request) -> Response:
        req = request_parsing.decode_tokenize_request(await self._body(request), self.limits)
        self._check_model(req.model)
        tok = self.engine.tokenizer
        try:
            if req.messages is not None:
                self._check_chat_template()
                text = tok.apply_chat_template(
                    request_parsing.chat_messages(req),
                    add_generation_prompt=req.add_generation_prompt,
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
        req = request_parsing.decode_detokenize_request(await self._body(request))
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
