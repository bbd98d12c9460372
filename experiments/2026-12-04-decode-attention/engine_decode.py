"""Decode steps of the default engine (SmolLM2-135M, `--dtype auto`, greedy) at B sequences of a
300-token prompt each: median ms and CPU ms per step over 5 rounds of 6 steps. Run it from each
tree to compare.

    PYTHONPATH=<tree> .venv/bin/python experiments/2026-12-04-decode-attention/engine_decode.py 1,16,64
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
for B in (int(b) for b in sys.argv[1].split(",")):
    for i in range(B):
        eng.add_request(f"b{B}r{i}", rng.integers(100, 40000, 300).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                       for s in eng.scheduler.running):
        eng.step()
    wall, cpu = [], []
    for _ in range(5):
        eng.step()
        ts, cs = [], []
        for _ in range(6):
            t, c = time.perf_counter(), time.process_time()
            eng.step()
            ts.append(time.perf_counter() - t)
            cs.append(time.process_time() - c)
        wall.append(np.median(ts) * 1e3)
        cpu.append(np.median(cs) * 1e3)
    print(f"decode b{B}: {np.median(wall):.1f} ms ({min(wall):.1f}-{max(wall):.1f}), "
          f"cpu {np.median(cpu):.1f} ms", flush=True)
    for i in range(B):
        eng.abort_request(f"b{B}r{i}")
    while eng.has_unfinished_requests():
        eng.step()
