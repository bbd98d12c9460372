"""Decode steps of one engine per decode-chunk setting, interleaved in one process (issue 16).

    .venv/bin/python experiments/2026-12-02-decode-b16/chunk_ab.py --batch 8 \
        --settings 64,128,256 [--rounds 8 --steps 5 --out results.json]

Each setting is a value of ``decode_kv_chunk`` for every decode program, or ``auto`` (the
op's ``decode_chunk_for``). Per setting an engine (default model, prefix caching off, enough KV
blocks for the run, no executable cache) is built with ``ragged_paged_attention``'s default replaced while
its programs are traced, and prefills ``--batch`` random prompts of ``--context`` tokens. Then,
round by round, each engine runs ``--steps`` decode steps; the median step time and process
CPU time per step of each setting are printed (and written as JSON).
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import statistics
import time

import jax
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--settings", default="auto,64")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    rpa = importlib.import_module("pallas_kernels.ragged_paged_attention")
    original = rpa.decode_chunk_for
    engines = {}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40000, ns.context).tolist() for _ in range(ns.batch)]
    steps_total = ns.rounds * ns.steps + 8
    blocks = ns.batch * -(-(ns.context + steps_total) // 16) + 64
    for setting in ns.settings.split(","):
        jax.clear_caches()  # the op's jit would reuse another setting's trace
        rpa.decode_chunk_for = original if setting == "auto" else (lambda s, v=int(setting): v)
        eng = LLMEngine(EngineConfig(max_model_len=2048, enable_prefix_caching=False,
                                     num_kv_blocks=blocks, compilation_cache_dir=""),
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
    rpa.decode_chunk_for = original
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
        print(f"batch {ns.batch} decode_kv_chunk {s:>5s}: {r['median_step_ms']:6.1f} ms, "
              f"{r['median_cpu_ms']:6.1f} CPU ms a step", flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"args": vars(ns), "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
