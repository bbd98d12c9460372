"""The model program and the sampler program of a 64-row decode step, timed apart inside one
engine, with the minor page faults of each call (issue 16).

    .venv/bin/python experiments/2026-12-03-zen3/sampler_in_engine.py top_p   # or greedy, ...

One engine (default model, prefix caching off, synchronous steps) prefills 64 random prompts
of 300 tokens with the mode's sampling settings, runs 3 decode steps, then 15 more with the
runner's two programs wrapped: each call waits for its inputs, then is timed until its outputs
are ready (so the host's overlap is gone; this measures the programs, not the step). Prints the
median ms and minor faults per call of each program.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time

import jax
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

MODES = {"greedy": {"temperature": 0.0}, "top_p": {"temperature": 0.7, "top_p": 0.95},
         "min_p": {"temperature": 1.0, "min_p": 0.05}, "top_k": {"temperature": 1.0, "top_k": 200}}


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "top_p"
    batch, context = 64, 300
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40000, context).tolist() for _ in range(batch)]
    eng = LLMEngine(EngineConfig(max_model_len=2048, enable_prefix_caching=False,
                                 num_kv_blocks=batch * 24 + 64, compilation_cache_dir="",
                                 async_scheduling=False), LoadConfig())
    eng.warmup(progress=False)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=100_000, ignore_eos=True, seed=i,
                                                   **MODES[mode]))
    while eng.scheduler.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    stats: dict[str, list[float]] = {k: [] for k in ("model", "sampler", "model_faults",
                                                     "sampler_faults")}

    def timed(fn, name):
        def call(*args):
            jax.block_until_ready(args)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            stats[name].append((time.perf_counter() - t0) * 1e3)
            stats[name + "_faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            return out
        return call

    for table, name in ((eng.runner.compiled, "model"), (eng.runner.samplers, "sampler")):
        for key, fn in list(table.items()):
            table[key] = timed(fn, name)
    for _ in range(3):
        eng.step()
    for v in stats.values():
        v.clear()
    for _ in range(15):
        eng.step()
    print(mode, {k: round(statistics.median(v), 1) for k, v in stats.items()})


if __name__ == "__main__":
    main()
