"""Decode steps at a given number of live sequences, with the power-of-two token buckets and
with intermediate ones, interleaved in one process (issue 16).

    .venv/bin/python experiments/2026-12-02-decode-buckets/bucket_ab.py \
        --live 64,48,40,33,24,12 --settings pow2,x1.5 [--rounds 6 --steps 4 --out r.json]

A setting is a token-bucket rule for ``jaxserve.device.buckets.token_buckets`` while the engine
is built: ``pow2`` (the default: 8, 16, 32, 64, ...) or ``x1.5`` (the powers of two and
1.5 times each from 8: 8, 12, 16, 24, 32, 48, 64, 96, ...), or ``add:12+20+24`` (the powers
of two and those). One engine per setting (default
model and dtype, ``max_num_seqs`` 64, prefix caching off, no executable cache) prefills the
largest ``--live`` count of random prompts of ``--context`` tokens; then for each live count,
descending, requests are aborted down to it, and round by round each engine runs ``--steps``
decode steps. Median wall and process CPU ms per step are printed and written as JSON.
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
from jaxserve.device import buckets
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

ORIGINAL = buckets.token_buckets


def x15_buckets(max_num_batched_tokens: int, small: tuple[int, ...] = ()) -> list[int]:
    base = ORIGINAL(max_num_batched_tokens, small)
    extra = [t * 3 // 2 for t in base if t >= 8 and t * 3 // 2 < max_num_batched_tokens]
    return sorted(set(base + extra))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--live", default="64,48,40,33,24,12")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--settings", default="pow2,x1.5")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    lives = sorted({int(x) for x in ns.live.split(",")}, reverse=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40000, ns.context).tolist() for _ in range(lives[0])]
    steps_total = len(lives) * ns.rounds * ns.steps + 16
    blocks = lives[0] * -(-(ns.context + steps_total) // 16) + 64
    engines = {}
    for setting in ns.settings.split(","):
        jax.clear_caches()
        if setting.startswith("add:"):
            extra = [int(t) for t in setting[4:].split("+")]
            buckets.token_buckets = (lambda m, small=(), extra=extra:
                                     sorted(set(ORIGINAL(m, small) + extra)))
        else:
            buckets.token_buckets = ORIGINAL if setting == "pow2" else x15_buckets
        t0 = time.perf_counter()
        eng = LLMEngine(EngineConfig(max_model_len=2048, enable_prefix_caching=False,
                                     max_num_seqs=64, num_kv_blocks=blocks,
                                     compilation_cache_dir=""), LoadConfig())
        eng.warmup(progress=False)
        print(f"{setting}: buckets {[b.num_tokens for b in eng.runner.buckets]}, built and "
              f"warmed in {time.perf_counter() - t0:.1f} s", flush=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=100_000,
                                                       ignore_eos=True))
        while eng.scheduler.waiting or any(
                s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
            eng.step()
        engines[setting] = eng
    buckets.token_buckets = ORIGINAL
    res = {}
    for live in lives:
        for eng in engines.values():
            eng.abort_request([f"r{i}" for i in range(live, lives[0])])
            for _ in range(3):
                eng.step()
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
        res[live] = {s: {"median_step_ms": statistics.median(wall[s]),
                         "median_cpu_ms": statistics.median(cpu[s])} for s in engines}
        print(f"live {live:3d}: " + "  ".join(
            f"{s} {r['median_step_ms']:6.1f} ms ({r['median_cpu_ms']:6.1f} CPU ms)"
            for s, r in res[live].items()), flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"args": vars(ns), "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
