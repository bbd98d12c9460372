"""Tool calls: ``tools`` / ``tool_choice`` to a plan and a constraint, replies to OpenAI's
``tool_calls`` (the same parser for streams, fed piece by piece, and whole replies), and over
HTTP on the scripted fake engine: Hermes-style ``auto`` with a template that renders tools,
``auto`` refused where the template cannot, and tool messages in the history.
"""

from __future__ import annotations

import json

import jsonschema_rs
import msgspec
import openai
import pytest
from starlette.testclient import TestClient

from jaxserve.server import tools
from jaxserve.server.protocol import ChatCompletionRequest, RequestError
from jaxserve.server.routes import build_app
from tests.support.fake_engine import FakeEngine
from tests.support.http_server import serve_app
from tests.support.tool_templates import HERMES_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": None}}
HI = [{"role": "user", "content": "What is the weather in Paris?"}]


def _req(**kw) -> ChatCompletionRequest:
    return msgspec.convert({"messages": HI, **kw}, ChatCompletionRequest)


def _plan(template: str | None = None, **kw) -> tools.ToolPlan:
    plan = tools.tool_plan(_req(**kw), template)
    assert plan is not None
    return plan


# -- plans and constraints ----------------------------------------------------------------------


def test_a_named_choice_constrains_to_its_parameters() -> None:
    plan = _plan(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                     "function": {"name": "get_weather"}})
    assert (plan.mode, plan.name) == ("named", "get_weather")
    assert plan.constraint().json == WEATHER["function"]["parameters"]
    no_params = _plan(tools=[TIME], tool_choice={"type": "function",
                                                 "function": {"name": "get_time"}})
    assert no_params.constraint().json == {"type": "object"}


def test_required_constrains_to_an_array_of_calls_of_the_tools() -> None:
    schema = _plan(tools=[WEATHER, TIME], tool_choice="required").constraint().json
    ok = [{"name": "get_weather", "parameters": {"city": "Oslo"}},
          {"name": "get_time", "parameters": {}}]
    assert jsonschema_rs.is_valid(schema, ok)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "nope", "parameters": {}}], {"name": "get_time", "parameters": {}}):
        assert not jsonschema_rs.is_valid(schema, bad), bad
    one = _plan(tools=[WEATHER, TIME], tool_choice="required",
                parallel_tool_calls=False).constraint().json
    assert jsonschema_rs.is_valid(one, ok[:1]) and not jsonschema_rs.is_valid(one, ok)


def test_required_closes_the_parameters_of_strict_tools_only() -> None:
    open_params = {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}
    strict = {"type": "function", "function": {"name": "get_weather", "strict": True,
                                               "parameters": open_params}}
    loose = {"type": "function", "function": {"name": "get_weather", "parameters": open_params}}
    extra = [{"name": "get_weather", "parameters": {"city": "Oslo", "country": "NO"}}]
    closed = _plan(tools=[strict], tool_choice="required").constraint().json
    assert not jsonschema_rs.is_valid(closed, extra)
    assert jsonschema_rs.is_valid(closed, [{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    assert jsonschema_rs.is_valid(_plan(tools=[loose], tool_choice="required").constraint().json,
                                  extra)


@pytest.mark.parametrize("kw,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),  # auto, and this template has no call format
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
])  # fmt: skip
def test_bad_tool_choices_name_their_field(kw: dict, param: str) -> None:
    with pytest.raises(RequestError) as e:
        tools.tool_plan(_req(**kw), "{{ messages }}")
    assert e.value.param == param


def test_auto_needs_a_template_with_a_call_format() -> None:
    assert tools.tool_call_format(HERMES_TEMPLATE) == "hermes"
    assert tools.tool_call_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert _plan(HERMES_TEMPLATE, tools=[WEATHER]).mode == "auto"
    assert _plan(None, tools=[WEATHER], tool_choice="none").constraint() is None


# -- replies to tool calls: whole, and fed piece by piece ---------------------------------------


def _streamed(plan: tools.ToolPlan, text: str, finish: str, step: int
              ) -> tuple[str, list[dict], str | None]:
    """Feed ``text`` ``step`` characters at a time; returns (content, calls, finish) as a
    client accumulates a stream."""
    parser, content, calls = tools.ToolCallParser(plan), "", {}
    parts = []
    for i in range(0, len(text), step):
        c, p = parser.feed(text[i:i + step])
        content += c
        parts += p
    c, p, reason = parser.finish(finish)
    content, parts = content + c, parts + p
    for part in parts:
        call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
        if part.id is not msgspec.UNSET:
            assert call["id"] is None, "a call's id comes once, in its first part"
            call["id"] = part.id
        f = part.function
        call["name"] += f.name if f.name is not msgspec.UNSET else ""
        call["arguments"] += f.arguments if f.arguments is not msgspec.UNSET else ""
    return content, [calls[i] for i in sorted(calls)], reason


HERMES_REPLY = ('Let me look that up. <tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": '
                '{}}</tool_call>')
CASES = [  # plan kwargs, reply, finish -> content, [(name, arguments)], finish
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "get_weather"}}},
     '{"city": "Paris"}', "stop", None, [("get_weather", {"city": "Paris"})], "stop"),
    ({"tools": [WEATHER, TIME], "tool_choice": "required"},
     ('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": '
      '{"city": "Rome"}}]'), "stop", None,
     [("get_time", {}), ("get_weather", {"city": "Rome"})], "tool_calls"),
    ({"tools": [WEATHER, TIME], "tool_choice": "required"}, '[{"name": "get_ti', "length",
     '[{"name": "get_ti', [], "length"),
    ({"tools": [WEATHER, TIME]}, HERMES_REPLY, "stop", "Let me look that up. ",
     [("get_weather", {"city": "Paris"}), ("get_time", {})], "tool_calls"),
    ({"tools": [WEATHER]}, "It is sunny <tool_cal", "stop", "It is sunny <tool_cal", [],
     "stop"),
    ({"tools": [WEATHER]}, "<tool_call>not json</tool_call>", "stop",
     "<tool_call>not json</tool_call>", [], "stop"),
    ({"tools": [WEATHER], "tool_choice": "none"}, "No tools.", "stop", "No tools.", [], "stop"),
]  # fmt: skip


@pytest.mark.parametrize("kw,reply,finish,content,calls,reason", CASES)
def test_replies_become_tool_calls_alike_whole_and_streamed(kw, reply, finish, content, calls,
                                                            reason) -> None:
    plan = _plan(HERMES_TEMPLATE, **kw)
    got_content, got_calls, got_reason = tools.final_message(plan, reply, finish)
    assert got_content == content and got_reason == reason
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    for step in (1, 3, len(reply)):
        s_content, s_calls, s_reason = _streamed(plan, reply, finish, step)
        assert s_content == (content or "") and s_reason == reason
        assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == calls


def test_history_tool_calls_carry_arguments_as_objects() -> None:
    req = _req(messages=[*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "raw"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert tools.history_tool_calls(req.messages[1].tool_calls) == [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "raw"}}]


# -- over HTTP, on the scripted engine ------------------------------------------------------------


def _hermes_engine(script: str) -> FakeEngine:
    engine = FakeEngine(script=script, max_model_len=4096)
    engine.tokenizer.chat_template = HERMES_TEMPLATE  # what tool_choice "auto" reads
    return engine


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_over_http(stream: bool) -> None:
    engine = _hermes_engine(HERMES_REPLY)
    with serve_app(build_app(engine, "m")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        args = {"model": "m", "messages": HI, "tools": [WEATHER, TIME]}
        if not stream:
            choice = client.chat.completions.create(**args).choices[0]
            content, calls = choice.message.content, choice.message.tool_calls
            finish = choice.finish_reason
        else:
            content, acc, finish = "", {}, None
            for chunk in client.chat.completions.create(**args, stream=True):
                for c in chunk.choices:
                    content += c.delta.content or ""
                    for t in c.delta.tool_calls or ():
                        call = acc.setdefault(t.index, {"id": t.id, "name": "", "args": ""})
                        call["name"] += t.function.name or ""
                        call["args"] += t.function.arguments or ""
                    finish = c.finish_reason or finish
            calls = [openai.types.chat.ChatCompletionMessageToolCall(
                id=c["id"], type="function",
                function={"name": c["name"], "arguments": c["args"]}) for c in acc.values()]
    assert content == "Let me look that up. " and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls)
    (_, params, prompt), = engine.requests.values()
    assert not params.skip_special_tokens, "a model's <tool_call> may be a special token"
    assert prompt.startswith("<|tools|>get_weather,get_time\n")  # the template got the tools


def test_tool_history_and_refusals_over_http() -> None:
    engine = FakeEngine(script="Done.", max_model_len=4096)
    client = TestClient(build_app(engine, "m"))
    history = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER],
                                                  "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Done."}
    (_, _, prompt), = engine.requests.values()
    assert '<|call|>get_weather({\'city\': \'Paris\'})\n<|tool|>sunny\n' in prompt
    for body, param in (
            ({"messages": HI, "tools": [WEATHER]}, "tool_choice"),  # auto: no call format here
            ({"messages": HI, "tool_choice": "required"}, "tool_choice"),
            ({"messages": HI, "tools": [{"type": "function"}]}, "tools"),
            ({"messages": HI, "tools": [WEATHER], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "response_format"),
            ({"messages": [{"role": "user", "content": "x", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
             "messages")):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = client.post("/v1/completions", json={"prompt": "hi", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
