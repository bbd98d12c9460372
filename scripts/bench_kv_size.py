"""Decode step time at a fixed context with a small and a large KV cache: equal within noise
shows the cache is updated in place, never copied.

Usage: .venv/bin/python scripts/bench_kv_size.py [--blocks 256 4096] [--out results/kv_size.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def decode_step_ms(num_blocks: int, batch: int, context: int, steps: int) -> list[float]:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    e = LLMEngine(EngineConfig(max_model_len=1024, num_kv_blocks=num_blocks, max_num_seqs=batch,
                               max_num_batched_tokens=max(64, batch)))
    e.warmup(progress=False)
    for i in range(batch):
        e.add_request(str(i), [100 + (i + j) % 1000 for j in range(context)],
                      SamplingParams(max_tokens=steps + 20, temperature=0, ignore_eos=True))
    while any(s.num_computed_tokens < context for s in e.scheduler.running) or e.scheduler.waiting:
        e.step()  # prefill
    for _ in range(3):
        e.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        e.step()
        times.append((time.perf_counter() - t) * 1000)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default="results/kv_size.json")
    a = p.parse_args()
    res = {}
    print(f"{'num_kv_blocks':>14}{'median ms':>11}{'p90 ms':>9}")
    for nb in a.blocks:
        t = sorted(decode_step_ms(nb, a.batch, a.context, a.steps))
        res[nb] = {"median_ms": statistics.median(t), "p90_ms": t[int(0.9 * (len(t) - 1))],
                   "all_ms": t}
        print(f"{nb:14d}{res[nb]['median_ms']:11.1f}{res[nb]['p90_ms']:9.1f}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"config": vars(a), "results": res}, fh, indent=2)


if __name__ == "__main__":
    main()
