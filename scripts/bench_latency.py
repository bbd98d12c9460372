"""Single-request latency over HTTP against a running server: TTFT and inter-token latency
(ITL) of streamed completions, one request at a time.

Usage: .venv/bin/jaxserve serve --max-model-len 1024 &
       .venv/bin/python scripts/bench_latency.py --base-url http://127.0.0.1:8000 [--out results/latency.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import httpx


def one(client: httpx.Client, url: str, model: str, prompt_len: int, max_tokens: int
        ) -> tuple[float, list[float]]:
    body = {"model": model, "prompt": [100 + i % 1000 for i in range(prompt_len)],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times = []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return times[0] - t0, [b - a for a, b in itertools.pairwise(times)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=5)
    p.add_argument("--out", default="results/latency.json")
    a = p.parse_args()
    with httpx.Client() as c:
        model = c.get(a.base_url + "/v1/models").json()["data"][0]["id"]
        one(c, a.base_url, model, a.prompt_len, 4)  # warm the path
        ttfts, itls = [], []
        for _ in range(a.num_requests):
            t, i = one(c, a.base_url, model, a.prompt_len, a.max_tokens)
            ttfts.append(t * 1000)
            itls += [x * 1000 for x in i]
    res = {"config": vars(a), "median_ttft_ms": statistics.median(ttfts),
           "p99_ttft_ms": pct(ttfts, 0.99), "median_itl_ms": statistics.median(itls),
           "mean_itl_ms": statistics.mean(itls), "p99_itl_ms": pct(itls, 0.99),
           "ttfts_ms": ttfts}
    print(f"TTFT median {res['median_ttft_ms']:.1f} ms (p99 {res['p99_ttft_ms']:.1f}); ITL median "
          f"{res['median_itl_ms']:.1f} ms, mean {res['mean_itl_ms']:.1f}, p99 {res['p99_itl_ms']:.1f}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
