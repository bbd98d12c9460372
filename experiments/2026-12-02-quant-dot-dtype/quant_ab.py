"""Decode steps of quantised engines per ``NARROW_DOT_MIN_ROWS`` setting, interleaved in one
process (issue 16).

    .venv/bin/python experiments/2026-12-02-quant-dot-dtype/quant_ab.py --quantization int8 \
        --batch 16 [--settings rule,f32 --rounds 6 --steps 5 --out results.json]

A setting is ``rule`` (``models.quant.NARROW_DOT_MIN_ROWS`` as shipped) or ``f32`` (every
quantised dot in float32, as before it existed). Per setting an engine (default model and
dtype, ``--quantization``, prefix caching off, no executable cache) is built with the table
replaced while its programs are traced, and prefills ``--batch`` random prompts of
``--context`` tokens (timed: ``prefill_ms``). Then, round by round, each engine runs
``--steps`` greedy decode steps; prints the median step time and process CPU time per step
of each setting (and writes them as JSON).
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
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from models import quant


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--settings", default="rule,f32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    original = dict(quant.NARROW_DOT_MIN_ROWS)
    engines, prefill_ms = {}, {}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40000, ns.context).tolist() for _ in range(ns.batch)]
    steps_total = ns.rounds * ns.steps + 8
    blocks = ns.batch * -(-(ns.context + steps_total) // 16) + 64
    for setting in ns.settings.split(","):
        jax.clear_caches()  # a jit would reuse another setting's trace
        quant.NARROW_DOT_MIN_ROWS.update(
            original if setting == "rule" else {k: 1 << 30 for k in original})
        eng = LLMEngine(EngineConfig(max_model_len=2048, enable_prefix_caching=False,
                                     num_kv_blocks=blocks, compilation_cache_dir="",
                                     quantization=ns.quantization), LoadConfig())
        eng.warmup(progress=False)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=100_000,
                                                       ignore_eos=True))
        t0 = time.perf_counter()
        while eng.scheduler.waiting or any(
                s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
            eng.step()
        prefill_ms[setting] = 1e3 * (time.perf_counter() - t0)
        for _ in range(3):
            eng.step()
        engines[setting] = eng
    quant.NARROW_DOT_MIN_ROWS.update(original)
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
               "median_cpu_ms": statistics.median(cpu[s]),
               "prefill_ms": prefill_ms[s]} for s in engines}
    for s, r in res.items():
        print(f"{ns.quantization} batch {ns.batch} {s:>4s}: {r['median_step_ms']:6.1f} ms, "
              f"{r['median_cpu_ms']:6.1f} CPU ms a step; prefill {r['prefill_ms']:.0f} ms "
              f"(once, not interleaved)", flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"args": vars(ns), "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
