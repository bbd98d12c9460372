"""``jaxserve run-batch``: OpenAI Batch files through the engine.

Against the fake engine (fast, in-process): a file mixing completions, chat and bad lines gives
one output line per input line in input order, lines run concurrently (at most
``max_in_flight``), each answer equals the HTTP server's for the same body, and an engine fault
fails only its line. Then the CLI end to end on the real SmolLM2 model.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from starlette.testclient import TestClient

from jaxserve.cli.main import main
from jaxserve.server.batch import run_batch
from jaxserve.server.handlers import OpenAIServer
from jaxserve.server.routes import build_app
from jaxserve.server_config import RequestLimits
from tests.support.fake_engine import FakeEngine

MODEL = "test-model"
REPO_ROOT = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "hi"}]


def line(custom_id: object, url: str, body: object, method: str = "POST") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": body}).encode()


MIXED = [
    line("c-long", "/v1/completions", {"prompt": "a", "max_tokens": 12, "ignore_eos": True}),
    line("chat", "/v1/chat/completions", {"messages": HI, "max_tokens": 3}),
    b"{not json",
    b"[1, 2",
    line("url", "/v1/embeddings", {"input": "x"}),
    line("method", "/v1/completions", {"prompt": "x"}, method="GET"),
    line("temp", "/v1/completions", {"prompt": "x", "temperature": -1}),
    line("model", "/v1/chat/completions", {"model": "other", "messages": HI}),
    line("stream", "/v1/completions", {"prompt": "x", "stream": True}),
    line(7, "/v1/completions", {"prompt": "x"}),
    b'{"custom_id": "nobody", "method": "POST", "url": "/v1/completions"}',
    line("huge", "/v1/completions", {"prompt": "x" * 3000}),
    line("c-short", "/v1/completions", {"prompt": "b", "max_tokens": 1}),
]
# custom_id, status (None: an error line), error code
EXPECTED = [
    ("c-long", 200, None), ("chat", 200, None), (None, None, "invalid_json_line"),
    (None, None, "invalid_json_line"),
    ("url", None, "invalid_url"), ("method", None, "invalid_method"), ("temp", 400, None),
    ("model", 404, None), ("stream", 400, None), (None, None, "invalid_request"),
    ("nobody", None, "invalid_request"), (None, None, "line_too_large"), ("c-short", 200, None),
]  # fmt: skip


class PeakEngine(FakeEngine):
    """A FakeEngine that records the most requests it held at once."""

    peak = 0

    async def generate(self, *args, **kwargs):  # type: ignore[override]
        gen = super().generate(*args, **kwargs)
        try:
            async for out in gen:
                self.peak = max(self.peak, len(self.running))
                yield out
        finally:
            await gen.aclose()


def _run(engine: FakeEngine, lines: list[bytes], max_in_flight: int,
         limits: RequestLimits | None = None) -> tuple[list[dict], dict]:
    api = OpenAIServer(engine, MODEL, limits)
    out = io.BytesIO()
    counts = asyncio.run(run_batch(api, lines, out, max_in_flight, progress=False))
    rows = [json.loads(r) for r in out.getvalue().splitlines()]
    return rows, dict(counts)


def test_mixed_file_one_line_each_in_input_order() -> None:
    engine = PeakEngine(step_s=0.01)
    rows, counts = _run(engine, MIXED, max_in_flight=4, limits=RequestLimits(2000))
    assert [(r["custom_id"], (r["response"] or {}).get("status_code"),
             (r["error"] or {}).get("code")) for r in rows] == EXPECTED
    assert counts == {"ok": 3, "failed": 10}
    for r in rows:
        assert r["id"].startswith("batch_req_") and (r["response"] is None) != (r["error"] is None)
    long, chat, short = rows[0]["response"], rows[1]["response"], rows[-1]["response"]
    assert long["body"]["choices"][0]["text"] == "Hello there," and long["body"]["usage"] == {
        "prompt_tokens": 1, "completion_tokens": 12, "total_tokens": 13}
    assert chat["body"]["object"] == "chat.completion" and chat["request_id"].startswith("chatc")
    assert chat["body"]["choices"][0]["message"]["content"] == "Hel"
    assert short["body"]["choices"][0]["finish_reason"] == "length"
    assert long["body"]["id"] == long["request_id"]
    err = rows[6]["response"]["body"]["error"]
    assert err["param"] == "temperature" and err["code"] is None
    assert rows[7]["response"]["body"]["error"]["type"] == "not_found_error"
    assert rows[7]["response"]["body"]["error"]["code"] == "model_not_found"
    assert rows[8]["response"]["body"]["error"]["param"] == "stream"
    assert engine.peak >= 2  # the three good lines overlapped in the engine
    assert engine.running == set() and engine.aborted == []


def test_concurrency_is_bounded_and_answers_equal_the_http_server() -> None:
    bodies = [{"prompt": "p" * (i % 5 + 1), "max_tokens": i % 7 + 1, "ignore_eos": True}
              for i in range(30)]
    engine = PeakEngine(step_s=0.002)
    rows, counts = _run(engine, [line(f"r{i}", "/v1/completions", b)
                                 for i, b in enumerate(bodies)], max_in_flight=5)
    assert counts == {"ok": 30} and [r["custom_id"] for r in rows] == [f"r{i}" for i in range(30)]
    assert 2 <= engine.peak <= 5
    http = TestClient(build_app(FakeEngine(), MODEL))
    for r, body in zip(rows, bodies, strict=True):
        want = http.post("/v1/completions", json=body).json()
        got = r["response"]["body"]
        for d in (want, got):
            del d["id"], d["created"]
        assert got == want


def test_engine_fault_fails_only_its_line() -> None:
    rows, counts = _run(FakeEngine(fail_after=2), [
        line("a", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
        line("b", "/v1/completions", {"prompt": "x", "max_tokens": 5}),
        line("c", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ], max_in_flight=2)
    assert [r["response"]["status_code"] for r in rows] == [200, 500, 200]
    assert rows[1]["response"]["body"]["error"]["type"] == "server_error"
    assert counts == {"ok": 2, "failed": 1}


def test_cli_refuses_bad_files_before_loading(tmp_path: Path, capsys) -> None:
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o",
                 str(tmp_path / "o.jsonl")]) == 2
    assert "cannot read input file" in capsys.readouterr().err
    src = tmp_path / "in.jsonl"
    src.write_text("")
    assert main(["run-batch", "-i", str(src), "-o", str(tmp_path)]) == 2  # a directory
    assert "cannot write output file" in capsys.readouterr().err


def test_cli_end_to_end_on_the_real_model(tmp_path: Path) -> None:
    """The CLI on SmolLM2-135M (the conftest engine's flags, so its compilation cache serves)."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        line("france", "/v1/completions",
             {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
        b"",
        line("hello", "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
              "temperature": 0}),
        b"[1, 2",
        line("toolong", "/v1/completions", {"prompt": [1] * 1024, "max_tokens": 1}),
        line("ids", "/v1/completions", {"prompt": [504, 3575, 3004], "max_tokens": 3,
                                        "temperature": 0}),
    ]
    src.write_bytes(b"\n".join(lines) + b"\n")
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "run-batch", "-i", str(src), "-o", str(dst),
           "--max-model-len", "1024", "--num-kv-blocks", "160",
           "--compilation-cache-dir", str(REPO_ROOT / ".jax_cache")]
    proc = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run-batch: 5 lines, 3 succeeded, 2 failed" in proc.stderr
    assert "5/5" in proc.stderr  # the progress bar's last state
    rows = [json.loads(r) for r in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["france", "hello", None, "toolong", "ids"]
    france, hello = rows[0]["response"]["body"], rows[1]["response"]["body"]
    assert france["choices"][0]["text"].startswith(" Paris")
    assert france["usage"]["completion_tokens"] == 4
    assert hello["object"] == "chat.completion" and hello["choices"][0]["message"]["content"]
    assert rows[2]["error"]["code"] == "invalid_json_line"
    err = rows[3]["response"]["body"]["error"]
    assert rows[3]["response"]["status_code"] == 400 and err["param"] == "prompt"
    assert "1024" in err["message"]
    assert rows[4]["response"]["body"]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
