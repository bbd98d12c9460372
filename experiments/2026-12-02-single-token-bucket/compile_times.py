"""Cold compile time of each step program of the default engine, one by one (issue 16/17).

    .venv/bin/python experiments/2026-12-02-single-token-bucket/compile_times.py

No compilation cache; prints per bucket the model program's and (first time a row count is
seen) the sampler program's wall and process CPU seconds.
"""

from __future__ import annotations

import os
import time

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    runner = LLMEngine(EngineConfig(compilation_cache_dir=""), LoadConfig()).runner
    for b in runner.buckets:
        c0, t0 = _cpu(), time.perf_counter()
        runner._compile_model(b)
        line = (f"model {b.num_tokens:5d}x{b.num_seqs:<3d} {time.perf_counter() - t0:6.2f} s "
                f"{_cpu() - c0:6.2f} CPU-s")
        if b.num_seqs not in runner.samplers:
            c1, t1 = _cpu(), time.perf_counter()
            runner._compile_sampler(b)
            line += (f"   sampler {b.num_seqs:3d} rows {time.perf_counter() - t1:6.2f} s "
                     f"{_cpu() - c1:6.2f} CPU-s")
        print(line, flush=True)


if __name__ == "__main__":
    main()
