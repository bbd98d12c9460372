"""Tool calls on chat completions: ``tools`` and ``tool_choice`` to an output constraint, and
the generated text back to OpenAI's ``tool_calls``, streamed or not.

``tool_plan`` reads the request into a ``ToolPlan``:
  - ``none``: the tools are rendered into the prompt (if the template shows them) and the reply
    is plain text;
  - a named function: the output is constrained to that function's ``parameters`` schema (any
    model, any template); the reply is one call of it, ``finish_reason`` "stop" (as OpenAI);
  - ``required``: the output is constrained to a JSON array of ``{"name", "parameters"}``
    objects, one of the tools each (at most one with ``parallel_tool_calls: false``); the reply
    is those calls, ``finish_reason`` "tool_calls";
  - ``auto`` (the default when ``tools`` are given): the model chooses, which needs a chat
    template that renders ``tools`` and a parser for the model's call format: Hermes-style
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (Qwen 2.5 / 3, Hermes,
    many fine-tunes), recognised by the template writing ``<tool_call>``. Text before the first
    block is the reply's ``content``. Any other template makes ``auto`` a 400.
``ToolCallParser`` (one per choice) turns text deltas into content and ``DeltaToolCall`` parts,
and the final text into ``ToolCall``s, with the same code for both, so a stream and a
non-streamed reply agree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from jaxserve import request_ids
from jaxserve.engine.structured_output import no_additional_properties
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.server.output_protocol import DeltaFunctionCall, DeltaToolCall
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    ChatTool,
    FunctionCall,
    NamedToolChoice,
    RequestError,
    ToolCall,
)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_call_format(chat_template: str | None) -> Literal["hermes"] | None:
    """The call format ``auto`` can parse for a chat template: "hermes" when it renders
    ``tools`` and writes ``<tool_call>``; else None."""
    if chat_template and HERMES_OPEN in chat_template and "tools" in chat_template:
        return "hermes"
    return None


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools.

    Fields:
      mode: "none", "named", "required" or "auto".
      tools: the request's tools (rendered into the prompt by templates that show them).
      name: the function of a named ``tool_choice``.
      parallel: ``parallel_tool_calls`` (None: the default, several allowed).
    """

    mode: Literal["none", "named", "required", "auto"]
    tools: tuple[ChatTool, ...]
    name: str | None = None
    parallel: bool | None = None

    def template_tools(self) -> list[dict]:
        """The tools as the chat template's ``tools`` variable (OpenAI's dicts)."""
        return [msgspec.to_builtins(t) for t in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint of ``named`` and ``required``; None otherwise."""
        if self.mode == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.name)
            return StructuredOutputsParams(json=_parameters(fn.parameters),
                                           disable_additional_properties=bool(fn.strict))
        if self.mode != "required":
            return None
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "parameters"],
                  "properties": {"name": {"const": t.function.name},
                                 "parameters": _strict(t.function)}}
                 for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.parallel is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)


def _parameters(schema: dict | None) -> dict:
    return schema if schema is not None else {"type": "object"}


def _strict(fn) -> dict:
    """A function's parameters schema, closed (no properties beyond those listed) when the
    tool is ``strict``, as a named choice applies it."""
    schema = _parameters(fn.parameters)
    return no_additional_properties(schema) if fn.strict else schema


def tool_plan(req: ChatCompletionRequest, chat_template: str | None) -> ToolPlan | None:
    """The request's ``ToolPlan`` (None without tools and without ``tool_choice``).

    Raises:
      RequestError: naming ``tool_choice``: a choice other than "none" without tools, a named
        function that is not among them, "auto" (or no choice) with a template that has no
        tool-call format; naming ``tools``: two tools of one name; naming ``response_format``:
        a constraint beside a tool choice that constrains the output too.
    """
    tools, choice = tuple(req.tools or ()), req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise RequestError(f"tools holds two functions of one name: {names}", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise RequestError(f"tool_choice names {choice.function.name!r}, which is not "
                               f"among the tools ({', '.join(names)})", param="tool_choice")
        plan = ToolPlan("named", tools, choice.function.name, req.parallel_tool_calls)
    elif choice in ("none", "required"):
        plan = ToolPlan(choice, tools, parallel=req.parallel_tool_calls)
    else:
        if tool_call_format(chat_template) is None:
            raise RequestError(
                "tool_choice 'auto' (the default with tools) needs a chat template that "
                "renders tools and writes Hermes-style <tool_call> blocks; this model's "
                "template does not: send tool_choice 'required' or a named function "
                "({'type': 'function', 'function': {'name': ...}}), which work with any model",
                param="tool_choice")
        plan = ToolPlan("auto", tools, parallel=req.parallel_tool_calls)
    return plan


def history_tool_calls(calls: list[ToolCall]) -> list[dict]:
    """An assistant message's ``tool_calls`` for the chat template: arguments parsed from
    their JSON text into objects, as Hugging Face templates expect (kept as text if they are
    not JSON)."""
    out = []
    for c in calls:
        try:
            args: object = json.loads(c.function.arguments)
        except ValueError:
            args = c.function.arguments
        out.append({"id": c.id, "type": "function",
                    "function": {"name": c.function.name, "arguments": args}})
    return out


def _call_id() -> str:
    return f"call_{request_ids.random_id()[:24]}"


@dataclass
class ToolCallParser:
    """One choice's text -> content and tool calls, fed delta by delta (``feed``) and closed
    once (``finish``); ``calls`` holds the complete calls found."""

    plan: ToolPlan
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""  # text not yet given out (auto: after a possible <tool_call>)
    _in_call: bool = False  # auto: inside the tool-call part of the reply
    _unparsed: str = ""  # auto: blocks that are not a call, given back as content at the end
    _named_id: str | None = None

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        """The content to stream now and the tool-call parts, for a new piece of text."""
        mode = self.plan.mode
        if mode == "named":
            if not delta and self._named_id is not None:
                return "", []
            self._buf += delta
            if self._named_id is None:
                self._named_id = _call_id()
                return "", [DeltaToolCall(index=0, id=self._named_id, type="function",
                                          function=DeltaFunctionCall(name=self.plan.name,
                                                                     arguments=delta))]
            return "", [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]
        if mode == "required":
            self._buf += delta
            return "", []
        if mode != "auto":
            return delta, []
        self._buf += delta
        parts: list[DeltaToolCall] = []
        content = ""
        if not self._in_call:
            at = self._buf.find(HERMES_OPEN)
            if at < 0:  # hold back a tail that may begin <tool_call>
                keep = _prefix_tail(self._buf, HERMES_OPEN)
                content, self._buf = self._buf[:len(self._buf) - keep], self._buf[
                    len(self._buf) - keep:]
                return content, []
            content, self._buf, self._in_call = self._buf[:at], self._buf[at:], True
        while (m := _HERMES_BLOCK.search(self._buf)) is not None:
            call = _hermes_call(m.group(1))
            if call is not None:
                parts.append(self._add(call))
            else:
                self._unparsed += m.group(0)
            self._buf = self._buf[m.end():]
        return content, parts

    def _add(self, call: tuple[str, str]) -> DeltaToolCall:
        name, arguments = call
        c = ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=arguments))
        self.calls.append(c)
        return DeltaToolCall(index=len(self.calls) - 1, id=c.id, type="function",
                             function=DeltaFunctionCall(name=name, arguments=arguments))

    def finish(self, finish_reason: str | None) -> tuple[str, list[DeltaToolCall], str | None]:
        """The content and tool-call parts left at the end, and the finish reason to report
        ("tool_calls" where the reply made calls of its own choosing)."""
        mode = self.plan.mode
        if mode == "named":
            self.calls = [ToolCall(id=self._named_id or _call_id(), function=FunctionCall(
                name=self.plan.name, arguments=self._buf))]
            if self._named_id is None:  # no text came: the call still goes out, empty
                return "", [self._first_named()], finish_reason
            return "", [], finish_reason
        if mode == "required":
            calls = _required_calls(self._buf)
            if calls is None:  # cut short (max_tokens): the text is all there is
                text, self._buf = self._buf, ""
                return text, [], finish_reason
            parts = [self._add(c) for c in calls]
            return "", parts, "tool_calls" if finish_reason == "stop" else finish_reason
        if mode != "auto":
            return "", [], finish_reason
        rest, self._buf = self._unparsed + self._buf, ""
        if self.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        leftover = rest if not self.calls or rest.strip() else ""
        return leftover, [], finish_reason

    def _first_named(self) -> DeltaToolCall:
        self._named_id = self.calls[0].id
        return DeltaToolCall(index=0, id=self._named_id, type="function",
                             function=DeltaFunctionCall(name=self.plan.name, arguments=""))


def _prefix_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a Hermes block's ``{"name", "arguments"}``; None if it is
    not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _required_calls(text: str) -> list[tuple[str, str]] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    return [(x["name"], json.dumps(x["parameters"], ensure_ascii=False)) for x in items
            if isinstance(x, dict) and isinstance(x.get("name"), str) and "parameters" in x]


def final_message(plan: ToolPlan | None, text: str, finish_reason: str | None
                  ) -> tuple[str | None, list[ToolCall], str | None]:
    """A finished choice's (content, tool calls, finish reason): content None when the reply
    is only tool calls."""
    if plan is None:
        return text, [], finish_reason
    parser = ToolCallParser(plan)
    content, _ = parser.feed(text)
    rest, _, finish_reason = parser.finish(finish_reason)
    content += rest
    if parser.calls and not content.strip():
        return None, parser.calls, finish_reason
    return content, parser.calls, finish_reason
