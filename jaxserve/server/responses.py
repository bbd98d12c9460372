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
The reply's text goes through a ``ResponseBuilder`` (through ``tools.ToolCallParser`` under a
tool plan), which makes the output items (a ``message`` with one ``output_text`` part, and
``function_call`` items) and, for a stream, the events; a non-streamed reply is built by the
same code from the whole text, so both agree. A finished response with ``store`` goes to the
``ResponseStore`` (the last N, oldest dropped first) with its conversation, for
``previous_response_id`` and ``GET /v1/responses/{id}``.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from msgspec import UNSET

from jaxserve.config import RequestLimits
from jaxserve.outputs import RequestOutput
from jaxserve.server import decode
from jaxserve.server import protocol as p
from jaxserve.server.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallItem,
    FunctionChoice,
    IncompleteDetails,
    InputContentPart,
    InputItem,
    LifecycleEvent,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextConfig,
    TextDeltaEvent,
    TextDoneEvent,
    TextFormat,
)
from jaxserve.server.tools import ToolCallParser, ToolPlan, tool_call_format

_decoder = msgspec.json.Decoder(ResponsesRequest)
_encoder = msgspec.json.Encoder()
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# chat's field names in errors of the shared path -> the Responses request's
_FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
                "response_format": "text.format"}


def _unsupported(message: str, param: str) -> p.RequestError:
    return p.RequestError(message, param=param, code=decode.UNSUPPORTED)


def decode_request(body: bytes) -> ResponsesRequest:
    """Decode a ``/v1/responses`` body and refuse the fields that would change the reply and
    are not built; raises RequestError naming the field."""
    req = decode.decode_body(_decoder, body)
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
    if new is None:
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
    return decode.check_chat_request(chat, limits), items


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
        self._entries[response.id] = StoredResponse(response, items)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
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


def _usage(out: RequestOutput) -> ResponseUsage:
    num_in = len(out.prompt_token_ids)
    num_out = sum(len(c.token_ids) for c in out.outputs)
    return ResponseUsage(input_tokens=num_in, output_tokens=num_out,
                         total_tokens=num_in + num_out)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response's output, built from the reply's text as it arrives (``on_output`` per
    engine output, for a stream) or at once (``complete``).

    Items open and close one after another, each being the last of ``response.output``: text
    opens a ``message`` (whitespace before anything else is held back, and dropped when the
    reply turns out to be only calls, as chat's ``content`` is null then); a call's first part
    closes the open item and opens a ``function_call``. At the finish the open item closes
    ("incomplete" when cut by length), a reply with no item gets an empty message, and the
    response becomes "completed" or "incomplete" and is handed to ``on_done``. Stream events
    come in the Responses API's order: ``response.created``, ``response.in_progress``, per
    item ``output_item.added`` (a message then ``content_part.added``, text deltas,
    ``output_text.done``, ``content_part.done``; a call ``function_call_arguments.delta``s and
    ``.done``), ``output_item.done``, and last ``response.completed`` / ``.incomplete``, each
    as ``event: <type>`` and ``data: <json>`` with its ``sequence_number``.
    """

    terminator = b""  # the Responses API ends a stream without [DONE]

    def __init__(self, draft: ResponseObject, plan: ToolPlan | None,
                 on_done: Callable[[ResponseObject], None]) -> None:
        self.response = draft
        self.id = draft.id
        self._parser = None if plan is None else ToolCallParser(plan)
        self._on_done = on_done
        self._seq = 0
        self._events: list[StreamEvent] = []
        self._open: OutputItem | None = None
        self._pieces: list[str] = []  # the open item's text or arguments so far
        self._held = ""  # whitespace not yet in a message

    # -- the two ways in ---------------------------------------------------------------------
    def complete(self, out: RequestOutput) -> ResponseObject:
        """The finished response of a finished engine output (one choice)."""
        c = out.outputs[0]
        self._feed(c.text)
        self._finish(c.finish_reason, _usage(out))
        self._events.clear()
        return self.response

    def start(self) -> list[bytes]:
        """The events before the first output: created, in progress."""
        snapshot = msgspec.structs.replace(self.response, output=[])
        self._emit(LifecycleEvent, type="response.created", response=snapshot)
        self._emit(LifecycleEvent, type="response.in_progress", response=snapshot)
        return self._take()

    def on_output(self, out: RequestOutput, prompt_index: int = 0) -> list[bytes]:
        """The events of one engine output (the last one's include the finish)."""
        c = out.outputs[0]
        self._feed(c.delta_text)
        if c.finish_reason is not None:
            self._finish(c.finish_reason, _usage(out))
        return self._take()

    def end(self, outs: list[RequestOutput]) -> list[bytes]:
        """Nothing: the finish came with the last output."""
        return []

    def error(self, message: str, type: str) -> bytes:
        """The ``error`` event of a stream that fails after it started."""
        self._emit(ErrorEvent, code=type, message=message)
        return self._take()[0]

    # -- events ------------------------------------------------------------------------------
    def _emit(self, cls: type, **fields: object) -> None:
        self._events.append(cls(sequence_number=self._seq, **fields))
        self._seq += 1

    def _take(self) -> list[bytes]:
        events, self._events = self._events, []
        return [b"event: " + e.type.encode() + b"\ndata: " + _encoder.encode(e) + b"\n\n"
                for e in events]

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    # -- items -------------------------------------------------------------------------------
    def _feed(self, delta: str) -> None:
        if self._parser is None:
            self._add_text(delta)
            return
        content, parts = self._parser.feed(delta)
        self._add_text(content)
        self._add_calls(parts)

    def _finish(self, finish_reason: str | None, usage: ResponseUsage) -> None:
        if self._parser is not None:
            rest, parts, _ = self._parser.finish(finish_reason)
            self._add_text(rest)
            self._add_calls(parts)
        output = self.response.output
        if not any(isinstance(i, FunctionCallItem) for i in output) and (self._held or
                                                                          not output):
            if not isinstance(self._open, OutputMessage):
                self._open_item(OutputMessage(id=_item_id("msg"), status="in_progress",
                                              content=[]))
            if self._held:
                self._text_delta(self._held)
        cut = finish_reason == "length"
        self._close("incomplete" if cut else "completed")
        r = self.response
        r.status = "incomplete" if cut else "completed"
        r.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
        r.usage = usage
        self._emit(LifecycleEvent, type=f"response.{r.status}", response=r)
        self._on_done(r)

    def _add_text(self, text: str) -> None:
        if not text:
            return
        if isinstance(self._open, OutputMessage):
            self._text_delta(text)
            return
        self._held += text
        if self._held.strip():
            self._close("completed")
            self._open_item(OutputMessage(id=_item_id("msg"), status="in_progress", content=[]))
            self._text_delta(self._held)
            self._held = ""

    def _add_calls(self, parts: list[p.DeltaToolCall]) -> None:
        for part in parts:
            if part.id is not UNSET:  # a new call
                self._close("completed")
                self._held = ""
                name = part.function.name
                self._open_item(FunctionCallItem(
                    id=_item_id("fc"), call_id=part.id, name=name if name is not UNSET else "",
                    arguments="", status="in_progress"))
            args = part.function.arguments
            if args is not UNSET and args and isinstance(self._open, FunctionCallItem):
                self._pieces.append(args)
                self._emit(ArgumentsDeltaEvent, item_id=self._open.id, output_index=self._index,
                           delta=args)

    def _open_item(self, item: OutputItem) -> None:
        self.response.output.append(item)
        self._open, self._pieces = item, []
        self._emit(OutputItemEvent, type="response.output_item.added", output_index=self._index,
                   item=msgspec.structs.replace(item))
        if isinstance(item, OutputMessage):
            self._emit(ContentPartEvent, type="response.content_part.added", item_id=item.id,
                       output_index=self._index, content_index=0, part=OutputText(text=""))

    def _text_delta(self, text: str) -> None:
        assert self._open is not None
        self._pieces.append(text)
        self._emit(TextDeltaEvent, item_id=self._open.id, output_index=self._index,
                   content_index=0, delta=text)

    def _close(self, status: str) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        item.status = status  # type: ignore[assignment]
        whole = "".join(self._pieces)
        if isinstance(item, OutputMessage):
            part = OutputText(text=whole)
            item.content = [part]
            self._emit(TextDoneEvent, item_id=item.id, output_index=self._index,
                       content_index=0, text=whole)
            self._emit(ContentPartEvent, type="response.content_part.done", item_id=item.id,
                       output_index=self._index, content_index=0, part=part)
        else:
            item.arguments = whole
            self._emit(ArgumentsDoneEvent, item_id=item.id, output_index=self._index,
                       name=item.name, arguments=whole)
        self._emit(OutputItemEvent, type="response.output_item.done", output_index=self._index,
                   item=item)
