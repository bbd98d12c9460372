"""Engines with different settings side by side in one process: prefill and decode steps,
interleaved (issue 16).

    .venv/bin/python experiments/2026-12-04-cpu-dtype/engine_ab.py \
        --config f32:dtype=float32 --config bf16:dtype=bfloat16 \
        [--batches 1,4,16,64 --context 300 --prefill-lens 128,256,320 --rounds 4 --steps 5
         --out results.json]

Each ``--config NAME:key=value,...`` is an ``EngineConfig`` (values parsed as int, float, bool
or text) over the defaults of a serving engine (default model, prefix caching off, synchronous
steps, no executable cache). Phase 1, per round and engine in turn: one prompt of each
``--prefill-lens`` length alone, timed from ``add_request`` to its first token (the prefill
steps). Phase 2, per batch size: each engine prefills ``B`` prompts of ``--context`` tokens,
then, round by round, each runs ``--steps`` decode steps. Prints (and writes as JSON) medians
of wall and process CPU ms.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _config(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    kv = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, {k.replace("-", "_"): _value(v) for k, v in kv.items()}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _prefill(eng: LLMEngine, rid: str, ids: list[int]) -> tuple[float, float]:
    c0, t0 = _cpu(), time.perf_counter()
    eng.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    return 1e3 * (time.perf_counter() - t0), 1e3 * (_cpu() - c0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--prefill-lens", default="128,256,320")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    batches = [int(b) for b in ns.batches.split(",") if b]
    lens = [int(n) for n in ns.prefill_lens.split(",") if n]
    rng = np.random.default_rng(0)
    configs = dict(_config(c) for c in ns.config)
    engines = {}
    for name, kw in configs.items():
        cfg = EngineConfig(**{"max_model_len": 2048, "enable_prefix_caching": False,
                              "max_num_seqs": max(batches + [1]), "compilation_cache_dir": "",
                              "async_scheduling": False, **kw})
        engines[name] = LLMEngine(cfg, LoadConfig())
        engines[name].warmup(progress=False)
    res: dict = {"configs": configs, "prefill": {}, "decode": {}}
    for n in lens:
        wall, cpu = {k: [] for k in engines}, {k: [] for k in engines}
        for r in range(ns.rounds):
            ids = rng.integers(100, 40000, n).tolist()
            for name, eng in engines.items():
                w, c = _prefill(eng, f"p{n}-{r}", ids)
                wall[name].append(w)
                cpu[name].append(c)
        res["prefill"][n] = {k: {"median_ms": statistics.median(wall[k]),
                                 "median_cpu_ms": statistics.median(cpu[k])} for k in engines}
        print(f"prefill {n:4d} tokens: " + " | ".join(
            f"{k} {v['median_ms']:7.1f} ms ({v['median_cpu_ms']:7.1f} CPU)"
            for k, v in res["prefill"][n].items()), flush=True)
    for b in batches:
        prompts = [rng.integers(100, 40000, ns.context).tolist() for _ in range(b)]
        for name, eng in engines.items():
            for i, p in enumerate(prompts):
                eng.add_request(f"d{b}-{i}", p, SamplingParams(
                    temperature=0.0, max_tokens=ns.rounds * ns.steps + 4, ignore_eos=True))
            while eng.scheduler.waiting or any(
                    s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
                eng.step()
            eng.step()
        wall, cpu = {k: [] for k in engines}, {k: [] for k in engines}
        for _ in range(ns.rounds):
            for name, eng in engines.items():
                for _ in range(ns.steps):
                    c0, t0 = _cpu(), time.perf_counter()
                    eng.step()
                    wall[name].append(1e3 * (time.perf_counter() - t0))
                    cpu[name].append(1e3 * (_cpu() - c0))
        for eng in engines.values():  # finish the batch
            while eng.has_unfinished_requests():
                eng.step()
        res["decode"][b] = {k: {"median_ms": statistics.median(wall[k]),
                                "median_cpu_ms": statistics.median(cpu[k])} for k in engines}
        print(f"decode batch {b:3d} context {ns.context}: " + " | ".join(
            f"{k} {v['median_ms']:7.1f} ms ({v['median_cpu_ms']:7.1f} CPU)"
            for k, v in res["decode"][b].items()), flush=True)
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
