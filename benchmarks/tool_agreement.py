"""Do GuideLLM, AIPerf and ``jaxserve bench serve`` report the same TTFT and ITL on the same load?

    python -m benchmarks.tool_agreement --concurrency 1,4 --num-prompts 20,40 \\
        --json tool_agreement.json

Starts one ``jaxserve serve`` (``--serve-args``, default the default model; prefix caching off,
so that no run reuses another's prompts), then per concurrency runs each tool in turn, closed
loop, chat completions streamed, 256 prompt tokens and 64 output tokens (``ignore_eos``):
``jaxserve bench serve``, GuideLLM 0.8.1 (``--profile kind=concurrent``) and AIPerf 0.13.0,
each from the venv the peer-tool tests build (``tests/support/tool_venv.py``; run ``pytest tests/peer_tools`` once
first). Around each run it reads the server's own TTFT and ITL histograms
(``jaxserve:time_to_first_token_seconds``, ``jaxserve:inter_token_latency_seconds``), so a tool's
figures can be told apart from the load it puts on the machine, and it counts the tool's
CPU-seconds (its process tree, from ``getrusage``). Prints a table and writes JSON. Findings:
docs/decisions/0044-fleet-tools.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import typing
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import format_table, int_list, write_json

# the venvs the peer-tool tests build (one definition of the tools and where they live)
from tests.support.released_wheel import cache_dir
from tests.support.tool_venv import AIPERF, GUIDELLM

HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds")
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 64


def server_sums(url: str) -> dict[str, float]:
    """The ``_sum`` and ``_count`` of the server's TTFT and ITL histograms."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    names = {f"jaxserve:{h}_{k}" for h in HISTOGRAMS for k in ("sum", "count")}
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name in names}


def tool_commands(tool: str, url: str, model: str, tok: Path, c: int, n: int, out: Path
                  ) -> list[str]:
    """The command line of ``tool`` (bench, guidellm, aiperf) for ``n`` requests at ``c``."""
    venvs = cache_dir() / "venvs"
    if tool == "bench":
        return [sys.executable, "-m", "jaxserve.cli.main", "bench", "serve", "--base-url", url,
                "--endpoint", "/v1/chat/completions", "--dataset-name", "random",
                "--random-input-len", str(PROMPT_TOKENS), "--random-output-len",
                str(OUTPUT_TOKENS), "--random-range-ratio", "0", "--num-prompts", str(n),
                "--max-concurrency", str(c), "--ignore-eos", "--disable-tqdm", "--save-result",
                "--result-dir", str(out.parent), "--result-filename", out.name]
    if tool == "guidellm":
        return [str(venvs / GUIDELLM.name / "bin" / "guidellm"), "run", "--backend",
                f"kind=openai_http,target={url}", "--tokenizer", f"kind=hf_auto,model={tok}",
                "--data", (f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                           f"output_tokens={OUTPUT_TOKENS}"),
                "--profile", f"kind=concurrent,streams={c}",
                "--constraint", f"kind=max_requests,count={n}", "--output",
                f"kind=json,path={out}", "--disable-console-interactive"]
    return [str(venvs / AIPERF.name / "bin" / "aiperf"), "profile", "--model", model, "--url",
            url, "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tok),
            "--synthetic-input-tokens-mean", str(PROMPT_TOKENS),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(OUTPUT_TOKENS),
            "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--concurrency",
            str(c), "--request-count", str(n), "--use-server-token-count",
            "--output-artifact-dir", str(out)]


def tool_figures(tool: str, out: Path) -> tuple[float, float]:
    """(mean TTFT, mean ITL) in ms as the tool reported them (ITL: per request, averaged)."""
    if tool == "bench":
        r = json.loads(out.read_text())
        return r["mean_ttft_ms"], r["mean_itl_ms"]
    if tool == "guidellm":
        m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
        return (m["time_to_first_token_ms"]["successful"]["mean"],
                m["inter_token_latency_ms"]["successful"]["mean"])
    m = json.loads((out / "profile_export_aiperf.json").read_text())
    return m["time_to_first_token"]["avg"], m["inter_token_latency"]["avg"]


def measure(tool: str, url: str, model: str, tok: Path, c: int, n: int, work: Path
            ) -> dict[str, Any]:
    """One run of ``tool``: its figures, the server's over the same run, its CPU-seconds.

    Raises:
      SystemExit: the tool failed (its log named).
    """
    out = work / f"{tool}-c{c}" if tool == "aiperf" else work / f"{tool}-c{c}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"} if tool == "guidellm" else None
    before, r0 = server_sums(url), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with open(work / f"{tool}-c{c}.log", "w", encoding="utf-8") as log:
        rc = subprocess.run(tool_commands(tool, url, model, tok, c, n, out), stdout=log,
                            stderr=subprocess.STDOUT, env=env, check=False).returncode
    wall = time.monotonic() - t0
    r1, after = resource.getrusage(resource.RUSAGE_CHILDREN), server_sums(url)
    if rc != 0:
        raise SystemExit(f"error: {tool} exited {rc}: see {work / f'{tool}-c{c}.log'}")
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    server = [d[f"jaxserve:{h}_sum"] / max(d[f"jaxserve:{h}_count"], 1) * 1e3
              for h in HISTOGRAMS]
    ttft, itl = tool_figures(tool, out)
    return {"tool": tool, "concurrency": c, "num_prompts": n, "wall_s": wall,
            "ttft_ms": ttft, "itl_ms": itl, "server_ttft_ms": server[0],
            "server_itl_ms": server[1],
            "client_cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)}


TOOLS = ("bench", "guidellm", "aiperf")


def _counts(flag: str) -> typing.Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            out = int_list(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers, got "
                                             f"{text!r}") from None
        if not out or min(out) < 1:
            raise argparse.ArgumentTypeError(f"{flag} values must be >= 1, got {text!r}")
        return out
    return parse


def _tools(text: str) -> list[str]:
    out = [t.strip() for t in text.split(",")]
    if not out or not set(out) <= set(TOOLS):
        raise argparse.ArgumentTypeError(f"--tools takes some of {', '.join(TOOLS)}, got {text!r}")
    return out


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be in 1-65535, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--concurrency", type=_counts("--concurrency"), default=[1, 4],
                   help="comma-separated concurrencies")
    p.add_argument("--num-prompts", type=_counts("--num-prompts"), default=[20, 40],
                   help="requests at each --concurrency, in the same order")
    p.add_argument("--tools", type=_tools, default=list(TOOLS),
                   help=f"comma-separated, of {', '.join(TOOLS)}")
    p.add_argument("--serve-args", default="",
                   help="`jaxserve serve` arguments (default: the default model)")
    p.add_argument("--port", type=_port, default=8400, help="a free local port for the server")
    p.add_argument("--json", default=None, metavar="PATH", help="write every run here")
    return p


def _port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now (as uvicorn binds: SO_REUSEADDR, so the
    TIME_WAIT connections of a server that just left do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Serve, run each tool at each concurrency, print the table; returns the rows.

    Raises:
      SystemExit: mismatched flags, a missing tool venv, the port in use or a server that does
        not start.
    """
    conc, counts, tools = ns.concurrency, ns.num_prompts, ns.tools
    if len(conc) != len(counts):
        raise SystemExit(f"error: --num-prompts needs one count per --concurrency ({len(conc)}), "
                         f"got {len(counts)}")
    for t, spec in (("guidellm", GUIDELLM), ("aiperf", AIPERF)):
        if t in tools and not (cache_dir() / "venvs" / spec.name / ".complete").exists():
            raise SystemExit(f"error: {spec.name}'s venv is missing: run `pytest "
                             "tests/peer_tools` once")
    if not _port_free(ns.port):
        raise SystemExit(f"error: port {ns.port} is in use: give --port a free one")
    url = f"http://127.0.0.1:{ns.port}"
    work = Path(tempfile.mkdtemp(prefix="tool_agreement-"))
    tok = work / "tok"
    subprocess.run([sys.executable, "-m", "jaxserve.cli.main", "convert", "default", str(tok),
                    "--format", "tokenizer"], check=True, capture_output=True)
    with open(work / "server.log", "w", encoding="utf-8") as log:
        server = subprocess.Popen([sys.executable, "-m", "jaxserve.cli.main", "serve",
                                   *shlex.split(ns.serve_args), "--port", str(ns.port),
                                   "--no-enable-prefix-caching"], stdout=log,
                                  stderr=subprocess.STDOUT)
    rows = []
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: the server did not start: {work / 'server.log'}")
            try:
                if urllib.request.urlopen(url + "/ready", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(1)
        models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())
        model = models["data"][0]["id"]
        for c, n in zip(conc, counts, strict=True):
            for tool in tools:
                print(f"--- {tool} at concurrency {c}: {n} requests", flush=True)
                rows.append(measure(tool, url, model, tok, c, n, work))
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(format_table(
        ["load", "tool", "TTFT ms", "server's", "ITL ms", "server's", "CPU-s/req"],
        [[f"c{r['concurrency']}", r["tool"], r["ttft_ms"], r["server_ttft_ms"], r["itl_ms"],
          r["server_itl_ms"], f"{r['client_cpu_s'] / r['num_prompts']:.2f}"] for r in rows]))
    write_json(ns.json, {"rows": rows, "work_dir": str(work)})
    print(f"logs in {work}")
    return rows


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
