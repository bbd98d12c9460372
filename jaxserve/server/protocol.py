"""OpenAI-compatible request and response bodies, as msgspec Structs (the wire format).

``server.request_parsing`` reads requests into these strictly (no type coercion: ``"ten"`` is not an
int); unknown fields are ignored, known but unimplemented ones (functions, beam search, ...) are
refused when set. ``server.response_bodies`` builds the responses; fields left
``UNSET`` are omitted (a chat finish chunk's ``delta`` encodes as ``{}``, and ``usage`` is absent
from stream chunks unless ``stream_options.include_usage`` asked for it). Every client mistake
is a ``RequestError``, which the server turns into an OpenAI-style error body with a 4xx status.
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


class PromptTokenUsageInfo(msgspec.Struct, kw_only=True):
    """``usage.prompt_tokens_details`` (vLLM's, with ``--enable-prompt-tokens-details``): the
    prompt tokens whose K/V came from the prefix cache."""

    cached_tokens: int


class UsageInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Token counts of a response: prompt, completion and their sum; ``prompt_tokens_details``
    only where the server reports it."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokenUsageInfo | None = None


def usage(num_prompt_tokens: int, num_completion_tokens: int,
          num_cached_tokens: int | None = None) -> UsageInfo:
    """Usage with the total filled in, and ``prompt_tokens_details`` when ``num_cached_tokens``
    is given."""
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=None if num_cached_tokens is None else PromptTokenUsageInfo(
            cached_tokens=num_cached_tokens),
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
    """One choice of a completions response."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A non-streamed ``/v1/completions`` response."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE chunk of a streamed ``/v1/completions`` response."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class TopLogprob(msgspec.Struct, kw_only=True):
    """One of the most likely tokens at a position, with its log-probability."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    """A sampled token's log-probability and the top alternatives, in chat form."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    """The ``logprobs`` of a chat choice: one entry per generated token."""

    content: list[ChatTokenLogprob]


class ChatMessageOut(msgspec.Struct, kw_only=True):
    """The assistant message of a chat choice: ``content`` is null when the reply is only tool
    calls; ``tool_calls`` is left out when there are none."""

    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    """One choice of a chat completions response."""

    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    """A non-streamed ``/v1/chat/completions`` response."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(msgspec.Struct, kw_only=True):
    """A function call's part in a stream chunk: the name once, then pieces of arguments."""

    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(msgspec.Struct, kw_only=True):
    """A tool call's part in a stream chunk (OpenAI's shape): ``index`` says which call of the
    choice; the first part carries ``id``, ``type`` and the function's name."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: DeltaFunctionCall


class DeltaMessage(msgspec.Struct, kw_only=True):
    """The new part of the assistant message in a chat stream chunk."""

    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    """One choice of a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE chunk of a streamed ``/v1/chat/completions`` response."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    """One served model: an item of ``/v1/models`` and the body of ``/v1/models/{id}``."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "jaxserve"
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    """The ``/v1/models`` list."""

    object: str = "list"
    data: list[ModelCard]


class TokenizerInfoResponse(msgspec.Struct, kw_only=True):
    """``GET /tokenizer_info`` (vLLM's): the tokenizer's settings under the keys of a Hugging
    Face tokenizer config, which remote-tokenizer clients (lm-evaluation-harness) read; the
    ``/tokenize`` and ``/detokenize`` endpoints do the work. A token the model lacks is null."""

    tokenizer_class: str
    name_or_path: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    add_bos_token: bool
    add_eos_token: bool
    model_max_length: int
    chat_template: str | None
