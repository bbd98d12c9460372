"""Where a decode step's device time goes, per XLA op (issue 16).

    PYTHONPATH=. .venv/bin/python experiments/2026-12-01-bf16-weights/op_profile.py \
        --dtype bfloat16 --batch 16 --context 300 --steps 5 --out prof_bf16_b16.json

Builds one engine (any ``--dtype``), prefills ``--batch`` random prompts of ``--context``
tokens, then traces ``--steps`` decode steps with ``jax.profiler`` and sums the trace's XLA:CPU
op events by op name (``fusion.12``, ``dot.3``: the HLO instruction names), printing the top
ones with their share of the traced op time and writing them as JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile

import jax
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    eng = LLMEngine(EngineConfig(dtype=ns.dtype, kv_cache_dtype=ns.kv_cache_dtype,
                                 max_model_len=ns.context + 64, max_num_seqs=max(ns.batch, 8),
                                 enable_prefix_caching=False), LoadConfig())
    eng.warmup(progress=False)
    rng = np.random.default_rng(0)
    for i in range(ns.batch):
        eng.add_request(f"r{i}", rng.integers(0, eng.tokenizer.vocab_size, ns.context).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    sched = eng.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        eng.step()
    for _ in range(3):
        eng.step()
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    for _ in range(ns.steps):
        eng.step()
    jax.profiler.stop_trace()
    eng.abort_request([f"r{i}" for i in range(ns.batch)])
    path = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as fh:
        trace = json.load(fh)
    tot: dict[str, float] = collections.defaultdict(float)
    cnt: dict[str, int] = collections.Counter()
    for ev in trace["traceEvents"]:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        name = ev.get("name", "")
        args = ev.get("args", {})
        if "hlo_op" not in args and "long_name" not in args and not any(
                name.startswith(p) for p in ("fusion", "dot", "copy", "gather", "scatter",
                                             "while", "reduce", "convert", "custom-call")):
            continue
        tot[name] += ev["dur"] / 1e3
        cnt[name] += 1
    total = sum(tot.values())
    rows = sorted(tot.items(), key=lambda kv: -kv[1])
    print(f"dtype {eng.dtype} compute {eng.compute_dtype} batch {ns.batch}: {total / ns.steps:.1f}"
          f" ms of op events per step (all threads)")
    for name, ms in rows[:ns.top]:
        print(f"{ms / ns.steps:8.2f} ms/step {100 * ms / total:5.1f}%  x{cnt[name] // ns.steps:<4d} {name}")
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"dtype": str(eng.dtype), "batch": ns.batch, "context": ns.context,
                       "steps": ns.steps, "ms_per_step": {n: ms / ns.steps for n, ms in rows}},
                      fh, indent=1)


if __name__ == "__main__":
    main()
