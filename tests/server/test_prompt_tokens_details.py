"""``--enable-prompt-tokens-details`` (vLLM's flag): ``usage.prompt_tokens_details.cached_tokens``
is the prompt tokens the prefix cache held when the request was first scheduled, in chat and
completions responses, streamed (the usage chunk) or not; AIPerf's prompt-cache metrics and
GuideLLM's ``cached_tokens`` read it. Off (the default), the usage has no such key. The
Responses API always says it in ``usage.input_tokens_details.cached_tokens``. Real SmolLM2
engine with a fresh, empty prefix cache, over real HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.routes import build_app
from jaxserve.server_config import ServerConfig
from tests.support.http_server import serve_app
from tests.support.kv import kv_manager

MODEL = "smollm2"
TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening to light the lamp, "
        "counting the steps as his father had taught him, and wrote the weather in a book. ")


@pytest.fixture
def serve(idle_engine):
    """``serve(details)``: an httpx client of a server on the shared engine (fresh prefix
    cache) with ``enable_prompt_tokens_details=details``."""
    import contextlib

    @contextlib.contextmanager
    def run(details: bool):
        with kv_manager(idle_engine, caching=True):
            aeng = AsyncEngine(idle_engine)
            aeng.start(warmup=False)
            try:
                cfg = ServerConfig(enable_prompt_tokens_details=details)
                with serve_app(build_app(aeng, MODEL, cfg)) as url, \
                        httpx.Client(base_url=url, timeout=60) as http:
                    yield http
            finally:
                aeng.shutdown()

    return run


def cached_if_hit(num_prompt_tokens: int) -> int:
    """The prompt tokens a repeated prompt finds cached: its full blocks of 16, leaving at
    least its last token to compute."""
    return (num_prompt_tokens - 1) // 16 * 16


def test_cached_tokens_in_chat_and_completions_usage(serve) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": TEXT * 2}],
            "max_tokens": 2}
    with serve(True) as http:
        first = http.post("/v1/chat/completions", json=chat).json()["usage"]
        again = http.post("/v1/chat/completions", json=chat).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        n = again["prompt_tokens"]
        assert n > 32 and again["prompt_tokens_details"] == {"cached_tokens": cached_if_hit(n)}
        # streamed: the usage chunk says the same
        lines = [json.loads(x[6:]) for x in http.post("/v1/chat/completions", json={
            **chat, "stream": True, "stream_options": {"include_usage": True}}
        ).text.splitlines() if x.startswith("data: {")]
        assert lines[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached_if_hit(n)}
        # completions with two prompts: summed over them
        body = {"model": MODEL, "prompt": [TEXT * 2, TEXT * 2], "max_tokens": 1}
        http.post("/v1/completions", json=body)
        u = http.post("/v1/completions", json=body).json()["usage"]
        each = u["prompt_tokens"] // 2
        assert u["prompt_tokens_details"] == {"cached_tokens": 2 * cached_if_hit(each)}
        r = http.post("/v1/responses", json={"model": MODEL, "input": TEXT * 2,
                                             "max_output_tokens": 2}).json()
        http_again = http.post("/v1/responses", json={"model": MODEL, "input": TEXT * 2,
                                                      "max_output_tokens": 2}).json()
        assert r["usage"]["input_tokens_details"]["cached_tokens"] >= 0
        assert http_again["usage"]["input_tokens_details"]["cached_tokens"] == cached_if_hit(
            http_again["usage"]["input_tokens"])


def test_off_by_default_no_key(serve) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 2}
    with serve(False) as http:
        http.post("/v1/chat/completions", json=chat)
        usage = http.post("/v1/chat/completions", json=chat).json()["usage"]
        assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_the_flag_is_vllms() -> None:
    import argparse

    from jaxserve.config_args import add_server_args, server_config_from_args

    p = argparse.ArgumentParser()
    add_server_args(p)
    assert server_config_from_args(p.parse_args(["--enable-prompt-tokens-details"])
                                   ).enable_prompt_tokens_details
    assert not server_config_from_args(p.parse_args([])).enable_prompt_tokens_details
