"""The OpenAI Responses API's wire format (``POST /v1/responses``), as msgspec Structs.

Requests decode strictly into ``ResponsesRequest`` (no type coercion; unknown fields ignored,
known fields that would change the reply and are not built are decoded only to be refused:
``server.responses.handler.decode_request``). An input item is one Struct for every item type (a
message may come without ``type``); ``server.responses.handler`` checks each type's fields. Output
items, the response object and the stream events are what the openai SDK's
``openai.types.responses`` models read (the tests validate them against those models): every
event carries ``type`` and ``sequence_number``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# ---- requests -------------------------------------------------------------------------------


class InputContentPart(msgspec.Struct, kw_only=True):
    """One part of an input message's content: ``input_text`` or ``output_text`` (an assistant
    turn sent back); other types are refused."""

    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One item of ``input``: a message (``type`` "message" or absent: ``role``, ``content``),
    a ``function_call`` the model made (``call_id``, ``name``, ``arguments``) or a
    ``function_call_output`` answering it (``call_id``, ``output``). ``id`` and ``status``
    (present on output items sent back) are accepted and not used."""

    type: str | None = None
    role: str | None = None
    content: str | list[InputContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None
    id: str | None = None
    status: str | None = None


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``,
    ``description``, ``strict``, flat as the Responses API has them)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """``text``: the output's format; ``verbosity`` other than "medium" is refused."""

    format: TextFormat | None = None
    verbosity: str | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    """One entry of ``tools``, flat: ``{"type": "function", "name", "description",
    "parameters", "strict"}``; the built-in tool types (``web_search``, ...) are refused."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming one function: ``{"type": "function", "name"}`` (other types,
    such as ``allowed_tools`` or a built-in tool, are refused)."""

    type: str
    name: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/responses``.

    ``input``: a string (one user message) or a list of items. ``store`` absent means true
    (OpenAI's default) while the server keeps responses (``--max-stored-responses``).
    ``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``, ``service_tier``,
    ``stream_options`` and ``truncation: "disabled"`` are accepted and change nothing. A field
    not listed here (e.g. chat's ``max_tokens`` or ``stop``) is a 400 ``unknown_parameter``, as
    OpenAI answers, rather than ignored.
    """

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # not built: decoded only to be refused with a 400 naming them when set
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    context_management: Any = None
    moderation: Any = None


# ---- the response -----------------------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True):
    """The text of an output message (``annotations`` always empty)."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    """An assistant message of ``output``: one ``output_text`` part."""

    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    """A function call of ``output``: ``arguments`` is JSON text; ``call_id`` is what a
    ``function_call_output`` item answers."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    """``usage.input_tokens_details``: ``cached_tokens``, the prompt tokens whose K/V the prefix
    cache held; no cache writes are reported (0)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    """``usage.output_tokens_details``: the served models do not reason apart (0)."""

    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    """Token counts of a response: the prompt (instructions, history and input through the
    chat template), the generated tokens, and their sum."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = msgspec.field(
        default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(msgspec.Struct, kw_only=True):
    """Why a response is ``incomplete``: "max_output_tokens" (or the context window)."""

    reason: str


class ResponseError(msgspec.Struct, kw_only=True):
    """The ``error`` of a failed response."""

    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The ``response`` object: the body of a non-streamed ``POST /v1/responses`` and of
    ``GET /v1/responses/{id}``, and what the lifecycle events of a stream carry. ``status`` is
    "in_progress" (stream start), "completed", "incomplete" (``incomplete_details``) or
    "failed"; the request's settings are echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float
    top_p: float
    text: TextConfig
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    tools: list[FunctionTool]
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None


class DeletedResponse(msgspec.Struct, kw_only=True):
    """The body of ``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# ---- stream events ------------------------------------------------------------------------------


class LifecycleEvent(msgspec.Struct, kw_only=True):
    """``response.created`` / ``.in_progress`` / ``.completed`` / ``.incomplete``."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(msgspec.Struct, kw_only=True):
    """``response.output_item.added`` / ``.done``."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(msgspec.Struct, kw_only=True):
    """``response.content_part.added`` / ``.done``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(msgspec.Struct, kw_only=True):
    """``response.output_text.delta``: a piece of a message's text."""

    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class TextDoneEvent(msgspec.Struct, kw_only=True):
    """``response.output_text.done``: a message's whole text."""

    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ArgumentsDeltaEvent(msgspec.Struct, kw_only=True):
    """``response.function_call_arguments.delta``: a piece of a call's arguments."""

    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta")
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(msgspec.Struct, kw_only=True):
    """``response.function_call_arguments.done``: a call's whole arguments."""

    type: Literal["response.function_call_arguments.done"] = (
        "response.function_call_arguments.done")
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(msgspec.Struct, kw_only=True):
    """``error``: the stream failed after it started (engine fault, timeout, drain)."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str
    message: str
    param: str | None = None


StreamEvent = (LifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent
               | TextDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent | ErrorEvent)
