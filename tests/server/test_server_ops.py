"""Operating the server against the fake engine: API key, the bounded waiting queue, per-request
timeouts, the SIGTERM drain (a subprocess serving the fake engine through
``jaxserve.server.gate.run_server``, as ``jaxserve serve`` does), request ids in log records and
JSON logs, /tokenize and /detokenize, and /openapi.json.

Semantics chosen (docs/api.md#behaviour-chosen-where-the-openai-api-leaves-room): a wrong or missing key is 401; a full queue or a draining
server is 503 with ``Retry-After``; a timed-out request is 504 (``timeout_error``) or, once a
stream has started, an error event then ``[DONE]``; the drain answers what is left at its
timeout with 503 / an error event (``server_error``), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from jaxserve.cli.main import build_parser, main
from jaxserve.config_args import server_config_from_args
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.logs import JsonFormatter, TextFormatter, request_id_var
from jaxserve.server.routes import build_app
from jaxserve.server_config import ServerConfig
from tests.support.fake_engine import FakeEngine, FakeTokenizer
from tests.support.http_server import serve_app

MODEL = "test-model"
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
TESTS = Path(__file__).resolve().parents[1] / "support"
LONG = {"prompt": "x", "max_tokens": 5000, "ignore_eos": True}


def make(config: ServerConfig | None = None, **engine_kwargs: object
         ) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(**engine_kwargs)  # type: ignore[arg-type]
    return TestClient(build_app(engine, MODEL, config)), engine


def assert_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    assert err["code"] is None or isinstance(err["code"], str)  # as OpenAI: never the status
    return err


def sse(text: str) -> list[str]:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    return [e.removeprefix("data: ") for e in text.split("\n\n")[:-1]]


# ---- API key ---------------------------------------------------------------------------------


def test_api_key_guards_v1_tokenize_detokenize_only() -> None:
    client, engine = make(ServerConfig(api_key="sekret"))
    good = {"Authorization": "Bearer sekret"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                    {"Authorization": "Basic sekret"}, {"Authorization": "Bearer sekret2"}):
        resp = client.post(COMPL, json={"prompt": "hi"}, headers={**headers, "X-Request-Id": "a1"})
        assert_error(resp, 401)
        assert resp.headers["www-authenticate"] == "Bearer"
        assert resp.headers["x-request-id"] == "a1"
    assert engine.requests == {}
    assert_error(client.get("/v1/models"), 401)
    assert_error(client.post("/v1/nope", json={}), 401)  # the key is checked before routing
    assert_error(client.post("/tokenize", json={"prompt": "hi"}), 401)
    assert_error(client.post("/detokenize", json={"tokens": [104]}), 401)
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert client.get(path).status_code == 200, path
    assert client.post(COMPL, json={"prompt": "hi"}, headers=good).status_code == 200
    assert client.post(CHAT, json={"messages": HI},
                       headers={"authorization": "bearer sekret"}).status_code == 200
    assert client.get("/v1/models", headers=good).status_code == 200
    assert client.post("/tokenize", json={"prompt": "hi"}, headers=good).status_code == 200


def test_api_key_with_openai_client() -> None:
    engine = FakeEngine(script="Hello")
    with serve_app(build_app(engine, MODEL, ServerConfig(api_key="k1"))) as url:
        ok = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="hi").choices[0].text == "Hello"
        bad = openai.OpenAI(base_url=url + "/v1", api_key="k2", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi")


def test_server_flags_and_api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    assert server_config_from_args(parse(["serve"])) == ServerConfig()
    monkeypatch.setenv("JAXSERVE_API_KEY", "from-env")
    assert server_config_from_args(parse(["serve"])).api_key == "from-env"
    cfg = server_config_from_args(parse([
        "serve", "--api-key", "flag", "--max-waiting-requests", "7", "--request-timeout-s", "2.5",
        "--shutdown-timeout", "4", "--timeout-keep-alive", "75", "--metrics-compat", "vllm",
        "--log-format", "json", "--port", "0"]))
    assert cfg == ServerConfig(port=0, api_key="flag", max_waiting_requests=7,
                               request_timeout_s=2.5, shutdown_timeout=4.0,
                               timeout_keep_alive=75, metrics_compat="vllm", log_format="json")
    # invalid server settings fail before any model is loaded
    for bad in (["--max-waiting-requests", "0"], ["--request-timeout-s", "0"],
                ["--shutdown-timeout", "-1"], ["--timeout-keep-alive", "0"]):
        assert main(["serve", *bad]) == 2
    for bad in (["--log-format", "xml"], ["--metrics-compat", "sglang"]):
        with pytest.raises(SystemExit):
            parse(["serve", *bad])


# ---- the bounded waiting queue ---------------------------------------------------------------


def test_full_queue_is_503_with_retry_after() -> None:
    engine = FakeEngine(first_delay_s=0.4)
    app = build_app(engine, MODEL, ServerConfig(max_waiting_requests=2))

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            queued = [asyncio.ensure_future(http.post(COMPL, json={"prompt": "hi"}))
                      for _ in range(2)]
            while engine.num_waiting() < 2:
                await asyncio.sleep(0.005)
            for path, body in ((COMPL, {"prompt": "hi"}), (CHAT, {"messages": HI})):
                resp = await http.post(path, json=body)
                err = assert_error(resp, 503)
                assert err["type"] == "server_error" and "2" in err["message"]
                assert resp.headers["retry-after"] == "1"
            assert (await http.get("/v1/models")).status_code == 200  # only generation is bounded
            assert [(await q).status_code for q in queued] == [200, 200]
            assert engine.num_waiting() == 0
            assert (await http.post(COMPL, json={"prompt": "hi"})).status_code == 200

    asyncio.run(run())
    assert len(engine.requests) == 3 and engine.running == set()


class _StubLLMEngine:
    """Just what AsyncEngine's thread uses of LLMEngine: a waiting list, one running request
    at a time, steps that produce nothing."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len, self.metrics, self.model_name = 64, None, "stub"
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.requests: dict[str, object] = {}

    def validate(self, ids: list[int], params: SamplingParams) -> int:
        return 1

    def add_request(self, rid: str, ids: list[int], params: SamplingParams,
                    prompt: str | None, arrival_time: float | None = None,
                    grammar: object = None, max_tokens: int | None = None) -> None:
        self.requests[rid] = params
        self.waiting.append(rid)

    def abort_request(self, ids: str | list[str]) -> list[str]:
        ids = [ids] if isinstance(ids, str) else ids
        for rid in ids:
            self.requests.pop(rid, None)
            for q in (self.waiting, self.running):
                if rid in q:
                    q.remove(rid)
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def close(self) -> None:  # AsyncEngine.shutdown stops the engine's KV-events publisher
        self.closed = True

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def step(self) -> list:
        if not self.running and self.waiting:
            self.running.append(self.waiting.pop(0))
        time.sleep(0.002)
        return []


def test_async_engine_counts_waiting_requests() -> None:
    aeng = AsyncEngine(_StubLLMEngine())  # type: ignore[arg-type]
    aeng.start(warmup=False)

    async def consume(rid: str) -> None:
        async for _ in aeng.generate([1, 2], SamplingParams(), rid):
            pass

    async def until(cond: object) -> None:
        for _ in range(2000):
            if cond():  # type: ignore[operator]
                return
            await asyncio.sleep(0.001)
        raise AssertionError(f"num_waiting stuck at {aeng.num_waiting()}")

    async def run() -> None:
        assert aeng.num_waiting() == 0
        tasks = [asyncio.ensure_future(consume(f"r{i}")) for i in range(4)]
        await until(lambda: aeng.num_waiting() == 3)  # one runs, three wait
        tasks[3].cancel()
        await until(lambda: aeng.num_waiting() == 2)
        for t in tasks:
            t.cancel()
        await until(lambda: aeng.num_waiting() == 0)

    try:
        asyncio.run(run())
    finally:
        aeng.shutdown()


def test_async_engine_reports_a_dead_engine_thread() -> None:
    class Broken(_StubLLMEngine):
        def has_unfinished_requests(self) -> bool:
            raise RuntimeError("scheduler state corrupted")

    aeng = AsyncEngine(Broken())  # type: ignore[arg-type]
    assert aeng.alive  # not started: nothing has died
    aeng.start(warmup=False)
    for _ in range(2000):
        if not aeng.alive:
            break
        time.sleep(0.001)
    assert not aeng.alive
    aeng.shutdown()


# ---- per-request timeout ---------------------------------------------------------------------


def test_request_timeout_non_stream_and_queued() -> None:
    cfg = ServerConfig(request_timeout_s=0.15)
    client, engine = make(cfg, max_model_len=100_000, step_s=0.005)
    t0 = time.monotonic()
    err = assert_error(client.post(COMPL, json=LONG, headers={"X-Request-Id": "t1"}), 504)
    assert err["type"] == "timeout_error" and "0.15" in err["message"]
    assert time.monotonic() - t0 < 2 and engine.aborted == ["cmpl-t1"]
    assert client.post(COMPL, json={"prompt": "x", "max_tokens": 3}).status_code == 200
    client, engine = make(cfg, first_delay_s=30.0)  # never leaves the queue
    assert_error(client.post(CHAT, json={"messages": HI}, headers={"X-Request-Id": "t2"}), 504)
    assert engine.aborted == ["chatcmpl-t2"] and engine.waiting == set()


def test_request_timeout_mid_stream_sends_error_then_done() -> None:
    client, engine = make(ServerConfig(request_timeout_s=0.15), max_model_len=100_000,
                          step_s=0.005)
    resp = client.post(COMPL, json={**LONG, "stream": True}, headers={"X-Request-Id": "t3"})
    assert resp.status_code == 200
    data = sse(resp.text)
    assert len(data) > 3 and json.loads(data[0])["choices"][0]["text"] == "H"
    err = json.loads(data[-2])["error"]
    assert err["code"] is None and err["type"] == "timeout_error"
    assert engine.aborted == ["cmpl-t3"] and engine.running == set()


# ---- draining ------------------------------------------------------------------------------


def test_draining_refuses_everything_but_the_probes() -> None:
    client, _ = make(ServerConfig(shutdown_timeout=20.0))
    gate = client.app.state.gate  # type: ignore[attr-defined]
    assert client.get("/ready").json()["stage"] == "ready"
    assert 'jaxserve:draining{model_name="test-model"} 0.0' in client.get("/metrics").text
    gate.start_drain()
    for resp in (client.post(COMPL, json={"prompt": "hi"}), client.get("/v1/models"),
                 client.get("/openapi.json")):
        assert_error(resp, 503)
        assert resp.headers["retry-after"] == "1"
    ready = client.get("/ready")
    body = ready.json()
    assert ready.status_code == 503 and body["stage"] == "draining"
    assert 0 <= body["progress"] < 1 and 0 < body["eta_s"] <= 20.0  # until the drain timeout
    assert client.get("/health").status_code == 200  # still alive: liveness must not fail
    assert 'jaxserve:draining{model_name="test-model"} 1.0' in client.get("/metrics").text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_fake_server(*args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(TESTS / "serve_fake.py"), str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"fake server did not start: {proc.communicate()[1][-2000:]!r}")
        time.sleep(0.05)


def _stream_then_sigterm(proc: subprocess.Popen, url: str, body: dict, rid: str) -> list[str]:
    """Start a stream, SIGTERM the server after its first event, check that new requests are
    refused while the stream runs on; return the stream's data payloads."""
    with (
        httpx.Client(base_url=url, timeout=20) as http,
        http.stream("POST", COMPL, json={**body, "stream": True},
                    headers={"X-Request-Id": rid}) as resp,
    ):
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        proc.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=url, timeout=5) as other:
            deadline = time.monotonic() + 5  # the drain starts at once, at the signal
            while (ready := other.get("/ready")).status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert ready.status_code == 503 and ready.json()["stage"] == "draining"
            assert other.get("/health").status_code == 200
            refused = other.post(COMPL, json={"prompt": "hi"})
            assert_error(refused, 503)
            assert refused.headers["retry-after"] == "1"
        rest = [line for line in lines if line]
    return [e.removeprefix("data: ") for e in [first, *rest]]


def _logs(proc: subprocess.Popen) -> list[dict]:
    assert proc.wait(15) == 0
    lines = proc.stderr.read().decode().splitlines()  # type: ignore[union-attr]
    return [json.loads(line) for line in lines]  # every line is one JSON object


def test_sigterm_drain_finishes_the_stream_and_exits_0() -> None:
    proc, url = _start_fake_server("--step-s", "0.03")
    try:
        data = _stream_then_sigterm(proc, url, {"prompt": "x", "max_tokens": 40,
                                                "ignore_eos": True}, "d1")
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(c["choices"][0]["text"] for c in chunks)) == 40
        logs = _logs(proc)
    finally:
        proc.kill()
    assert all(set(r) >= {"time", "level", "logger", "message", "request_id"} for r in logs)
    assert any(r["message"].startswith("draining: 1 request") for r in logs)
    assert any(r["message"].startswith("drained in") for r in logs)
    access = [r for r in logs if r["logger"] == "uvicorn.access" and "/v1/completions" in
              r["message"] and " 200" in r["message"]]
    assert [r["request_id"] for r in access] == ["d1"]


def test_sigterm_drain_timeout_aborts_the_rest_and_exits_0() -> None:
    proc, url = _start_fake_server("--step-s", "0.01", "--shutdown-timeout", "0.5")
    try:
        t0 = time.monotonic()
        data = _stream_then_sigterm(proc, url, LONG, "d2")
        assert time.monotonic() - t0 < 10
        assert data[-1] == "[DONE]"
        err = json.loads(data[-2])["error"]
        assert err["type"] == "server_error" and "shut down" in err["message"]
        logs = _logs(proc)
    finally:
        proc.kill()
    assert any("aborting 1 request" in r["message"] for r in logs)
    aborted = [r for r in logs if r["message"].startswith("aborted mid-stream")]
    assert [r["request_id"] for r in aborted] == ["d2"]


# ---- request ids in logs, log formats --------------------------------------------------------


def test_log_records_carry_the_request_id(caplog: pytest.LogCaptureFixture) -> None:
    client, _ = make(ServerConfig(request_timeout_s=0.05), first_delay_s=30.0)
    with caplog.at_level(logging.INFO):
        client.post(COMPL, json={"prompt": "x"}, headers={"X-Request-Id": "log-1"})
        resp = client.post(COMPL, json={"prompt": "x"})
    ours = [r for r in caplog.records if r.name.startswith("jaxserve")]
    assert [r.request_id for r in ours] == ["log-1", resp.headers["x-request-id"]]
    assert logging.getLogger("x").makeRecord("x", logging.INFO, "f", 1, "m", (), None).request_id \
        is None  # outside a request


def test_formatters() -> None:
    rec = logging.getLogger("jaxserve.t").makeRecord("jaxserve.t", logging.WARNING, "f", 1,
                                                     "hello %s", ("you",), None)
    rec.request_id = "r-9"
    obj = json.loads(JsonFormatter().format(rec))
    assert obj["level"] == "WARNING" and obj["logger"] == "jaxserve.t"
    assert obj["message"] == "hello you" and obj["request_id"] == "r-9"
    assert obj["time"].endswith("Z") and "T" in obj["time"]
    assert TextFormatter().format(rec).endswith("WARNING jaxserve.t [r-9]: hello you")
    try:
        raise ValueError("boom")
    except ValueError:
        rec.exc_info = sys.exc_info()
    assert "ValueError: boom" in json.loads(JsonFormatter().format(rec))["exc_info"]
    token = request_id_var.set("ctx")
    try:
        assert logging.getLogger("y").makeRecord("y", 20, "f", 1, "m", (), None).request_id \
            == "ctx"
    finally:
        request_id_var.reset(token)


# ---- /tokenize, /detokenize ------------------------------------------------------------------


def test_tokenize_and_detokenize() -> None:
    client, _ = make()
    body = client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}).json()
    assert body == {"tokens": [104, 105], "count": 2, "max_model_len": 64}
    chat = client.post("/tokenize", json={"messages": HI}).json()
    rendered = "<|user|>hi\n<|assistant|>"
    assert chat["tokens"] == [ord(c) for c in rendered] and chat["count"] == len(rendered)
    no_gen = client.post("/tokenize", json={"messages": HI, "add_generation_prompt": False})
    assert no_gen.json()["count"] == len("<|user|>hi\n")
    out = client.post("/detokenize", json={"tokens": chat["tokens"]}).json()
    assert out == {"prompt": rendered}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": HI}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [104, 0x110000]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),  # a missing field is named too
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
])
def test_tokenize_errors(path: str, body: dict, status: int, param: str | None) -> None:
    client, _ = make()
    assert assert_error(client.post(path, json=body), status)["param"] == param
    assert_error(client.get(path), 405)


# ---- /openapi.json ---------------------------------------------------------------------------


@pytest.mark.parametrize("api_key", [None, "k"])
def test_openapi_document(api_key: str | None) -> None:
    client, _ = make(ServerConfig(api_key=api_key))
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    # OpenAPI writes a path parameter as {name}; Starlette's route may add a converter
    routes = {re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path): {m.lower() for m in r.methods
                                                          if m != "HEAD"}
              for r in client.app.routes if isinstance(r, Route)}  # type: ignore[attr-defined]
    assert {path: set(ops) for path, ops in doc["paths"].items()} == routes
    schemas = doc["components"]["schemas"]

    def resolve(ref: str) -> dict:
        return schemas[ref.removeprefix("#/components/schemas/")]

    for path, ops in doc["paths"].items():
        for op in ops.values():
            for resp in op["responses"].values():
                for media in resp.get("content", {}).values():
                    if "$ref" in media["schema"]:
                        resolve(media["schema"]["$ref"])
            assert ("security" in op) == (api_key is not None and path not in
                                          ("/health", "/ready", "/metrics", "/openapi.json"))
    compl = resolve(doc["paths"][COMPL]["post"]["requestBody"]["content"]["application/json"]
                    ["schema"]["$ref"])
    assert "prompt" in compl["required"] and "max_tokens" in compl["properties"]
    chat = resolve(doc["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]
                   ["schema"]["$ref"])
    assert chat["required"] == ["messages"]
    tok = resolve(doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]
                  ["application/json"]["schema"]["$ref"])
    assert {"prompt", "messages", "add_generation_prompt"} <= set(tok["properties"])
    assert "text/event-stream" in doc["paths"][COMPL]["post"]["responses"]["200"]["content"]
    assert ("securitySchemes" in doc["components"]) == (api_key is not None)



def test_gate_counts_admitted_requests_not_yet_queued() -> None:
    """A simultaneous burst: requests the gate let in that are still reading their body or
    tokenising (not yet handed to the engine) count against --max-waiting-requests, so the
    burst cannot all pass before any of it reaches the engine (found by
    docs/decisions/0013-overload.md: 200 simultaneous requests against a cap of 8 were all
    admitted)."""
    from jaxserve.server.gate import Gate, RequestBudget
    from jaxserve.server.lifecycle import Lifecycle

    class Idle:
        def num_waiting(self) -> int:
            return 0

    async def run() -> None:
        gate = Gate(Idle(), ServerConfig(max_waiting_requests=2), Lifecycle(ready=True))
        scope = {"type": "http", "path": "/v1/completions", "headers": []}
        assert gate.refusal(scope) is None
        first, second = RequestBudget(None), RequestBudget(None)
        gate.inflight |= {first, second}  # both admitted, neither queued yet
        refused = gate.refusal(scope)
        assert refused is not None and refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert b"2 requests are waiting" in refused.body
        first.queued = True  # handed over: the engine's own waiting count covers it now
        assert gate.refusal(scope) is None
        assert gate.refusal({**scope, "path": "/v1/models"}) is None  # only generation is gated

    asyncio.run(run())
