"""One offline workload on one engine per bucket setting, the engines stepped in turn (issue 16).

    .venv/bin/python experiments/2026-12-02-decode-buckets/offline_lockstep.py \
        [--num-prompts 64 --input-len 272 --output-len 136 --range-ratio 0.882 --out r.json]

The machine's speed drifts by tens of percent within a minute, so two whole runs one after
the other do not compare. Here each setting gets an engine (default model and dtype,
``max_num_seqs`` 64, prefix caching off, no executable cache) and the same requests (random
token ids; input and output lengths uniform in ``len * (1 +- range_ratio)``, as ``jaxserve
bench throughput --dataset-name random``), and the engines take one step each in turn until
all are done, so drift hits them alike (synchronous loops: an async engine's step would still be running
during the other engine's). Settings: ``mid`` (the engine's buckets) and ``pow2``
(``mid_up_to`` forced to 0: powers of two only). Prints and writes each engine's summed step
wall and CPU seconds, its tokens per second of steps, and its steps per bucket.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import time

import jax
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.device import buckets
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

ORIGINAL = buckets.token_buckets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="pow2,mid")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=272)
    ap.add_argument("--output-len", type=int, default=136)
    ap.add_argument("--range-ratio", type=float, default=0.882)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    rng = np.random.default_rng(ns.seed)

    def lengths(n):
        lo, hi = int(n * (1 - ns.range_ratio)), int(n * (1 + ns.range_ratio))
        return rng.integers(max(lo, 1), hi + 1, ns.num_prompts)

    ins, outs = lengths(ns.input_len), lengths(ns.output_len)
    prompts = [rng.integers(0, 40000, int(n)).tolist() for n in ins]
    engines = {}
    steps = {s: collections.Counter() for s in ns.settings.split(",")}
    for setting in ns.settings.split(","):
        jax.clear_caches()
        buckets.token_buckets = ORIGINAL if setting == "mid" else (
            lambda m, small=(), mid_up_to=0: ORIGINAL(m, small, 0))
        eng = LLMEngine(EngineConfig(enable_prefix_caching=False, max_num_seqs=64,
                                     compilation_cache_dir="", async_scheduling=False),
                        LoadConfig())
        eng.warmup(progress=False)
        print(f"{setting}: buckets {[b.num_tokens for b in eng.runner.buckets]}", flush=True)
        for i, (p, n) in enumerate(zip(prompts, outs)):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=int(n),
                                                       ignore_eos=True))
        engines[setting] = eng
        execute = eng.runner.execute

        def counted(bucket, *a, _execute=execute, _count=steps[setting], **k):
            _count[bucket.num_tokens] += 1
            return _execute(bucket, *a, **k)

        eng.runner.execute = counted
    buckets.token_buckets = ORIGINAL
    wall = dict.fromkeys(engines, 0.0)
    cpu = dict.fromkeys(engines, 0.0)
    out_tokens = dict.fromkeys(engines, 0)
    while any(e.has_unfinished_requests() for e in engines.values()):
        for s, eng in engines.items():
            if not eng.has_unfinished_requests():
                continue
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            outs_ = eng.step()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            wall[s] += time.perf_counter() - t0
            cpu[s] += r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
            out_tokens[s] += sum(len(o.outputs[0].token_ids) for o in outs_ if o.finished)
    total_in = int(ins.sum())
    res = {}
    for s in engines:
        tok = total_in + out_tokens[s]
        res[s] = {"step_wall_s": wall[s], "step_cpu_s": cpu[s], "output_tokens": out_tokens[s],
                  "total_tok_per_s": tok / wall[s], "steps_by_bucket": dict(sorted(steps[s].items()))}
        print(f"{s}: {wall[s]:.2f} s of steps ({cpu[s]:.2f} CPU s), {out_tokens[s]} output "
              f"tokens, {tok / wall[s]:.1f} tok/s; steps by bucket {res[s]['steps_by_bucket']}",
              flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"args": vars(ns), "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
