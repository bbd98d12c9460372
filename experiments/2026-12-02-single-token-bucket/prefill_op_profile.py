"""Where a prefill step's device time goes, per XLA op (issue 16).

    .venv/bin/python experiments/2026-12-02-single-token-bucket/prefill_op_profile.py \
        --num-prompts 4 --prompt-len 256

Builds the default engine (prefix caching off), runs ``--num-prompts`` random prompts of
``--prompt-len`` tokens once to warm up, then traces the same shape again (one token each, so
the traced steps are the prefill) with ``jax.profiler`` and sums the XLA:CPU op events by
name, printing the top ones. Op events are summed over XLA's threads (a multi-threaded dot
counts once per thread), and a ``while`` event spans its body's ops.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile

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
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--top", type=int, default=30)
    ns = ap.parse_args()
    eng = LLMEngine(EngineConfig(max_model_len=2048, enable_prefix_caching=False), LoadConfig())
    eng.warmup(progress=False)
    rng = np.random.default_rng(0)

    def run(tag: str) -> int:
        for i in range(ns.num_prompts):
            eng.add_request(f"{tag}{i}", rng.integers(0, 40000, ns.prompt_len).tolist(),
                            SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        steps = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        return steps

    run("warm")
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    steps = run("traced")
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
            tot[name] += ev["dur"] / 1e3
            cnt[name] += 1
    total = sum(tot.values())
    print(f"{steps} steps, {total:.0f} ms of op events (all threads)")
    for name, ms in sorted(tot.items(), key=lambda kv: -kv[1])[:ns.top]:
        print(f"{ms:8.1f} ms {100 * ms / total:5.1f}% x{cnt[name]:<5d} {name}")


if __name__ == "__main__":
    main()
