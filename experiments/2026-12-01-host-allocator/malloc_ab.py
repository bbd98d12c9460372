"""In-process A/B of glibc's mmap threshold under the engine's decode and prefill steps (issue 16).

    PYTHONPATH=. .venv/bin/python experiments/2026-12-01-host-allocator/malloc_ab.py \
        --batch-sizes 1,16,64 --context 300 --rounds 6 --out malloc_ab.json

XLA:CPU allocates each execution's temporaries afresh. glibc serves a block above its mmap
threshold (dynamic, at most 32 MiB) with a fresh mmap, so every step page-faults its
temporaries in again. ``mallopt`` changes the threshold at run time, so one engine can
alternate between the two settings step by step:
  default   M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 64 MiB (glibc's dynamic ceiling)
  heap      both 2 GiB - 1 (what ``jaxserve`` sets at start-up)
Prints per setting the median step time, process CPU time and minor page faults per step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import time

import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

_LIBC = ctypes.CDLL("libc.so.6")
SETTINGS = {"default": (32 << 20, 64 << 20), "heap": (2**31 - 1, 2**31 - 1)}


def apply(name: str) -> None:
    mmap_t, trim_t = SETTINGS[name]
    assert _LIBC.mallopt(-3, mmap_t) == 1 and _LIBC.mallopt(-1, trim_t) == 1


def timed(eng: LLMEngine) -> tuple[float, float, int]:
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, t0 = time.process_time(), time.perf_counter()
    eng.step()
    return (1e3 * (time.perf_counter() - t0), 1e3 * (time.process_time() - c0),
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)


def until_done(eng: LLMEngine) -> tuple[float, float, int]:
    """Steps until nothing is left (an asynchronous engine returns a step's tokens a step
    late), timed as one."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, t0 = time.process_time(), time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return (1e3 * (time.perf_counter() - t0), 1e3 * (time.process_time() - c0),
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prefill-tokens", type=int, default=1000)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    sizes = [int(b) for b in ns.batch_sizes.split(",")]
    max_len = max(ns.context + 2 * ns.rounds * ns.steps + 64, ns.prefill_tokens + 8)
    eng = LLMEngine(EngineConfig(max_num_seqs=max(sizes), max_model_len=max_len,
                                 enable_prefix_caching=False), LoadConfig())
    eng.warmup(progress=False)
    res: dict = {}
    greedy = SamplingParams(temperature=0.0, max_tokens=max_len, ignore_eos=True)
    rng = np.random.default_rng(0)
    for b in sizes:
        for i in range(b):
            eng.add_request(f"{b}-{i}", rng.integers(0, 49152, ns.context).tolist(), greedy)
        s = eng.scheduler
        while s.waiting or any(q.num_computed_tokens < q.num_prompt_tokens for q in s.running):
            eng.step()
        for _ in range(3):
            eng.step()
        rows = {n: [] for n in SETTINGS}
        for _ in range(ns.rounds):
            for n in SETTINGS:
                apply(n)
                eng.step()  # the first step after a switch frees the other setting's blocks
                rows[n] += [timed(eng) for _ in range(ns.steps)]
        eng.abort_request([f"{b}-{i}" for i in range(b)])
        while eng.has_unfinished_requests():
            eng.step()
        res[f"decode_b{b}"] = summarize(rows)
        print(f"decode b{b}: " + fmt(res[f"decode_b{b}"]), flush=True)
    # one prompt of --prefill-tokens tokens to its first token, alternating settings
    rows = {n: [] for n in SETTINGS}
    for r in range(ns.rounds):
        for n in SETTINGS:
            apply(n)
            eng.add_request(f"p{r}{n}", rng.integers(0, 49152, ns.prefill_tokens).tolist(),
                            SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            rows[n].append(until_done(eng))
    res["prefill"] = summarize(rows)
    print(f"prefill {ns.prefill_tokens}: " + fmt(res["prefill"]), flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"args": vars(ns), "settings": SETTINGS, "results": res}, fh, indent=1)


def summarize(rows: dict) -> dict:
    return {n: {"wall_ms": statistics.median(r[0] for r in v),
                "cpu_ms": statistics.median(r[1] for r in v),
                "minflt": statistics.median(r[2] for r in v)} for n, v in rows.items()}


def fmt(res: dict) -> str:
    return "  ".join(f"{n} {v['wall_ms']:.1f} ms (CPU {v['cpu_ms']:.1f}, {v['minflt']:.0f} faults)"
                     for n, v in res.items())


if __name__ == "__main__":
    main()
