"""Prefill steps of one engine per attention tiling, interleaved in one process (issue 16).

    .venv/bin/python experiments/2026-12-02-decode-b16/prefill_ab.py --num-prompts 4 \
        --prompt-len 256 --settings 128:128,64:128,128:256 [--rounds 6 --out results.json]

A setting is ``q_tile:kv_chunk`` of the CPU attention op's prefill path. Per setting an engine
(default model, prefix caching off, no executable cache) is built with the op's tiling bound
in; then, round by round, each engine takes ``--num-prompts`` random prompts of
``--prompt-len`` tokens (one output token each) and runs them to completion. Prints the median
wall and process CPU time per round of each setting (and writes them as JSON).
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import time

import jax
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine import llm_engine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from pallas_kernels import ragged_paged_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--settings", default="128:128,64:128")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    original = llm_engine.attention_fn_for_backend
    engines = {}
    for setting in ns.settings.split(","):
        qt, kc = map(int, setting.split(":"))
        jax.clear_caches()
        llm_engine.attention_fn_for_backend = lambda _b, qt=qt, kc=kc: functools.partial(
            ragged_paged_attention, q_tile=qt, kv_chunk=kc)
        eng = LLMEngine(EngineConfig(max_model_len=2048, enable_prefix_caching=False,
                                     compilation_cache_dir=""), LoadConfig())
        eng.warmup(progress=False)
        engines[setting] = eng
    llm_engine.attention_fn_for_backend = original
    rng = np.random.default_rng(0)
    wall = {s: [] for s in engines}
    cpu = {s: [] for s in engines}
    for r in range(ns.rounds + 1):
        prompts = [rng.integers(0, 40000, ns.prompt_len).tolist() for _ in range(ns.num_prompts)]
        for s, eng in engines.items():
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for i, p in enumerate(prompts):
                eng.add_request(f"{r}-{i}", p, SamplingParams(temperature=0.0, max_tokens=1,
                                                              ignore_eos=True))
            while eng.has_unfinished_requests():
                eng.step()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            if r:  # round 0 warms up
                wall[s].append(1e3 * (time.perf_counter() - t0))
                cpu[s].append(1e3 * (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime))
    res = {s: {"median_ms": statistics.median(wall[s]), "median_cpu_ms": statistics.median(cpu[s])}
           for s in engines}
    for s, v in res.items():
        print(f"{ns.num_prompts} x {ns.prompt_len} tokens, q_tile:kv_chunk {s:>8s}: "
              f"{v['median_ms']:7.1f} ms, {v['median_cpu_ms']:7.1f} CPU ms", flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"args": vars(ns), "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
