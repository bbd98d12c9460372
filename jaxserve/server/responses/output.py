"""A Responses API reply's output, built from the generated text as it arrives: the output items
(a ``message`` with one ``output_text`` part, ``function_call`` items) and, for a stream, the
events, so that a streamed and a non-streamed reply hold the same output
(``ResponseBuilder``). ``server.responses.handler`` makes the builder of each request.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from msgspec import UNSET

from jaxserve import request_ids
from jaxserve.outputs import RequestOutput
from jaxserve.server.output_protocol import DeltaToolCall
from jaxserve.server.responses.protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    LifecycleEvent,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from jaxserve.server.tools import ToolCallParser, ToolPlan

_encoder = msgspec.json.Encoder()


def _usage(out: RequestOutput) -> ResponseUsage:
    num_in = len(out.prompt_token_ids)
    num_out = sum(len(c.token_ids) for c in out.outputs)
    return ResponseUsage(input_tokens=num_in, output_tokens=num_out,
                         total_tokens=num_in + num_out,
                         input_tokens_details=InputTokensDetails(
                             cached_tokens=out.num_cached_tokens or 0))


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
                self._open_item(OutputMessage(id=request_ids.item_id("msg"), status="in_progress",
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
            self._open_item(OutputMessage(id=request_ids.item_id("msg"), status="in_progress", content=[]))
            self._text_delta(self._held)
            self._held = ""

    def _add_calls(self, parts: list[DeltaToolCall]) -> None:
        for part in parts:
            if part.id is not UNSET:  # a new call
                self._close("completed")
                self._held = ""
                name = part.function.name
                self._open_item(FunctionCallItem(
                    id=request_ids.item_id("fc"), call_id=part.id, name=name if name is not UNSET else "",
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
