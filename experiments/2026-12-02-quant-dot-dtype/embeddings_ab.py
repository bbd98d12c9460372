"""Decode steps with and without ``--quantize-embeddings``, engines interleaved in one process
(issue 16).

    .venv/bin/python experiments/2026-12-02-quant-dot-dtype/embeddings_ab.py \
        --settings int4,int4+emb,int8,int8+emb --batch 1 [--rounds 6 --steps 8 --out r.json]

A setting is a ``--quantization`` method, ``+emb`` adding ``--quantize-embeddings``. Per
setting an engine (default model and dtype, prefix caching off, no executable cache) prefills
``--batch`` random prompts of ``--context`` tokens; then, round by round, each engine runs
``--steps`` greedy decode steps, timed as a block (the async loop's steps differ in length, a
block of them does not). Prints each setting's mean step time and process CPU time per step
over all blocks, the median block, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def _cpu_ms() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return 1e3 * (r.ru_utime + r.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="int4,int4+emb,int8,int8+emb")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40000, ns.context).tolist() for _ in range(ns.batch)]
    steps_total = ns.rounds * ns.steps + 16
    blocks = ns.batch * -(-(ns.context + steps_total) // 16) + 64
    engines = {}
    for setting in ns.settings.split(","):
        method, _, emb = setting.partition("+")
        eng = LLMEngine(EngineConfig(max_model_len=1024, enable_prefix_caching=False,
                                     num_kv_blocks=blocks, compilation_cache_dir="",
                                     quantization=method, quantize_embeddings=emb == "emb"),
                        LoadConfig())
        eng.warmup(progress=False)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=100_000,
                                                       ignore_eos=True))
        for _ in range(8):  # the prefill and the first decode steps
            eng.step()
        engines[setting] = eng
    wall = {s: [] for s in engines}
    cpu = {s: [] for s in engines}
    for _ in range(ns.rounds):
        for s, eng in engines.items():
            c0, t0 = _cpu_ms(), time.perf_counter()
            for _ in range(ns.steps):
                eng.step()
            wall[s].append(1e3 * (time.perf_counter() - t0) / ns.steps)
            cpu[s].append((_cpu_ms() - c0) / ns.steps)
    res = {s: {"mean_step_ms": statistics.fmean(wall[s]),
               "median_block_step_ms": statistics.median(wall[s]),
               "mean_cpu_ms": statistics.fmean(cpu[s])} for s in engines}
    for s, r in res.items():
        print(f"batch {ns.batch} {s:>9s}: {r['mean_step_ms']:6.1f} ms a step (median block "
              f"{r['median_block_step_ms']:6.1f}), {r['mean_cpu_ms']:6.1f} CPU ms", flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"args": vars(ns), "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
