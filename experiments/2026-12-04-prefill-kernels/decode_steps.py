"""Engine decode steps: B sequences of 300 random prompt tokens (greedy, 200 output tokens),
prefilled, then the median of 30 decode steps (ms, and CPU ms) for each B; run it from each tree
to compare.

    PYTHONPATH=<tree> .venv/bin/python experiments/2026-12-04-prefill-kernels/decode_steps.py 1,16,64
"""

import sys
import time

import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

cfg = EngineConfig(max_model_len=2048, enable_prefix_caching=False, max_num_seqs=64,
                   compilation_cache_dir="", async_scheduling=False)
eng = LLMEngine(cfg, LoadConfig())
eng.warmup(progress=False)
rng = np.random.default_rng(0)
out = []
for B in [int(b) for b in sys.argv[1].split(",")]:
    for i in range(B):
        eng.add_request(f"b{B}r{i}", rng.integers(100, 40000, 300).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                       for s in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    ts, cs = [], []
    for _ in range(30):
        t, c = time.perf_counter(), time.process_time()
        eng.step()
        ts.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
    out.append(f"{B} sequences {np.median(ts) * 1e3:.1f} ms, CPU {np.median(cs) * 1e3:.1f}")
    for i in range(B):
        eng.abort_request(f"b{B}r{i}")
    while eng.has_unfinished_requests():
        eng.step()
print(" | ".join(out))
