"""Behaviour under overload: a burst of many more concurrent requests than the server admits.

Starts ``jaxserve serve`` (default model unless flags after ``--`` say otherwise) with a small
``--max-waiting-requests``, waits for /health, then sends ``--num-requests`` non-streamed
completions all at once (random token-id prompts, fixed seed; ``ignore_eos`` so every admitted
request generates exactly ``--max-tokens``). Records per request: status, latency, Retry-After.
Samples the server's resident memory (``/proc/PID/status`` VmRSS) every 50 ms during the burst,
reads /metrics afterwards (requests still running or waiting, KV-cache usage: all blocks back),
then, unless ``--no-sigterm``, sends a second burst and a SIGTERM while it is in flight and
records how the drain answered it and the exit status (0 expected).

Prints a table and writes JSON (``--out``): requests sent / served (200) / refused (503) /
errors (anything else, exceptions included), 503 rate, latency percentiles of the served
requests, peak RSS during the burst, the metrics after, the drain's figures, and the command.

Usage: PYTHONPATH=. .venv/bin/python experiments/2026-12-01-overload/overload.py [--num-requests 200] [--max-waiting-requests 8]
           [--out results/overload.json] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def burst(base_url: str, bodies: list[dict], pid: int, sigterm_after_s: float | None
                ) -> tuple[list[dict], float]:
    """Send every body at once; return per-request records and the peak RSS (MiB) seen."""
    peak = rss_mib(pid)
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_mib(pid))
            await asyncio.sleep(0.05)

    async def one(http: httpx.AsyncClient, body: dict) -> dict:
        t0 = time.perf_counter()
        try:
            r = await http.post("/v1/completions", json=body)
            rec = {"status": r.status_code, "retry_after": r.headers.get("retry-after")}
            if r.status_code == 200:
                rec["completion_tokens"] = r.json()["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            rec = {"status": None, "exception": f"{type(exc).__name__}: {exc}"}
        rec["latency_s"] = time.perf_counter() - t0
        return rec

    async def terminate_later() -> None:
        assert sigterm_after_s is not None
        await asyncio.sleep(sigterm_after_s)
        os.kill(pid, signal.SIGTERM)

    limits = httpx.Limits(max_connections=len(bodies) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        sampler = asyncio.ensure_future(sample())
        killer = asyncio.ensure_future(terminate_later()) if sigterm_after_s is not None else None
        records = await asyncio.gather(*(one(http, b) for b in bodies))
        stop.set()
        await sampler
        if killer is not None:
            await killer
    return list(records), peak


def summarize(records: list[dict], max_tokens: int) -> dict:
    served = [r for r in records if r["status"] == 200]
    refused = [r for r in records if r["status"] == 503]
    errors = [r for r in records if r["status"] not in (200, 503)]
    lat = [r["latency_s"] for r in served]
    return {
        "sent": len(records), "served": len(served), "refused_503": len(refused),
        "errors": len(errors), "rate_503": len(refused) / max(1, len(records)),
        "served_full_length": sum(r.get("completion_tokens") == max_tokens for r in served),
        "refused_with_retry_after": sum(r["retry_after"] is not None for r in refused),
        "served_latency_s": {"p50": pct(lat, 0.5), "p90": pct(lat, 0.9), "p99": pct(lat, 0.99),
                             "max": max(lat, default=float("nan"))},
        "refused_latency_s_p50": pct([r["latency_s"] for r in refused], 0.5),
        "error_samples": errors[:5],
    }  # fmt: skip


def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    want = ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting",
            "jaxserve:kv_cache_usage_perc")
    out = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in want:
            out[name.removeprefix("jaxserve:")] = float(line.rsplit(" ", 1)[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--max-waiting-requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-sigterm", action="store_true", help="skip the drain-under-load phase")
    ap.add_argument("--sigterm-after-s", type=float, default=1.0,
                    help="seconds into the second burst to send SIGTERM")
    ap.add_argument("--out", default="results/overload.json")
    ap.add_argument("extra", nargs="*", help="extra serve flags (after --)")
    a = ap.parse_args()

    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", "--port", str(port),
           "--max-waiting-requests", str(a.max_waiting_requests), "--max-model-len", "512",
           "--log-level", "warning", *a.extra]
    rng = random.Random(a.seed)
    bodies = [{"prompt": [rng.randrange(100, 40000) for _ in range(a.prompt_len)],
               "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}
              for _ in range(a.num_requests)]
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            t0 = time.perf_counter()
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"server exited:\n{log.read()[-3000:]}")
                try:
                    if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > 900:
                    raise TimeoutError("server not ready in 900 s")
                time.sleep(0.2)
            rss_idle = rss_mib(proc.pid)
            t_burst = time.perf_counter()
            records, peak = asyncio.run(burst(base_url, bodies, proc.pid, None))
            burst_s = time.perf_counter() - t_burst
            after = metrics(base_url)
            rss_after = rss_mib(proc.pid)
            normal = httpx.post(base_url + "/v1/completions", json=bodies[0], timeout=600)
            drain: dict = {}
            if not a.no_sigterm:
                t_term = time.perf_counter()
                recs2, _ = asyncio.run(burst(base_url, bodies[: a.num_requests // 2], proc.pid,
                                             a.sigterm_after_s))
                code = proc.wait(300)
                drain = {**summarize(recs2, a.max_tokens), "exit_status": code,
                         "exit_s_after_burst_start": time.perf_counter() - t_term}
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    result = {
        "command": cmd, "num_requests": a.num_requests, "prompt_len": a.prompt_len,
        "max_tokens": a.max_tokens, "burst": summarize(records, a.max_tokens),
        "burst_wall_s": burst_s, "rss_mib": {"idle": rss_idle, "peak_during_burst": peak,
                                             "after": rss_after},
        "metrics_after_burst": after, "normal_request_after_status": normal.status_code,
        "drain_under_load": drain,
    }  # fmt: skip
    b = result["burst"]
    print(f"burst of {b['sent']}: served {b['served']} ({b['served_full_length']} full length), "
          f"503 {b['refused_503']} ({b['rate_503']:.0%}, {b['refused_with_retry_after']} with "
          f"Retry-After), errors {b['errors']}, in {burst_s:.1f} s")
    lat = b["served_latency_s"]
    print(f"served latency s: p50 {lat['p50']:.2f}  p90 {lat['p90']:.2f}  p99 {lat['p99']:.2f}  "
          f"max {lat['max']:.2f}; 503 answered in p50 {b['refused_latency_s_p50'] * 1e3:.0f} ms")
    print(f"RSS MiB: idle {rss_idle:.0f}, peak during burst {peak:.0f}, after {rss_after:.0f}; "
          f"after: {after}; a normal request then: {normal.status_code}")
    if drain:
        print(f"SIGTERM {a.sigterm_after_s:g} s into a burst of {drain['sent']}: served "
              f"{drain['served']}, 503 {drain['refused_503']}, errors {drain['errors']}, exit "
              f"status {drain['exit_status']} after {drain['exit_s_after_burst_start']:.1f} s")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {a.out}")
    if b["errors"]:
        print(f"error samples: {b['error_samples']}")


if __name__ == "__main__":
    main()
