"""Prefix caching: N requests sharing one long system prompt, with prefix caching off and on.

Workload (fixed seed): a system prompt of ``--system-len`` random token ids, then a different
question of ``--question-min`` .. ``--question-max`` random ids per request; all ``--num-requests``
requests are submitted at once to an in-process engine (greedy, ``ignore_eos``,
``--max-tokens`` each). Each engine first serves one unrelated request, so that the measured
run is warm. Reported per setting: prompt tokens the engine computed (prefill work; the goal
with caching on is <= 1/5 of it off), prefix-cache hits, time to first token (arrival to first
token) median and p99, and the wall time.

Usage: .venv/bin/python scripts/bench_prefix_cache.py [--model smollm2-135m --load-format dummy]
       [--out results/prefix_cache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of xs."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_once(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Submit ``prompts`` at once, step until idle; TTFTs (ms) and counters of this run."""
    from jaxserve.sampling_params import SamplingParams

    reg = engine.metrics.registry
    prompt_before = reg.get_sample_value("jaxserve:prompt_tokens_total") or 0.0
    hits_before = engine.scheduler.kv_stats.prefix_cache_hits
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"q{i}-{time.perf_counter_ns()}", ids, params)
    ttfts, steps = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                m = out.metrics
                ttfts.append(1000 * (m["first_token_time"] - m["arrival_time"]))
        steps += 1
    wall = time.perf_counter() - t0
    return {
        "prefill_tokens": (reg.get_sample_value("jaxserve:prompt_tokens_total") or 0.0)
        - prompt_before,
        "prefix_cache_hit_tokens": engine.scheduler.kv_stats.prefix_cache_hits - hits_before,
        "median_ttft_ms": float(np.median(ttfts)), "p99_ttft_ms": pct(ttfts, 0.99),
        "wall_s": wall, "steps": steps, "ttfts_ms": ttfts,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--question-min", type=int, default=10)
    p.add_argument("--question-max", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/prefix_cache.json")
    a = p.parse_args()

    from jaxserve.config import EngineConfig, LoadConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.metrics import EngineMetrics

    rng = np.random.default_rng(a.seed)
    vocab = 49152 - 200
    system = rng.integers(100, vocab, a.system_len).tolist()
    prompts = [system + rng.integers(100, vocab, int(rng.integers(a.question_min,
                                                                  a.question_max + 1))).tolist()
               for _ in range(a.num_requests)]
    warm = rng.integers(100, vocab, a.system_len).tolist()
    results = {}
    for caching in (False, True):
        engine = LLMEngine(EngineConfig(enable_prefix_caching=caching,
                                        max_model_len=a.system_len + a.question_max + a.max_tokens
                                        + 16),
                           LoadConfig(a.model, a.load_format), metrics=EngineMetrics())
        engine.warmup(progress=False)
        run_once(engine, [warm], a.max_tokens)
        res = run_once(engine, prompts, a.max_tokens)
        key = "prefix_caching_on" if caching else "prefix_caching_off"
        results[key] = res
        print(f"{key:19s}: prefill tokens {res['prefill_tokens']:7.0f}, cache hits "
              f"{res['prefix_cache_hit_tokens']:6d} tokens, TTFT median {res['median_ttft_ms']:8.1f}"
              f" ms, p99 {res['p99_ttft_ms']:8.1f} ms, wall {res['wall_s']:6.1f} s", flush=True)
        del engine
    ratio = results["prefix_caching_on"]["prefill_tokens"] / \
        results["prefix_caching_off"]["prefill_tokens"]
    print(f"prefill tokens on/off = {ratio:.3f} (goal <= 0.2)")
    out = {"config": vars(a), "prefill_ratio_on_over_off": ratio, **results}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
