"""``jaxserve bench step``'s decode measurement with each step's CPU seconds beside its wall time.

    PYTHONPATH=. python experiments/2026-12-01-sampler-fast/step_cpu.py \\
        --modes greedy,sampled,top_p,top_k,min_p --batch-sizes 1,64 --repeats 2

On a shared 2-core machine the wall time of a step mostly measures the other processes; the
CPU seconds of this process (all threads, ``getrusage``) over the step move far less. Each
(mode, batch) runs ``--repeats`` times, interleaved; printed: median / min wall ms and median
CPU ms of the timed decode steps, per repeat.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics

import numpy as np

import jaxserve.bench.step as bench_step
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="greedy,sampled,top_p,top_k,min_p")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    ns = p.parse_args()
    modes, batches = ns.modes.split(","), [int(b) for b in ns.batch_sizes.split(",")]
    log: list[tuple[float, float]] = []
    timed = bench_step._timed_step

    def timed_cpu(engine, timer, masks):
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        out = timed(engine, timer, masks)
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        log.append((out[1], c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime))
        return out

    bench_step._timed_step = timed_cpu
    cfg = EngineConfig(max_num_seqs=max(batches), max_model_len=64 + ns.num_steps + 18)
    engine = LLMEngine(cfg, LoadConfig(None, "auto"))
    engine.warmup(progress=False)
    timer, masks = bench_step._ExecuteTimer(engine.runner), bench_step._MaskTimer(engine)
    rng = np.random.default_rng(cfg.seed)
    res: dict[str, list[str]] = {}
    for _ in range(ns.repeats):
        for mode in modes:
            for b in batches:
                bench_step.measure(engine, timer, masks, mode, b, 64, ns.num_steps, rng)
                wall = [1e3 * w for w, _ in log[-ns.num_steps:]]
                cpu = [1e3 * c for _, c in log[-ns.num_steps:]]
                res.setdefault(f"{mode}/{b}", []).append(
                    f"wall med {statistics.median(wall):7.1f} min {min(wall):7.1f} "
                    f"cpu med {statistics.median(cpu):7.1f}")
    print(f"load average {os.getloadavg()}")
    for k, v in res.items():
        print(f"{k:<12} " + " | ".join(v))


if __name__ == "__main__":
    main()
