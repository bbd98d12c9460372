"""OpenAI-compatible request bodies and the error body, as msgspec Structs (the wire format;
what the server sends back: ``server.output_protocol``).

``server.request_parsing`` reads requests into these strictly (no type coercion: ``"ten"`` is not an
int); unknown fields are ignored, known but unimplemented ones (functions, beam search, ...) are
refused when set. Every client mistake is a ``RequestError``, which the server turns into an
OpenAI-style error body with a 4xx status.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from jaxserve import request_ids


class RequestError(Exception):
    """A client error, rendered as ``{"error": {...}}`` with ``status``.

    Args:
      message: human-readable cause, naming the field and value where there is one.
      status: HTTP status (400 by default; 404 for unknown models and routes).
      type: OpenAI error type ("invalid_request_error", "not_found_error", ...).
      param: the offending request field, or None.
      code: OpenAI's machine-readable code ("model_not_found", "context_length_exceeded",
        ...), or None where OpenAI sends none.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code


# ---- errors ---------------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, kw_only=True):
    """The ``error`` object of an OpenAI error body. ``code`` is a string or null, as OpenAI
    sends it (the HTTP status is the response's, not a field)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """An OpenAI-style error body: ``{"error": {...}}``."""

    error: ErrorInfo


def error_body(message: str, type: str, param: str | None = None, code: str | None = None
               ) -> bytes:
    """An OpenAI-style error body as JSON bytes."""
    return msgspec.json.encode(
        ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    )


def request_error_body(exc: RequestError) -> bytes:
    """The error body of a ``RequestError``."""
    return error_body(exc.message, exc.type, exc.param, exc.code)


# ---- requests -------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: ``include_usage`` adds a final chunk with the usage."""

    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: OpenAI's named JSON Schema. ``strict`` true gives every
    object schema that does not set ``additionalProperties`` none (OpenAI's strict mode forbids
    keys beyond ``properties``); the schema is enforced either way."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (one value valid against ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` extra field (``jaxserve.sampling_params.
    StructuredOutputsParams``): exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``. ``disable_fallback`` is accepted (there is one grammar engine, so nothing
    to fall back to); ``structural_tag`` is refused. Unknown keys are a 400 (a misspelt
    constraint must not pass as no constraint)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False
    structural_tag: Any = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints (vLLM's extra sampling fields included)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # null means the default for these (OpenAI clients send explicit nulls): see
    # request_parsing._fill_nulls
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
    min_tokens: int | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share KV blocks
    # structured output (request_parsing.structured_outputs_of): OpenAI's field, vLLM's, and vLLM's
    # older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # features not built: accepted by the decoder only to be rejected with a 400 naming them
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    best_of: int | None = None
    suffix: str | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    prompt_logprobs: int | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a batch (a
    list of strings or of token-id lists; ``request_parsing.completion_prompts`` checks the shape).
    ``max_completion_tokens`` (OpenAI's newer name) is taken as ``max_tokens``; ``max_tokens``
    is UNSET when the body has no such key (default 16)."""

    prompt: str | list[int | str | list[int]]
    max_tokens: int | None | UnsetType = UNSET
    max_completion_tokens: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    top_logprobs: int | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content list; a part other than ``type: "text"`` is a 400."""

    type: str
    text: str | None = None


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionCall(msgspec.Struct, kw_only=True):
    """A function call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    """One tool call of an assistant message (in a response, or sent back in the history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat message: a role and its content (a string or a list of text parts); an
    assistant message may carry ``tool_calls`` (then ``content`` may be null), a ``tool``
    message the ``tool_call_id`` it answers."""

    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A tool's function: its name, what it does, and its arguments' JSON Schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    """The ``function`` of a named ``tool_choice``: the name of one of ``tools``."""

    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming the function that must be called."""

    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/chat/completions``; ``max_completion_tokens`` overrides ``max_tokens``;
    both absent means "up to the context window". ``tools`` / ``tool_choice`` /
    ``parallel_tool_calls``: see ``server.tools``."""

    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
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
    """The token ids of ``/tokenize``, their count and the context window."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    """The text of ``/detokenize``."""

    prompt: str


def random_id() -> str:
    """A fresh request id (``request_ids.random_id``: 32 hex digits)."""
    return request_ids.random_id()


# ---- responses ------------------------------------------------------------------------------
