"""The readiness and lifecycle contract over real HTTP: the port answers from the start,
``/health`` is liveness, ``/ready`` reports loading -> compiling -> ready (and draining), the model
endpoints answer 503 + Retry-After until ready, keep-alive connections outlive a short idle and
say how long they may idle, and ``/metrics`` carries the server's own series and, on request,
vLLM's names.

In-process tests run ``gate.run_server`` (the code path of ``jaxserve serve``) on a thread with a
start-up function the test holds at each stage; one test starts the real ``jaxserve serve`` on the
tiny dummy model in a subprocess, polls it from process start, and SIGTERMs it mid-stream.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from jaxserve.server.gate import run_server
from jaxserve.server.lifecycle import Lifecycle
from jaxserve.server.routes import build_app
from jaxserve.server_config import ServerConfig
from tests.conftest import REPO_ROOT
from tests.support.fake_engine import FakeEngine

MODEL = "test-model"
COMPL = "/v1/completions"
WAIT_S = 60.0  # how long a poll may wait for a state it expects (a loaded 2-core machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(what: str, cond: Callable[[], object]) -> object:
    deadline = time.monotonic() + WAIT_S
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def _serving(config: ServerConfig, start: Callable[[Lifecycle], object] | None = None,
             engine: FakeEngine | None = None) -> Iterator[tuple[str, object, list]]:
    """``run_server`` on a thread (no signal handlers off the main thread); yields the base
    URL, the app and a list that receives run_server's result or exception. Leaving drains
    the server (as a SIGTERM would) and waits for it to stop."""
    app = build_app(engine, MODEL, config)
    result: list = []

    def run() -> None:
        try:
            result.append(run_server(app, start))
        except BaseException as exc:  # noqa: BLE001 (the test inspects it)
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    _until("the port", lambda: _answers(url) or result)
    try:
        yield url, app, result
    finally:
        app.state.gate.start_drain()
        thread.join(WAIT_S)
        assert not thread.is_alive()


def test_port_answers_while_loading_and_the_stages_advance() -> None:
    gates = {k: threading.Event() for k in ("compile", "half", "done")}

    def start(lifecycle: Lifecycle) -> FakeEngine:
        gates["compile"].wait(WAIT_S)
        lifecycle.compiling(0, 2)
        gates["half"].wait(WAIT_S)
        lifecycle.compiling(1, 2)
        gates["done"].wait(WAIT_S)
        return FakeEngine(script="Hi")

    cfg = ServerConfig(port=_free_port())
    with _serving(cfg, start) as (url, _, result), httpx.Client(base_url=url, timeout=10) as http:
        ready = http.get("/ready")
        assert ready.status_code == 503
        body = ready.json()
        assert (body["stage"], body["progress"], body["eta_s"]) == ("loading", 0.0, None)
        assert body["elapsed_s"] >= 0
        assert http.get("/health").json() == {"status": "ok"}
        for resp in (http.post(COMPL, json={"prompt": "hi"}), http.get("/v1/models"),
                     http.post("/tokenize", json={"prompt": "hi"}),
                     http.post("/v1/responses", json={"input": "hi"}),
                     http.get("/v1/responses/resp_1")):
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
            err = resp.json()["error"]
            assert err["code"] is None and err["type"] == "server_error"
            assert "not ready" in err["message"] and "loading" in err["message"]
        metrics = http.get("/metrics").text
        assert "process_cpu_seconds_total" in metrics and "jaxserve:draining" in metrics
        assert "jaxserve:num_requests_running" not in metrics  # no engine yet
        assert "jaxserve:time_to_ready_seconds" not in metrics
        assert http.get("/openapi.json").status_code == 200

        gates["compile"].set()
        body = _until("compiling", lambda: (b := http.get("/ready").json())["stage"]
                      == "compiling" and b)
        assert (body["progress"], body["eta_s"]) == (0.0, None)
        gates["half"].set()
        body = _until("half compiled", lambda: (b := http.get("/ready").json())["progress"]
                      == 0.5 and b)
        assert body["stage"] == "compiling" and body["eta_s"] >= 0
        refused = http.post(COMPL, json={"prompt": "hi"})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert "compiling, 50% done" in refused.json()["error"]["message"]

        gates["done"].set()
        _until("ready", lambda: http.get("/ready").status_code == 200)
        body = http.get("/ready").json()
        assert (body["stage"], body["progress"], body["eta_s"]) == ("ready", 1.0, 0.0)
        out = http.post(COMPL, json={"prompt": "hi", "max_tokens": 2})
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == "Hi"
        metrics = http.get("/metrics").text
        assert 'jaxserve:num_requests_running{model_name="fake-model"}' in metrics
        (ready_s,) = [float(ln.split()[-1]) for ln in metrics.splitlines()
                      if ln.startswith(f'jaxserve:time_to_ready_seconds{{model_name="{MODEL}"}}')]
        assert 0 < ready_s <= http.get("/ready").json()["elapsed_s"]
    assert result == [True]


def test_a_failed_start_stops_the_server_with_its_error() -> None:
    def start(lifecycle: Lifecycle) -> FakeEngine:
        raise FileNotFoundError("model file 'x.gguf' does not exist")

    with _serving(ServerConfig(port=_free_port()), start) as (_, _, result):
        _until("the server to stop", lambda: result)
    assert isinstance(result[0], FileNotFoundError)


def test_health_is_500_once_the_engine_died() -> None:
    engine = FakeEngine()
    client = TestClient(build_app(engine, MODEL))
    assert client.get("/health").status_code == 200
    engine.alive = False
    resp = client.get("/health")
    assert resp.status_code == 500 and "died" in resp.json()["error"]["message"]


def test_keep_alive_connection_is_reused_after_an_idle_shorter_than_the_timeout() -> None:
    cfg = ServerConfig(port=_free_port(), timeout_keep_alive=2)
    with _serving(cfg, engine=FakeEngine()):
        conn = http.client.HTTPConnection("127.0.0.1", cfg.port, timeout=10)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Keep-Alive") == "timeout=2"
        resp.read()
        sock = conn.sock
        time.sleep(0.5)  # idle, well under the 2 s timeout
        conn.request("POST", COMPL, body=json.dumps({"prompt": "hi", "max_tokens": 2}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Keep-Alive") == "timeout=2"
        resp.read()
        assert conn.sock is sock  # the same connection served both requests
        # past the timeout (and short of uvicorn's own 5 s default) the server closes it
        time.sleep(3.0)
        sock.settimeout(5)
        assert sock.recv(1) == b""
        conn.close()


@pytest.mark.parametrize("compat", [None, "vllm"])
def test_metrics_endpoint_vllm_names_only_with_the_flag(compat: str | None) -> None:
    client = TestClient(build_app(FakeEngine(), MODEL, ServerConfig(metrics_compat=compat)))
    client.post(COMPL, json={"prompt": "hi", "max_tokens": 2})
    text = client.get("/metrics").text
    assert "process_resident_memory_bytes" in text and "_created" not in text
    assert ('jaxserve:request_success_total{finished_reason="length",model_name="fake-model"} 1.0'
            in text)
    if compat is None:
        assert "vllm:" not in text
    else:
        for line in ('vllm:num_requests_waiting{model_name="fake-model"} 0.0',
                     'vllm:num_requests_running{model_name="fake-model"} 0.0',
                     'vllm:kv_cache_usage_perc{model_name="fake-model"} 0.0',
                     'vllm:request_success_total{finished_reason="length",'
                     + 'model_name="fake-model"} 1.0'):
            assert line in text.splitlines(), line


# ---- the real command ----------------------------------------------------------------------

TINY_SERVE = ["tiny", "--load-format", "dummy", "--max-model-len", "256", "--num-kv-blocks",
              "40", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
              "--compilation-cache-dir", str(REPO_ROOT / ".jax_cache")]


def test_jaxserve_serve_answers_from_start_and_drains_on_sigterm(tmp_path: Path) -> None:
    """Poll ``jaxserve serve`` (tiny dummy model) from process start: the port answers before
    the model is ready, the stages advance in order, then a SIGTERM during a stream turns
    /ready 503 at once while the stream finishes, and the process exits 0."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", *TINY_SERVE, "--port", str(port),
           "--shutdown-timeout", "30", "--log-format", "json"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        stages: list[str] = []
        first: dict = {}
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=url, timeout=10) as http:
            while True:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                try:
                    ready = http.get("/ready")
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                stage = ready.json()["stage"]
                if not first:  # the first answer: before the model is ready
                    first = {"ready": ready, "health": http.get("/health"),
                             "completion": http.post(COMPL, json={"prompt": "hi"})}
                if not stages or stages[-1] != stage:
                    stages.append(stage)
                if ready.status_code == 200:
                    break
                time.sleep(0.02)
            assert first["ready"].status_code == 503 and stages[0] == "loading"
            assert first["health"].status_code == 200
            assert first["completion"].status_code == 503
            assert first["completion"].headers["retry-after"].isdigit()
            assert stages in (["loading", "compiling", "ready"], ["loading", "ready"]), stages

            body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            with http.stream("POST", COMPL, json=body) as resp:
                lines = resp.iter_lines()
                next(line for line in lines if line)
                proc.send_signal(signal.SIGTERM)
                _until("/ready 503", lambda: http.get("/ready").status_code == 503)
                assert http.get("/ready").json()["stage"] == "draining"
                assert http.get("/health").status_code == 200
                assert http.post(COMPL, json={"prompt": "hi"}).status_code == 503
                events = [line for line in lines if line]
            assert events[-1] == "data: [DONE]"
            last = json.loads(events[-2].removeprefix("data: "))
            assert last["choices"][0]["finish_reason"] == "length"
        assert proc.wait(40) == 0
        records = [json.loads(line) for line in log_path.read_text().splitlines()
                   if line.startswith("{")]
        assert any(r["message"].startswith("draining: 1 request") for r in records)
        # the start-up heap frozen before ready: later collections do not walk it
        frozen = [r for r in records if r["message"].startswith("garbage collector: ")]
        assert frozen and int(frozen[0]["message"].split()[2]) > 10_000, frozen
        # one clock, one number: the start-up line and the gate's log say the same time to ready
        ready_in = re.search(r"; ready in ([\d.]+) s", log_path.read_text())
        assert ready_in is not None
        assert f"ready: {ready_in[1]} s after start-up began" in [r["message"] for r in records]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_the_time_to_ready_is_fixed_when_the_start_up_work_ends() -> None:
    """``startup_done`` fixes the figure the start-up lines print; ``set_ready`` keeps it, and
    counts from the ``started`` it was given (the process's start-up, not the app's)."""
    life = Lifecycle(started=time.monotonic() - 5.0)
    assert life.ready_s is None and life.status().elapsed_s >= 5.0
    done = life.startup_done()
    assert done >= 5.0 and life.startup_done() == done
    time.sleep(0.01)
    life.set_ready()
    assert life.ready and life.ready_s == done
    late = Lifecycle()
    late.set_ready()  # without startup_done: now
    assert late.ready_s is not None and 0 <= late.ready_s < 5.0
