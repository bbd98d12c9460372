"""Where a decode step's device time goes, per XLA op (issue 16).

    .venv/bin/python experiments/2026-12-02-decode-b16/decode_op_profile.py \
        --batch 16 --context 300 --steps 10

Builds the default engine (prefix caching off), prefills ``--batch`` random prompts of
``--context`` tokens, decodes a few steps to warm up, then traces ``--steps`` decode steps with
``jax.profiler`` and sums the XLA:CPU op events by name per step, printing the top ones. Op
events are summed over XLA's threads (a multi-threaded dot counts once per thread), and a
``while`` event spans its body's ops.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile
import time

import jax
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

_OP_PREFIXES = ("fusion", "ynn", "dot", "copy", "gather", "scatter", "while", "reduce",
                "convert", "custom-call", "wrapped", "dynamic", "broadcast", "multiply", "add",
                "subtract", "select")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--quantization", default="none")
    ns = ap.parse_args()
    eng = LLMEngine(EngineConfig(max_model_len=2048, enable_prefix_caching=False,
                                 quantization=ns.quantization), LoadConfig())
    eng.warmup(progress=False)
    rng = np.random.default_rng(0)
    for i in range(ns.batch):
        eng.add_request(f"r{i}", rng.integers(0, 40000, ns.context).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
    while any(len(s.output_token_ids) == 0 for s in eng.scheduler.running) or \
            eng.scheduler.waiting:
        eng.step()
    for _ in range(5):
        eng.step()
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    t0 = time.perf_counter()
    for _ in range(ns.steps):
        eng.step()
    wall = (time.perf_counter() - t0) / ns.steps * 1e3
    jax.profiler.stop_trace()
    with gzip.open(glob.glob(d + "/**/*.trace.json.gz", recursive=True)[0]) as fh:
        trace = json.load(fh)
    tot: dict[str, float] = collections.defaultdict(float)
    cnt: collections.Counter = collections.Counter()
    for ev in trace["traceEvents"]:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        name, args = ev.get("name", ""), ev.get("args", {})
        if "hlo_op" in args or "long_name" in args or name.startswith(_OP_PREFIXES):
            tot[name] += ev["dur"] / 1e3 / ns.steps
            cnt[name] += 1
    total = sum(tot.values())
    print(f"batch {ns.batch}: {wall:.1f} ms a traced step, {total:.1f} ms of op events a step")
    for name, ms in sorted(tot.items(), key=lambda kv: -kv[1])[:ns.top]:
        print(f"{ms:8.2f} ms {100 * ms / total:5.1f}% x{cnt[name] // ns.steps:<5d} {name}")


if __name__ == "__main__":
    main()
