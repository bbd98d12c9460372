"""Batched prompts and prompt scoring on ``/v1/completions`` over HTTP, on the real model: what
evaluation harnesses (lm-evaluation-harness ``local-completions`` with ``--batch_size``) send.
A real uvicorn on 127.0.0.1 serves the shared session engine (``AsyncEngine`` over it), driven
with httpx and the official ``openai`` client.

Semantics asserted (docs/api.md#behaviour-chosen-where-the-openai-api-leaves-room):
- ``prompt`` may be a list of strings or of token-id lists; each prompt runs as its own engine
  request, all at once. Prompt ``i``'s choice ``j`` is choice ``i * n + j`` (choices ordered
  prompt-major, then by ``n``) and is what the same request with that prompt alone returns;
  usage sums every prompt's tokens and every choice's.
- Streamed, every chunk carries one choice with that index; the prompts' chunks interleave as
  the engine produces them; each choice finishes once; the usage chunk sums every prompt.
- ``echo`` + ``logprobs`` + ``max_tokens: 0`` scores the prompts: each choice is the prompt's
  text and its tokens' logprobs (the first null), no generated token, ``finish_reason``
  "length", ``completion_tokens`` 0; the logprobs are those that ``max_tokens: 1`` (the form
  lm-eval sends, dropping the last entry) returns for the prompt tokens.
"""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from jaxserve.engine.llm_engine import LLMEngine
from tests.support.http_server import serve_engine

MODEL = "m"
COMPL = "/v1/completions"
PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):"]


@pytest.fixture(scope="module")
def base_url(engine: LLMEngine):
    # batched and single requests are compared exactly: prefix caching off
    with serve_engine(engine, MODEL, caching=False) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def _post(http, body: dict) -> dict:
    r = http.post(COMPL, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _sse(http, body: dict) -> list[dict]:
    with http.stream("POST", COMPL, json={"model": MODEL, "stream": True, **body}) as r:
        raw = r.read()
    assert r.status_code == 200, raw
    parts = raw.split(b"\n\n")
    assert parts[-2:] == [b"data: [DONE]", b""], raw[-200:]
    return [json.loads(p[len(b"data: "):]) for p in parts[:-2]]


def _texts(choices: list[dict]) -> list[str]:
    assert [c["index"] for c in choices] == list(range(len(choices)))
    return [c["text"] for c in choices]


# ---- batched prompts --------------------------------------------------------------------------


def test_batch_is_its_prompts_run_alone(http, engine: LLMEngine) -> None:
    body = {"max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 2, "ignore_eos": True}
    batch = _post(http, {"prompt": PROMPTS, **body})
    singles = [_post(http, {"prompt": p, **body}) for p in PROMPTS]
    expected = [t for s in singles for t in _texts(s["choices"])]
    assert _texts(batch["choices"]) == expected  # index i * n + j: prompt i, choice j
    assert len(set(expected)) > len(PROMPTS)  # the choices differ, so the order is checked
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles), key
    assert batch["usage"]["completion_tokens"] == len(PROMPTS) * 2 * 5
    assert all(c["finish_reason"] == "length" for c in batch["choices"])
    # the same prompts as token-id lists
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    as_ids = _post(http, {"prompt": ids, **body})
    assert _texts(as_ids["choices"]) == expected and as_ids["usage"] == batch["usage"]


def test_batch_with_the_openai_client(base_url, http) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0)
    greedy = [_post(http, {"prompt": p, "max_tokens": 4, "temperature": 0}) for p in PROMPTS]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [
        g["choices"][0]["text"] for g in greedy]
    assert r.usage.prompt_tokens == sum(g["usage"]["prompt_tokens"] for g in greedy)


def test_batch_stream_interleaves_choices_by_index(http) -> None:
    body = {"prompt": PROMPTS, "max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 2,
            "ignore_eos": True}
    ns = _post(http, body)
    events = _sse(http, {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"] == ns["usage"]
    text = {i: "" for i in range(len(PROMPTS) * 2)}
    finished, order = [], []
    for e in events[:-1]:
        (choice,) = e["choices"]  # one choice per chunk
        assert e["id"] == events[0]["id"] and e["usage"] is None
        text[choice["index"]] += choice["text"]
        order.append(choice["index"])
        if choice["finish_reason"] is not None:
            finished.append(choice["index"])
    assert [text[i] for i in sorted(text)] == _texts(ns["choices"])
    assert sorted(finished) == list(range(len(PROMPTS) * 2))
    # the prompts ran together: the last prompt started before the first one finished
    assert order.index(4) < len(order) - 1 - order[::-1].index(0)


# ---- scoring: echo + logprobs + max_tokens 0 -------------------------------------------------


def _check_scored(choice: dict, prompt_ids: list[int], text: str) -> list[float | None]:
    lp = choice["logprobs"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt_ids)
    assert "".join(lp["tokens"]) == text
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert math.isfinite(value) and value <= 0 and len(top) == 1
        # lm-eval's is_greedy: the token is the argmax exactly when its value is the top's
        assert value <= max(top.values())
    return lp["token_logprobs"]


def test_scoring_batch_of_token_lists(http, engine: LLMEngine) -> None:
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    body = {"prompt": ids, "echo": True, "logprobs": 1, "temperature": 0}
    scored = _post(http, {**body, "max_tokens": 0})
    assert scored["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 0,
                               "total_tokens": sum(map(len, ids))}
    assert len(scored["choices"]) == len(PROMPTS)
    values = [_check_scored(c, i, p) for c, i, p in zip(scored["choices"], ids, PROMPTS)]
    # lm-eval's request: max_tokens 1, then token_logprobs[ctxlen:-1]
    lm_eval = _post(http, {**body, "max_tokens": 1})
    for c, v, i in zip(sorted(lm_eval["choices"], key=lambda c: c["index"]), values, ids):
        assert len(c["logprobs"]["token_logprobs"]) == len(i) + 1
        assert c["logprobs"]["token_logprobs"][:-1] == v
    # each prompt scored alone gives the same values
    for i, v in zip(ids, values):
        alone = _post(http, {**body, "prompt": i, "max_tokens": 0})["choices"][0]
        assert alone["logprobs"]["token_logprobs"][1:] == pytest.approx(v[1:], abs=1e-4)


def test_scoring_streamed_and_with_the_openai_client(base_url, http, engine: LLMEngine) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = engine.tokenizer.encode(prompt)
    body = {"prompt": [prompt, prompt[:19]], "echo": True, "logprobs": 2, "max_tokens": 0,
            "n": 2}
    ns = _post(http, body)
    assert len(ns["choices"]) == 4 and ns["usage"]["completion_tokens"] == 0
    assert ns["choices"][0] == {**ns["choices"][1], "index": 0}  # the n choices are equal
    events = _sse(http, {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"] == ns["usage"]
    per_index: dict[int, list[dict]] = {}
    for e in events[:-1]:
        (choice,) = e["choices"]
        per_index.setdefault(choice["index"], []).append(choice)
    for i, chunks in per_index.items():
        echo, end = chunks  # the prompt with its logprobs, then the finish chunk
        assert echo["text"] == ns["choices"][i]["text"] and echo["finish_reason"] is None
        assert echo["logprobs"] == ns["choices"][i]["logprobs"]
        assert end["text"] == "" and end["finish_reason"] == "length"
        assert end["logprobs"] == {"text_offset": [], "token_logprobs": [], "tokens": [],
                                   "top_logprobs": []}
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0,
                                  max_tokens=0)
    assert r.choices[0].text == prompt and r.usage.prompt_tokens == len(ids)
    assert len(r.choices[0].logprobs.tokens) == len(ids) and r.usage.completion_tokens == 0
    assert r.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        ns["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-4)
