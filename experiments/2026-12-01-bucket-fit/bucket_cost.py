"""Median step time of a one-sequence prefill at each token bucket (default engine)."""
import json
import statistics
import sys
import time

import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

eng = LLMEngine(EngineConfig(enable_prefix_caching=False), LoadConfig())
eng.warmup(progress=False)
rng = np.random.default_rng(0)
lens = [int(x) for x in sys.argv[1].split(",")]
times = {n: [] for n in lens}
for rep in range(int(sys.argv[2])):
    for n in lens:
        ids = rng.integers(100, 40000, n).tolist()
        eng.add_request(f"r{rep}-{n}", ids, SamplingParams(temperature=0.0, max_tokens=1))
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        times[n].append((time.perf_counter() - t) * 1e3)
res = {n: statistics.median(v) for n, v in times.items()}
print(json.dumps(res))
