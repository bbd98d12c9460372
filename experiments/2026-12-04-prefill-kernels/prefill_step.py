"""Engine prefill steps: rounds of 4 prompts of 256 random tokens (one 1024-token step each, one
output token), greedy, through `LLMEngine` with the CPU defaults (bfloat16 weights and cache on
an AVX512-BF16 CPU). Prints the median ms (min-max) and CPU ms per round; run it from each tree
to compare.

    PYTHONPATH=<tree> .venv/bin/python experiments/2026-12-04-prefill-kernels/prefill_step.py 8
"""

import sys
import time

import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
cfg = EngineConfig(max_model_len=2048, enable_prefix_caching=False, max_num_seqs=64,
                   compilation_cache_dir="", async_scheduling=False)
eng = LLMEngine(cfg, LoadConfig())
eng.warmup(progress=False)
rng = np.random.default_rng(0)
wall, cpu = [], []
for r in range(rounds + 1):
    for i in range(4):
        eng.add_request(f"r{r}_{i}", rng.integers(100, 40000, 256).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=1))
    t, c = time.perf_counter(), time.process_time()
    while eng.has_unfinished_requests():
        eng.step()
    if r:  # the first round warms the caches
        wall.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
print(f"prefill 4 x 256: {np.median(wall):.1f} ms ({min(wall):.1f}-{max(wall):.1f}), "
      f"CPU {np.median(cpu):.1f} ms")
