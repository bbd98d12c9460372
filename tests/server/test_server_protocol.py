"""The OpenAI-compatible server against a fake engine: bodies, SSE format, errors, disconnects.

Serving cases covered here at the protocol level (the real-model versions live in the HTTP
tests): 18 (empty prompts), 19 (over-long prompt), 21 (malformed bodies), 30 (disconnect aborts),
34 (``[DONE]`` last, error mid-stream), 35/36/37 (usage and finish_reason chunk rules), 38.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from jaxserve.server.routes import build_app
from tests.support.fake_engine import FakeEngine
from tests.support.http_server import serve_app

MODEL = "test-model"
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def make_client(**engine_kwargs: object) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(**engine_kwargs)  # type: ignore[arg-type]
    return TestClient(build_app(engine, MODEL)), engine


def sse_data(resp: object) -> list[str]:
    """The data payloads of an SSE body, checking the framing; the last one is [DONE]."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.text
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    for e in events[:-1]:
        assert e.startswith("data: ") and "\n" not in e, repr(e)
    data = [e[len("data: ") :] for e in events[:-1]]
    assert data.count("[DONE]") == 1
    return data


def chunks(resp: object) -> list[dict]:
    return [json.loads(d) for d in sse_data(resp)[:-1]]


def assert_error(resp: object, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


# ---- case 21: malformed bodies --------------------------------------------------------------

J = {"content-type": "application/json"}
MALFORMED_CHAT = [
    (b'{"model":"m", x}', J, 400),
    (b"[]", J, 400),
    (b"null", J, 400),
    (b"123", J, 400),
    (b'"text"', J, 400),
    (b"", J, 400),
    (json.dumps({"messages": HI}).encode(), {}, 400),  # no Content-Type
    (json.dumps({"messages": HI}).encode(), {"content-type": "text/plain"}, 400),
    (json.dumps({"messages": HI, "max_tokens": "ten"}).encode(), J, 400),
    (json.dumps({"messages": HI, "max_tokens": 0}).encode(), J, 400),
    (json.dumps({"messages": HI, "max_tokens": 10.5}).encode(), J, 400),
    (json.dumps({"messages": HI, "max_completion_tokens": -3}).encode(), J, 400),
    (json.dumps({"messages": HI, "temperature": -1}).encode(), J, 400),
    (json.dumps({"messages": HI, "temperature": "hot"}).encode(), J, 400),
    (json.dumps({"messages": HI, "temperature": 1e30}).encode(), J, 400),  # above MAX_TEMPERATURE
    (json.dumps({"messages": HI, "top_p": 1.5}).encode(), J, 400),
    (json.dumps({"messages": HI, "top_p": 0}).encode(), J, 400),
    (json.dumps({"messages": HI, "top_k": -2}).encode(), J, 400),
    (json.dumps({"messages": HI, "seed": 2**64}).encode(), J, 400),
    # features not built are refused, never silently ignored
    (json.dumps({"messages": HI, "logit_bias": {"1": 500}}).encode(), J, 400),
    (json.dumps({"messages": HI, "logit_bias": {"one": 5}}).encode(), J, 400),
    # int() would read these as ids: a space, a sign, an underscore, a non-ASCII digit
    (json.dumps({"messages": HI, "logit_bias": {" 5": 5}}).encode(), J, 400),
    (json.dumps({"messages": HI, "logit_bias": {"+5": 5}}).encode(), J, 400),
    (json.dumps({"messages": HI, "logit_bias": {"5_0": 5}}).encode(), J, 400),
    (json.dumps({"messages": HI, "logit_bias": {"\u0665": 5}}).encode(), J, 400),
    (json.dumps({"messages": HI, "response_format": {"type": "json_schema"}}).encode(), J, 400),
    (json.dumps({"messages": HI, "response_format": {"type": "xml"}}).encode(), J, 400),
    (json.dumps({"messages": HI, "structured_outputs": {"choices": ["a"]}}).encode(), J, 400),
    (json.dumps({"messages": HI, "structured_outputs": {}}).encode(), J, 400),
    (json.dumps({"messages": HI, "guided_choice": []}).encode(), J, 400),
    (json.dumps({"messages": HI, "tools": [{"type": "function"}]}).encode(), J, 400),
    (json.dumps({"messages": HI, "tool_choice": "auto"}).encode(), J, 400),
    (json.dumps({"messages": HI, "functions": [{"name": "f"}]}).encode(), J, 400),
    (json.dumps({"messages": [{"role": "user", "content": None}]}).encode(), J, 400),
    (json.dumps({"messages": [{"role": "user"}]}).encode(), J, 400),
    (json.dumps({"messages": HI, "min_tokens": 20, "max_tokens": 5}).encode(), J, 400),
    (json.dumps({"messages": HI, "repetition_penalty": 5.0}).encode(), J, 400),
    (json.dumps({"messages": HI, "use_beam_search": True}).encode(), J, 400),
    (json.dumps({"messages": HI, "guided_json": 5}).encode(), J, 400),
    (json.dumps({"messages": HI, "guided_json": {"type": "object"}, "guided_regex": "a"}).encode(),
     J, 400),
    (json.dumps({"messages": HI, "echo": True}).encode(), J, 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5000 + b"]" * 5000
     + b"}", J, 400),  # nesting deeper than the decoder's recursion limit
    (json.dumps({"messages": HI, "n": 0}).encode(), J, 400),
    (json.dumps({"messages": HI, "n": 1.5}).encode(), J, 400),
    (json.dumps({"messages": HI, "stop": [""]}).encode(), J, 400),
    (json.dumps({"messages": HI, "stop": 5}).encode(), J, 400),
    (json.dumps({"messages": HI, "stream": "yes"}).encode(), J, 400),
    (json.dumps({"messages": HI, "stream_options": {"include_usage": True}}).encode(), J, 400),
    (json.dumps({"messages": HI, "logprobs": True, "top_logprobs": 21}).encode(), J, 400),
    (json.dumps({"messages": HI, "top_logprobs": 2}).encode(), J, 400),  # needs logprobs
    (json.dumps({"messages": HI, "presence_penalty": 2.5}).encode(), J, 400),
    (json.dumps({"messages": HI, "frequency_penalty": -3}).encode(), J, 400),
    (json.dumps({"messages": HI, "min_p": 1.5}).encode(), J, 400),
    (json.dumps({"messages": HI, "repetition_penalty": 0}).encode(), J, 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', J, 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', J, 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}', J, 400),
    (json.dumps({"messages": "hello"}).encode(), J, 400),
    (json.dumps({"messages": []}).encode(), J, 400),
    (json.dumps({"messages": [{"content": "no role"}]}).encode(), J, 400),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), J, 400),
    (
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
        J,
        400,
    ),
    (json.dumps({"model": "nope", "messages": HI}).encode(), J, 404),
]


@pytest.mark.parametrize("body,headers,status", MALFORMED_CHAT)
def test_malformed_chat_bodies_are_4xx_json(body: bytes, headers: dict, status: int) -> None:
    client, engine = make_client()
    err = assert_error(client.post(CHAT, content=body, headers=headers), status)
    if status == 404:
        assert err["type"] == "not_found_error" and err["param"] == "model"
    assert engine.requests == {}
    assert client.get("/health").status_code == 200
    ok = client.post(CHAT, json={"model": MODEL, "messages": HI})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "body,status",
    [
        ({"prompt": ""}, 400),  # case 18: encodes to no tokens
        ({"prompt": [""]}, 400),
        ({"prompt": []}, 400),
        ({"prompt": [[]]}, 400),
        ({"prompt": ["a", [1]]}, 400),  # a batch mixes strings and id lists
        ({"prompt": ["a", ""]}, 400),  # one prompt of a batch is empty
        ({"prompt": [[1, 2], []]}, 400),
        ({"prompt": [1, "a"]}, 400),
        ({"prompt": [1, True]}, 400),
        ({"prompt": [-1, 5]}, 400),  # token id out of range
        ({"prompt": [0x110000]}, 400),
        ({"prompt": {"text": "x"}}, 400),
        ({}, 400),  # prompt is required
        ({"prompt": "hi", "max_tokens": 0}, 400),  # 0 only with echo (scoring)
        ({"prompt": "hi", "max_completion_tokens": 0}, 400),
        ({"prompt": "hi", "max_tokens": 3, "max_completion_tokens": 4}, 400),
        ({"prompt": "hi", "logprobs": 21}, 400),
        ({"prompt": "hi", "logprobs": -1}, 400),
        ({"prompt": "hi", "max_tokens": -5}, 400),
        ({"prompt": "hi", "suffix": "bye"}, 400),
        ({"prompt": "hi", "best_of": 2}, 400),
        ({"prompt": "hi", "logit_bias": {"5": -101}}, 400),
        ({"prompt": "hi", "prompt_logprobs": 1}, 400),  # echo + logprobs is the HTTP form
        ({"prompt": "hi", "top_logprobs": 2}, 400),
        ({"prompt": "hi", "min_tokens": 17}, 400),  # above the default max_tokens of 16
        ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400),
        ({"prompt": "hi", "model": "other"}, 404),
    ],
)
def test_bad_completion_requests(body: dict, status: int) -> None:
    client, engine = make_client()
    err = assert_error(client.post(COMPL, json=body), status)
    assert err["code"] is None or isinstance(err["code"], str)  # as OpenAI: never the status
    if status == 404:
        assert err["code"] == "model_not_found"
    assert engine.running == set()
    assert client.post(COMPL, json={"prompt": "hi"}).status_code == 200


def test_error_names_the_field() -> None:
    client, _ = make_client()
    assert (
        assert_error(client.post(CHAT, json={"messages": HI, "top_p": 1.5}), 400)["param"]
        == "top_p"
    )
    assert (
        assert_error(client.post(CHAT, json={"messages": HI, "max_tokens": "ten"}), 400)["param"]
        == "max_tokens"
    )
    assert (
        assert_error(client.post(COMPL, json={"prompt": "x", "min_p": 2}), 400)["param"] == "min_p"
    )


def test_routes_and_methods() -> None:
    client, _ = make_client()
    assert_error(client.post("/v1/embeddings", json={}), 404)
    assert_error(client.get("/nope"), 404)
    resp = client.get(COMPL)
    assert_error(resp, 405)
    assert "POST" in resp.headers["allow"]
    assert_error(client.post("/v1/models"), 405)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_too_long_is_400_naming_both_numbers(stream: bool) -> None:
    client, engine = make_client(max_model_len=32)
    for n in (32, 33, 64, 320):
        resp = client.post(COMPL, json={"prompt": [5] * n, "max_tokens": 1, "stream": stream})
        err = assert_error(resp, 400)
        assert str(n) in err["message"] and "32" in err["message"]
    assert client.post(COMPL, json={"prompt": "ok", "stream": stream}).status_code == 200
    assert engine.running == set()


# ---- non-streaming shapes --------------------------------------------------------------------


def test_completion_response_shape_and_request_id() -> None:
    client, engine = make_client(script="abcdefghij")
    resp = client.post(
        COMPL,
        json={"model": MODEL, "prompt": "hey", "max_tokens": 4, "temperature": 0},
        headers={"X-Request-Id": "r-42"},
    )
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "r-42"
    body = resp.json()
    assert body["id"] == "cmpl-r-42" and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "text": "abcd", "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    ids, params, prompt = engine.requests["cmpl-r-42"]
    assert ids == [ord(c) for c in "hey"] and prompt == "hey"
    assert params.max_tokens == 4 and params.temperature == 0.0
    # No header: a fresh id, echoed.
    resp = client.post(COMPL, json={"prompt": [104, 105]})
    assert resp.json()["id"] == "cmpl-" + resp.headers["x-request-id"]
    assert engine.requests[resp.json()["id"]][2] is None
    assert engine.requests[resp.json()["id"]][1].max_tokens == 16


def test_chat_response_shape_and_max_tokens_policy() -> None:
    client, engine = make_client(script="Hi!")
    body = client.post(CHAT, json={"model": MODEL, "messages": HI, "stop": "!"}).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt_ids, params, _ = engine.requests[body["id"]]
    assert params.max_tokens is None and params.stop == ["!"]  # chat default: up to the window
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    body = client.post(
        CHAT, json={"messages": HI, "max_tokens": 9, "max_completion_tokens": 2}
    ).json()
    assert engine.requests[body["id"]][1].max_tokens == 2
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


def test_models_health_metrics() -> None:
    client, engine = make_client()
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
        (MODEL, "model", engine.max_model_len)
    ]
    assert client.get("/health").json() == {"status": "ok"}
    engine.alive = False  # the engine thread died
    err = assert_error(client.get("/health"), 500)
    assert "died" in err["message"]
    client.post(COMPL, json={"prompt": "x", "max_tokens": 2})
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    assert ('jaxserve:request_success_total{finished_reason="length",model_name="fake-model"} 1.0'
            in resp.text)


def test_engine_fault_is_500_json() -> None:
    client, _ = make_client(fail_after=2)
    err = assert_error(client.post(COMPL, json={"prompt": "x"}), 500)
    assert err["type"] == "server_error"


# ---- streaming (cases 34-38) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,reason",
    [({"max_tokens": 5}, "length"), ({"stop": ["lo"]}, "stop"), ({"max_tokens": 100}, "stop")],
)
@pytest.mark.parametrize("include_usage", [None, False, True])
def test_completion_stream(extra: dict, reason: str, include_usage: bool | None) -> None:
    client, _ = make_client(script="Hello world")
    body = {"prompt": "p", **extra}
    ns = client.post(COMPL, json=body).json()
    opts = {} if include_usage is None else {"stream_options": {"include_usage": include_usage}}
    resp = client.post(COMPL, json={**body, "stream": True, **opts})
    assert resp.status_code == 200
    cs = chunks(resp)
    content = [c for c in cs if c["choices"]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in cs)
    assert len({c["id"] for c in cs}) == 1 and cs[0]["id"].startswith("cmpl-")
    finishes = [c["choices"][0]["finish_reason"] for c in content]
    assert finishes[-1] == reason and finishes[:-1] == [None] * (len(finishes) - 1)
    assert "".join(c["choices"][0]["text"] for c in content) == ns["choices"][0]["text"]
    if include_usage:
        assert all("usage" in c and c["usage"] is None for c in content)
        assert len(cs) == len(content) + 1 and cs[-1]["choices"] == []
        assert cs[-1]["usage"] == ns["usage"]
    else:
        assert all("usage" not in c for c in cs) and cs == content
    if reason == "length":
        assert ns["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream(include_usage: bool) -> None:
    client, _ = make_client(script="Sure, 1 2 3.")
    body = {"messages": HI, "max_tokens": 50}
    ns = client.post(CHAT, json=body).json()
    resp = client.post(
        CHAT, json={**body, "stream": True, "stream_options": {"include_usage": include_usage}}
    )
    cs = chunks(resp)
    assert all(c["object"] == "chat.completion.chunk" for c in cs)
    assert cs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    with_choices = [c for c in cs if c["choices"]]
    fin = with_choices[-1]["choices"][0]
    assert fin["delta"] == {} and fin["finish_reason"] == "stop"
    middle = [c["choices"][0] for c in with_choices[1:-1]]
    assert all(set(ch["delta"]) == {"content"} and ch["finish_reason"] is None for ch in middle)
    assert (
        "".join(ch["delta"]["content"] for ch in middle) == ns["choices"][0]["message"]["content"]
    )
    if include_usage:
        assert all(c["usage"] is None for c in with_choices)
        assert cs[-1]["choices"] == [] and cs[-1]["usage"] == ns["usage"]
        assert len(cs) == len(with_choices) + 1
    else:
        assert all("usage" not in c for c in cs)


def test_error_mid_stream_sends_error_event_then_done() -> None:
    client, engine = make_client(fail_after=3)
    for path, body in ((COMPL, {"prompt": "x"}), (CHAT, {"messages": HI})):
        data = sse_data(client.post(path, json={**body, "stream": True}))
        err = json.loads(data[-2])["error"]
        assert err["type"] == "server_error" and "simulated engine fault" in err["message"]
    assert engine.running == set()


# ---- disconnects (case 30) -------------------------------------------------------------------


async def _drive(
    app: object, path: str, body: dict, rid: str, disconnect: asyncio.Event
) -> list[dict]:
    """Run one request through the ASGI app; deliver ``http.disconnect`` once ``disconnect`` is
    set. Returns the messages the app sent."""
    sent: list[dict] = []
    raw = json.dumps(body).encode()
    request_sent = False

    async def receive() -> dict:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"x-request-id", rid.encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=5)  # type: ignore[operator]
    return sent


@pytest.mark.parametrize("path,kind", [(COMPL, "cmpl"), (CHAT, "chatcmpl")])
def test_stream_disconnect_aborts(path: str, kind: str) -> None:
    engine = FakeEngine(max_model_len=100_000, step_s=0.001)
    app = build_app(engine, MODEL)
    body = {"prompt": "x", "messages": HI, "max_tokens": 4000, "ignore_eos": True, "stream": True}

    async def main() -> list[dict]:
        gone = asyncio.Event()
        task = asyncio.ensure_future(_drive(app, path, body, "s1", gone))
        while engine.steps.get(f"{kind}-s1", 0) < 3:
            await asyncio.sleep(0.001)
        gone.set()
        return await task

    sent = asyncio.run(main())
    assert sent[0]["status"] == 200
    assert engine.aborted == [f"{kind}-s1"] and engine.running == set()
    assert engine.steps[f"{kind}-s1"] < 100
    assert ('jaxserve:num_aborted_requests_total{model_name="fake-model"} 1.0'
            in engine.metrics.render().decode())


@pytest.mark.parametrize("first_delay_s", [0.0, 30.0])
def test_non_stream_disconnect_aborts(first_delay_s: float) -> None:
    engine = FakeEngine(max_model_len=100_000, step_s=0.001, first_delay_s=first_delay_s)
    app = build_app(engine, MODEL)
    body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True}

    async def main() -> None:
        gone = asyncio.Event()
        task = asyncio.ensure_future(_drive(app, COMPL, body, "n1", gone))
        while "cmpl-n1" not in engine.steps or (not first_delay_s and engine.steps["cmpl-n1"] < 3):
            await asyncio.sleep(0.001)
        gone.set()
        await task

    asyncio.run(main())
    assert engine.aborted == ["cmpl-n1"] and engine.running == set()
    assert engine.steps["cmpl-n1"] < 100


def test_stream_disconnect_while_queued_aborts() -> None:
    engine = FakeEngine(first_delay_s=30.0)
    app = build_app(engine, MODEL)

    async def main() -> None:
        gone = asyncio.Event()
        task = asyncio.ensure_future(
            _drive(app, CHAT, {"messages": HI, "stream": True}, "q1", gone)
        )
        while "chatcmpl-q1" not in engine.running:
            await asyncio.sleep(0.001)
        gone.set()
        await task

    asyncio.run(main())
    assert engine.aborted == ["chatcmpl-q1"]


# ---- a real uvicorn server and the official client -------------------------------------------


def test_openai_client_against_uvicorn() -> None:
    engine = FakeEngine(script="Hello world")
    with serve_app(build_app(engine, MODEL)) as base_url:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        c = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0)
        assert c.choices[0].text == "Hello" and c.choices[0].finish_reason == "length"
        assert c.usage.completion_tokens == 5
        parts = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=5, stream=True))
        assert "".join(p.choices[0].text for p in parts) == "Hello"
        r = client.chat.completions.create(model=MODEL, messages=HI)
        assert r.choices[0].message.content == "Hello world"
        assert r.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(
            model=MODEL, messages=HI, stream=True, stream_options={"include_usage": True}
        )
        parts = list(stream)
        text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        assert text == "Hello world" and parts[-1].usage.total_tokens == r.usage.total_tokens
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=HI)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=HI, temperature=-1)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=[1] * 100, stream=True)
    assert engine.running == set()


def test_disconnect_aborts_under_uvicorn() -> None:
    engine = FakeEngine(max_model_len=100_000, step_s=0.002)
    body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True}

    def wait_aborted(rid: str) -> None:
        for _ in range(500):
            if rid in engine.aborted:
                return
            time.sleep(0.01)
        raise AssertionError(f"{rid} was not aborted: {engine.aborted}")

    with serve_app(build_app(engine, MODEL)) as base_url, httpx.Client(base_url=base_url) as http:
        with http.stream(
            "POST", COMPL, json={**body, "stream": True}, headers={"X-Request-Id": "u1"}
        ) as resp:
            assert next(resp.iter_lines()).startswith("data: ")
        wait_aborted("cmpl-u1")
        with pytest.raises(httpx.ReadTimeout):
            http.post(COMPL, json=body, headers={"X-Request-Id": "u2"}, timeout=0.3)
        wait_aborted("cmpl-u2")
        assert http.post(COMPL, json={"prompt": "x"}).status_code == 200
    assert engine.steps["cmpl-u1"] < 1000 and engine.steps["cmpl-u2"] < 1000
    assert engine.running == set()


def test_explicit_nulls_mean_the_defaults() -> None:
    """OpenAI clients send explicit nulls; they are the documented defaults, not type errors."""
    client, _ = make_client()
    nulls = {"n": None, "stream": None, "ignore_eos": None, "include_stop_str_in_output": None,
             "skip_special_tokens": None, "max_tokens": None}
    r = client.post(COMPL, json={"model": MODEL, "prompt": "hi", "echo": None, **nulls})
    assert r.status_code == 200, r.text
    r = client.post(CHAT, json={"model": MODEL, "messages": HI, "add_generation_prompt": None,
                                **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"  # stream: null is not a stream


def test_max_completion_tokens_error_names_that_field() -> None:
    client, _ = make_client()
    err = assert_error(client.post(CHAT, json={"messages": HI, "max_completion_tokens": 0}), 400)
    assert err["param"] == "max_completion_tokens"
    assert err["message"].startswith("max_completion_tokens")
