"""The server stage of scripts/device_run.py: ``jaxserve serve`` started cold then warm, and
against the warm one ``jaxserve bench serve`` per workload, one structured-output request, and the
compiles counted after warm-up.

``server_stage`` starts the server twice with one compilation cache directory: empty at the first
(cold) start, written by it for the second (warm); each start is timed from the launch to
``/ready`` 200, and the server's own load and compile seconds are read from its output. The
benchmarks run ``jaxserve bench serve``'s entry point in this process (the JSON it saves is read
back); the structured-output reply must match ``VERDICT_SCHEMA`` and finish with ``stop``; the
compile counter (``jaxserve:num_compiles_after_warmup_total`` on /metrics) must be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxserve.bench import serve as bench_serve
from jaxserve.bench.startup import parse_server_output

COMPILES_METRIC = "jaxserve:num_compiles_after_warmup_total"
# the structured-output request: a bounded answer, so that random weights still finish it
VERDICT_SCHEMA = {"type": "object", "additionalProperties": False,
                  "required": ["answer", "confidence"],
                  "properties": {"answer": {"enum": ["yes", "no"]},
                                 "confidence": {"enum": ["low", "medium", "high"]}}}


@dataclass(frozen=True)
class Workload:
    """One ``jaxserve bench serve`` run; lengths in tokens."""

    name: str
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    dataset_args: tuple[str, ...]


def random_workload(name: str, concurrency: int, num_prompts: int, input_len: int,
                    output_len: int) -> Workload:
    return Workload(name, concurrency, num_prompts, input_len, output_len,
                    ("--dataset-name", "random", "--random-input-len", str(input_len),
                     "--random-output-len", str(output_len)))


def prefix_workload(name: str, concurrency: int, num_prompts: int, prefix_len: int,
                    suffix_len: int, num_prefixes: int, output_len: int) -> Workload:
    return Workload(name, concurrency, num_prompts, prefix_len + suffix_len, output_len,
                    ("--dataset-name", "prefix_repetition",
                     "--prefix-repetition-prefix-len", str(prefix_len),
                     "--prefix-repetition-suffix-len", str(suffix_len),
                     "--prefix-repetition-num-prefixes", str(num_prefixes),
                     "--prefix-repetition-output-len", str(output_len)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: dict, timeout_s: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


class Server:
    """One ``jaxserve serve`` on a free local port, its output in ``log_path``; a context
    manager that stops it (SIGTERM: drain, exit 0)."""

    def __init__(self, serve_args: list[str], log_path: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", *serve_args,
                    "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    def start(self, timeout_s: float) -> float:
        """Launch and wait for ``/ready`` 200; returns the seconds from launch.

        Raises:
          RuntimeError: the server exited or was not ready in time (its output's tail quoted).
        """
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.tail()}")
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"server not ready in {timeout_s:.0f} s: {self.tail()}")
            try:
                if _get(self.url + "/ready", 2.0)[0] == 200:
                    return time.perf_counter() - t0
            except OSError:
                pass  # the port is not open yet
            time.sleep(0.1)

    def stop(self) -> int | None:
        if self.proc is not None and self.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.returncode = self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.returncode = self.proc.wait()
        return self.returncode

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def tail(self, n: int = 2000) -> str:
        return self.log()[-n:]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def startup_figures(ready_s: float, server: Server) -> dict:
    figures = parse_server_output(server.log())
    return {"ready_s": round(ready_s, 2), "load_s": figures["load_s"],
            "compile_s": figures["compile_s"], "num_programs": figures["num_programs"]}


def run_bench(url: str, w: Workload, result_dir: str) -> dict:
    """One ``jaxserve bench serve`` (its own entry point, in this process); the figures."""
    argv = ["--base-url", url, *w.dataset_args, "--num-prompts", str(w.num_prompts),
            "--max-concurrency", str(w.concurrency), "--num-warmups", "2", "--seed", "0",
            "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", result_dir,
            "--result-filename", f"bench-{w.name}.json"]
    p = argparse.ArgumentParser()
    bench_serve.add_cli_args(p)
    bench_serve.run(p.parse_args(argv))
    with open(os.path.join(result_dir, f"bench-{w.name}.json"), encoding="utf-8") as fh:
        r = json.load(fh)
    ok = r["completed"] == w.num_prompts and not r["failed"]
    return {"name": w.name, "status": "ok" if ok else "FAIL", "concurrency": w.concurrency,
            "num_prompts": w.num_prompts, "input_len": w.input_len, "output_len": w.output_len,
            "completed": r["completed"], "failed": r["failed"],
            "duration_s": round(r["duration"], 2),
            "output_tok_s": round(r["output_throughput"], 1),
            "ttft_ms_p50": round(r["median_ttft_ms"], 2), "ttft_ms_p99": round(r["p99_ttft_ms"], 2),
            "itl_ms_p50": round(r["median_itl_ms"], 2), "itl_ms_p99": round(r["p99_itl_ms"], 2),
            "errors": sorted({e for e in r["errors"] if e})[:3],
            "command": "jaxserve bench serve " + shlex.join(argv)}


def compiles_after_warmup(metrics_text: str) -> int:
    """The sum of ``COMPILES_METRIC``'s samples in a /metrics page.

    Raises:
      ValueError: the page has no such sample.
    """
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
              if line.startswith(COMPILES_METRIC)]
    if not values:
        raise ValueError(f"/metrics has no {COMPILES_METRIC}")
    return int(sum(values))


def schema_error(text: str) -> str | None:
    """Why ``text`` is not an object of ``VERDICT_SCHEMA``, or None when it is one."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"
    props = VERDICT_SCHEMA["properties"]
    if not isinstance(obj, dict) or set(obj) != set(VERDICT_SCHEMA["required"]):
        return f"keys {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}"
    bad = [k for k, v in obj.items() if v not in props[k]["enum"]]
    return f"values outside the enum: {bad}" if bad else None


def structured_request(url: str, model: str) -> dict:
    """One chat completion with ``response_format`` json_schema (strict); is its reply valid?"""
    body = {"model": model, "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": "Is the sky green? Answer in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "verdict", "schema": VERDICT_SCHEMA, "strict": True}}}
    choice = _post(url + "/v1/chat/completions", body)["choices"][0]
    content = choice["message"]["content"]
    error = schema_error(content)
    if error is None and choice["finish_reason"] != "stop":
        error = f"finish_reason {choice['finish_reason']}"
    return {"status": "ok" if error is None else "FAIL", "content": content,
            "finish_reason": choice["finish_reason"], "error": error}


def server_stage(serve_args: list[str], workloads: tuple[Workload, ...], ready_timeout_s: float,
                 work: str, time_left: Callable[[], float]) -> tuple[dict, dict]:
    """(the section, the structured-output check): the cold and the warm start of ``jaxserve
    serve`` with ``serve_args`` (its logs in ``work``), then ``measure`` against the warm one.
    A failure ends the stage as a FAIL that keeps what was measured before it."""
    section: dict = {"serve_command": "jaxserve serve " + shlex.join(serve_args), "startup": {},
                     "benchmarks": [], "compiles_after_warmup": None}
    structured: dict = {"status": "skipped (the server did not start)"}
    problems = []
    try:
        for kind in ("cold", "warm"):
            with Server(serve_args, os.path.join(work, f"serve-{kind}.log")) as server:
                ready_s = server.start(ready_timeout_s)
                section["startup"][kind] = startup_figures(ready_s, server)
                if kind == "warm":
                    structured = measure(server, workloads, section, work, time_left)
            section["startup"][kind]["exit_code"] = server.returncode
            if server.returncode:
                problems.append(f"the {kind} server exited {server.returncode}")
    except Exception as e:  # noqa: BLE001 - keep what was measured before
        problems.append(f"{type(e).__name__}: {str(e)[:3000]}")
    problems += [f"bench {b['name']}" for b in section["benchmarks"] if b["status"] == "FAIL"]
    if section["compiles_after_warmup"] != 0:
        problems.append(f"compiles after warm-up: {section['compiles_after_warmup']}")
    section["status"] = "ok" if not problems else "FAIL"
    section["problems"] = problems
    return section, structured


def measure(server: Server, workloads: tuple[Workload, ...], section: dict, work: str,
            time_left: Callable[[], float]) -> dict:
    """Against the warm server: the benchmarks into ``section`` (each skipped with under 30 s
    left), the structured-output request (returned), then the compiles since warm-up."""
    for w in workloads:
        if time_left() < 30:
            section["benchmarks"].append({"name": w.name, "status": "skipped (time)"})
        else:
            section["benchmarks"].append(run_bench(server.url, w, work))
    model = json.loads(_get(server.url + "/v1/models")[1])["data"][0]["id"]
    structured = structured_request(server.url, model)
    section["compiles_after_warmup"] = compiles_after_warmup(
        _get(server.url + "/metrics")[1].decode())
    return structured
