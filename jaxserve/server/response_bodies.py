"""Engine outputs to response bodies: usage, logprobs in the completions and chat shapes, the
final (non-streamed) response, and the SSE chunks of a stream.

A completions request may hold several prompts (a batch), each run as its own engine request
with ``n`` choices; prompt ``i``'s choice ``j`` is the response's choice ``i * n + j`` (OpenAI's
and vLLM's numbering: prompt-major, then by ``n``), and the usage sums every prompt."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import msgspec
from msgspec import UNSET

from jaxserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from jaxserve.server.output_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
    usage,
)
from jaxserve.server.protocol import error_body
from jaxserve.server.tools import ToolCallParser, ToolPlan, final_message

# ---- building responses from engine outputs ---------------------------------------------------


def usage_of(outs: Sequence[RequestOutput], prompt_only: bool = False,
             prompt_tokens_details: bool = False) -> UsageInfo:
    """Usage of a request's prompts: each prompt's tokens once, generated tokens summed over
    every choice (none for a request that only scores its prompts); with
    ``prompt_tokens_details``, the prompt tokens the prefix cache held, summed over prompts."""
    generated = 0 if prompt_only else sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outs) if prompt_tokens_details else None
    return usage(sum(len(o.prompt_token_ids) for o in outs), generated, cached)


LOGPROB_FLOOR = -9999.0
"""What a logprob of -inf (or NaN) is reported as, so that bodies stay strict JSON."""


def _lp(x: float) -> float:
    return min(x, 0.0) if math.isfinite(x) else LOGPROB_FLOOR


class LogprobFormat:
    """How one prompt's logprobs are rendered.

    Args:
      num_top: alternatives per token (the request's ``logprobs`` / ``top_logprobs``), or None
        when the request did not ask for logprobs.
      token_bytes: a token id's exact bytes in the output (``Tokenizer.token_bytes`` with the
        request's ``skip_special_tokens``).
      echo: completions ``echo``: the prompt (``echo_text``) leads each choice's text, and with
        logprobs its tokens lead the logprobs (the first with logprob None).
      prompt_only: ``echo`` with ``max_tokens`` 0 (scoring): the engine ran one step for the
        prompt's logprobs; its generated token is dropped from text, logprobs and usage, and
        each choice finishes with "length".
    Token strings are the bytes decoded as UTF-8, with U+FFFD standing for the part of a
    multi-byte character; chat entries carry the exact ``bytes``.
    """

    def __init__(self, num_top: int | None, token_bytes: Callable[[int], bytes],
                 echo: bool = False, echo_text: str = "", prompt_only: bool = False) -> None:
        self.num_top = num_top
        self.token_bytes = token_bytes
        self.echo = echo
        self.echo_text = echo_text
        self.prompt_only = prompt_only

    def _text(self, t: int) -> str:
        return self.token_bytes(t).decode("utf-8", "replace")

    def _top(self, entry: TokenLogprobs) -> list[tuple[int, float]]:
        return [(t, lp.logprob) for t, lp in list(entry.items())[: self.num_top]]

    def chat(self, ids: list[int], entries: list[TokenLogprobs]) -> ChatLogprobs | None:
        """Chat logprobs of ``ids`` (each with its entry), or None without logprobs."""
        if self.num_top is None:
            return None
        content = []
        for t, e in zip(ids, entries):
            top = [TopLogprob(token=self._text(a), logprob=_lp(v), bytes=list(self.token_bytes(a)))
                   for a, v in self._top(e)]
            content.append(ChatTokenLogprob(token=self._text(t), logprob=_lp(e[t].logprob),
                                            bytes=list(self.token_bytes(t)), top_logprobs=top))
        return ChatLogprobs(content=content)

    def completion(self, ids: list[int], entries: list[TokenLogprobs | None], offset: int = 0
                   ) -> CompletionLogprobs | None:
        """Completions logprobs of ``ids``; ``offset`` is the text offset of the first."""
        if self.num_top is None:
            return None
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for t, e in zip(ids, entries):
            text = self._text(t)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if e is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(_lp(e[t].logprob))
                top: dict[str, float] = {}
                for a, v in self._top(e):
                    top.setdefault(self._text(a), _lp(v))
                out.top_logprobs.append(top)
        return out

    def prompt(self, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        """The echoed prompt text and its logprobs (``("", None)`` without echo)."""
        if not self.echo:
            return "", None
        plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return self.echo_text, self.completion(out.prompt_token_ids, plp)


def _join(a: CompletionLogprobs | None, b: CompletionLogprobs | None) -> CompletionLogprobs | None:
    if a is None or b is None:
        return a or b
    shift = (a.text_offset[-1] + len(a.tokens[-1])) if a.tokens else 0
    return CompletionLogprobs(text_offset=a.text_offset + [o + shift for o in b.text_offset],
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)


def final_response(
    chat: bool, response_id: str, created: int, model: str, outs: Sequence[RequestOutput],
    fmts: Sequence[LogprobFormat] = (), tools: ToolPlan | None = None,
    prompt_tokens_details: bool = False,
) -> CompletionResponse | ChatCompletionResponse:
    """The non-streamed response body: ``outs[i]`` is prompt ``i``'s finished output (chat: one
    prompt), rendered with ``fmts[i]`` (default: no logprobs); choices numbered as the module
    says. ``tools``: a chat request's tool plan, which turns replies into tool calls.
    ``prompt_tokens_details``: as ``usage_of``."""
    fmts = list(fmts) or [LogprobFormat(None, lambda t: b"")] * len(outs)
    if chat:
        (out,), (fmt,) = outs, fmts
        choices = []
        for c in out.outputs:
            content, calls, reason = final_message(tools, c.text, c.finish_reason)
            message = ChatMessageOut(content=content, tool_calls=calls or UNSET)
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=fmt.chat(c.token_ids, c.logprobs or []),
                                      finish_reason=reason))
        return ChatCompletionResponse(id=response_id, created=created, model=model,
                                      usage=usage_of(outs, False, prompt_tokens_details),
                                      choices=choices)
    completion_choices = []
    for i, (out, fmt) in enumerate(zip(outs, fmts, strict=True)):
        n = len(out.outputs)
        prompt_text, prompt_lp = fmt.prompt(out)
        for c in out.outputs:
            if fmt.prompt_only:
                text, lp, reason = prompt_text, prompt_lp, "length"
            else:
                text, reason = prompt_text + c.text, c.finish_reason
                lp = _join(prompt_lp, fmt.completion(c.token_ids, c.logprobs or []))
            completion_choices.append(CompletionChoice(index=i * n + c.index, text=text,
                                                       logprobs=lp, finish_reason=reason))
    prompt_only = bool(fmts) and fmts[0].prompt_only
    return CompletionResponse(id=response_id, created=created, model=model,
                              usage=usage_of(outs, prompt_only, prompt_tokens_details),
                              choices=completion_choices)


def sse_event(obj: msgspec.Struct) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class StreamFormatter:
    """Turns one request's outputs into SSE chunks, for completions or chat.

    Each chunk carries one choice, with its ``index`` (for a batch of prompts, numbered as the
    module says; the prompts' chunks interleave as their outputs arrive). Completions: one chunk
    per non-empty text delta of a choice (under echo, the prompt and its logprobs first; when
    only scoring, then one empty chunk with finish_reason "length"); the last content chunk of a
    choice carries its finish_reason. Chat: a role chunk per choice first, a chunk per content
    delta, then a chunk with an empty delta and the finish_reason. Logprobs ride with the chunk
    of the tokens they belong to (a stop token's entry with the last chunk of its choice). With
    include_usage every chunk has ``usage: null`` and ``end`` adds one chunk with
    ``choices: []`` and the usage of every prompt; without it no chunk has a ``usage`` key.

    Under a tool plan (chat), a choice's text goes through its ``ToolCallParser``: content
    deltas where the reply is text, ``tool_calls`` deltas where it calls (OpenAI's shape: the
    first part of a call carries its id, type and name, then pieces of its arguments).

    Args:
      n: choices per prompt.
      fmts: how each prompt's logprobs are rendered (default: one prompt, no logprobs).
      tools: the chat request's tool plan, or None.
      prompt_tokens_details: as ``usage_of``.
    """

    terminator = b"data: [DONE]\n\n"  # the last event of every stream

    def __init__(
        self, chat: bool, response_id: str, created: int, model: str, include_usage: bool,
        n: int = 1, fmts: Sequence[LogprobFormat] = (), tools: ToolPlan | None = None,
        prompt_tokens_details: bool = False,
    ) -> None:
        self.chat = chat
        self.prompt_tokens_details = prompt_tokens_details
        self.id = response_id
        self.created = created
        self.model = model
        self.include_usage = include_usage
        self.n = n
        self.fmts = list(fmts) or [LogprobFormat(None, lambda t: b"")]
        self._done: set[int] = set()  # choice indexes that finished
        self._echoed: set[int] = set()  # prompts whose echo was sent
        self._offset: dict[int, int] = {}  # text offset of each choice's next token
        self.tools = tools
        self._parsers: dict[int, ToolCallParser] = {}  # by choice index, under a tool plan

    def _chunk(self, choices: list, usage: UsageInfo | None = None) -> bytes:
        cls = ChatCompletionChunk if self.chat else CompletionChunk
        u = usage if self.include_usage else UNSET
        chunk = cls(id=self.id, created=self.created, model=self.model, choices=choices, usage=u)
        return sse_event(chunk)

    def start(self) -> list[bytes]:
        """Events sent before the first output."""
        if not self.chat:
            return []
        delta = DeltaMessage(role="assistant", content="")
        return [self._chunk([ChatChunkChoice(index=i, delta=delta)]) for i in range(self.n)]

    def on_output(self, out: RequestOutput, prompt_index: int = 0) -> list[bytes]:
        """Events for one engine output of prompt ``prompt_index``."""
        events = []
        fmt, base = self.fmts[prompt_index], prompt_index * self.n
        if not self.chat and fmt.echo and prompt_index not in self._echoed:
            self._echoed.add(prompt_index)
            text, lp = fmt.prompt(out)
            for j in range(self.n):
                events.append(self._chunk([CompletionChoice(index=base + j, text=text,
                                                            logprobs=lp)]))
                self._offset[base + j] = len(text)
        for c in out.outputs:
            if base + c.index not in self._done:
                events += self._choice_events(c, base + c.index, fmt)
        return events

    def _choice_events(self, c: CompletionOutput, index: int, fmt: LogprobFormat
                       ) -> list[bytes]:
        new = c.delta_token_ids
        first = len(c.token_ids) - len(new)
        entries = (c.logprobs or [])[first:first + len(new)]
        finished = c.finish_reason is not None
        if finished:
            self._done.add(index)
        events = []
        if self.chat:
            lp = fmt.chat(new, entries) if new else None
            content, calls, reason = c.delta_text, [], c.finish_reason
            if self.tools is not None:
                parser = self._parsers.setdefault(index, ToolCallParser(self.tools))
                content, calls = parser.feed(c.delta_text)
                if finished:
                    rest, more, reason = parser.finish(c.finish_reason)
                    content, calls = content + rest, calls + more
            if content or calls or lp is not None:
                delta = DeltaMessage(content=content if content or not calls else UNSET,
                                     tool_calls=calls or UNSET)
                events.append(self._chunk([ChatChunkChoice(index=index, delta=delta,
                                                           logprobs=lp)]))
            if finished:
                choice = ChatChunkChoice(index=index, delta=DeltaMessage(),
                                         finish_reason=reason)
                events.append(self._chunk([choice]))
        elif fmt.prompt_only:
            if finished:
                events.append(self._chunk([CompletionChoice(
                    index=index, text="", logprobs=self._no_logprobs(fmt),
                    finish_reason="length")]))
        elif c.delta_text or new or finished:
            lp = fmt.completion(new, entries, self._offset.get(index, 0)) if new else None
            if lp is not None and lp.tokens:
                self._offset[index] = lp.text_offset[-1] + len(lp.tokens[-1])
            if lp is None:
                lp = self._no_logprobs(fmt)
            choice = CompletionChoice(index=index, text=c.delta_text, logprobs=lp,
                                      finish_reason=c.finish_reason)
            events.append(self._chunk([choice]))
        return events

    @staticmethod
    def _no_logprobs(fmt: LogprobFormat) -> CompletionLogprobs | None:
        """The logprobs of a chunk without tokens: empty lists when logprobs were asked for."""
        if fmt.num_top is None:
            return None
        return CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])

    @staticmethod
    def error(message: str, type: str) -> bytes:
        """The event of a stream that fails after it started: ``data: {"error": {...}}``."""
        return b"data: " + error_body(message, type) + b"\n\n"

    def end(self, outs: Sequence[RequestOutput]) -> list[bytes]:
        """Events after the finish chunks (the usage chunk), before ``[DONE]``; ``outs``: each
        prompt's last output."""
        if not self.include_usage:
            return []
        return [self._chunk([], usage_of(outs, self.fmts[0].prompt_only,
                                         self.prompt_tokens_details))]
