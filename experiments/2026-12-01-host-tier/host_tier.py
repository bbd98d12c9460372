"""Host tier: a prefix working set three times the device KV cache, served with the host tier
(evicted blocks offloaded, loaded back on a hit) and without it (evicted blocks recomputed).

Workload (fixed seed): ``P`` distinct prompts of ``--prompt-len`` random token ids, ``P`` chosen
so that together they fill ``--working-set`` times the device cache; ``--rounds`` rounds over
them in the same order, one request at a time, each with a fresh ``--suffix-len``-token suffix
(greedy, ``--max-tokens``). Round-robin over more prefixes than the device holds is the LRU
worst case: without the host tier every request recomputes its prefix; with a host tier that
holds the working set, every request after the first round loads it back. Reported (rounds
after the first, where the two differ): TTFT median and p99, prompt tokens computed, host-tier
hits and blocks offloaded.

Usage: PYTHONPATH=. .venv/bin/python experiments/2026-12-01-host-tier/host_tier.py [--out results/host_tier.json]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--load-format", default="dummy", choices=["dummy"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=65, help="device blocks (incl. block 0)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--working-set", type=float, default=3.0, help="prefix tokens / device cache")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--suffix-len", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/host_tier.json")
    a = p.parse_args()

    from jaxserve.config import EngineConfig, LoadConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.metrics import EngineMetrics
    from jaxserve.loading.load import resolve_dtype, served_name
    from jaxserve.sampling_params import SamplingParams
    from models.config import builtin_config
    from pallas_kernels import kv_cache_bytes_per_block

    mc = builtin_config(a.model)  # the dummy model's shapes (size of one KV block)

    cache_tokens = (a.num_kv_blocks - 1) * a.block_size
    num_prompts = max(2, round(a.working_set * cache_tokens / a.prompt_len))
    rng = np.random.default_rng(a.seed)
    vocab = 49152 - 200
    prompts = [rng.integers(100, vocab, a.prompt_len).tolist() for _ in range(num_prompts)]
    max_model_len = min(cache_tokens, a.prompt_len + a.suffix_len + a.max_tokens + a.block_size)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    results = {}
    for host in (False, True):
        cfg = EngineConfig(block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
                           max_model_len=max_model_len)
        if host:  # room for the whole working set, plus a margin of one prompt
            per_block = kv_cache_bytes_per_block(mc.num_layers, a.block_size, mc.num_kv_heads,
                                                 mc.head_dim, resolve_dtype("auto"))
            blocks = (num_prompts + 1) * -(-a.prompt_len // a.block_size)
            cfg = cfg.replace(kv_offloading_size=blocks * per_block / 2**30)
        load = LoadConfig(a.model, a.load_format)
        engine = LLMEngine(cfg, load, metrics=EngineMetrics(served_name(load)))
        engine.warmup(progress=False)
        reg = engine.metrics.registry
        ttfts: list[list[float]] = []
        prefill: list[float] = []
        for r in range(a.rounds):
            ttfts.append([])
            label = {"model_name": engine.model_name}
            before = reg.get_sample_value("jaxserve:prompt_tokens_total", label) or 0.0
            for i, prefix in enumerate(prompts):
                ids = prefix + rng.integers(100, vocab, a.suffix_len).tolist()
                engine.add_request(f"r{r}-{i}", ids, params)
                t0 = time.perf_counter()
                first = None
                while engine.has_unfinished_requests():
                    outs = engine.step()
                    if first is None and outs:
                        first = time.perf_counter()
                ttfts[-1].append(1000 * (first - t0))
            prefill.append((reg.get_sample_value("jaxserve:prompt_tokens_total", label) or 0.0)
                           - before)
        later = [t for rnd in ttfts[1:] for t in rnd]
        st = engine.scheduler.kv_stats
        key = "host_tier" if host else "recompute"
        results[key] = {
            "median_ttft_ms_after_round_1": float(np.median(later)),
            "p99_ttft_ms_after_round_1": pct(later, 0.99),
            "median_ttft_ms_round_1": float(np.median(ttfts[0])),
            "prefill_tokens_per_round": prefill, "host_cache_hit_tokens": st.host_cache_hits,
            "prefix_cache_hit_tokens": st.prefix_cache_hits,
            "offloaded_blocks": st.num_offloaded_blocks, "evicted_blocks": st.num_evicted_blocks,
            "num_host_blocks": engine.scheduler.config.num_host_blocks, "ttfts_ms": ttfts,
        }
        res = results[key]
        print(f"{key:9s}: TTFT after round 1 median {res['median_ttft_ms_after_round_1']:7.1f} ms, "
              f"p99 {res['p99_ttft_ms_after_round_1']:7.1f} ms (round 1 median "
              f"{res['median_ttft_ms_round_1']:7.1f}); prefill tokens per round {prefill}; "
              f"host hits {st.host_cache_hits} tokens, offloaded {st.num_offloaded_blocks} "
              f"blocks", flush=True)
        del engine
    out = {"config": vars(a), "num_prompts": num_prompts, "device_cache_tokens": cache_tokens,
           **results}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
