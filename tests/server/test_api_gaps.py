"""Small API surfaces that real clients probe, against the fake engine over a real uvicorn with
the official ``openai`` client: ``GET /v1/models/{id}``, error ``code`` strings as OpenAI sends
them, ``max_completion_tokens`` on completions, the checks of batched prompts, and the
``/tokenizer_info`` contract that lm-evaluation-harness's remote tokenizer reads (its
``check_remote_tokenizer_support`` then ``RemoteTokenizer``), with the real SmolLM2 tokenizer.

Semantics asserted (docs/api.md#behaviour-chosen-where-the-openai-api-leaves-room):
- ``GET /v1/models/{id}`` is the card of ``/v1/models``; another id is 404 with
  ``code: "model_not_found"`` (ids may hold ``/``).
- ``error.code`` is a string or null, never the HTTP status: ``model_not_found``,
  ``context_length_exceeded``, ``invalid_api_key``, ``unsupported_parameter``; null for other
  invalid values, unknown routes, overload and timeouts.
- Completions take ``max_completion_tokens`` as ``max_tokens``; both given (not null) and
  different is a 400 naming ``max_completion_tokens``.
- A batch mixing strings and id lists, or longer than ``--max-num-prompts``, is a 400 naming
  ``prompt``; a batch with one bad prompt is a 400 naming it (``prompt[i]: ...``), and the
  other prompts are aborted.
"""

from __future__ import annotations

import httpx
import jinja2.sandbox
import openai
import pytest

from jaxserve.server.routes import build_app
from jaxserve.server_config import RequestLimits, ServerConfig
from jaxserve.tokenizer import Tokenizer
from tests.support.fake_engine import FakeEngine
from tests.support.http_server import serve_app

MODEL = "test-model"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def served():
    """(openai client, httpx client, engine) against a uvicorn serving the fake engine."""
    engine = FakeEngine(script="Hello world")
    with serve_app(build_app(engine, MODEL)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with httpx.Client(base_url=url, timeout=30) as http:
            yield client, http, engine


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


# ---- GET /v1/models/{id} ----------------------------------------------------------------------


def test_retrieve_model_and_unknown_id(served) -> None:
    client, http, _ = served
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "jaxserve")
    assert http.get(f"/v1/models/{MODEL}").json() == http.get("/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4o")
    assert exc.value.code == "model_not_found" and exc.value.param == "model"
    assert "gpt-4o" in exc.value.message
    _error(http.get("/v1/models/test-model/extra"), 404)


def test_model_id_with_a_slash() -> None:
    with serve_app(build_app(FakeEngine(), "org/model-1")) as url:
        r = httpx.get(url + "/v1/models/org/model-1")
        assert r.status_code == 200 and r.json()["id"] == "org/model-1"
        assert _error(httpx.get(url + "/v1/models/org"), 404)["code"] == "model_not_found"


# ---- error codes ------------------------------------------------------------------------------


def test_error_codes_are_openai_strings(served) -> None:
    client, http, engine = served
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="other", prompt="hi")
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt="x" * engine.max_model_len)
    assert (long.value.code, long.value.param) == ("context_length_exceeded", "prompt")
    assert str(engine.max_model_len) in long.value.message
    with pytest.raises(openai.BadRequestError) as chat_long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                               "content": "y" * 100}])
    assert (chat_long.value.code, chat_long.value.param) == ("context_length_exceeded",
                                                             "messages")
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model=MODEL, prompt="hi", best_of=2)
    assert (unsupported.value.code, unsupported.value.param) == ("unsupported_parameter",
                                                                 "best_of")
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert (bad.value.code, bad.value.param) == (None, "temperature")
    assert _error(http.post("/v1/embeddings", json={}), 404)["code"] is None
    assert _error(http.post("/v1/completions", content=b"{", headers={
        "content-type": "application/json"}), 400)["code"] is None


def test_invalid_api_key_code() -> None:
    app = build_app(FakeEngine(), MODEL, ServerConfig(api_key="secret"))
    with serve_app(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as exc:
            client.models.list()
        assert exc.value.code == "invalid_api_key"
        ok = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0)
        assert ok.models.retrieve(MODEL).id == MODEL


# ---- max_completion_tokens on completions ---------------------------------------------------


def test_max_completion_tokens_on_completions(served) -> None:
    client, http, _ = served
    for extra in ({"max_completion_tokens": 3}, {"max_completion_tokens": 3, "max_tokens": 3},
                  {"max_completion_tokens": 3, "max_tokens": None}):
        r = client.completions.create(model=MODEL, prompt="hi", extra_body=extra)
        assert r.usage.completion_tokens == 3 and r.choices[0].text == "Hel", extra
        assert r.choices[0].finish_reason == "length"
    streamed = client.completions.create(model=MODEL, prompt="hi", stream=True,
                                         extra_body={"max_completion_tokens": 2})
    assert "".join(c.choices[0].text for c in streamed) == "He"
    default = client.completions.create(model=MODEL, prompt="hi", extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                  extra_body={"max_completion_tokens": 5})
    assert exc.value.param == "max_completion_tokens"
    assert "4" in exc.value.message and "5" in exc.value.message
    err = _error(http.post("/v1/completions", json={"prompt": "hi", "max_completion_tokens": 0}),
                 400)
    assert err["param"] == "max_completion_tokens" and "echo" in err["message"]
    err = _error(http.post("/v1/completions", json={"prompt": "hi", "max_completion_tokens": -1}),
                 400)
    assert err["param"] == "max_completion_tokens"


# ---- batched prompts: the checks --------------------------------------------------------------


def test_batch_shape_and_cap() -> None:
    engine = FakeEngine(script="ok")
    with serve_app(build_app(engine, MODEL, limits=RequestLimits(max_num_prompts=3))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2)
        assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.prompt_tokens == 3
        assert sorted(engine.requests) == [f"{r.id}-{i}" for i in range(3)]
        assert [engine.requests[f"{r.id}-{i}"][0] for i in range(3)] == [[97], [98], [99]]
        ids = client.completions.create(model=MODEL, prompt=[[104, 105], [106]], max_tokens=2)
        assert ids.usage.prompt_tokens == 3 and len(ids.choices) == 2
        for prompt in (["a", [1]], [[1], "a"], ["a", 5]):
            with pytest.raises(openai.BadRequestError) as exc:
                client.completions.create(model=MODEL, prompt=prompt)
            assert exc.value.param == "prompt", prompt
        with pytest.raises(openai.BadRequestError) as many:
            client.completions.create(model=MODEL, prompt=["a"] * 4)
        assert many.value.param == "prompt" and "--max-num-prompts" in many.value.message
        # a token-id list is one prompt, however long
        one = client.completions.create(model=MODEL, prompt=[104] * 10, max_tokens=1)
        assert len(one.choices) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_one_bad_prompt_fails_the_batch_and_aborts_the_others(stream: bool) -> None:
    engine = FakeEngine(script="abcdefgh", step_s=0.01)
    with serve_app(build_app(engine, MODEL)) as url:
        r = httpx.post(url + "/v1/completions", json={
            "prompt": ["fine", "x" * engine.max_model_len, "also fine"], "max_tokens": 50,
            "ignore_eos": True, "stream": stream}, timeout=30)
        err = _error(r, 400)
        assert err["param"] == "prompt" and err["message"].startswith("prompt[1]: ")
        assert err["code"] == "context_length_exceeded"
        # prompts 0 and 2 had been queued (to run beside the others) and were aborted
        assert sorted(engine.aborted) == sorted(engine.requests)
        assert [rid[-2:] for rid in sorted(engine.requests)] == ["-0", "-2"]
        assert engine.running == set()


# ---- /tokenizer_info --------------------------------------------------------------------------


def test_tokenizer_info_contract(tokenizer: Tokenizer) -> None:
    """What lm-eval's remote tokenizer reads, with the real SmolLM2 tokenizer behind it."""
    engine = FakeEngine(max_model_len=1024)
    engine.tokenizer = tokenizer
    with serve_app(build_app(engine, MODEL)) as url, httpx.Client(base_url=url) as http:
        r = http.get("/tokenizer_info")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        info = r.json()
        assert info == {
            "tokenizer_class": "PreTrainedTokenizerFast", "name_or_path": MODEL,
            "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": None,
            "add_bos_token": False, "add_eos_token": False, "model_max_length": 1024,
            "chat_template": tokenizer.chat_template}

        # check_remote_tokenizer_support: eos_token present, /tokenize answers a token list
        tokens = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
        assert tokens.json()["tokens"] == tokenizer.encode("test", add_special_tokens=False)

        # RemoteTokenizer: eos/bos ids are the first id of their encoded text
        def encode(text: str) -> list[int]:
            return http.post("/tokenize", json={"prompt": text,
                                                "add_special_tokens": False}).json()["tokens"]

        assert encode(info["eos_token"])[0] == tokenizer.eos_token_id
        assert encode(info["bos_token"])[0] == tokenizer.bos_token_id
        ids = encode("Hello, world! 茶")
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == "Hello, world! 茶"

        # RemoteTokenizer.apply_chat_template renders chat_template itself with jinja2
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        msgs = [{"role": "user", "content": "Hi!"}]
        rendered = env.from_string(info["chat_template"]).render(messages=msgs,
                                                                 add_generation_prompt=True)
        assert rendered == tokenizer.apply_chat_template(msgs)


def test_tokenizer_info_without_chat_template(served) -> None:
    _, http, engine = served
    engine.tokenizer.has_chat_template = False
    info = http.get("/tokenizer_info").json()
    assert info["chat_template"] is None and info["bos_token"] is None
    assert info["eos_token"] == "\x00" and info["model_max_length"] == engine.max_model_len
