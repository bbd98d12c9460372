"""Property-based fuzzing of the HTTP API from its own OpenAPI document (schemathesis).

For every operation of ``/openapi.json``, schemathesis generates requests that fit the schema
(positive) and requests that break it (negative: wrong types, missing fields, odd bodies).
Properties: no request ever gets a 5xx; every answer's status is one the document declares,
with the declared content type and a body that matches the declared schema; and a normal
request afterwards still succeeds (the engine keeps serving). The fake engine runs in-process
(fast, many examples); then a short run against the real SmolLM2 engine behind uvicorn, with a
request timeout so that a generated ``max_tokens`` of thousands costs at most that long (504 is
an allowed answer; 500 is not), after which the engine must be idle with every KV block free.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.testclient import TestClient

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.routes import build_app
from jaxserve.server_config import ServerConfig
from tests.support.fake_engine import FakeEngine
from tests.support.http_server import serve_app

MODEL = "fuzz-model"
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("DELETE", "/v1/responses/{response_id}"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model_id}"), ("GET", "/tokenizer_info"),
              ("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics")]  # schemathesis skips /openapi.json
NORMAL = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 2},
          "/v1/responses": {"input": "hi", "max_output_tokens": 2}}


def _fuzz(operation: schemathesis.APIOperation, max_examples: int, allowed_5xx: tuple = (),
          **call_kwargs: object) -> dict[int, int]:
    """Run ``max_examples`` positive and (for operations with a body) negative cases, checking
    each answer (no 5xx but ``allowed_5xx``; status, content type and body as documented);
    return how many answers had each status."""
    statuses: dict[int, int] = {}
    modes = [GenerationMode.POSITIVE]
    if operation.body:
        modes.append(GenerationMode.NEGATIVE)
    for mode in modes:

        @settings(max_examples=max_examples, deadline=None, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: schemathesis.Case) -> None:
            response = case.call(**call_kwargs)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            status = response.status_code
            assert status < 500 or status in allowed_5xx, (status, response.text, case.body)
            case.validate_response(response, checks=CHECKS)

        check()
    return statuses


def test_openapi_lists_every_route() -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(FakeEngine(), MODEL))
    found = {(r.ok().method.upper(), r.ok().path) for r in schema.get_all_operations()}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize("method,path", OPERATIONS)
def test_fuzz_fake_engine(method: str, path: str) -> None:
    engine = FakeEngine(max_model_len=256)
    app = build_app(engine, MODEL, ServerConfig(request_timeout_s=10.0))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    statuses = _fuzz(schema[path][method], max_examples=40)
    assert all(s < 500 for s in statuses), statuses
    assert engine.running == set() and engine.waiting == set()
    if path in NORMAL:
        resp = TestClient(app).post(path, json={**NORMAL[path], "model": MODEL})
        assert resp.status_code == 200, resp.text


@pytest.fixture(scope="module")
def real_server(engine):  # conftest's session engine: the real SmolLM2-135M
    aeng = AsyncEngine(engine)
    aeng.start(warmup=False)
    app = build_app(aeng, MODEL, ServerConfig(request_timeout_s=2.0))
    try:
        with serve_app(app) as base_url:
            yield base_url, aeng
    finally:
        aeng.shutdown()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses",
                                  "/tokenize"])
def test_fuzz_real_engine(real_server, engine, path: str) -> None:
    base_url, aeng = real_server
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    statuses = _fuzz(schema[path]["POST"], max_examples=8, allowed_5xx=(504,),
                     base_url=base_url)
    assert all(s < 500 or s == 504 for s in statuses), statuses
    if path in NORMAL:
        resp = httpx.post(base_url + path, json=NORMAL[path], timeout=60)
        assert resp.status_code == 200, resp.text
    for _ in range(200):  # aborted requests leave the engine within a step or two
        if aeng.num_unfinished() == 0 and not engine.has_unfinished_requests():
            break
        httpx.get(base_url + "/health", timeout=10)
    assert aeng.num_unfinished() == 0 and not engine.has_unfinished_requests()
    pool = engine.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
