"""Request validation against the fake engine: the configured caps (body size,
message count, n), a range check naming the field for every numeric field the API accepts,
unknown fields ignored, and features we do not have refused with 400.

Semantics chosen (docs/api.md#behaviour-chosen-where-the-openai-api-leaves-room): a body over ``--max-request-body-bytes`` is 413 before it
is parsed (by its ``Content-Length``, or while it is read when it has none); more messages than
``--max-num-messages`` and ``n`` above ``--max-n`` are 400s naming ``messages`` / ``n``, checked
before anything else and before tokenising.
"""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from jaxserve.cli.main import build_parser, main
from jaxserve.config_args import limits_from_args
from jaxserve.server.routes import build_app
from jaxserve.server_config import RequestLimits
from tests.support.fake_engine import FakeEngine

MODEL = "test-model"
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
J = {"content-type": "application/json"}


class CountingEngine(FakeEngine):
    """A FakeEngine that counts chat-template renders and encodes (to show what ran)."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.num_tokenised = 0
        tok = self.tokenizer
        encode, template = tok.encode, tok.apply_chat_template

        def counted_encode(text: str, add_special_tokens: bool = True) -> list[int]:
            self.num_tokenised += 1
            return encode(text, add_special_tokens)

        def counted_template(messages: list[dict], add_generation_prompt: bool = True) -> str:
            self.num_tokenised += 1
            return template(messages, add_generation_prompt)

        tok.encode, tok.apply_chat_template = counted_encode, counted_template  # type: ignore


def make(limits: RequestLimits | None = None, **kw: object) -> tuple[TestClient, CountingEngine]:
    engine = CountingEngine(**kw)
    return TestClient(build_app(engine, MODEL, limits=limits)), engine


def assert_error(resp: object, status: int, param: str | None = "-") -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["code"] is None or isinstance(err["code"], str)  # as OpenAI: never the status
    if param != "-":
        assert err["param"] == param, err
    return err


# ---- caps ------------------------------------------------------------------------------------


def test_body_over_the_cap_is_413_before_parsing() -> None:
    client, engine = make(RequestLimits(max_request_body_bytes=200))
    small = json.dumps({"prompt": "x" * 40, "pad": "p" * 100, "max_tokens": 2}).encode()
    assert len(small) <= 200 and client.post(COMPL, content=small, headers=J).status_code == 200
    big = json.dumps({"prompt": "x" * 300}).encode()
    err = assert_error(client.post(COMPL, content=big, headers=J), 413, None)
    assert "200" in err["message"] and "--max-request-body-bytes" in err["message"]
    # not JSON at all: still 413, so the cap comes before the parser
    assert_error(client.post(CHAT, content=b"{" * 500, headers=J), 413)
    # no Content-Length (chunked upload): the cap holds while reading
    resp = client.post(CHAT, content=iter([b'{"messages": [', b" " * 300, b"]}"]), headers=J)
    assert "content-length" not in resp.request.headers
    assert_error(resp, 413)
    for path, body in (("/tokenize", {"prompt": "y" * 300}), ("/detokenize", {"tokens": [1] * 99})):
        assert_error(client.post(path, json=body), 413)
    assert len(engine.requests) == 1 and engine.num_tokenised == 1  # only the small request ran
    assert client.post(COMPL, json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_message_count_cap_comes_before_tokenising() -> None:
    client, engine = make(RequestLimits(max_num_messages=3))
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(4)]
    for path, extra in ((CHAT, {}), ("/tokenize", {})):
        err = assert_error(client.post(path, json={"messages": msgs, **extra}), 400, "messages")
        assert "4 messages" in err["message"] and "3" in err["message"]
    assert engine.num_tokenised == 0 and engine.requests == {}
    assert client.post(CHAT, json={"messages": msgs[:3], "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("limits,n", [(None, 17), (None, 10**30), (RequestLimits(max_n=4), 5)])
@pytest.mark.parametrize("path,body", [(COMPL, {"prompt": "hi"}), (CHAT, {"messages": HI})])
def test_n_above_the_cap_is_400(limits: RequestLimits | None, n: int, path: str, body: dict
                                ) -> None:
    client, engine = make(limits)
    cap = (limits or RequestLimits()).max_n
    err = assert_error(client.post(path, json={**body, "n": n}), 400, "n")
    assert f"at most {cap}" in err["message"] and "--max-n" in err["message"]
    assert engine.num_tokenised == 0 and engine.requests == {}


def test_limit_flags_and_their_checks() -> None:
    ns = build_parser().parse_args(["serve", "--max-n", "3", "--max-num-messages", "7",
                                    "--max-request-body-bytes", "1000"])
    assert limits_from_args(ns) == RequestLimits(1000, 7, 3)
    ns = build_parser().parse_args(["run-batch", "-i", "a", "-o", "b", "--max-n", "2"])
    assert limits_from_args(ns).max_n == 2
    for field in ("max_request_body_bytes", "max_num_messages", "max_n"):
        with pytest.raises(ValueError, match=field):
            RequestLimits(**{field: 0})
    assert main(["serve", "--max-n", "0"]) == 2


# ---- every numeric field: a 400 naming it ----------------------------------------------------

BIG = 10**30
NUMERIC_CASES = [  # (path, field, bad value); vocabulary of the fake tokenizer: [0, 0x110000)
    (COMPL, "max_tokens", 0), (COMPL, "max_tokens", -1), (COMPL, "max_tokens", 1.5),
    (CHAT, "max_tokens", 0), (CHAT, "max_completion_tokens", 0),
    (CHAT, "max_completion_tokens", -BIG),
    (COMPL, "temperature", -0.1), (CHAT, "temperature", "1"),
    (COMPL, "top_p", 0), (COMPL, "top_p", 1.0001), (CHAT, "top_p", -1),
    (COMPL, "top_k", -2), (CHAT, "top_k", -BIG), (CHAT, "top_k", 2.5),
    (COMPL, "seed", 2**64), (CHAT, "seed", -(2**63) - 1), (CHAT, "seed", 1.0),
    (COMPL, "n", 0), (CHAT, "n", -1), (CHAT, "n", 17),
    (COMPL, "stop_token_ids", [-1]), (CHAT, "stop_token_ids", [0x110000]),
    (COMPL, "stop_token_ids", [BIG]), (CHAT, "stop_token_ids", [1.5]),
    (COMPL, "best_of", 0), (COMPL, "best_of", 3), (CHAT, "min_tokens", -1),
    (COMPL, "min_tokens", 17), (COMPL, "truncate_prompt_tokens", 0),
    (CHAT, "truncate_prompt_tokens", -2), (CHAT, "truncate_prompt_tokens", 1.5),
    (COMPL, "length_penalty", -2.0), (COMPL, "prompt_logprobs", -1),
    (COMPL, "prompt", [BIG]), (COMPL, "prompt", [-1, 5]), (COMPL, "prompt", [1.5]),
    # the sampling fields of item 1 (their ranges are chosen there; here: a 400 naming them)
    (COMPL, "min_p", 1.5), (CHAT, "min_p", -0.1), (CHAT, "presence_penalty", 2.5),
    (COMPL, "frequency_penalty", -3), (CHAT, "repetition_penalty", 0),
    (COMPL, "repetition_penalty", -1.0), (COMPL, "logprobs", -1), (COMPL, "logprobs", BIG),
    (CHAT, "top_logprobs", -1), (COMPL, "logit_bias", {"5": 101}),
    (CHAT, "logit_bias", {"5": -BIG}), (COMPL, "logit_bias", {"x": 1}),
    (COMPL, "cache_salt", ""), (CHAT, "cache_salt", 5),
]  # fmt: skip


@pytest.mark.parametrize("path,field,value", NUMERIC_CASES)
def test_numeric_field_out_of_range_is_400_naming_it(path: str, field: str, value: object
                                                     ) -> None:
    client, engine = make()
    body = {"prompt": "hi"} if path == COMPL else {"messages": HI}
    assert_error(client.post(path, json={**body, field: value}), 400, field)
    assert engine.running == set()
    assert client.post(path, json={**body, "max_tokens": 2}).status_code == 200


def test_prompt_too_long_names_messages_for_chat() -> None:
    client, _ = make(max_model_len=32)
    long = [{"role": "user", "content": "x" * 40}]
    assert_error(client.post(CHAT, json={"messages": long}), 400, "messages")
    assert_error(client.post(COMPL, json={"prompt": "x" * 40}), 400, "prompt")


def test_missing_required_field_is_400_naming_it() -> None:
    client, engine = make()
    assert_error(client.post(COMPL, json={"model": MODEL}), 400, "prompt")
    assert_error(client.post(CHAT, json={"model": MODEL}), 400, "messages")
    assert_error(client.post(CHAT, json={"messages": [{"content": "hi"}]}), 400, "messages")
    assert engine.num_tokenised == 0


def test_detokenize_ids_out_of_range_name_tokens() -> None:
    client, _ = make()
    for tokens in ([-1], [BIG], [0x110000]):
        assert_error(client.post("/detokenize", json={"tokens": tokens}), 400, "tokens")


# ---- unknown fields ignored, unsupported features refused ------------------------------------


def test_unknown_fields_are_ignored() -> None:
    client, engine = make()
    extra = {"frobnicate": [1, {"x": None}], "store": True, "metadata": {"k": "v"},
             "service_tier": "auto", "reasoning_effort": "low", "max_tokens": 2}
    assert client.post(CHAT, json={"messages": HI, **extra}).status_code == 200
    assert client.post(COMPL, json={"prompt": "hi", **extra}).status_code == 200
    assert client.post(CHAT, json={"messages": HI, "modalities": ["text"],
                                   "max_tokens": 2}).status_code == 200
    assert len(engine.requests) == 3


@pytest.mark.parametrize("field,value", [
    ("tool_choice", "required"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("response_format", {"type": "json_schema"}), ("audio", {"voice": "alloy"}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}), ("response_format", {"type": "structural_tag"}),
    ("use_beam_search", True),
    ("suffix", "bye"),
])  # fmt: skip
def test_unsupported_features_are_400_naming_them(field: str, value: object) -> None:
    client, engine = make()
    assert_error(client.post(CHAT, json={"messages": HI, field: value}), 400, field)
    assert engine.num_tokenised == 0
