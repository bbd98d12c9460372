"""Decode steps of one or four sequences with the LM head's rows padded to 2, 4 or 8,
one engine per setting, interleaved in one process (issue 16).

    .venv/bin/python experiments/2026-12-02-lm-head-rows/pad_ab.py --batch 1 \
        --settings 8,2 [--quantization int4 --rounds 10 --steps 10 --out r.json]

``runner._lm_head`` pads fewer rows than ``LM_HEAD_MIN_ROWS`` up to it (8, ``MIN_TOKEN_BUCKET``,
when these runs were made; now 2), because XLA:CPU runs a 1-row dot against the transposed
embedding on a slow path. A setting replaces that row count (``runner.LM_HEAD_MIN_ROWS``) while the engine's programs
are traced. Per setting an engine (default model and dtype, prefix caching off, no executable
cache) prefills ``--batch`` random prompts of ``--context`` tokens; then, round by round, each
runs ``--steps`` decode steps (synchronous loop). Prints and writes the median wall and CPU
ms a step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import jax
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.device import runner
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--settings", default="8,2")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    original = runner.LM_HEAD_MIN_ROWS
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40000, ns.context).tolist() for _ in range(ns.batch)]
    engines = {}
    for setting in ns.settings.split(","):
        jax.clear_caches()
        runner.LM_HEAD_MIN_ROWS = int(setting)
        eng = LLMEngine(EngineConfig(enable_prefix_caching=False, compilation_cache_dir="",
                                     async_scheduling=False, quantization=ns.quantization),
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
        engines[setting] = eng
    runner.LM_HEAD_MIN_ROWS = original
    wall = {s: [] for s in engines}
    cpu = {s: [] for s in engines}
    for _ in range(ns.rounds):
        for s, eng in engines.items():
            for _ in range(ns.steps):
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                eng.step()
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                wall[s].append(1e3 * (time.perf_counter() - t0))
                cpu[s].append(1e3 * (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime))
    res = {s: {"median_step_ms": statistics.median(wall[s]),
               "median_cpu_ms": statistics.median(cpu[s])} for s in engines}
    for s, r in res.items():
        print(f"batch {ns.batch} {ns.quantization} LM head rows padded to {s}: "
              f"{r['median_step_ms']:6.2f} ms, {r['median_cpu_ms']:6.2f} CPU ms a step",
              flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"args": vars(ns), "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
