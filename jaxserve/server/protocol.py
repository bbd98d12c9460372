"""OpenAI-compatible request and response bodies, as msgspec Structs.

Requests are decoded strictly from bytes (no type coercion: ``"ten"`` is not an int, ``true`` is
not a number); unknown fields are ignored, as OpenAI clients send fields we do not know. Fields we
know but do not implement (tools, ``response_format``, ``guided_*``, beam search, ...) are rejected
when set to a non-default value rather than silently ignored. The configured caps
(``RequestLimits``: the largest ``n``, the most messages) are checked right after decoding, before
any other check and before anything is tokenised. Every client mistake becomes a
``RequestError``, which the server turns into an OpenAI-style error body with a 4xx status.

Responses are Structs encoded with ``msgspec.json.encode``; fields left ``UNSET`` are omitted
(a chat finish chunk's ``delta`` encodes as ``{}``, and ``usage`` is absent from stream chunks
unless ``stream_options.include_usage`` asked for it).
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from jaxserve.config import RequestLimits
from jaxserve.errors import InvalidRequest
from jaxserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from jaxserve.sampling_params import SamplingParams


class RequestError(Exception):
    """A client error, rendered as ``{"error": {...}}`` with ``status``.

    Args:
      message: human-readable cause, naming the field and value where there is one.
      status: HTTP status (400 by default; 404 for unknown models and routes).
      type: OpenAI error type ("invalid_request_error", "not_found_error", ...).
      param: the offending request field, or None.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param


# ---- errors ---------------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo


def error_body(message: str, type: str, status: int, param: str | None = None) -> bytes:
    """An OpenAI-style error body as JSON bytes."""
    return msgspec.json.encode(
        ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=status))
    )


# ---- requests -------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints (vLLM's extra sampling fields included)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # null means the default for these (OpenAI clients send explicit nulls): see _fill_nulls
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    # features not built: accepted by the decoder only to be rejected with a 400 naming them
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    best_of: int | None = None
    suffix: str | None = None
    min_tokens: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/completions``. ``prompt`` holds one prompt: a string, a list of token
    ids, or a list holding exactly one of those."""

    prompt: str | list[int | str | list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    top_logprobs: int | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(msgspec.Struct, kw_only=True):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/chat/completions``; ``max_completion_tokens`` overrides ``max_tokens``;
    both absent means "up to the context window"."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = True
    logprobs: bool | None = None
    top_logprobs: int | None = None
    echo: bool | None = None
    # chat features not built, refused with a 400 naming them (see decode_chat_request)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None


_AT_FIELD = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)


_NULL_DEFAULTS = {"ignore_eos": False, "include_stop_str_in_output": False,
                  "skip_special_tokens": True, "stream": False, "n": 1, "echo": False,
                  "add_generation_prompt": True}


def _fill_nulls[T](req: T) -> T:
    for name, default in _NULL_DEFAULTS.items():
        if getattr(req, name, default) is None:
            setattr(req, name, default)
    return req


def _decode[T](decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    try:
        return _fill_nulls(decoder.decode(body))
    except RecursionError:
        raise RequestError("invalid JSON body: nested too deeply") from None
    except msgspec.DecodeError as exc:
        if isinstance(exc, msgspec.ValidationError):
            m = _AT_FIELD.search(str(exc))
            raise RequestError(f"invalid request: {exc}", param=m.group(1) if m else None)
        raise RequestError(f"invalid JSON body: {exc}")


_DEFAULT_LIMITS = RequestLimits()


def _check_limits(req: _SamplingFields | TokenizeRequest, limits: RequestLimits) -> None:
    """The configured caps, checked before any other check and before anything is tokenised."""
    n = getattr(req, "n", 1)
    if n > limits.max_n:
        raise RequestError(f"n must be at most {limits.max_n} (--max-n), got {n}", param="n")
    messages = getattr(req, "messages", None) or []
    if len(messages) > limits.max_num_messages:
        raise RequestError(
            f"messages holds {len(messages)} messages; the limit is {limits.max_num_messages} "
            "(--max-num-messages)",
            param="messages",
        )


def decode_completion_request(
    body: bytes, limits: RequestLimits = _DEFAULT_LIMITS
) -> CompletionRequest:
    """Decode and check a completions body against ``limits``; raises RequestError."""
    req = _decode(_completion_decoder, body)
    _check_limits(req, limits)
    if req.top_logprobs is not None:
        raise RequestError("top_logprobs is a chat field; completions take logprobs=<int>",
                           param="top_logprobs")
    _check_common(req)
    return req


def decode_chat_request(
    body: bytes, limits: RequestLimits = _DEFAULT_LIMITS
) -> ChatCompletionRequest:
    """Decode and check a chat-completions body against ``limits``; raises RequestError."""
    req = _decode(_chat_decoder, body)
    _check_limits(req, limits)
    unsupported_chat = {
        "audio": req.audio is not None,
        "modalities": req.modalities not in (None, ["text"]),
        "prediction": req.prediction is not None,
        "web_search_options": req.web_search_options is not None,
    }
    for name, used in unsupported_chat.items():
        if used:
            raise RequestError(f"{name} is not supported", param=name)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
    if req.echo:
        raise RequestError("echo is not supported yet", param="echo")
    if not req.messages:
        raise RequestError("messages must hold at least one message", param="messages")
    _check_common(req)
    return req


def _check_common(req: _SamplingFields) -> None:
    if req.n < 1:
        raise RequestError(f"n must be at least 1, got {req.n}", param="n")
    rf = req.response_format
    unsupported = {
        "response_format": rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"),
        "tools": bool(req.tools),
        "tool_choice": req.tool_choice not in (None, "none"),
        "functions": bool(req.functions),
        "function_call": req.function_call not in (None, "none"),
        "best_of": req.best_of not in (None, 1),
        "suffix": bool(req.suffix),
        "min_tokens": req.min_tokens not in (None, 0),
        "use_beam_search": bool(req.use_beam_search),
        "length_penalty": req.length_penalty not in (None, 1.0),
        # the HTTP form of prompt logprobs is echo=true with logprobs (completions)
        "prompt_logprobs": req.prompt_logprobs is not None,
        "guided_json": req.guided_json is not None,
        "guided_regex": req.guided_regex is not None,
        "guided_choice": req.guided_choice is not None,
        "guided_grammar": req.guided_grammar is not None,
    }
    for name, used in unsupported.items():
        if used:
            raise RequestError(f"{name} is not supported", param=name)
    if req.stream_options is not None and not req.stream:
        raise RequestError(
            "stream_options is only allowed with stream=true", param="stream_options"
        )


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``POST /tokenize`` (as vLLM's): ``prompt`` or ``messages`` (with the chat
    template), not both. ``add_special_tokens`` defaults to true for a prompt and false for
    messages (the template holds them), as the generation endpoints encode them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None


class TokenizeResponse(msgspec.Struct, kw_only=True):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def decode_tokenize_request(
    body: bytes, limits: RequestLimits = _DEFAULT_LIMITS
) -> TokenizeRequest:
    """Decode a /tokenize body; exactly one of prompt / messages; raises RequestError."""
    req = _decode(_tokenize_decoder, body)
    _check_limits(req, limits)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("exactly one of prompt and messages is required", param="prompt")
    if req.messages is not None and not req.messages:
        raise RequestError("messages must hold at least one message", param="messages")
    return req


def decode_detokenize_request(body: bytes) -> DetokenizeRequest:
    """Decode a /detokenize body; raises RequestError."""
    return _decode(_detokenize_decoder, body)


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completions request: text or token ids; raises RequestError."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if p and all(isinstance(t, int) for t in p):
        return p  # type: ignore[return-value]
    if len(p) == 1 and isinstance(p[0], (str, list)):
        return p[0]
    if not p:
        raise RequestError("prompt must not be empty", param="prompt")
    raise RequestError(
        "prompt must be a string, a list of token ids, or a list holding exactly one of those "
        "(batched prompts are not supported yet)",
        param="prompt",
    )


def chat_messages(req: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, str]]:
    """The messages as plain dicts for the chat template; text content parts are joined."""
    out: list[dict[str, str]] = []
    for i, m in enumerate(req.messages or []):
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text":
                    raise RequestError(
                        f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                        param="messages",
                    )
                if part.text is None:
                    raise RequestError(
                        f"messages[{i}]: a text content part needs a 'text' string",
                        param="messages",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        elif m.content is None and m.role != "assistant":
            raise RequestError(f"messages[{i}].content is required for role {m.role!r}",
                               param="messages")
        else:
            content = m.content or ""
        msg = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def to_sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """The request's SamplingParams; an invalid value raises RequestError naming the field."""
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    stop = req.stop if req.stop is not None else []
    bias = None
    if req.logit_bias:
        # plain ASCII decimal keys only: int() would also take " 5", "+5", "5_0" and
        # non-ASCII digits, reading another token id than the client meant
        bad = [k for k in req.logit_bias if not (k.isascii() and k.isdigit())]
        if bad:
            raise RequestError(f"logit_bias keys must be token ids written as decimal digits, "
                               f"got {bad[0]!r}", param="logit_bias")
        bias = {int(k): v for k, v in req.logit_bias.items()}
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo else None
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            n=req.n,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except InvalidRequest as exc:
        # the engine's field name -> the request's (the message starts with the field name)
        param, msg = exc.param, str(exc)
        chat = isinstance(req, ChatCompletionRequest)
        if param in ("logprobs", "prompt_logprobs") and chat:
            rename = "top_logprobs"
        elif param == "prompt_logprobs":
            rename = "logprobs"
        elif param == "max_tokens" and chat and req.max_completion_tokens is not None:
            rename = "max_completion_tokens"
        else:
            rename = param
        if param is not None and rename != param:
            msg = msg.replace(param, rename, 1)
        raise RequestError(msg, param=rename) from exc


def random_id() -> str:
    """A fresh request id (32 hex digits)."""
    return uuid.uuid4().hex


# ---- responses ------------------------------------------------------------------------------


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    """Usage with the total filled in."""
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """Completions logprobs (OpenAI's legacy shape): per token its text, its offset in the
    choice's text, its logprob (None for the first prompt token under echo) and the requested
    most likely alternatives (None where the logprob is None)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(msgspec.Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "jaxserve"
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


# ---- building responses from engine outputs ---------------------------------------------------


def usage_of(out: RequestOutput) -> UsageInfo:
    """Usage of a request: prompt tokens once, generated tokens summed over choices."""
    return usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))


LOGPROB_FLOOR = -9999.0
"""What a logprob of -inf (or NaN) is reported as, so that bodies stay strict JSON."""


def _lp(x: float) -> float:
    return min(x, 0.0) if math.isfinite(x) else LOGPROB_FLOOR


class LogprobFormat:
    """How one request's logprobs are rendered.

    Args:
      num_top: alternatives per token (the request's ``logprobs`` / ``top_logprobs``), or None
        when the request did not ask for logprobs.
      token_bytes: a token id's exact bytes in the output (``Tokenizer.token_bytes`` with the
        request's ``skip_special_tokens``).
      echo: completions ``echo``: the prompt (``echo_text``) leads each choice's text, and with
        logprobs its tokens lead the logprobs (the first with logprob None).
    Token strings are the bytes decoded as UTF-8, with U+FFFD standing for the part of a
    multi-byte character; chat entries carry the exact ``bytes``.
    """

    def __init__(self, num_top: int | None, token_bytes: Callable[[int], bytes],
                 echo: bool = False, echo_text: str = "") -> None:
        self.num_top = num_top
        self.token_bytes = token_bytes
        self.echo = echo
        self.echo_text = echo_text

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
    chat: bool, response_id: str, created: int, model: str, out: RequestOutput,
    fmt: LogprobFormat | None = None,
) -> CompletionResponse | ChatCompletionResponse:
    """The non-streamed response body for a finished request (one choice per output)."""
    fmt = fmt or LogprobFormat(None, lambda t: b"")
    if chat:
        choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text),
                              logprobs=fmt.chat(c.token_ids, c.logprobs or []),
                              finish_reason=c.finish_reason) for c in out.outputs]
        return ChatCompletionResponse(id=response_id, created=created, model=model,
                                      usage=usage_of(out), choices=choices)
    prompt_text, prompt_lp = fmt.prompt(out)
    choices = [CompletionChoice(
        index=c.index, text=prompt_text + c.text, finish_reason=c.finish_reason,
        logprobs=_join(prompt_lp, fmt.completion(c.token_ids, c.logprobs or [])))
        for c in out.outputs]
    return CompletionResponse(id=response_id, created=created, model=model,
                              usage=usage_of(out), choices=choices)


def sse_event(obj: msgspec.Struct) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class StreamFormatter:
    """Turns one request's outputs into SSE chunks, for completions or chat.

    Each chunk carries one choice, with its ``index``. Completions: one chunk per non-empty text
    delta of a choice (under echo, the prompt and its logprobs first); the last content chunk of
    a choice carries its finish_reason. Chat: a role chunk per choice first, a chunk per content
    delta, then a chunk with an empty delta and the finish_reason. Logprobs ride with the chunk
    of the tokens they belong to (a stop token's entry with the last chunk of its choice). With
    include_usage every chunk has ``usage: null`` and ``end`` adds one chunk with
    ``choices: []`` and the usage; without it no chunk has a ``usage`` key.
    """

    def __init__(
        self, chat: bool, response_id: str, created: int, model: str, include_usage: bool,
        n: int = 1, fmt: LogprobFormat | None = None,
    ) -> None:
        self.chat = chat
        self.id = response_id
        self.created = created
        self.model = model
        self.include_usage = include_usage
        self.n = n
        self.fmt = fmt or LogprobFormat(None, lambda t: b"")
        self._done: set[int] = set()
        self._echoed = False
        self._offset: dict[int, int] = {}  # text offset of each choice's next token

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

    def on_output(self, out: RequestOutput) -> list[bytes]:
        """Events for one engine output."""
        events = []
        if not self.chat and self.fmt.echo and not self._echoed:
            self._echoed = True
            text, lp = self.fmt.prompt(out)
            events += [self._chunk([CompletionChoice(index=i, text=text, logprobs=lp)])
                       for i in range(self.n)]
            self._offset = dict.fromkeys(range(self.n), len(text))
        for c in out.outputs:
            if c.index not in self._done:
                events += self._choice_events(c)
        return events

    def _choice_events(self, c: CompletionOutput) -> list[bytes]:
        new = c.delta_token_ids
        first = len(c.token_ids) - len(new)
        entries = (c.logprobs or [])[first:first + len(new)]
        finished = c.finish_reason is not None
        if finished:
            self._done.add(c.index)
        events = []
        if self.chat:
            lp = self.fmt.chat(new, entries) if new else None
            if c.delta_text or lp is not None:
                delta = DeltaMessage(content=c.delta_text)
                events.append(self._chunk([ChatChunkChoice(index=c.index, delta=delta,
                                                           logprobs=lp)]))
            if finished:
                choice = ChatChunkChoice(index=c.index, delta=DeltaMessage(),
                                         finish_reason=c.finish_reason)
                events.append(self._chunk([choice]))
        elif c.delta_text or new or finished:
            lp = self.fmt.completion(new, entries, self._offset.get(c.index, 0)) if new else None
            if lp is not None and lp.tokens:
                self._offset[c.index] = lp.text_offset[-1] + len(lp.tokens[-1])
            if lp is None and self.fmt.num_top is not None:
                lp = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[],
                                        top_logprobs=[])
            choice = CompletionChoice(index=c.index, text=c.delta_text, logprobs=lp,
                                      finish_reason=c.finish_reason)
            events.append(self._chunk([choice]))
        return events

    def end(self, out: RequestOutput) -> list[bytes]:
        """Events after the finish chunks (the usage chunk), before ``[DONE]``."""
        return [self._chunk([], usage_of(out))] if self.include_usage else []
