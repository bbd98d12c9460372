"""The Responses API over HTTP on the real model, with the official ``openai`` client: string and
item input with instructions (greedy text and token counts equal to the chat completion of the
same conversation), ``max_output_tokens`` cuts, the typed stream events and the SDK's
``responses.stream`` helper, ``text.format`` JSON schemas, a named function call and its result
sent back, ``previous_response_id`` chains with the store, and the fields refused with a 400
naming them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema_rs
import openai
import pydantic
import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseTextDeltaEvent,
)

from jaxserve.engine.llm_engine import LLMEngine
from tests.support.http_server import serve_engine

MODEL = "m"
ASK = "What is the capital of France?"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "required": ["city", "unit"],
                          "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}
ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                      "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                     "b": {"type": "integer", "minimum": -1000,
                                           "maximum": 1000}}}}


@pytest.fixture(scope="module")
def base_url(engine: LLMEngine) -> Iterator[str]:
    # responses and chat completions of one conversation are compared greedily: no reuse
    with serve_engine(engine, MODEL, caching=False) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=300) as c:
        yield c


def _create(client: openai.OpenAI, **kw):
    return client.responses.create(**{"model": MODEL, "temperature": 0, **kw})


def _num_tokens(http: httpx.Client, messages: list[dict]) -> int:
    return http.post("/tokenize", json={"messages": messages}).json()["count"]


def test_a_string_input(client, http) -> None:
    r = _create(client, input=ASK, max_output_tokens=12)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    (part,) = msg.content
    assert part.type == "output_text" and part.annotations == [] and part.text
    assert r.output_text == part.text
    assert (r.temperature, r.top_p, r.max_output_tokens, r.tools) == (0, 1, 12, [])
    u = r.usage
    assert u.input_tokens == _num_tokens(http, [{"role": "user", "content": ASK}])
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert (u.input_tokens_details.cached_tokens, u.output_tokens_details.reasoning_tokens) == (
        0, 0)
    if r.status == "completed":
        assert r.incomplete_details is None and 0 < u.output_tokens <= 12
    else:
        assert r.status == "incomplete" and u.output_tokens == 12


def test_max_output_tokens_cut_is_incomplete(client) -> None:
    r = _create(client, input="Tell me a long story about a dragon.", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.output[0].status == "incomplete"


def test_items_and_instructions_equal_the_chat_completion(client) -> None:
    items = [{"role": "user", "content": "Hi!"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello! How can I help?"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}]
    r = _create(client, instructions="You answer in one word.", input=items,
                max_output_tokens=10)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=10, messages=[
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name a colour."}])
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                             chat.usage.completion_tokens)
    assert r.instructions == "You answer in one word."
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                        else "completed")


def test_stream_events_in_order(client) -> None:
    events = list(_create(client, input=ASK, max_output_tokens=12, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    final = events[-1]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", final.type]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert isinstance(events[0], ResponseCreatedEvent)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert events[-4].text == text == final.response.output_text and text
    assert final.response.id == events[0].response.id
    assert final.type == ("response.completed" if final.response.status == "completed"
                          else "response.incomplete")
    whole = _create(client, input=ASK, max_output_tokens=12)
    assert whole.output_text == text and whole.usage == final.response.usage


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


def test_the_stream_helper_parses_a_schema(client) -> None:
    with client.responses.stream(model=MODEL, input="Name one city in Italy.", temperature=0,
                                 text_format=City, max_output_tokens=60) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    assert isinstance(final.output_parsed, City)
    parsed = client.responses.parse(model=MODEL, input="Name one city in Italy.",
                                    temperature=0, text_format=City, max_output_tokens=60)
    assert parsed.output_parsed == final.output_parsed


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_format_is_followed(client, stream: bool) -> None:
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                      "strict": True}}
    kw = {"input": "Invent a person.", "text": fmt, "max_output_tokens": 60}
    if stream:
        events = list(_create(client, stream=True, **kw))
        assert isinstance(events[-1], ResponseCompletedEvent)
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        r = events[-1].response
        assert r.output_text == text
    else:
        r = _create(client, **kw)
        text = r.output_text
    assert r.status == "completed" and r.text.format.type == "json_schema"
    assert jsonschema_rs.is_valid(PERSON, json.loads(text)), text


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called(client, stream: bool) -> None:
    kw = {"input": "What is the weather in Paris, in celsius?", "tools": [WEATHER, ADD],
          "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40}
    if stream:
        events = list(_create(client, stream=True, **kw))
        added = [e for e in events if e.type == "response.output_item.added"]
        assert [e.item.type for e in added] == ["function_call"]
        args = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done.arguments == args and done.item_id == added[0].item.id
        r = events[-1].response
    else:
        r = _create(client, **kw)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert jsonschema_rs.is_valid(WEATHER["parameters"], json.loads(call.arguments))
    assert r.tool_choice.name == "get_weather"
    assert [(t.name, t.strict) for t in r.tools] == [("get_weather", True), ("add", True)]


def test_a_function_result_sent_back(client) -> None:
    ask = {"role": "user", "content": "What is 2 + 3?"}
    first = _create(client, input=[ask], tools=[ADD], max_output_tokens=30,
                    tool_choice={"type": "function", "name": "add"})
    (call,) = first.output
    # as the SDK's guide does: the output items go back into the input as they are
    second = _create(client, input=[ask, *first.output, {"type": "function_call_output",
                                                         "call_id": call.call_id, "output": "5"}],
                     tools=[ADD], tool_choice="none", max_output_tokens=10)
    assert [i.type for i in second.output] == ["message"] and second.output_text
    chat_add = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=10, tools=[chat_add], tool_choice="none",
        messages=[ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "add", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "5"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_previous_response_id_continues_the_conversation(client, http) -> None:
    first = _create(client, instructions="Be brief.", input="My name is Ada.",
                    max_output_tokens=6)
    second = _create(client, input="What is my name?", previous_response_id=first.id,
                     max_output_tokens=6)
    assert second.previous_response_id == first.id and second.instructions is None
    # the history is the first input and output; the first instructions are not carried over
    history = [{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == _num_tokens(http, history)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6,
                                          messages=history)
    assert second.output_text == chat.choices[0].message.content
    third = _create(client, input="And again?", previous_response_id=second.id,
                    max_output_tokens=3)
    history += [{"role": "assistant", "content": second.output_text},
                {"role": "user", "content": "And again?"}]
    assert third.usage.input_tokens == _num_tokens(http, history)

    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.usage) == (first.id, first.output_text, first.usage)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        _create(client, input="Hi", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.param == "previous_response_id"
    unstored = _create(client, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_harmless_fields_are_accepted(client) -> None:
    r = _create(client, input="Hi", max_output_tokens=2, metadata={"k": "v"}, user="u",
                parallel_tool_calls=False, truncation="disabled", store=True,
                service_tier="auto", safety_identifier="s", prompt_cache_key="p",
                reasoning={"effort": None}, include=[], text={"verbosity": "medium"})
    assert r.metadata == {"k": "v"} and r.user == "u" and r.parallel_tool_calls is False


@pytest.mark.parametrize("fields,param", [
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [ADD], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice"),
    ({"tools": [ADD]}, "tool_choice"),  # auto, and SmolLM2's template cannot call
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input"),
    ({"input": "x " * 1500}, "input"),  # longer than the context window
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
])  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_refused_fields_are_400s_naming_them(http, fields: dict, param: str,
                                             stream: bool) -> None:
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                         "stream": stream, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_an_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="other", input="Hi")
    assert e.value.param == "model"
