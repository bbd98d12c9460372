"""``jaxserve bench startup``: seconds from launching ``jaxserve serve`` to ``/ready`` 200.

    jaxserve bench startup --model SmolLM2-135M-Instruct.Q4_1.gguf --repeats 3 \\
        --serve-args "--max-model-len 2048" --output-json results/startup.json

Each run starts ``jaxserve serve`` in a fresh process on a free local port and polls ``/ready``
every 0.1 s; beside the time to ready (``ready_s``) and to the port's first answer (``port_s``,
when probes start getting answers) it reads the server's own figures from its output: the
load time (weights on the device, tokenizer) and the compile time of every step program. A
cold start has an empty persistent compilation cache; the warm start that follows reuses the
cache the cold one wrote. ``--repeats`` pairs, each with a new cache; medians are reported. For
load time per weights format, run it once per format (GGUF, ``jaxserve convert``'s orbax
directory, HF safetensors, ``--load-format dummy``).
"""

from __future__ import annotations

import argparse
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from jaxserve.cli.bench.common import write_json

POLL_S = 0.1
KINDS = ("cold", "warm")
FIGURES = ("port_s", "ready_s", "load_s", "compile_s")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``jaxserve bench startup``'s flags."""
    a = p.add_argument
    a("--model", default="tiny", help="as serve's MODEL (a GGUF file, an HF or orbax directory, "
                                   "or a built-in config with --load-format dummy)")
    a("--load-format", default="dummy", choices=["auto", "gguf", "dummy"],
      help="as serve's --load-format")
    a("--serve-args", default="", help="more 'jaxserve serve' flags, one string")
    a("--repeats", type=int, default=1, help="cold + warm start pairs")
    a("--timeout-s", type=float, default=900.0, help="the longest one start may take")
    a("--output-json", default=None, help="write the results here")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int | None:
    """The HTTP status of GET ``url``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status
    except urllib.error.HTTPError as e:  # /ready is 503 while loading and compiling
        return e.code
    except OSError:
        return None


def parse_server_output(text: str) -> dict[str, float]:
    """The server's load and compile figures from its start-up lines (-1 when absent)."""
    load = re.search(r"^loaded .* in ([\d.]+) s", text, re.MULTILINE)
    comp = re.search(r"^compiled (\d+) programs in ([\d.]+) s", text, re.MULTILINE)
    return {"load_s": float(load.group(1)) if load else -1.0,
            "compile_s": float(comp.group(2)) if comp else -1.0,
            "num_programs": int(comp.group(1)) if comp else -1}


def start_once(serve_args: list[str], cache_dir: str, timeout_s: float) -> dict[str, float]:
    """Launch ``jaxserve serve`` with this compilation cache, wait for ``/ready`` 200, stop it.

    Raises:
      ValueError: the server exited or was not ready within ``timeout_s`` (its output quoted).
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", *serve_args, "--host",
           "127.0.0.1", "--port", str(port), "--compilation-cache-dir", cache_dir]
    t0 = time.perf_counter()
    port_s = None
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise ValueError(f"server exited with {proc.returncode}: {log.read()[-2000:]}")
                if time.perf_counter() - t0 > timeout_s:
                    log.seek(0)
                    raise ValueError(f"server not ready in {timeout_s} s: {log.read()[-2000:]}")
                status = _status(f"http://127.0.0.1:{port}/ready")
                if status is not None and port_s is None:
                    port_s = time.perf_counter() - t0
                if status == 200:
                    break
                time.sleep(POLL_S)
            ready_s = time.perf_counter() - t0
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        return {"port_s": port_s, "ready_s": ready_s, **parse_server_output(log.read())}


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``jaxserve bench startup``; returns the exit status.

    Raises:
      ValueError: bad flags, or a server that did not start.
    """
    if ns.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    serve_args = [ns.model, "--load-format", ns.load_format, "--log-level", "warning",
                  *shlex.split(ns.serve_args)]
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    for _ in range(ns.repeats):
        with tempfile.TemporaryDirectory() as cache:
            for kind in KINDS:
                runs[kind].append(start_once(serve_args, cache, ns.timeout_s))
    result: dict[str, Any] = {"model": ns.model, "load_format": ns.load_format,
                              "serve_args": serve_args, "repeats": ns.repeats, "runs": runs}
    for kind in KINDS:
        result[kind] = {f"median_{f}": statistics.median(r[f] for r in runs[kind])
                        for f in FIGURES}
        result[kind]["num_programs"] = runs[kind][0]["num_programs"]
    print(format_table(result), flush=True)
    write_json(ns.output_json, result)
    return 0


def format_table(result: dict[str, Any]) -> str:
    """Cold and warm start side by side (medians)."""
    lines = [(f"jaxserve serve {shlex.join(result['serve_args'])}: median of "
             f"{result['repeats']} start(s)"),
             f"{'':6}{'port s':>8}{'ready s':>9}{'load s':>8}{'compile s':>10}{'programs':>9}"]
    for kind in KINDS:
        r = result[kind]
        lines.append(f"{kind:6}{r['median_port_s']:8.2f}{r['median_ready_s']:9.2f}"
                     f"{r['median_load_s']:8.2f}"
                     f"{r['median_compile_s']:10.2f}{r['num_programs']:9d}")
    return "\n".join(lines)
