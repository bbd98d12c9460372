"""Evaluate every query of the Grafana dashboard and the rule file on a real Prometheus that
scrapes a real ``jaxserve serve``, once each, and print the results (scripts/check_dashboard.sh).

1. starts ``jaxserve serve`` on a free loopback port (SERVE_ARGS after ``--``; default: the
   bundled SmolLM2 with a 512-token window) and waits for ``/ready`` 200;
2. starts ``prometheus`` (Debian's package) on another free loopback port, scraping it every
   2 s with the target labels ``namespace="jaxserve", pod="jaxserve-local-0"`` that a PodMonitor
   would add, and loading deploy/prometheus/rules.yaml (evaluated every 5 s);
3. sends a bounded load (``jaxserve bench serve``: --num-prompts requests, 4 at once);
4. evaluates each dashboard query (``$__rate_interval`` as 1m, the variables as ``.*``) and each
   rule expression through ``/api/v1/query``, prints one line per query (series returned, the
   first values), then the rule groups' health and the alerts' states; stops both processes.

Exit status 1 if a query fails to evaluate or a rule is unhealthy (an empty result is reported,
not an error: a panel for the host tier is empty without one).

``--dry-run`` needs no Prometheus: it reads every query, runs steps 1 and 3 and stops (the
suite's smoke test, with a tiny dummy model after ``--``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "jaxserve-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
LABELS = {"namespace": "jaxserve", "pod": "jaxserve-local-0"}
DEFAULT_SERVE_ARGS = ["--max-model-len", "512", "--served-model-name", "SmolLM2-135M-Instruct"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def wait_for(what: str, cond, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None:
            raise SystemExit(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.5)


def grafana_to_promql(expr: str) -> str:
    expr = re.sub(r"\$\{?__rate_interval\}?|\$\{?__interval\}?", "1m", expr)
    expr = re.sub(r"\$\{(\w+)\}|\$(\w+)", ".*", expr)
    m = re.match(r"^label_values\((.*),\s*(\w+)\)$", expr.strip(), re.DOTALL)
    return m.group(1) if m else expr


def queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']!r} {t['refId']}", grafana_to_promql(t["expr"]))
           for p in dash["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", grafana_to_promql(v["query"]["query"]))
            for v in dash["templating"]["list"] if v["type"] == "query"]
    rules = yaml.safe_load(RULES.read_text())
    out += [(f"rule {r.get('record') or r.get('alert')}", r["expr"])
            for g in rules["groups"] for r in g["rules"]]
    return out


def summary(result: list[dict]) -> str:
    vals = []
    for s in result[:3]:
        labels = {k: v for k, v in s["metric"].items() if k not in ("__name__", *LABELS,
                                                                     "job", "instance")}
        v = float(s["value"][1])
        vals.append(f"{v:.4g}" + (f" {labels}" if labels else ""))
    return "; ".join(vals) + (" ..." if len(result) > 3 else "")


def stop(proc: subprocess.Popen | None, name: str) -> None:
    """SIGTERM (a drain for jaxserve), SIGKILL after 60 s; prints how it ended."""
    if proc is None or proc.poll() is not None:
        return
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    print(f"{name} exited {proc.returncode} {time.monotonic() - t0:.1f} s after SIGTERM")


def load(jaxserve: list[str], base: str, num_prompts: int) -> int:
    """``jaxserve bench serve`` against ``base``: ``num_prompts`` requests, 4 at once; prints
    and returns its exit status."""
    done = subprocess.run(
        [*jaxserve, "bench", "serve", "--base-url", base, "--dataset-name", "random",
         "--random-input-len", "64", "--random-output-len", "16",
         "--num-prompts", str(num_prompts), "--max-concurrency", "4",
         "--num-warmups", "0", "--seed", "0"],
        capture_output=True, text=True, timeout=900, check=False, cwd=ROOT)
    print(f"load: {num_prompts} requests, exit {done.returncode}")
    return done.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--settle-s", type=float, default=20.0,
                    help="seconds of scrapes after the load, before the queries")
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    ap.add_argument("--dry-run", action="store_true",
                    help="no Prometheus: start jaxserve, wait for /ready, send the load, stop")
    ap.add_argument("serve_args", nargs="*", help="after --: arguments of jaxserve serve")
    ns = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # a line per query as it is evaluated
    if not ns.dry_run and shutil.which(ns.prometheus) is None:
        print("prometheus not found (Debian: apt-get install prometheus)", file=sys.stderr)
        return 2
    print(f"{len(queries())} queries and rules to evaluate")
    jaxserve = [sys.executable, "-m", "jaxserve.cli.main"]  # this interpreter's jaxserve
    serve_port, prom_port = free_port(), free_port()
    base = f"http://127.0.0.1:{serve_port}"
    prom_url = f"http://127.0.0.1:{prom_port}"
    server = prom = None
    failed = 0
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxserve-dashboard-"))
        serve_log = stack.enter_context(open(Path(tmp) / "serve.log", "w"))
        prom_log = stack.enter_context(open(Path(tmp) / "prometheus.log", "w"))
        try:
            t0 = time.monotonic()
            server = subprocess.Popen(
                [*jaxserve, "serve", *(ns.serve_args or DEFAULT_SERVE_ARGS), "--host",
                 "127.0.0.1", "--port", str(serve_port)],
                stdout=serve_log, stderr=subprocess.STDOUT, cwd=ROOT)
            wait_for("jaxserve /ready", lambda: get(base + "/ready")[0] == 200,
                     ns.ready_timeout_s, server)
            print(f"jaxserve ready after {time.monotonic() - t0:.1f} s on {base}")
            if ns.dry_run:
                status = load(jaxserve, base, ns.num_prompts)
                print("dry run: no Prometheus, no queries evaluated")
                return 1 if status else 0
            config = {
                "global": {"scrape_interval": "2s", "evaluation_interval": "5s"},
                "rule_files": [str(RULES)],
                "scrape_configs": [{"job_name": "jaxserve/jaxserve", "static_configs": [
                    {"targets": [f"127.0.0.1:{serve_port}"], "labels": LABELS}]}],
            }
            (Path(tmp) / "prometheus.yml").write_text(yaml.safe_dump(config))
            prom = subprocess.Popen(
                [ns.prometheus, f"--config.file={tmp}/prometheus.yml",
                 f"--storage.tsdb.path={tmp}/data",
                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                stdout=prom_log, stderr=subprocess.STDOUT)
            wait_for("prometheus", lambda: get(prom_url + "/-/ready")[0] == 200, 60, prom)
            time.sleep(5)  # a couple of scrapes before the load, so rates have a start
            load(jaxserve, base, ns.num_prompts)
            time.sleep(ns.settle_s)
            for where, expr in queries():
                q = urllib.parse.urlencode({"query": expr})
                status, body = get(f"{prom_url}/api/v1/query?{q}", timeout=30)
                reply = json.loads(body or b"{}")
                if status != 200 or reply.get("status") != "success":
                    failed += 1
                    print(f"ERROR  {where}: {reply.get('error', status)}")
                    continue
                result = reply["data"]["result"]
                if reply["data"]["resultType"] == "vector":
                    tag = "ok    " if result else "empty "
                    print(f"{tag} {where}: {len(result)} series: {summary(result)}")
                else:
                    print(f"ok     {where}: {reply['data']['resultType']} {result}")
            rules = json.loads(get(prom_url + "/api/v1/rules")[1])["data"]["groups"]
            for g in rules:
                for r in g["rules"]:
                    name = r.get("name")
                    extra = f", state {r['state']}" if r["type"] == "alerting" else ""
                    if r["health"] != "ok":
                        failed += 1
                    print(f"rule   {g['name']}/{name}: health {r['health']}{extra}"
                          + (f" ({r['lastError']})" if r.get("lastError") else ""))
        finally:
            stop(prom, "prometheus")
            stop(server, "jaxserve")
            if failed or sys.exc_info()[0] is not None:
                for log in ("serve.log", "prometheus.log"):
                    tail = (Path(tmp) / log).read_text(errors="replace").splitlines()[-15:]
                    print(f"--- last lines of {log}:", *tail, sep="\n")
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
