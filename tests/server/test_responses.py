"""The Responses API without a model: the output built from a reply's text (streamed piece by
piece or whole, under each tool plan) agrees both ways and validates against the openai SDK's
own models; input items become the chat messages they stand for; the store is bounded; and over
HTTP on the scripted fake engine: store settings and an ``auto`` tool call with a Hermes-style
template.
"""

from __future__ import annotations

import json

import msgspec
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from starlette.testclient import TestClient

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server import protocol as p
from jaxserve.server import tools
from jaxserve.server.responses import handler as responses
from jaxserve.server.responses.output import ResponseBuilder
from jaxserve.server.responses.protocol import InputItem, ResponseObject, ResponsesRequest
from jaxserve.server.routes import build_app
from jaxserve.server_config import RequestLimits, ServerConfig
from tests.support.fake_engine import FakeEngine
from tests.support.http_server import serve_app
from tests.support.tool_templates import HERMES_TEMPLATE

MODEL = "m"
ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'


def _request(**kw) -> ResponsesRequest:
    return msgspec.convert({"input": "hi", **kw}, ResponsesRequest)


def _plan(mode: str, name: str | None = None) -> tools.ToolPlan:
    tool = p.ChatTool(type="function", function=p.FunctionDefinition(
        name="add", parameters=ADD["parameters"]))
    return tools.ToolPlan(mode, (tool,), name)  # type: ignore[arg-type]


def _builder(plan: tools.ToolPlan | None, done: list | None = None) -> ResponseBuilder:
    job = responses.ResponseJob(_request(), [], None)
    builder = job.builder("resp_1", 0, MODEL, plan)
    if done is not None:
        builder._on_done = done.append
    return builder


def _outputs(text: str, finish: str, piece: int) -> list[RequestOutput]:
    """The engine outputs of a reply ``text`` arriving ``piece`` characters at a time."""
    outs = []
    for start in range(0, max(len(text), 1), piece):
        end = min(start + piece, len(text))
        last = end >= len(text)
        c = CompletionOutput(index=0, text=text[:end], token_ids=list(range(end)),
                             finish_reason=finish if last else None,
                             delta_text=text[start:end], delta_token_ids=list(range(start, end)))
        outs.append(RequestOutput("r", None, [1, 2, 3], [c], finished=last))
    return outs


def _items(response: ResponseObject) -> list[dict]:
    """The output items without their random ids."""
    return [{k: v for k, v in msgspec.to_builtins(i).items() if k not in ("id", "call_id")}
            for i in response.output]


CASES = [  # (plan, reply text, finish reason, expected item types)
    (None, "Hello there, friend.", "stop", ["message"]),
    (None, "", "stop", ["message"]),
    (None, "Cut sh", "length", ["message"]),
    (("named", "add"), '{"a": 2, "b": 3}', "stop", ["function_call"]),
    (("named", "add"), '{"a": 2', "length", ["function_call"]),
    (("required", None), '[{"name": "add", "parameters": {"a": 1, "b": 2}}]', "stop",
     ["function_call"]),
    (("required", None), '[{"name": "add", "param', "length", ["message"]),
    (("auto", None), f"Let me add.\n<tool_call>\n{CALL}\n</tool_call>", "stop",
     ["message", "function_call"]),
    (("auto", None), f"\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{CALL}</tool_call>",
     "stop", ["function_call", "function_call"]),
    (("auto", None), "  No call after all.", "stop", ["message"]),
]


@pytest.mark.parametrize("plan,text,finish,types", CASES)
@pytest.mark.parametrize("piece", [1, 5])
def test_a_stream_and_a_whole_reply_agree(plan, text: str, finish: str, types: list[str],
                                          piece: int) -> None:
    whole = _builder(_plan(*plan) if plan else None).complete(_outputs(text, finish, 10**6)[0])
    sdk = Response.model_validate(msgspec.to_builtins(whole))  # the SDK's model, strictly
    assert [i.type for i in sdk.output] == types
    assert whole.status == ("incomplete" if finish == "length" else "completed")
    assert whole.output[-1].status == whole.status
    assert (whole.incomplete_details is not None) == (finish == "length")

    done: list[ResponseObject] = []
    builder = _builder(_plan(*plan) if plan else None, done)
    raw = builder.start() + [e for o in _outputs(text, finish, piece) for e in builder.on_output(o)]
    events = []
    for chunk in raw:
        head, data = chunk.decode().removesuffix("\n\n").split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type == f"response.{whole.status}"
    (final,) = done
    assert _items(final) == _items(whole) and final.usage == whole.usage
    assert events[-1].response == Response.model_validate(msgspec.to_builtins(final))

    # per item: added, its deltas, its done events, in output order, one item at a time
    index, open_id, text_so_far, args = -1, None, "", ""
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert open_id is None and e.output_index == index + 1
            index, open_id, text_so_far, args = e.output_index, e.item.id, "", ""
            continue
        assert open_id is not None and e.output_index == index
        if e.type == "response.output_text.delta":
            text_so_far += e.delta
        elif e.type == "response.output_text.done":
            assert e.text == text_so_far == final.output[index].content[0].text
        elif e.type == "response.function_call_arguments.delta":
            args += e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == args == final.output[index].arguments
        elif e.type == "response.output_item.done":
            assert e.item.id == open_id == final.output[index].id
            open_id = None
        else:
            assert e.type in ("response.content_part.added", "response.content_part.done")
    assert open_id is None and index == len(final.output) - 1


def test_input_items_become_chat_messages() -> None:
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Adding.", "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "5"},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "6"}]}]
    chat, conv = responses.to_chat_request(_request(input=items, instructions="Sys."), [], None,
                                           RequestLimits())
    got = [(m.role, m.content, [c.id for c in m.tool_calls or ()], m.tool_call_id)
           for m in chat.messages]
    assert got == [("system", "Sys.", [], None), ("developer", "Be brief.", [], None),
                   ("user", "a\nb", [], None), ("assistant", "Adding.", ["c1", "c2"], None),
                   ("tool", "5", [], "c1"), ("tool", "6", [], "c2")]
    assert len(conv) == len(items)  # instructions are not part of the conversation


@pytest.mark.parametrize("item,message", [
    ({"role": "tool", "content": "x"}, "input[0].role"),
    ({"role": "user"}, "input[0].content is required"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input_file"),
    ({"type": "function_call", "call_id": "c"}, "needs name, arguments"),
    ({"type": "function_call_output", "call_id": "c", "output": "1"}, "no function_call"),
    ({"type": "item_reference", "id": "msg_1"}, "item_reference"),
])  # fmt: skip
def test_bad_input_items_name_input(item: dict, message: str) -> None:
    with pytest.raises(p.RequestError) as e:
        responses.to_chat_request(_request(input=[item]), [], None, RequestLimits())
    assert e.value.param == "input" and message in e.value.message


def test_the_store_keeps_the_last_n() -> None:
    store = responses.ResponseStore(2)
    for i in range(3):
        job = responses.ResponseJob(_request(), [InputItem(role="user", content=f"q{i}")], store)
        job.builder(f"resp_{i}", 0, MODEL, None).complete(_outputs(f"reply {i}", "stop", 100)[0])
    assert store.get("resp_0") is None and store.get("resp_2") is not None
    with pytest.raises(p.RequestError) as e:
        store.history("resp_0")
    assert (e.value.status, e.value.param) == (404, "previous_response_id")
    (question, answer) = (i.content for i in store.history("resp_1"))
    assert question == "q1" and answer[0].text == "reply 1"
    assert store.delete("resp_1") and not store.delete("resp_1")


def test_store_settings_over_http() -> None:
    kept = TestClient(build_app(FakeEngine(max_model_len=512, script="Hi"), MODEL))
    body = {"model": MODEL, "input": "hi"}
    r = kept.post("/v1/responses", json=body).json()
    assert r["store"] is True and kept.get(f"/v1/responses/{r['id']}").json() == r
    streamed = kept.get(f"/v1/responses/{r['id']}?stream=true")
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    assert kept.delete(f"/v1/responses/{r['id']}").json() == {
        "id": r["id"], "object": "response", "deleted": True}
    assert kept.delete(f"/v1/responses/{r['id']}").json()["error"]["param"] == "response_id"
    r = kept.post("/v1/responses", json={**body, "store": False}).json()
    assert r["store"] is False and kept.get(f"/v1/responses/{r['id']}").status_code == 404
    none = TestClient(build_app(FakeEngine(max_model_len=512, script="Hi"), MODEL,
                                ServerConfig(max_stored_responses=0)))
    assert none.post("/v1/responses", json=body).json()["store"] is False
    err = none.post("/v1/responses", json={**body, "store": True})
    assert err.status_code == 400 and err.json()["error"]["param"] == "store"


def test_ids_stay_unique_when_clients_reuse_a_request_id() -> None:
    client = TestClient(build_app(FakeEngine(max_model_len=512, script="Hi"), MODEL))
    body, same = {"model": MODEL, "input": "hi"}, {"X-Request-Id": "shared/id?x"}
    first, second = (client.post("/v1/responses", json=body, headers=same).json()
                     for _ in range(2))
    assert first["id"] != second["id"] and first["id"].startswith("resp_")
    for r in (first, second):  # both kept, each retrievable by its own id
        assert client.get(f"/v1/responses/{r['id']}").json()["id"] == r["id"]


@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": 1}, "max_tokens"), ({"stop": ["a"]}, "stop"), ({"seed": 5}, "seed"),
    ({"text": {"format": {"type": "text", "foo": 1}}}, "text.format.foo"),
])  # fmt: skip
def test_unknown_fields_are_refused_by_name_not_ignored(extra: dict, param: str) -> None:
    client = TestClient(build_app(FakeEngine(max_model_len=512, script="Hi"), MODEL))
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == (param, "unknown_parameter")


def test_the_settings_a_response_echoes_can_be_sent_back() -> None:
    client = TestClient(build_app(FakeEngine(max_model_len=512, script="Hi"), MODEL))
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi"}).json()
    echoed = {k: r[k] for k in ("tool_choice", "tools", "temperature", "top_p")}
    again = client.post("/v1/responses", json={"model": MODEL, "input": "hi", **echoed})
    assert echoed["tool_choice"] == "auto" and echoed["tools"] == []
    assert again.status_code == 200, again.json()


def test_auto_tool_call_with_a_hermes_template() -> None:
    engine = FakeEngine(max_model_len=512, script=f"<tool_call>{CALL}</tool_call>")
    engine.tokenizer.chat_template = HERMES_TEMPLATE
    with serve_app(build_app(engine, MODEL)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.responses.create(model=MODEL, input="2 + 3?", tools=[ADD])
        (call,) = r.output
        assert call.type == "function_call" and call.name == "add"
        assert json.loads(call.arguments) == {"a": 2, "b": 3}
        events = list(client.responses.create(model=MODEL, input="2 + 3?", tools=[ADD],
                                              stream=True))
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert json.loads(done.arguments) == {"a": 2, "b": 3}
        assert events[-1].response.output[0].name == "add"


def test_a_stream_cut_by_the_request_timeout_ends_with_an_error_event() -> None:
    engine = FakeEngine(script="word " * 2000, max_model_len=100_000, step_s=0.005)
    client = TestClient(build_app(engine, MODEL, ServerConfig(request_timeout_s=0.15)))
    resp = client.post("/v1/responses", headers={"X-Request-Id": "t1"},
                       json={"input": "hi", "max_output_tokens": 50_000, "stream": True})
    assert resp.status_code == 200
    events = [EVENTS.validate_python(json.loads(line.removeprefix("data: ")))
              for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[0].type == "response.created" and events[-2].type.startswith("response.output")
    assert events[-1].type == "error" and events[-1].code == "timeout_error"
    rid = events[0].response.id
    assert engine.aborted == [rid] and engine.running == set()
    assert client.get(f"/v1/responses/{rid}").status_code == 404  # only finished ones are kept


def test_the_gate_admits_responses_as_generation_requests() -> None:
    from jaxserve.server.gate import Gate
    from jaxserve.server.lifecycle import Lifecycle

    class Full:
        def num_waiting(self) -> int:
            return 8

    gate = Gate(Full(), ServerConfig(max_waiting_requests=8), Lifecycle(ready=True))
    refused = gate.refusal({"type": "http", "path": "/v1/responses", "headers": []})
    assert refused is not None and refused.status_code == 503
    assert gate.refusal({"type": "http", "path": "/v1/responses/resp_1", "headers": []}) is None
