"""Sampling and logprobs over HTTP on the real model: seeded requests independent of concurrent
ones, n choices, peaked top logprobs as strict JSON, zero alternatives, echo with logprobs, the
count and raw values of top logprobs, entries that are the output, top_k and invalid numbers;
against a real uvicorn on 127.0.0.1 serving the shared session engine (``AsyncEngine`` over it),
driven with httpx and the official ``openai`` client.

Semantics asserted (docs/api.md#behaviour-chosen-where-the-openai-api-leaves-room):
- Logprobs are of the raw model distribution (log-softmax of the logits before logit_bias,
  penalties, temperature, top-k, top-p, min-p): identical whatever the sampling settings, and
  finite; a -inf would be sent as -9999.0, never as a non-JSON literal.
- ``top_logprobs`` (chat) / ``logprobs`` (completions) = N gives exactly N alternatives per
  token (0: an empty list / dict), and one entry per generated token (a stop token included), so
  ``len(entries) == usage.completion_tokens``.
- ``echo=true`` with ``logprobs`` returns the prompt's tokens first, the first with logprob
  null; with ``max_tokens=0`` (prompt scoring) only those.
- ``top_k`` >= vocabulary size means off; ``top_k`` < -1, ``top_p`` = 0, ``min_p`` > 1 and
  non-finite numbers are 400s.
"""

from __future__ import annotations

import concurrent.futures
import json
import math

import httpx
import openai
import pytest

from jaxserve.engine.llm_engine import LLMEngine
from tests.support.http_server import serve_engine

MODEL = "m"
COMPL, CHAT = "/v1/completions", "/v1/chat/completions"
WET = [{"role": "user", "content": "Answer yes or no: is water wet?"}]


@pytest.fixture(scope="module")
def base_url(engine: LLMEngine):
    # Several tests compare two requests' logprobs exactly. With prefix caching the second
    # reuses the first's K/V blocks and computes only the rest, which may change the last
    # float32 bits; these tests are about sampling, so the engine runs with the cache off.
    with serve_engine(engine, MODEL, caching=False) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _strict(raw: bytes) -> dict:
    """Parse JSON refusing NaN / Infinity literals."""
    def bad(name: str) -> None:
        raise AssertionError(f"non-JSON literal {name} in {raw[:200]!r}")
    return json.loads(raw, parse_constant=bad)


def _post(http, path: str, body: dict) -> dict:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return _strict(r.content)


def _sse(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        raw = r.read()
    assert r.status_code == 200, raw
    parts = raw.split(b"\n\n")
    assert parts[-2:] == [b"data: [DONE]", b""], raw[-200:]
    return [_strict(p[len(b"data: "):]) for p in parts[:-2]]


def _chat_entries(events: list[dict], index: int = 0) -> list[dict]:
    out = []
    for e in events:
        for c in e["choices"]:
            if c["index"] == index and c.get("logprobs"):
                out += c["logprobs"]["content"]
    return out


def _error(r: httpx.Response, param: str | None = None) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _all_finite(entries: list[dict]) -> None:
    for e in entries:
        assert math.isfinite(e["logprob"]) and e["logprob"] <= 0, e
        for t in e["top_logprobs"]:
            assert math.isfinite(t["logprob"]) and t["logprob"] <= 0, t


# ---- case 13: -inf never reaches the JSON encoder ----------------------------------------------


@pytest.mark.parametrize("kw", [{"top_p": 0.3}, {"temperature": 0.01}])
def test_peaked_top_logprobs_are_strict_json(http, kw) -> None:
    body = {"messages": WET, "logprobs": True, "top_logprobs": 20, "max_tokens": 1, **kw}
    ns = _post(http, CHAT, body)
    entries = ns["choices"][0]["logprobs"]["content"]
    assert len(entries) == 1 and len(entries[0]["top_logprobs"]) == 20
    _all_finite(entries)
    s = _chat_entries(_sse(http, CHAT, body))
    _all_finite(s)
    assert s == entries  # streamed and non-streamed agree


# ---- case 14: zero alternatives is not "off" ---------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_zero_alternatives(http, stream) -> None:
    body = {"prompt": "The sky is", "logprobs": 0, "max_tokens": 5, "temperature": 0}
    if stream:
        events = _sse(http, COMPL, {**body, "stream_options": {"include_usage": True}})
        usage = events[-1]["usage"]
        lps = [c["logprobs"] for e in events[:-1] for c in e["choices"]]
        tokens = [t for lp in lps for t in lp["tokens"]]
        tops = [t for lp in lps for t in lp["top_logprobs"]]
        vals = [v for lp in lps for v in lp["token_logprobs"]]
    else:
        r = _post(http, COMPL, body)
        usage, lp = r["usage"], r["choices"][0]["logprobs"]
        tokens, tops, vals = lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]
    assert len(tokens) == len(vals) == usage["completion_tokens"] == 5
    assert tops == [{}] * 5 and all(v <= 0 for v in vals)
    for chat_kw in ({"logprobs": True}, {"logprobs": True, "top_logprobs": 0}):
        body = {"messages": WET, "max_tokens": 5, "temperature": 0, **chat_kw}
        if stream:
            events = _sse(http, CHAT, {**body, "stream_options": {"include_usage": True}})
            entries, usage = _chat_entries(events), events[-1]["usage"]
        else:
            r = _post(http, CHAT, body)
            entries, usage = r["choices"][0]["logprobs"]["content"], r["usage"]
        assert len(entries) == usage["completion_tokens"] > 0
        assert all(e["top_logprobs"] == [] for e in entries)
        _all_finite(entries)


# ---- case 15: echo + logprobs + restrictive sampling ------------------------------------------


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 0.1}, {"min_p": 0.9}])
def test_echo_with_logprobs(http, kw) -> None:
    prompt = "one two three four"
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 1,
            **kw}
    r = _post(http, COMPL, body)
    c, usage = r["choices"][0], r["usage"]
    lp = c["logprobs"]
    assert c["text"].startswith(prompt)
    n = usage["prompt_tokens"] + usage["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert "".join(lp["tokens"]) == c["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(math.isfinite(v) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    events = _sse(http, COMPL, body)
    assert "".join(ch["choices"][0]["text"] for ch in events) == c["text"]
    # scoring the prompt alone (max_tokens 0): its entries, whatever the sampling settings
    scored = _post(http, COMPL, {**body, "max_tokens": 0})
    s = scored["choices"][0]
    assert s["text"] == prompt and scored["usage"]["completion_tokens"] == 0
    assert s["logprobs"]["token_logprobs"] == lp["token_logprobs"][:usage["prompt_tokens"]]
    # without echo, max_tokens 0 is a 400
    _error(http.post(COMPL, json={"prompt": prompt, "logprobs": 1, "max_tokens": 0}),
           "max_tokens")


# ---- case 16: exactly N alternatives, raw values ----------------------------------------------


def test_top_logprobs_count_and_raw_values(http) -> None:
    seen = []
    for i, kw in enumerate(({"top_p": 0.5}, {"top_p": 1.0}, {"temperature": 0.5},
                            {"temperature": 1.0})):
        body = {"messages": WET, "logprobs": True, "top_logprobs": 3, "max_tokens": 1,
                "seed": 0, **kw}
        ns = _post(http, CHAT, body)["choices"][0]["logprobs"]["content"]
        if i == 0:
            assert _chat_entries(_sse(http, CHAT, body)) == ns
        assert len(ns[0]["top_logprobs"]) == 3
        seen.append({t["token"]: t["logprob"] for t in ns[0]["top_logprobs"]})
    assert all(s == seen[0] for s in seen), seen


# ---- case 17: each entry is its token ----------------------------------------------------------


def test_entries_are_the_output(http) -> None:
    body = {"messages": [{"role": "user", "content": "Write a short sentence about tea. 茶"}],
            "logprobs": True, "top_logprobs": 5, "max_tokens": 16, "temperature": 0}
    r = _post(http, CHAT, body)
    c = r["choices"][0]
    entries = c["logprobs"]["content"]
    assert len(entries) == r["usage"]["completion_tokens"]
    for e in entries:
        assert e["top_logprobs"][0]["token"] == e["token"]
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]
        assert e["top_logprobs"][0]["bytes"] == e["bytes"]
    assert bytes(b for e in entries for b in e["bytes"]) == c["message"]["content"].encode()
    assert _chat_entries(_sse(http, CHAT, body)) == entries


# ---- cases 10, 11: seeds and n over HTTP -------------------------------------------------------


def test_n_choices_over_http(http, client) -> None:
    body = {"prompt": "My favourite colour is", "n": 8, "temperature": 1.0, "max_tokens": 6,
            "seed": 7, "ignore_eos": True}
    r = _post(http, COMPL, body)
    assert sorted(c["index"] for c in r["choices"]) == list(range(8))
    texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) >= 4, texts
    assert r["usage"]["completion_tokens"] == 8 * 6  # summed over the choices
    assert [c["text"] for c in sorted(_post(http, COMPL, body)["choices"],
                                      key=lambda c: c["index"])] == texts  # reproducible set
    # streamed: every choice's chunks carry its index; each choice finishes exactly once
    events = _sse(http, COMPL, body)
    streamed = {i: "" for i in range(8)}
    finishes = []
    for e in events:
        (ch,) = e["choices"]
        streamed[ch["index"]] += ch["text"]
        if ch["finish_reason"] is not None:
            finishes.append(ch["index"])
    assert sorted(finishes) == list(range(8))
    assert [streamed[i] for i in range(8)] == texts
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], n=3,
        temperature=1.0, max_tokens=4, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_seed_is_independent_of_concurrent_requests(http) -> None:
    a = {"prompt": "The weather today", "temperature": 0.8, "seed": 42, "max_tokens": 6,
         "ignore_eos": True}
    others = [{"prompt": "Hi", "max_tokens": 8},
              {"prompt": "Tell me about the moon " * 5, "seed": 7, "max_tokens": 8},
              {"prompt": "x", "seed": 8, "max_tokens": 8}]
    results = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for b in others:
            fa = pool.submit(_post, http, COMPL, a)
            fb = pool.submit(_post, http, COMPL, {"temperature": 0.8, **b})
            results.append(fa.result()["choices"][0]["text"])
            fb.result()
    assert len(set(results)) == 1, results


# ---- case 23: top_k beyond the vocabulary, invalid numbers -------------------------------------


def test_top_k_and_invalid_numbers(http, engine: LLMEngine) -> None:
    vocab = engine.tokenizer.vocab_size
    body = {"prompt": "Once upon a time", "temperature": 1.0, "seed": 5, "max_tokens": 6,
            "ignore_eos": True}
    off = _post(http, COMPL, body)["choices"][0]["text"]
    for k in (0, -1, vocab, vocab + 1, 9999999):
        assert _post(http, COMPL, {**body, "top_k": k})["choices"][0]["text"] == off, k
    for field, value in (("top_k", -2), ("top_p", 0), ("min_p", 1.5),
                         ("repetition_penalty", 2.5), ("presence_penalty", 3)):
        _error(http.post(COMPL, json={**body, field: value}), field)
    for raw in (b"NaN", b"Infinity", b"-Infinity", b"1e400"):
        for field in (b"temperature", b"top_p", b"min_p", b"frequency_penalty"):
            r = http.post(COMPL, content=b'{"prompt": "hi", "' + field + b'": ' + raw + b"}",
                          headers={"content-type": "application/json"})
            assert r.status_code == 400, (field, raw, r.text)
    _error(http.post(COMPL, json={**body, "logit_bias": {str(vocab): 5}}), "logit_bias")
    # a tiny temperature is valid and acts as (near) greedy
    tiny = _post(http, COMPL, {**body, "temperature": 1e-9})["choices"][0]["text"]
    assert tiny == _post(http, COMPL, {**body, "temperature": 0})["choices"][0]["text"]
    assert http.get("/health").status_code == 200


def test_min_tokens_and_truncate_prompt_tokens_as_vllm_extra_body(client, engine) -> None:
    """vLLM's extra fields through the openai client's ``extra_body``: EOS biased to the top
    still comes only after ``min_tokens``; ``truncate_prompt_tokens`` keeps the last tokens, so
    usage counts them and the answer is that of the kept prompt alone."""
    eos = engine.tokenizer.eos_token_id
    chat = client.chat.completions.create(
        model=MODEL, messages=WET, max_tokens=12, temperature=0, logit_bias={str(eos): 100},
        extra_body={"min_tokens": 5})
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "stop"
    kept = engine.tokenizer.encode("The capital city of France is")
    long = engine.tokenizer.encode("Unrelated words first. ") + kept
    cut, alone = (client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0,
                                            extra_body=extra)
                  for p, extra in ((long, {"truncate_prompt_tokens": len(kept)}), (kept, {})))
    assert cut.usage.prompt_tokens == len(kept)
    assert cut.choices[0].text == alone.choices[0].text
