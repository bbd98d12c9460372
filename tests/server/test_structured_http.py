"""Structured output over HTTP on the real model, with the official ``openai`` client:
``response_format`` (``json_object``, ``json_schema`` with ``strict``), vLLM's
``structured_outputs`` and its older ``guided_*`` fields, on chat and completions, streamed and
not; against a real uvicorn on 127.0.0.1 serving the shared session engine.

Asserted (docs/api.md#structured-output):
- every constrained output parses and validates against its schema (20 varied schemas in
  ``jaxserve/data/json_schemas.jsonl``, each streamed and not, all in flight together) and
  finishes with ``stop``;
- unconstrained requests sent in the same burst get exactly the text they get alone (greedy);
- an invalid schema, regex or grammar is a 400 naming the field it came from, streamed or not,
  and so is a constraint that takes longer than the compile timeout.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from pathlib import Path

import httpx
import jsonschema_rs
import openai
import pydantic
import pytest

import jaxserve
from jaxserve.engine.llm_engine import LLMEngine
from tests.support.http_server import serve_engine

MODEL = "m"
SCHEMAS = [json.loads(line) for line in
           (Path(jaxserve.__file__).parent / "data" / "json_schemas.jsonl").read_text()
           .splitlines()]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def base_url(engine: LLMEngine):
    # the free requests' text is compared alone and in a batch: prefix caching off
    with serve_engine(engine, MODEL, caching=False) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=300) as c:
        yield c


def _chat(client: openai.OpenAI, content: str, stream: bool = False, max_tokens: int = 100,
          **kw) -> tuple[str, str]:
    """(text, finish_reason) of one greedy chat completion, streamed or not."""
    args = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **kw}
    if not stream:
        c = client.chat.completions.create(**args).choices[0]
        return c.message.content, c.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def _valid(schema: dict, text: str) -> bool:
    return jsonschema_rs.is_valid(schema, json.loads(text))


FREE = ["Name three fruits.", "What is the capital of Italy?"]


def test_twenty_schemas_validate_streamed_and_not_beside_free_requests(
        client: openai.OpenAI) -> None:
    alone = [_chat(client, q, max_tokens=30) for q in FREE]
    jobs = [("free", q, stream) for q in FREE for stream in (False, True)]
    jobs += [("json", r, stream) for r in SCHEMAS for stream in (False, True)]

    def run(job):
        kind, x, stream = job
        if kind == "free":
            return _chat(client, x, stream, max_tokens=30)
        fmt = {"type": "json_schema", "json_schema": {"name": x["name"], "schema": x["schema"],
                                                      "strict": stream}}
        return _chat(client, f"Give an example of {x['name'].replace('_', ' ')} as JSON.",
                     stream, response_format=fmt)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(run, jobs))
    for (kind, x, stream), (text, finish) in zip(jobs, results):
        if kind == "free":
            assert (text, finish) == alone[FREE.index(x)], (x, stream)
        else:
            assert finish == "stop" and _valid(x["schema"], text), (x["name"], stream, text)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_is_one_json_object(client: openai.OpenAI, stream: bool) -> None:
    text, finish = _chat(client, "Describe a cat in JSON with keys name and colour.", stream,
                         response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(text), dict), text


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


def test_the_clients_parse_helper_gets_its_model(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Who are you? Name and age."}],
        response_format=Person, max_tokens=60, temperature=0)
    assert isinstance(out.choices[0].message.parsed, Person)


GRAMMAR = 'start: "SELECT " col " FROM " table\ncol: "name" | "age"\ntable: "users" | "pets"'


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"structured_outputs": {"regex": "(yes|no), because [a-z ]{1,20}"}},
     lambda t: re.fullmatch("(yes|no), because [a-z ]{1,20}", t)),
    ({"structured_outputs": {"grammar": GRAMMAR}},
     lambda t: re.fullmatch("SELECT (name|age) FROM (users|pets)", t)),
    ({"guided_json": PERSON}, lambda t: _valid(PERSON, t)),
    ({"structured_outputs": {"json": json.dumps(PERSON), "disable_any_whitespace": True}},
     lambda t: _valid(PERSON, t) and " " not in t.replace(json.loads(t)["name"], "")),
    ({"guided_json": PERSON, "guided_whitespace_pattern": r"[ ]{0,2}"},
     lambda t: _valid(PERSON, t)),
])  # fmt: skip
def test_vllm_fields_constrain_chat(client: openai.OpenAI, extra: dict, check) -> None:
    text, finish = _chat(client, "Answer briefly: who is at the door?", max_tokens=40,
                         extra_body=extra)
    assert finish == "stop" and check(text), text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_response_format_and_structured_outputs(client: openai.OpenAI,
                                                                 stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    cases = [({"response_format": fmt}, lambda t: _valid(PERSON, t)),
             ({"extra_body": {"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}}},
              lambda t: re.fullmatch("[A-Z][a-z]{2,8}", t))]
    for kw, check in cases:
        args = {"model": MODEL, "prompt": "A person, as JSON:", "max_tokens": 60,
                "temperature": 0}
        if "response_format" in kw:
            args["extra_body"] = {"response_format": kw["response_format"]}
        else:
            args["extra_body"] = kw["extra_body"]
        if stream:
            chunks = list(client.completions.create(**args, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            c = client.completions.create(**args).choices[0]
            text, finish = c.text, c.finish_reason
        assert finish == "stop" and check(text), text


CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
BAD_SCHEMA = {"type": "object", "properties": {"n": {"type": "integr"}}}


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": BAD_SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs"),
    ({"structured_outputs": {"choices": ["a", "b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": BAD_SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"guided_json": BAD_SCHEMA}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])  # fmt: skip
@pytest.mark.parametrize("path,stream", [(CHAT, False), (CHAT, True), (COMPL, False)])
def test_invalid_constraints_are_400_naming_their_field(http, engine: LLMEngine,
                                                        body: dict, param: str, path: str,
                                                        stream: bool) -> None:
    prompt = {"messages": HI} if path == CHAT else {"prompt": "hi"}
    r = http.post(path, json={"model": MODEL, **prompt, **body, "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert not engine.has_unfinished_requests()


def test_a_constraint_slower_than_the_timeout_is_400(http, engine: LLMEngine,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    grammars = engine.grammars
    release, build = threading.Event(), grammars._build

    def slow(spec):
        release.wait()
        return build(spec)

    monkeypatch.setattr(grammars, "_build", slow)
    monkeypatch.setattr(grammars, "timeout_s", 0.01)
    fmt = {"type": "json_schema", "json_schema": {"name": "slow", "schema": {
        "type": "object", "properties": {"never_seen_before": {"type": "boolean"}}}}}
    try:
        r = http.post(CHAT, json={"model": MODEL, "messages": HI, "response_format": fmt})
    finally:
        release.set()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "longer than 0.01 s" in err["message"], err
