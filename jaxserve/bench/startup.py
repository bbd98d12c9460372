"""``jaxserve bench startup``: seconds from launching ``jaxserve serve`` to ``/ready`` 200.

    jaxserve bench startup --model '' --load-format auto --repeats 2 \\
        --output-json results/startup.json

(``--model ''``: the default model, SmolLM2-135M-Instruct.) Each run starts ``jaxserve serve``
in a fresh process on a free local port and polls ``/ready`` every 0.1 s from the launch.
Beside the time to ready (``ready_s``) and to the port's first answer (``port_s``) it records
when ``/ready`` first reported each stage (``stage_at_s``), the server's CPU seconds when it
became ready (``cpu_s``: the number to compare on a shared machine, where wall time depends on
the other load) and the load averages before the launch; from the server's output it reads
the load time, the compile time of the step programs and each start-up stage's seconds
(``stages_s``: import — launch to ``serve()``, taken as ``ready_s`` minus the server's own
``ready_in`` —, load_weights, plan_kv, kv_cache, runner, engine, compile, probe and the rest,
``server``: the port, uvicorn, the start-up thread). A cold start has an empty persistent
compilation cache; the warm start that follows reuses the cache the cold one wrote. A server
that became ready before all its programs compiled (``--background-compile``) is stopped only
once ``jaxserve:step_programs_pending`` is 0, so that the warm start finds every program
cached; ``background_s`` is how long after ready that took.
``--repeats`` pairs, each with a new cache; medians are reported. ``--server-env`` sets
environment variables of the server only (``PYTHONPATH=other/tree`` times another checkout,
``XLA_FLAGS=...`` compile options), so before/after runs can be interleaved. For load time per
weights format, run it once per format (GGUF, ``jaxserve convert``'s orbax directory, HF
safetensors, ``--load-format dummy``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from jaxserve.bench.common import write_json
from jaxserve.bench.server_process import free_port

POLL_S = 0.1
PENDING_GAUGE = "jaxserve:step_programs_pending"
KINDS = ("cold", "warm")
FIGURES = ("port_s", "ready_s", "load_s", "compile_s", "cpu_s", "background_s")
STAGES = ("import", "load_weights", "plan_kv", "kv_cache", "runner", "engine", "compile",
          "probe", "server")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``jaxserve bench startup``'s flags."""
    a = p.add_argument
    a("--model", default="tiny", help="as serve's MODEL (a GGUF file, an HF or orbax directory, "
                                   "or a built-in config with --load-format dummy); '': "
                                   "serve's default, SmolLM2-135M-Instruct")
    a("--load-format", default="dummy", choices=["auto", "gguf", "dummy"],
      help="as serve's --load-format")
    a("--serve-args", default="", help="more 'jaxserve serve' flags, one string")
    a("--server-env", action="append", default=[], metavar="KEY=VALUE",
      help="an environment variable of the server (repeatable)")
    a("--repeats", type=int, default=1, help="cold + warm start pairs")
    a("--timeout-s", type=float, default=900.0, help="the longest one start may take")
    a("--output-json", default=None, help="write the results here")


def _ready(url: str) -> tuple[int | None, str | None]:
    """(HTTP status, stage) of GET ``url`` (/ready), (None, None) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status, _stage(r.read())
    except urllib.error.HTTPError as e:  # /ready is 503 while loading and compiling
        return e.code, _stage(e.read())
    except OSError:
        return None, None


def _pending(url: str) -> float | None:
    """``pending_programs`` of GET ``url`` (/metrics); None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return pending_programs(r.read().decode("utf-8", "replace"))
    except OSError:
        return None


def pending_programs(metrics_text: str) -> float | None:
    """``jaxserve:step_programs_pending`` in a Prometheus text page (prometheus_client's
    parser; the sum over its label sets: data-parallel replicas); None when it is not there
    (a server from before the gauge)."""
    found = [s.value for fam in text_string_to_metric_families(metrics_text)
             for s in fam.samples if s.name == PENDING_GAUGE]
    return sum(found) if found else None


def _stage(body: bytes) -> str | None:
    try:
        return json.loads(body).get("stage")
    except (ValueError, AttributeError):
        return None


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its waited-for children so far (Linux
    ``/proc``; -1 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return -1.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def parse_server_output(text: str) -> dict[str, Any]:
    """The server's load and compile figures from its start-up lines (-1 when absent), and
    ``stages_s``: its "start-up stages" line as a dict (empty when absent); ``ready_in``, the
    seconds from ``serve()`` to ready, falls back to the "ready in" of the compiled line."""
    load = re.search(r"^loaded .* in ([\d.]+) s", text, re.MULTILINE)
    comp = re.search(r"^compiled (\d+) programs in ([\d.]+) s; ready in ([\d.]+) s", text,
                     re.MULTILINE)
    line = re.search(r"^start-up stages \(s\): (.*)$", text, re.MULTILINE)
    stages = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line.group(1))} \
        if line else {}
    if comp and "ready_in" not in stages:  # a server without the stages line
        stages["ready_in"] = float(comp.group(3))
    return {"load_s": float(load.group(1)) if load else -1.0,
            "compile_s": float(comp.group(2)) if comp else -1.0,
            "num_programs": int(comp.group(1)) if comp else -1, "stages_s": stages}


def _stages(ready_s: float, server: dict[str, float]) -> dict[str, float]:
    """``STAGES``' seconds of one start (module docstring); {} without the server's line."""
    if "ready_in" not in server or "load_weights" not in server:
        return {}
    out = {"import": ready_s - server["ready_in"]}
    out.update({k: server.get(k, 0.0) for k in STAGES[1:-1]})
    out["server"] = ready_s - sum(out.values())
    out["compile_cpu"] = server.get("compile_cpu", 0.0)
    return out


def start_once(serve_args: list[str], cache_dir: str, timeout_s: float,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Launch ``jaxserve serve`` with this compilation cache (and ``env`` added to its
    environment), wait for ``/ready`` 200, stop it; returns the run's figures (module
    docstring).

    Raises:
      ValueError: the server exited or was not ready within ``timeout_s`` (its output quoted).
    """
    port = free_port()
    # -P: the working directory does not shadow a PYTHONPATH of --server-env (another tree)
    cmd = [sys.executable, "-P", "-m", "jaxserve.cli.main", "serve", *serve_args, "--host",
           "127.0.0.1", "--port", str(port), "--compilation-cache-dir", cache_dir]
    url = f"http://127.0.0.1:{port}/ready"
    loadavg = os.getloadavg()
    lines: list[str] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    port_s, stage_at = None, {}
    try:
        while True:
            now = time.perf_counter() - t0
            if proc.poll() is not None:
                reader.join(5)
                raise ValueError(f"server exited with {proc.returncode}: "
                                 f"{''.join(lines)[-2000:]}")
            if now > timeout_s:
                raise ValueError(f"server not ready in {timeout_s} s: {''.join(lines)[-2000:]}")
            status, stage = _ready(url)
            if status is not None and port_s is None:
                port_s = now
            if stage is not None:
                stage_at.setdefault(stage, round(now, 3))
            if status == 200:
                break
            time.sleep(POLL_S)
        ready_s = time.perf_counter() - t0
        cpu_s = _cpu_s(proc.pid)
        metrics_url = f"http://127.0.0.1:{port}/metrics"
        while (_pending(metrics_url) or 0) > 0 and proc.poll() is None:
            if time.perf_counter() - t0 > timeout_s:
                raise ValueError(f"background compile not done in {timeout_s} s")
            time.sleep(POLL_S * 5)
        background_s = time.perf_counter() - t0 - ready_s
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    server = parse_server_output("".join(lines))
    return {"port_s": port_s, "ready_s": ready_s, "cpu_s": cpu_s, "background_s": background_s,
            "load_s": server["load_s"], "compile_s": server["compile_s"],
            "num_programs": server["num_programs"], "stage_at_s": stage_at,
            "stages_s": _stages(ready_s, server["stages_s"]),
            "loadavg": [round(x, 2) for x in loadavg]}


def _env(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--server-env {item!r} is not KEY=VALUE")
        out[key] = value
    return out


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``jaxserve bench startup``; returns the exit status.

    Raises:
      ValueError: bad flags, or a server that did not start.
    """
    if ns.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    env = _env(ns.server_env)
    serve_args = [*([ns.model] if ns.model else []), "--load-format", ns.load_format,
                  "--log-level", "warning", *shlex.split(ns.serve_args)]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for _ in range(ns.repeats):
        with tempfile.TemporaryDirectory() as cache:
            for kind in KINDS:
                runs[kind].append(start_once(serve_args, cache, ns.timeout_s, env))
    result: dict[str, Any] = {"model": ns.model, "load_format": ns.load_format,
                              "serve_args": serve_args, "server_env": env,
                              "repeats": ns.repeats, "runs": runs}
    for kind in KINDS:
        rs = runs[kind]
        result[kind] = {f"median_{f}": statistics.median(r[f] for r in rs) for f in FIGURES}
        result[kind]["num_programs"] = rs[0]["num_programs"]
        result[kind]["median_stages_s"] = {
            k: statistics.median(r["stages_s"][k] for r in rs)
            for k in rs[0]["stages_s"] if all(k in r["stages_s"] for r in rs)}
    print(format_table(result), flush=True)
    write_json(ns.output_json, result)
    return 0


def format_table(result: dict[str, Any]) -> str:
    """Cold and warm start side by side (medians), then the stages' seconds."""
    lines = [(f"jaxserve serve {shlex.join(result['serve_args'])}: median of "
             f"{result['repeats']} start(s)"),
             (f"{'':6}{'port s':>8}{'ready s':>9}{'cpu s':>8}{'load s':>8}{'compile s':>10}"
              f"{'programs':>9}{'bg s':>7}")]
    for kind in KINDS:
        r = result[kind]
        lines.append(f"{kind:6}{r['median_port_s']:8.2f}{r['median_ready_s']:9.2f}"
                     f"{r['median_cpu_s']:8.2f}{r['median_load_s']:8.2f}"
                     f"{r['median_compile_s']:10.2f}{r['num_programs']:9d}"
                     f"{r.get('median_background_s', 0.0):7.1f}")
    stages = [k for k in (*STAGES, "compile_cpu") if k in result["cold"]["median_stages_s"]]
    if stages:
        lines.append("stages, s: " + "  ".join(
            f"{k} {result['cold']['median_stages_s'][k]:.2f}/"
            f"{result['warm']['median_stages_s'].get(k, -1.0):.2f}" for k in stages)
            + "  (cold/warm)")
    return "\n".join(lines)
