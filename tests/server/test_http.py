"""Real-model tests over real HTTP: the ``jaxserve serve`` CLI in a subprocess, driven with the
official ``openai`` client (and ``httpx`` for raw SSE bytes and malformed bodies).

The server (SmolLM2-135M-Instruct, ``--max-model-len 1024 --num-kv-blocks 300 --port 0``) is started
once for the module, its bound port parsed from uvicorn's "Uvicorn running on http://..." line, and
/ready polled until 200 (at most 180 s). It is terminated (then killed) at the end, also when a
test fails. Generation on the 2-core CPU runs at roughly 10 tokens/s, so every request is short and
greedy (``temperature=0``). Notation: S = concatenated streamed
deltas, NS = the text of the same request with ``stream=false``.

Semantics asserted where a case leaves a choice:

- Prompts (case 18): ``prompt=""``, ``[""]``, ``[]``, ``[[]]`` (empty, alone or in a batch; batches
  are tested in test_batched_http.py) and chat ``messages=[]`` are all 400 with an OpenAI-style
  error body (SmolLM2 adds no BOS, so an empty prompt has 0 tokens and is rejected, not completed).
- Over-long prompts (case 19): a prompt of >= max_model_len tokens is 400, also for stream=true (the
  server awaits the engine's first output before sending any byte); the message names the prompt
  length and max_model_len.
- Window overflow (case 20): policy is *clamp*. max_tokens is silently reduced to
  ``max_model_len - prompt_tokens``; such a request ends with ``finish_reason == "length"`` at exactly
  ``prompt_tokens + completion_tokens == max_model_len``. Chat with max_tokens omitted means "up to
  the window" (it ends at EOS for a short question).
- Stop strings (cases 4-7): matched on decoded text, not tokens; output is cut at the first
  occurrence, the stop text is excluded unless ``include_stop_str_in_output=true``, and text that
  might be the start of a stop string is held back while streaming, so S == NS. Stop strings are
  additive to EOS (case 8).
- A length-finish that cuts a multi-byte character in half flushes the incomplete tail as U+FFFD at
  the end (stream and non-stream alike); U+FFFD never appears mid-stream.
- SSE (cases 34-37): every event is ``data: <json>\\n\\n``, the last ``data: [DONE]\\n\\n``. Completions
  put finish_reason on the last content chunk; chat sends a role chunk, content chunks, then a chunk
  with an empty delta and the finish_reason. With ``stream_options.include_usage`` every chunk has
  ``"usage": null`` except one final ``choices: []`` chunk with the usage; without it no chunk has
  a ``usage`` key.
- Disconnect (case 30): closing a stream, or timing out a non-streamed request, aborts the engine
  request (``jaxserve:num_aborted_requests_total`` + 1) and frees its KV blocks.
"""

from __future__ import annotations

import concurrent.futures
import json
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

from jaxserve.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 180.0
_URL_RE = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


# ---- the server ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully on SIGINT
    try:
        proc.wait(15)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _start(log_path: Path, port: int) -> tuple[subprocess.Popen, int]:
    """Start the CLI; return the process and the port it bound (parsed from uvicorn's line)."""
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", "--max-model-len", str(MAX_MODEL_LEN),
           "--num-kv-blocks", "300", "--port", str(port),
           "--max-num-batched-tokens", "512",  # a 700-token prompt is prefilled in two steps
           "--compilation-cache-dir", str(REPO_ROOT / ".jax_cache")]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            m = _URL_RE.search(log_path.read_text(errors="replace"))
            if m:
                bound = int(m.group(1))
                break
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not start within {STARTUP_TIMEOUT_S} s")
            time.sleep(0.2)
        if bound == 0:
            return proc, 0  # the caller retries with an explicit port
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{bound}/ready", timeout=5).status_code == 200:
                    return proc, bound
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"/ready not 200 within {STARTUP_TIMEOUT_S} s")
            time.sleep(0.2)
    except BaseException as exc:  # noqa: BLE001 (also KeyboardInterrupt: never leak it)
        _stop(proc)
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"could not start jaxserve: {exc}\n--- server output ---\n{tail}")


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("jaxserve_http") / "server.log"
    proc, port = _start(log_path, 0)
    if port == 0:  # uvicorn printed port 0: pick a free port ourselves
        _stop(proc)
        proc, port = _start(log_path, _free_port())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(tokenizer) -> Tokenizer:
    """The server's tokenizer (conftest's session fixture: ``Tokenizer.from_gguf`` on the
    default GGUF path)."""
    return tokenizer


# ---- helpers ---------------------------------------------------------------------------------


def _comp(client, prompt, **kw):
    """(text, finish_reason, usage) of a non-streamed greedy completion."""
    kw.setdefault("temperature", 0)
    r = client.completions.create(model=MODEL, prompt=prompt, **kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage


def _comp_stream(client, prompt, **kw):
    """(deltas, finish_reason) of a streamed greedy completion."""
    kw.setdefault("temperature", 0)
    deltas, finish = [], None
    for ch in client.completions.create(model=MODEL, prompt=prompt, stream=True, **kw):
        for c in ch.choices:
            if c.text:
                deltas.append(c.text)
            if c.finish_reason is not None:
                assert finish is None, "two chunks with a finish_reason"
                finish = c.finish_reason
    return deltas, finish


def _msgs(q):
    return [{"role": "user", "content": q}] if isinstance(q, str) else q


def _chat(client, q, **kw):
    kw.setdefault("temperature", 0)
    r = client.chat.completions.create(model=MODEL, messages=_msgs(q), **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def _chat_stream(client, q, **kw):
    kw.setdefault("temperature", 0)
    deltas, finish = [], None
    for ch in client.chat.completions.create(model=MODEL, messages=_msgs(q), stream=True, **kw):
        for c in ch.choices:
            if c.delta.content:
                deltas.append(c.delta.content)
            if c.finish_reason is not None:
                assert finish is None, "two chunks with a finish_reason"
                finish = c.finish_reason
    return deltas, finish


def _metrics(http) -> dict[str, float]:
    """The ``jaxserve:`` samples labelled with the model name alone, by name."""
    text = http.get("/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("jaxserve:") and line.count("=") <= 1:
            name, value = line.rsplit(" ", 1)
            out[name.removesuffix(f'{{model_name="{MODEL}"}}')] = float(value)
    return out


def _assert_error(r: httpx.Response, status: int | tuple[int, ...]) -> dict:
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str) and body["error"]["type"]
    return body["error"]


def _sse(http, path: str, body: dict) -> list[dict]:
    """POST a streaming request; return its parsed JSON events (without ``[DONE]``).

    Asserts the framing: ``data: <json>\\n\\n`` events, the last exactly ``data: [DONE]``, nothing
    after it, Content-Type text/event-stream.
    """
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        raw = r.read()
    assert r.status_code == 200, raw
    assert r.headers["content-type"].startswith("text/event-stream"), r.headers
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    parts = raw.split(b"\n\n")
    assert parts[-1] == b"", "bytes after the last event"
    parts = parts[:-1]
    assert parts[-1] == b"data: [DONE]"
    assert parts.count(b"data: [DONE]") == 1
    events = []
    for part in parts[:-1]:
        assert part.startswith(b"data: ") and b"\n" not in part, part
        events.append(json.loads(part[len(b"data: "):]))
    return events


def _ulp_prompt(tok, n: int) -> list[int]:
    """Exactly ``n`` token ids of ordinary English text."""
    text = ("The river wound slowly through the quiet valley, past farms and old stone bridges. "
            * (n // 10 + 2))
    ids = tok.encode(text)
    assert len(ids) >= n
    return ids[:n]


# ---- stream == non-stream (cases 3, 7) -------------------------------------------------------

PROSE = "Once upon a time, in a small village by the sea,"


@pytest.mark.parametrize(
    "prompt,kw",
    [
        (PROSE, {"max_tokens": 60}),  # ordinary prose, ~60 tokens (case 3)
        ("The capital city of France is", {"max_tokens": 30}),
        # case 7: the stop fires right after the held-back text
        ("A: Ask me a question.\nB: What colour is the sky on Mars", {"max_tokens": 8,
                                                                      "stop": ["\n"]}),
    ],
    ids=["prose60", "france", "stop-newline"],
)
def test_completions_stream_equals_nonstream(client, prompt, kw):
    ns, ns_finish, usage = _comp(client, prompt, **kw)
    deltas, s_finish = _comp_stream(client, prompt, **kw)
    assert "".join(deltas) == ns
    assert s_finish == ns_finish
    assert ns, "empty output makes the comparison meaningless"
    if "stop" in kw:
        assert ns_finish == "stop" and "\n" not in ns
    else:
        assert ns_finish == "length" and usage.completion_tokens == kw["max_tokens"]
        assert len(deltas) > 5  # really streamed, not one blob


@pytest.mark.parametrize("question", [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
])
def test_chat_stream_equals_nonstream(client, question):
    ns, ns_finish, _ = _chat(client, question, max_tokens=40)
    deltas, s_finish = _chat_stream(client, question, max_tokens=40)
    assert ns
    assert "".join(deltas) == ns
    assert s_finish == ns_finish


# ---- case 1: prompt ids ending inside a multi-byte character ----------------------------------


def test_token_id_prompt_ending_mid_emoji(client, tok):
    ids = tok.encode("Hello world 😀")
    prompt = ids[:-1]  # drop the emoji's last token: the prompt ends inside its UTF-8 bytes
    assert tok.decode(prompt).startswith("Hello world")
    assert "\ufffd" in tok.decode(prompt), "the truncated prompt should end mid-character"
    ns, ns_finish, usage = _comp(client, prompt, max_tokens=8)
    deltas, s_finish = _comp_stream(client, prompt, max_tokens=8)
    s = "".join(deltas)
    assert "Hello world" not in s and "Hello world" not in ns
    assert not deltas or "Hello" not in deltas[0]
    assert s == ns
    assert s_finish == ns_finish
    assert usage.prompt_tokens == len(prompt)


# ---- case 2: mixed ASCII / CJK / emoji --------------------------------------------------------


def _check_stream_prefixes(deltas: list[str], ns: str) -> None:
    """Every running concatenation is a prefix of NS (no re-sent or reordered text)."""
    sent = ""
    for d in deltas:
        assert d, "empty delta"
        sent += d
        assert ns.startswith(sent), (sent, ns)
    assert sent == ns


@pytest.mark.parametrize("question,expect", [
    ("Repeat exactly: A 世ab 😀 x 🌶 y", None),  # the case's literal prompt (model answers ASCII)
    ('Repeat exactly this text: "A 世ab 😀 x 🌶 y"', "A 世ab 😀 x 🌶 y"),  # does echo CJK+emoji
])
def test_multibyte_stream(client, question, expect):
    ns, ns_finish, _ = _chat(client, question, max_tokens=64)
    deltas, s_finish = _chat_stream(client, question, max_tokens=64)
    s = "".join(deltas)
    assert s == ns and s_finish == ns_finish
    assert "\ufffd" not in s
    _check_stream_prefixes(deltas, ns)
    if expect is not None:
        assert expect in s


def test_completion_emoji_run_cut_by_length(client):
    """The model repeats multi-byte text and max_tokens cuts a character: deltas never contain
    U+FFFD except the final flushed tail, and S == NS byte for byte."""
    prompt = "A 世ab 😀 x 🌶 y\nA 世ab 😀 x 🌶 y\nA 世ab 😀 x 🌶 y\n"
    ns, ns_finish, _ = _comp(client, prompt, max_tokens=24)
    deltas, s_finish = _comp_stream(client, prompt, max_tokens=24)
    assert "世" in ns and "😀" in ns
    assert "".join(deltas) == ns and s_finish == ns_finish == "length"
    _check_stream_prefixes(deltas, ns)
    assert "\ufffd" not in "".join(deltas).rstrip("\ufffd")


# ---- case 4: partial stop string never leaks --------------------------------------------------

ALPHA = "Here is the English alphabet: ABC"  # greedy: "DEFGHIJKLMNOPQRSTUVWXYZ\n\nNow, let's"


@pytest.mark.parametrize("stop", ["DEFGHIJ", "MNOPQ", "XYZ"])
def test_stop_string_not_leaked(client, stop):
    full, _, _ = _comp(client, ALPHA, max_tokens=16)
    assert stop in full, full
    ns, ns_finish, _ = _comp(client, ALPHA, max_tokens=16, stop=[stop])
    deltas, s_finish = _comp_stream(client, ALPHA, max_tokens=16, stop=[stop])
    s = "".join(deltas)
    assert s == ns == full[:full.index(stop)]
    assert ns_finish == s_finish == "stop"
    assert stop not in s
    for k in range(1, len(stop)):
        assert not s.endswith(stop[:k]), f"streamed text ends with stop prefix {stop[:k]!r}"
    assert not set(s) & set(stop), "a letter of the stop string was streamed"


@pytest.mark.parametrize("stop", ["DEFGHIJ", "MNOPQ"])
def test_include_stop_str_in_output(client, stop):
    extra = {"include_stop_str_in_output": True}
    ns, ns_finish, _ = _comp(client, ALPHA, max_tokens=16, stop=[stop], extra_body=extra)
    deltas, s_finish = _comp_stream(client, ALPHA, max_tokens=16, stop=[stop], extra_body=extra)
    assert "".join(deltas) == ns
    assert ns.endswith(stop) and ns.count(stop) == 1
    assert ns_finish == s_finish == "stop"


# ---- case 5: stop strings that end inside a token ---------------------------------------------

FRANCE = "The capital city of France is"


@pytest.fixture(scope="module")
def france_full(client):
    text, finish, usage = _comp(client, FRANCE, max_tokens=30)
    assert finish == "length" and usage.completion_tokens == 30
    return text


def _token_ends(tok, prompt: str, text: str) -> set[int]:
    """Character offsets in ``text`` where a token of its (re-)tokenization ends."""
    p = tok.encode(prompt)
    ids = tok.encode(prompt + text)
    assert ids[:len(p)] == p
    gen = ids[len(p):]
    return {len(tok.decode(gen[:i])) for i in range(len(gen) + 1)}


@pytest.mark.parametrize("stop,aligned", [
    (".", True),  # right after " Paris"
    (" United", True),
    ("Par", False),  # ends inside " Paris"
    ("Pari", False),
    ("Stat", False),  # ends inside " States"
    ("millio", False),
])
def test_stop_not_token_aligned(client, tok, france_full, stop, aligned):
    full = france_full
    assert stop in full, full
    cut = full.index(stop)
    ends = _token_ends(tok, FRANCE, full)
    assert ((cut + len(stop)) in ends) == aligned, "the stop's alignment premise changed"
    ns, ns_finish, _ = _comp(client, FRANCE, max_tokens=30, stop=[stop])
    assert ns == full[:cut]
    assert stop not in ns
    assert ns_finish == "stop"
    deltas, s_finish = _comp_stream(client, FRANCE, max_tokens=30, stop=[stop])
    assert "".join(deltas) == ns and s_finish == "stop"


# ---- case 6: chat stop string not returned ----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_chat_stop_seven(client, stream):
    q = "Say the numbers 1 to 10 separated by commas"
    # greedy: "The numbers 1 to 10 separated by commas are: 1, 2, 3, 4, 5, 6, 7, 8, 9,"
    if stream:
        deltas, finish = _chat_stream(client, q, max_tokens=40, stop=["7"])
        content = "".join(deltas)
    else:
        content, finish, _ = _chat(client, q, max_tokens=40, stop=["7"])
    assert "7" not in content
    assert finish == "stop"
    assert re.search(r"1, 2, 3, 4, 5, 6,\s*$", content), content


# ---- case 8: stop strings are additive to EOS -------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_keep_eos(client, stream):
    q, stop = "What is 2+2?", ["\nNeverAppearsHere"]
    if stream:
        r = client.chat.completions.create(
            model=MODEL, messages=_msgs(q), temperature=0, max_tokens=256, stop=stop, stream=True,
            stream_options={"include_usage": True})
        chunks = list(r)
        finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        assert finish == ["stop"]
        usage = chunks[-1].usage
    else:
        _, finish, usage = _chat(client, q, max_tokens=256, stop=stop)
        assert finish == "stop"
    assert usage.completion_tokens < 256


# ---- case 18: empty prompts -------------------------------------------------------------------


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": [""]}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": [[]]}),
    ("/v1/completions", {"prompt": "", "stream": True}),
    ("/v1/chat/completions", {"messages": []}),
])
def test_empty_prompt_400(http, path, body):
    r = http.post(path, json={"model": MODEL, "max_tokens": 4, **body})
    _assert_error(r, 400)
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2
    assert http.get("/health").status_code == 200


# ---- case 19: over-long prompts ---------------------------------------------------------------


@pytest.mark.parametrize("n", [MAX_MODEL_LEN + 1, 2 * MAX_MODEL_LEN, 10 * MAX_MODEL_LEN])
@pytest.mark.parametrize("stream", [False, True])
def test_prompt_too_long_400(http, client, tok, n, stream):
    before = _metrics(http)
    ids = (tok.encode("hello world ") * (n // 2 + 1))[:n]
    assert len(ids) == n
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1,
                                            "stream": stream})
    err = _assert_error(r, 400)
    assert str(n) in err["message"] and str(MAX_MODEL_LEN) in err["message"], err
    # a text prompt that tokenizes too long is rejected the same way
    if n == MAX_MODEL_LEN + 1 and not stream:
        text = "hello " * (MAX_MODEL_LEN + 1)
        assert len(tok.encode(text)) > MAX_MODEL_LEN
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
        _assert_error(r, 400)
    text, finish, _ = _comp(client, "Hi", max_tokens=2)
    assert finish == "length"
    after = _metrics(http)
    assert after["jaxserve:num_requests_running"] == 0
    assert after["jaxserve:num_requests_waiting"] == 0
    assert after["jaxserve:generation_tokens_total"] == before["jaxserve:generation_tokens_total"] + 2


# ---- case 20: prompt + max_tokens beyond the window: clamp --------------------------------------


def test_clamp_long_prompt(client, tok):
    ids = _ulp_prompt(tok, MAX_MODEL_LEN - 10)
    _, finish, usage = _comp(client, ids, max_tokens=100, extra_body={"ignore_eos": True})
    assert finish == "length"
    assert usage.prompt_tokens == MAX_MODEL_LEN - 10
    assert usage.completion_tokens == 10
    assert usage.prompt_tokens + usage.completion_tokens == MAX_MODEL_LEN
    # max_tokens above max_model_len itself: same clamp
    _, finish, usage = _comp(client, ids, max_tokens=5 * MAX_MODEL_LEN,
                             extra_body={"ignore_eos": True})
    assert finish == "length"
    assert usage.prompt_tokens + usage.completion_tokens == MAX_MODEL_LEN


def test_huge_max_tokens_short_prompt_accepted(http):
    """max_tokens > max_model_len with a short prompt is accepted (clamped, not a 400).
    Running it to the window would take ~100 s on this CPU, so read a few chunks and hang up;
    the exact clamp arithmetic is asserted by test_clamp_long_prompt."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5 * MAX_MODEL_LEN,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = []
        for ln in r.iter_lines():
            if ln.startswith("data: "):
                events.append(json.loads(ln[6:]))
            if len(events) == 3:
                break
    assert all(e["choices"][0]["finish_reason"] is None for e in events)


def test_chat_max_tokens_omitted(client):
    content, finish, usage = _chat(client, "What is the capital of France?",
                                   extra_body={"ignore_eos": False})
    assert finish == "stop"
    assert content and usage.prompt_tokens + usage.completion_tokens < MAX_MODEL_LEN


# ---- case 21: malformed bodies ----------------------------------------------------------------

_MSGS = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path,content,headers,status", [
    ("/v1/chat/completions", b'{"model":"m", x}', {"content-type": "application/json"}, 400),
    ("/v1/chat/completions", b"[]", {"content-type": "application/json"}, 400),
    ("/v1/chat/completions", b"null", {"content-type": "application/json"}, 400),
    ("/v1/chat/completions", b"123", {"content-type": "application/json"}, 400),
    ("/v1/chat/completions", b'"a string"', {"content-type": "application/json"}, 400),
    ("/v1/chat/completions", b"", {"content-type": "application/json"}, 400),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": _MSGS}).encode(), {}, 400),
    ("/v1/completions", b'{"prompt": "Hi"', {"content-type": "application/json"}, 400),
    ("/v1/completions", json.dumps({"prompt": "Hi"}).encode(), {"content-type": "text/plain"},
     400),
], ids=["invalid-json", "array", "null", "number", "string", "empty", "no-content-type",
        "completions-truncated-json", "completions-text-plain"])
def test_malformed_raw_bodies(http, path, content, headers, status):
    r = http.post(path, content=content, headers=headers)
    _assert_error(r, status)


@pytest.mark.parametrize("field,value,status", [
    ("max_tokens", "ten", 400),
    ("max_tokens", 0, 400),
    ("max_tokens", -5, 400),
    ("temperature", -1, 400),
    ("temperature", "hot", 400),
    ("top_p", 1.5, 400),
    ("top_p", 0, 400),
    ("n", 0, 400),
    ("messages", "Hi", 400),
    ("messages", [{"content": "no role"}], 400),
    ("stop", 7, 400),
    ("stream_options", {"include_usage": True}, 400),  # only allowed with stream=true
    ("model", "gpt-4o", 404),
])
def test_bad_fields(http, field, value, status):
    body = {"model": MODEL, "messages": _MSGS, "max_tokens": 2, field: value}
    err = _assert_error(http.post("/v1/chat/completions", json=body), status)
    if status == 404:
        assert err["type"] == "not_found_error"


def test_unknown_route_and_method(http):
    _assert_error(http.post("/v1/nonexistent", json={"model": MODEL}), 404)
    _assert_error(http.get("/v2/models"), 404)
    _assert_error(http.get("/v1/chat/completions"), 405)
    # openai client maps these to typed exceptions
    c = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=_MSGS, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=_MSGS, max_tokens=2, temperature=-1)


def test_server_healthy_after(http, client):
    assert http.get("/health").status_code == 200
    _, finish, _ = _chat(client, "Hi", max_tokens=3)
    assert finish in ("stop", "length")
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL


# ---- case 30: client disconnect aborts the request -------------------------------------------


def _wait_idle(http, polls: int = 50, interval_s: float = 0.1) -> tuple[dict, int]:
    """Poll /metrics until no request is running or waiting; return (metrics, polls used)."""
    for i in range(polls):
        m = _metrics(http)
        if (m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_requests_waiting"] == 0
                and m["jaxserve:kv_cache_usage_perc"] == 0):
            return m, i + 1
        time.sleep(interval_s)
    return m, polls


def _stream_and_hang_up(base_url: str, n_chunks: int = 2) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 900,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with (httpx.Client(base_url=base_url, timeout=60) as c,
          c.stream("POST", "/v1/completions", json=body) as r):
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == n_chunks:
                    break
    # leaving both context managers closes the connection mid-stream


def _settle(client) -> None:
    """One tiny request: runs an engine step, which refreshes the step-recorded gauges."""
    _comp(client, "Hi", max_tokens=1)


def test_stream_disconnect_aborts(base_url, http, client):
    _settle(client)
    idle = _metrics(http)
    assert idle["jaxserve:kv_cache_usage_perc"] == 0
    _stream_and_hang_up(base_url)
    for _ in range(50):  # the abort reaches the engine within a few polls
        m = _metrics(http)
        if m["jaxserve:num_aborted_requests_total"] == idle["jaxserve:num_aborted_requests_total"] + 1:
            break
        time.sleep(0.1)
    assert m["jaxserve:num_aborted_requests_total"] == idle["jaxserve:num_aborted_requests_total"] + 1
    # a new request is served at once, and after it nothing is running and no block is held
    t0 = time.monotonic()
    _, _, usage = _comp(client, "Hi", max_tokens=2)
    assert usage.completion_tokens == 2 and time.monotonic() - t0 < 10
    m, _ = _wait_idle(http)
    assert m["jaxserve:num_requests_running"] == 0, m
    assert m["jaxserve:kv_cache_usage_perc"] == 0, m


def test_gauges_return_to_idle_without_new_traffic(base_url, http, client):
    _settle(client)
    _stream_and_hang_up(base_url)
    m, polls = _wait_idle(http)
    assert m["jaxserve:num_requests_running"] == 0, (m, polls)
    assert m["jaxserve:kv_cache_usage_perc"] == 0, (m, polls)


def test_nonstream_client_timeout_aborts(base_url, http, client):
    before = _metrics(http)["jaxserve:num_aborted_requests_total"]
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 900,
            "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=base_url, timeout=1.0) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    for _ in range(50):
        if _metrics(http)["jaxserve:num_aborted_requests_total"] == before + 1:
            break
        time.sleep(0.1)
    assert _metrics(http)["jaxserve:num_aborted_requests_total"] == before + 1
    _settle(client)
    m, _ = _wait_idle(http)
    assert m["jaxserve:num_requests_running"] == 0 and m["jaxserve:kv_cache_usage_perc"] == 0, m


def test_repeated_aborts_leak_no_blocks(base_url, http, client):
    _settle(client)
    before = _metrics(http)
    for _ in range(20):
        _stream_and_hang_up(base_url)
    for _ in range(50):
        m = _metrics(http)
        if m["jaxserve:num_aborted_requests_total"] >= before["jaxserve:num_aborted_requests_total"] + 20:
            break
        time.sleep(0.1)
    assert m["jaxserve:num_aborted_requests_total"] == before["jaxserve:num_aborted_requests_total"] + 20
    _settle(client)
    after, _ = _wait_idle(http)
    assert after["jaxserve:kv_cache_usage_perc"] == before["jaxserve:kv_cache_usage_perc"] == 0
    assert after["jaxserve:num_requests_running"] == 0


# ---- cases 34, 36: raw SSE framing and finish_reason placement --------------------------------


@pytest.mark.parametrize("kw,finish", [
    ({"prompt": PROSE, "max_tokens": 20}, "length"),
    ({"prompt": ALPHA, "max_tokens": 16, "stop": ["MNOPQ"]}, "stop"),
])
def test_completions_sse(http, kw, finish):
    events = _sse(http, "/v1/completions", {"temperature": 0, **kw})
    assert events
    finishes = [i for i, e in enumerate(events) if e["choices"][0]["finish_reason"] is not None]
    assert finishes == [len(events) - 1], "finish_reason must be on exactly the last chunk"
    assert events[-1]["choices"][0]["finish_reason"] == finish
    for e in events:
        assert e["object"] == "text_completion" and e["model"] == MODEL
        assert "usage" not in e
        assert [c["index"] for c in e["choices"]] == [0]
    assert len({e["id"] for e in events}) == 1
    ns = http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **kw}).json()
    assert "".join(e["choices"][0]["text"] for e in events) == ns["choices"][0]["text"]
    if finish == "length":
        assert ns["usage"]["completion_tokens"] == kw["max_tokens"]


@pytest.mark.parametrize("kw,finish", [
    ({"messages": _msgs("What is the capital of France?"), "max_tokens": 40}, "stop"),
    ({"messages": _msgs("Write a poem about the sea."), "max_tokens": 6}, "length"),
])
def test_chat_sse(http, kw, finish):
    events = _sse(http, "/v1/chat/completions", {"temperature": 0, **kw})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finishes = [i for i, e in enumerate(events) if e["choices"][0]["finish_reason"] is not None]
    assert finishes == [len(events) - 1]
    assert events[-1]["choices"][0]["finish_reason"] == finish
    assert events[-1]["choices"][0]["delta"] == {}
    for e in events[1:-1]:
        assert set(e["choices"][0]["delta"]) == {"content"} and e["choices"][0]["delta"]["content"]
    for e in events:
        assert e["object"] == "chat.completion.chunk" and "usage" not in e


# ---- cases 35, 37: usage in streams -----------------------------------------------------------


def _check_usage_stream(events: list, ns_usage: dict) -> dict:
    usage_chunks = [i for i, e in enumerate(events) if e.get("usage") is not None]
    assert usage_chunks == [len(events) - 1], "exactly one usage chunk, the last before [DONE]"
    last = events[-1]
    assert last["choices"] == []
    for e in events[:-1]:
        assert "usage" in e and e["usage"] is None  # the flag set: explicit null on content chunks
        assert len(e["choices"]) == 1
    assert events[-2]["choices"][0]["finish_reason"] is not None  # usage follows the finish chunk
    u = last["usage"]
    assert u == ns_usage
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    return u


@pytest.mark.parametrize("path,kw", [
    ("/v1/chat/completions", {"messages": _msgs("What is the capital of France?"),
                              "max_tokens": 40}),
    ("/v1/completions", {"prompt": PROSE, "max_tokens": 12}),
])
def test_include_usage(http, path, kw):
    body = {"temperature": 0, **kw}
    events = _sse(http, path, {**body, "stream_options": {"include_usage": True}})
    ns = http.post(path, json={"model": MODEL, **body}).json()
    _check_usage_stream(events, ns["usage"])
    plain = _sse(http, path, body)
    assert all("usage" not in e for e in plain)
    off = _sse(http, path, {**body, "stream_options": {"include_usage": False}})
    assert all("usage" not in e for e in off)


def test_usage_with_chunked_prefill(http, tok):
    ids = _ulp_prompt(tok, 700)  # > max_num_batched_tokens (512): prefilled in two steps
    text = tok.decode(ids)
    n = len(tok.encode(text))
    assert 690 <= n <= 710
    body = {"prompt": text, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    events = _sse(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    ns = http.post("/v1/completions", json={"model": MODEL, **body}).json()
    u = _check_usage_stream(events, ns["usage"])
    assert u["prompt_tokens"] == n
    assert u["completion_tokens"] == 5 and u["total_tokens"] == n + 5


def test_chat_prompt_tokens_match_template(client, tok):
    msgs = _msgs("What is the capital of France?")
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True)
    n = len(tok.encode(rendered, add_special_tokens=False))
    _, _, usage = _chat(client, msgs, max_tokens=3)
    assert usage.prompt_tokens == n
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# ---- case 38: finish_reason length vs stop ----------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 5])
@pytest.mark.parametrize("stream", [False, True])
def test_length(client, http, max_tokens, stream):
    body = {"model": MODEL, "prompt": PROSE, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    if stream:
        events = _sse(http, "/v1/completions",
                            {**body, "stream_options": {"include_usage": True}})
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == max_tokens
    else:
        _, finish, usage = _comp(client, PROSE, max_tokens=max_tokens,
                                 extra_body={"ignore_eos": True})
        assert finish == "length" and usage.completion_tokens == max_tokens


def test_eos_is_stop(client):
    content, finish, usage = _chat(client, "What is the capital of France?", max_tokens=64)
    assert finish == "stop"
    assert usage.completion_tokens < 64
    assert content.strip()
    # the same request with ignore_eos runs to max_tokens and says "length"
    _, finish, usage = _chat(client, "What is the capital of France?", max_tokens=12,
                             extra_body={"ignore_eos": True})
    assert finish == "length" and usage.completion_tokens == 12


# ---- concurrency ------------------------------------------------------------------------------

CONCURRENT_PROMPTS = [
    "The capital city of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at",
    "Here is the English alphabet: ABC",
    "My favourite fruit is",
    "The quick brown fox",
    "In 1969, the first humans",
    "To make a cup of tea, first",
    "1, 2, 3, 4,",
    "The largest planet in the solar system is",
]


def test_concurrent_requests_match_sequential(base_url, client):
    alone = [_comp(client, p, max_tokens=10)[0] for p in CONCURRENT_PROMPTS]

    def one(i: int) -> str:
        c = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        if i % 2:  # half streamed, half not
            return "".join(_comp_stream(c, CONCURRENT_PROMPTS[i], max_tokens=10)[0])
        return _comp(c, CONCURRENT_PROMPTS[i], max_tokens=10)[0]

    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT_PROMPTS)) as ex:
        together = list(ex.map(one, range(len(CONCURRENT_PROMPTS))))
    assert len(set(alone)) == len(alone)  # varied outputs, so a mix-up would show
    # A request decoding alone runs the CPU's 1-token bucket, whose 1-row matmuls sum in
    # another order than batched rows (jaxserve/device/buckets.py), so a near-tie may flip a
    # later greedy token (the first comes from the prefill, batched either way); a mix-up of
    # requests would make an output share more with another prompt's text than with its own.
    shared = lambda x, y: len(os.path.commonprefix([x, y]))
    for i, (p, a, t) in enumerate(zip(CONCURRENT_PROMPTS, alone, together)):
        assert all(shared(t, a) > shared(t, b) for j, b in enumerate(alone) if j != i), (p, t)
    same = sum(a == t for a, t in zip(alone, together))
    assert same >= len(alone) // 2, list(zip(alone, together))
