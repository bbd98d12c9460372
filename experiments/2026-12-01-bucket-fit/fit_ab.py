"""Prefill-only latency of one prompt, bucket fitting on vs off, interleaved."""
import statistics
import sys
import time

import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

eng = LLMEngine(EngineConfig(enable_prefix_caching=False), LoadConfig())
eng.warmup(progress=False)
buckets = eng.scheduler.config.token_buckets
rng = np.random.default_rng(0)
lens = [int(x) for x in sys.argv[1].split(",")]
times = {(n, f): [] for n in lens for f in (0, 1)}
for rep in range(int(sys.argv[2])):
    for n in lens:
        for f in (0, 1):
            eng.scheduler.config.token_buckets = buckets if f else ()
            ids = rng.integers(100, 40000, n).tolist()
            eng.add_request(f"r{rep}-{n}-{f}", ids, SamplingParams(temperature=0.0, max_tokens=1))
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            times[(n, f)].append((time.perf_counter() - t) * 1e3)
for n in lens:
    off, on = statistics.median(times[(n, 0)]), statistics.median(times[(n, 1)])
    print(f"prompt {n}: off {off:.0f} ms  fit {on:.0f} ms  ratio {on/off:.2f}")
