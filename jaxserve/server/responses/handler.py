"""The OpenAI Responses API (``POST /v1/responses``) on top of the chat-completions path.

One request's path:
  body ─``decode_request``: strict decode; fields not built refused (400 naming them)─>
  ``ResponsesRequest`` ─``to_chat_request``: the conversation (the stored items of
  ``previous_response_id``'s response, then ``input``) becomes chat messages after
  ``instructions`` as a system message; flat function tools, ``tool_choice``, ``text.format``
  and ``max_output_tokens`` become chat's ``tools``, ``tool_choice``, ``response_format`` and
  ``max_tokens``─> ``ChatCompletionRequest``, which the server prepares as any chat request
  (chat template, tool plan, structured output); errors on that path name chat's fields, and
  ``request_error`` renames them (``messages`` -> ``input``, ...).
The reply's text goes through a ``responses.output.ResponseBuilder`` (through
``tools.ToolCallParser`` under a tool plan), which makes the output items and, for a stream, the
events; a non-streamed reply is built by the same code from the whole text, so both agree.
A finished response with ``store`` goes to the ``ResponseStore`` (the last N, oldest dropped
first) with its conversation, for ``previous_response_id`` and ``GET /v1/responses/{id}``.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from jaxserve.server import protocol as p
from jaxserve.server import request_parsing
from jaxserve.server.responses.output import ResponseBuilder
from jaxserve.server.responses.protocol import (
    FunctionChoice,
    InputContentPart,
    InputItem,
    OutputItem,
    OutputMessage,
    ResponseObject,
    ResponsesRequest,
    TextConfig,
    TextFormat,
)
from jaxserve.server.tools import ToolPlan, tool_call_format
from jaxserve.server_config import RequestLimits

_decoder = msgspec.json.Decoder(ResponsesRequest)
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# chat's field names in errors of the shared path -> the Responses request's
_FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
                "response_format": "text.format"}


_UNKNOWN = re.compile(r"unknown field `([^`]*)`(?: - at `([^`]*)`)?")


def _unsupported(message: str, param: str) -> p.RequestError:
    return p.RequestError(message, param=param, code=request_parsing.UNSUPPORTED)


def decode_request(body: bytes) -> ResponsesRequest:
    """Decode a ``/v1/responses`` body and refuse the fields that would change the reply and
    are not built; raises RequestError naming the field."""
    try:
        req = request_parsing.decode_body(_decoder, body)
    except p.RequestError as exc:
        unknown = _UNKNOWN.search(exc.message)
        if unknown is None:
            raise
        at, name = unknown.group(2), unknown.group(1)
        param = f"{at.removeprefix('$.')}.{name}" if at and at != "$" else name
        raise p.RequestError(f"unknown parameter: {param}", param=param,
                             code="unknown_parameter") from None
    r = req.reasoning
    reasoning = r is not None and not (isinstance(r, dict) and all(v is None for v in r.values()))
    verbosity = req.text is not None and req.text.verbosity not in (None, "medium")
    refused = {  # field: (set, why)
        "background": (req.background is True, "background responses are not supported"),
        "conversation": (req.conversation is not None,
                         "conversations are not supported; chain with previous_response_id"),
        "prompt": (req.prompt is not None, "prompt templates are not supported; send input"),
        "reasoning": (reasoning, "reasoning settings cannot be honoured by this model"),
        "include": (bool(req.include), f"include {req.include!r} is not supported"),
        "top_logprobs": (bool(req.top_logprobs),
                         "top_logprobs is not supported here (/v1/chat/completions has them)"),
        "max_tool_calls": (req.max_tool_calls is not None, "max_tool_calls is not supported"),
        "context_management": (req.context_management is not None,
                               "context_management is not supported"),
        "moderation": (req.moderation is not None, "moderation is not supported"),
        "truncation": (req.truncation == "auto",
                       "truncation 'auto' is not supported; send 'disabled'"),
        "text.verbosity": (verbosity, "text.verbosity other than 'medium' cannot be honoured"),
    }
    for name, (used, message) in refused.items():
        if used:
            raise _unsupported(message, name)
    return req


def request_error(exc: p.RequestError) -> p.RequestError:
    """``exc`` with chat's field name (``messages``, ``max_tokens``, ``response_format``)
    replaced by the Responses request's, in ``param`` and in the message."""
    new = _FIELD_NAMES.get(exc.param or "")
    if new is None or exc.code == "unknown_parameter":  # the client's own name
        return exc
    return p.RequestError(exc.message.replace(exc.param, new, 1), status=exc.status,
                          type=exc.type, param=new, code=exc.code)


# ---- the request as a chat request ------------------------------------------------------------


def _text(content: str | list[InputContentPart] | None, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise p.RequestError(f"{where} is required", param="input")
    texts = []
    for part in content:
        if part.type not in _TEXT_PARTS:
            raise _unsupported(f"{where}: content parts of type {part.type!r} are not "
                               "supported (input_text and output_text only)", "input")
        if part.text is None:
            raise p.RequestError(f"{where}: a {part.type} part needs a 'text' string",
                                 param="input")
        texts.append(part.text)
    return "\n".join(texts)


def _messages(items: list[InputItem], num_stored: int) -> list[p.ChatMessage]:
    """Chat messages of a conversation's items (the first ``num_stored`` come from the store):
    a ``function_call`` joins the assistant message before it (or starts one), a
    ``function_call_output`` is a ``tool`` message answering an earlier call."""
    out: list[p.ChatMessage] = []
    call_ids: set[str] = set()
    for k, item in enumerate(items):
        where = f"input[{k - num_stored}]" if k >= num_stored else f"stored item {k}"
        kind = item.type or "message"
        if kind == "message":
            if item.role not in _ROLES:
                raise p.RequestError(f"{where}.role must be one of {', '.join(_ROLES)}, got "
                                     f"{item.role!r}", param="input")
            out.append(p.ChatMessage(role=item.role,  # type: ignore[arg-type]
                                     content=_text(item.content, f"{where}.content")))
        elif kind == "function_call":
            missing = [f for f in ("call_id", "name", "arguments") if getattr(item, f) is None]
            if missing:
                raise p.RequestError(f"{where}: a function_call needs {', '.join(missing)}",
                                     param="input")
            assert item.call_id is not None and item.name is not None
            call = p.ToolCall(id=item.call_id, function=p.FunctionCall(
                name=item.name, arguments=item.arguments or ""))
            call_ids.add(item.call_id)
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or ()), call]
            else:
                out.append(p.ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            if item.call_id not in call_ids:
                raise p.RequestError(f"{where}: no function_call with call_id {item.call_id!r} "
                                     "comes before this function_call_output", param="input")
            out.append(p.ChatMessage(role="tool", tool_call_id=item.call_id,
                                     content=_text(item.output, f"{where}.output")))
        else:
            raise _unsupported(f"{where}: items of type {kind!r} are not supported (message, "
                               "function_call, function_call_output)", "input")
    return out


def _tools(req: ResponsesRequest) -> list[p.ChatTool] | None:
    """Flat function tools as chat's; ``strict`` defaults to true (the Responses API's)."""
    if req.tools is None:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise _unsupported(f"tools[{i}]: tools of type {t.type!r} are not supported; only "
                               "function tools (which the client runs)", "tools")
        if not t.name:
            raise p.RequestError(f"tools[{i}].name is required", param="tools")
        out.append(p.ChatTool(type="function", function=p.FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters,
            strict=t.strict is not False)))
    return out


def _tool_choice(req: ResponsesRequest, chat_template: str | None
                 ) -> p.NamedToolChoice | str | None:
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        if choice.type != "function":
            raise _unsupported(f"tool_choice of type {choice.type!r} is not supported (none, "
                               "auto, required or {'type': 'function', 'name': ...})",
                               "tool_choice")
        if not choice.name:
            raise p.RequestError("tool_choice.name is required", param="tool_choice")
        return p.NamedToolChoice(type="function",
                                 function=p.ToolChoiceFunction(name=choice.name))
    if req.tools and choice in (None, "auto") and tool_call_format(chat_template) is None:
        raise p.RequestError(
            "tool_choice 'auto' (the default with tools) needs a chat template that renders "
            "tools and writes Hermes-style <tool_call> blocks; this model's template does "
            "not: send tool_choice 'required' or {'type': 'function', 'name': ...}, which "
            "work with any model", param="tool_choice")
    if not req.tools and choice == "auto":  # what a response echoes when it had no tools
        return None
    return choice


def _response_format(fmt: TextFormat | None) -> p.ResponseFormat | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return p.ResponseFormat(type="json_object")
    if fmt.schema is None:
        raise p.RequestError("text.format of type json_schema needs schema (a JSON Schema "
                             "object)", param="text.format")
    return p.ResponseFormat(type="json_schema", json_schema=p.JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict))


def to_chat_request(req: ResponsesRequest, history: list[InputItem], chat_template: str | None,
                    limits: RequestLimits) -> tuple[p.ChatCompletionRequest, list[InputItem]]:
    """The chat request that generates ``req``'s reply, and the conversation's items
    (``history``, then ``input``; ``instructions`` are not among them: they apply to this
    response only, as OpenAI's do).

    Raises:
      RequestError: a bad input item (naming ``input``), a tool or choice that is not a
        function, ``auto`` without a template that can call, a ``json_schema`` without
        ``schema``, or a chat check (caps, fields), naming chat's field (``request_error``).
    """
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else (
        list(req.input))
    if not items:
        raise p.RequestError("input must hold at least one item", param="input")
    items = history + items
    messages = _messages(items, len(history))
    if req.instructions is not None:
        messages.insert(0, p.ChatMessage(role="system", content=req.instructions))
    chat = p.ChatCompletionRequest(
        model=req.model, messages=messages, tools=_tools(req),
        tool_choice=_tool_choice(req, chat_template),  # type: ignore[arg-type]
        parallel_tool_calls=req.parallel_tool_calls, max_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, stream=bool(req.stream),
        response_format=_response_format(req.text.format if req.text else None))
    return request_parsing.check_chat_request(chat, limits), items


# ---- the store --------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    """A finished response and its conversation: the items it continued (history and input)
    and its output, as input items (what ``previous_response_id`` prepends)."""

    response: ResponseObject
    items: list[InputItem]


class ResponseStore:
    """The last ``capacity`` finished responses with ``store``, by id, in memory (the oldest
    is dropped first; 0 keeps none). Used on the event loop only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def keeps(self, req: ResponsesRequest) -> bool:
        """Whether ``req``'s response is to be stored (``store`` absent: when there is room).

        Raises:
          RequestError: ``store: true`` while the server keeps none, naming ``store``.
        """
        if req.store is True and self.capacity == 0:
            raise _unsupported("store is true, but this server keeps no responses "
                               "(--max-stored-responses 0)", "store")
        return req.store is not False and self.capacity > 0

    def history(self, response_id: str | None) -> list[InputItem]:
        """The conversation ``previous_response_id`` continues ([] for None).

        Raises:
          RequestError: 404 naming ``previous_response_id`` for an id not (or no longer)
            stored.
        """
        if response_id is None:
            return []
        entry = self._entries.get(response_id)
        if entry is None:
            raise p.RequestError(
                f"previous response {response_id!r} is not stored here (the server keeps the "
                f"last {self.capacity} responses: --max-stored-responses)", status=404,
                param="previous_response_id", code="previous_response_not_found")
        return entry.items

    def put(self, response: ResponseObject, items: list[InputItem]) -> None:
        """Keep a finished response with its conversation as input items (history, input,
        output); the oldest is dropped past ``capacity``."""
        self._entries[response.id] = StoredResponse(response, items)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response of that id, or None."""
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Drop a stored response; False if it was not stored."""
        return self._entries.pop(response_id, None) is not None


def _as_input(item: OutputItem) -> InputItem:
    if isinstance(item, OutputMessage):
        return InputItem(type="message", role="assistant", content=[
            InputContentPart(type="output_text", text=c.text) for c in item.content])
    return InputItem(type="function_call", call_id=item.call_id, name=item.name,
                     arguments=item.arguments)


# ---- the response -----------------------------------------------------------------------------


@dataclass
class ResponseJob:
    """What a Responses request adds to its chat job.

    Fields:
      request: the request (its settings are echoed in the response).
      items: its conversation without instructions: stored history, then input.
      store: where the finished response is kept, or None (``store`` false).
    """

    request: ResponsesRequest
    items: list[InputItem]
    store: ResponseStore | None

    def builder(self, response_id: str, created: int, model: str, plan: ToolPlan | None
                ) -> ResponseBuilder:
        """A builder for this request's response (status "in_progress", no output yet)."""
        req = self.request
        draft = ResponseObject(
            id=response_id, created_at=created, status="in_progress", model=model, output=[],
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id, store=self.store is not None,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            text=TextConfig(format=(req.text.format if req.text else None) or
                            TextFormat(type="text")),
            tool_choice=req.tool_choice or "auto",
            tools=[msgspec.structs.replace(t, strict=t.strict is not False)
                   for t in req.tools or ()],
            user=req.user, metadata=req.metadata)
        return ResponseBuilder(draft, plan, self._finished)

    def _finished(self, response: ResponseObject) -> None:
        if self.store is not None:
            self.store.put(response, self.items + [_as_input(i) for i in response.output])
