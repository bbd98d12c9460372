"""Decode steps of one int4 engine per int4_matmul_backend, interleaved in one process (issue 16).

    .venv/bin/python experiments/2026-12-04-int4-kernel/int4_ab.py --batch 1 \
        --backends xla,native [--context 300 --rounds 6 --steps 5 --out results.json]

Per backend an engine (default model, --quantization int4, prefix caching off, synchronous steps, enough KV blocks,
no executable cache) prefills ``--batch`` random prompts of ``--context`` tokens; then, round by
round, each engine runs ``--steps`` decode steps. Prints (and writes as JSON) the median step
time and process CPU time per step of each backend.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--backends", default="xla,native")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40000, ns.context).tolist() for _ in range(ns.batch)]
    steps_total = ns.rounds * ns.steps * len(ns.backends.split(",")) + 8
    blocks = max(ns.batch * -(-(ns.context + steps_total) // 16) + 64, 2048 // 16 + 8)
    engines = {}
    for backend in ns.backends.split(","):
        eng = LLMEngine(EngineConfig(max_model_len=2048, enable_prefix_caching=False,
                                     num_kv_blocks=blocks, compilation_cache_dir="",
                                     quantization="int4", int4_matmul_backend=backend,
                                     async_scheduling=False),
                        LoadConfig())
        eng.warmup(progress=False)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=100_000,
                                                       ignore_eos=True))
        while eng.scheduler.waiting or any(
                s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
            eng.step()
        for _ in range(3):
            eng.step()
        engines[backend] = eng
    wall = {b: [] for b in engines}
    cpu = {b: [] for b in engines}
    for _ in range(ns.rounds):
        for b, eng in engines.items():
            for _ in range(ns.steps):
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                eng.step()
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                wall[b].append(1e3 * (time.perf_counter() - t0))
                cpu[b].append(1e3 * (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime))
    res = {b: {"batch": ns.batch, "context": ns.context,
               "median_step_ms": statistics.median(wall[b]),
               "median_cpu_ms": statistics.median(cpu[b])} for b in engines}
    for b, r in res.items():
        print(f"batch {ns.batch} context {ns.context} {b:>9s}: {r['median_step_ms']:6.1f} ms, "
              f"{r['median_cpu_ms']:6.1f} CPU ms a step", flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
