"""In-process A/B of model variants, decode steps interleaved engine by engine (issue 16).

    PYTHONPATH=. .venv/bin/python experiments/2026-12-01-bf16-weights/inproc_ab.py \
        --variants main,dtype=float32 --batch-sizes 1,16,64 --context 300 --rounds 6

The machine's speed drifts by 15-40% over minutes, more than the changes measured here, so
two processes run one after the other cannot compare them. This builds one engine per variant
in one process (the variant is applied while the engine traces its programs; no compilation
cache, so nothing is shared), prefills the same batch on each, then alternates: a few decode
steps on A, the same on B, ``--rounds`` times, and prints per variant the median step time and
the median process CPU time per step over all rounds. Variants:
  main     the model as committed
  dtype=X  any --dtype (e.g. dtype=float32)
A model change is compared by adding a variant that patches it in while its engine traces
(``fuse_ab.json`` came from one that joined q/k/v and gate/up into one dot each: 3-5% slower
at batch 1/16/64, not kept).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def build(name: str, max_seqs: int, max_len: int, ns) -> LLMEngine:
    dtype = name.split("=", 1)[1] if name.startswith("dtype=") else "auto"
    eng = LLMEngine(EngineConfig(dtype=dtype, compilation_cache_dir="", max_num_seqs=max_seqs,
                                 max_model_len=max_len, enable_prefix_caching=False,
                                 block_size=ns.block_size), LoadConfig())
    eng.warmup(progress=False)
    return eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="main,dtype=float32")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    names = ns.variants.split(",")
    sizes = [int(b) for b in ns.batch_sizes.split(",")]
    max_len = ns.context + 2 * ns.rounds * ns.steps * len(sizes) + 64
    engines = {n: build(n, max(sizes), max_len, ns) for n in names}
    res: dict = {}
    for b in sizes:
        rng = np.random.default_rng(b)
        prompts = [rng.integers(0, 49152, ns.context).tolist() for _ in range(b)]
        for n, eng in engines.items():
            for i, p in enumerate(prompts):
                eng.add_request(f"{b}-{i}", p, SamplingParams(temperature=0.0, max_tokens=max_len,
                                                              ignore_eos=True))
            s = eng.scheduler
            while s.waiting or any(q.num_computed_tokens < q.num_prompt_tokens for q in s.running):
                eng.step()
            for _ in range(3):
                eng.step()
        wall = {n: [] for n in names}
        cpu = {n: [] for n in names}
        for _ in range(ns.rounds):
            for n, eng in engines.items():
                for _ in range(ns.steps):
                    c0, t0 = time.process_time(), time.perf_counter()
                    eng.step()
                    wall[n].append(1e3 * (time.perf_counter() - t0))
                    cpu[n].append(1e3 * (time.process_time() - c0))
        for n, eng in engines.items():
            eng.abort_request([f"{b}-{i}" for i in range(b)])
            while eng.has_unfinished_requests():
                eng.step()
            res.setdefault(n, {})[b] = {"wall_ms": statistics.median(wall[n]),
                                        "cpu_ms": statistics.median(cpu[n])}
        print(f"batch {b}: " + "  ".join(
            f"{n} {res[n][b]['wall_ms']:.1f} ms (CPU {res[n][b]['cpu_ms']:.1f})" for n in names),
            flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"args": vars(ns), "decode_step": res}, fh, indent=1)


if __name__ == "__main__":
    main()
