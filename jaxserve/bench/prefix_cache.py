"""``jaxserve bench prefix-cache``: requests sharing one long system prompt, with prefix caching
off and on.

    jaxserve bench prefix-cache --model SmolLM2-135M-Instruct.Q4_1.gguf --num-requests 20 \\
        --system-len 1000 --output-json results/prefix_cache.json

Workload (fixed seed): a system prompt of ``--system-len`` random token ids, then a different
question of ``--question-min`` .. ``--question-max`` random ids per request; all
``--num-requests`` requests go into an in-process engine at once (greedy, EOS ignored,
``--max-tokens`` each). One engine per setting (the other engine flags as given); each first
serves one unrelated request of the same length, so the measured run is warm. Per setting:
prompt tokens the engine computed (its prefill work), prompt tokens found in the prefix cache,
time to first token (arrival to first token) median and p99, and the wall time; then the ratio
of prefill work on / off.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from jaxserve.bench.common import add_model_flags, percentile, write_json
from jaxserve.config import LoadConfig
from jaxserve.config_args import add_engine_args, engine_config_from_args
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.loading.load import served_name
from jaxserve.sampling_params import SamplingParams

SETTINGS = (("prefix_caching_off", False), ("prefix_caching_on", True))


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``jaxserve bench prefix-cache``'s flags: model, workload, and the engine flags."""
    add_model_flags(p, model="tiny", load_format="dummy")
    a = p.add_argument
    a("--num-requests", type=int, default=20, help="requests sharing the system prompt")
    a("--system-len", type=int, default=256, help="tokens of the shared system prompt")
    a("--question-min", type=int, default=10, help="fewest tokens of a request's own question")
    a("--question-max", type=int, default=40, help="most tokens of a request's own question")
    a("--max-tokens", type=int, default=4, help="output tokens per request")
    a("--output-json", default=None, help="write the results here")
    add_engine_args(p)  # its --seed also seeds the prompts


def _counter(engine: LLMEngine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(
        f"jaxserve:{name}_total", {"model_name": engine.model_name}) or 0.0


def run_once(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Submit ``prompts`` at once and step until idle; this run's counters and TTFTs (ms)."""
    prompt_before = _counter(engine, "prompt_tokens")
    hits_before = _counter(engine, "prefix_cache_hits")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for ids in prompts:
        engine.add_request(engine.next_request_id(), ids, params)
    ttfts, steps = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                m = out.metrics
                ttfts.append(1e3 * (m["first_token_time"] - m["arrival_time"]))
        steps += 1
    return {"prefill_tokens": int(_counter(engine, "prompt_tokens") - prompt_before),
            "prefix_cache_hit_tokens": int(_counter(engine, "prefix_cache_hits") - hits_before),
            "median_ttft_ms": statistics.median(ttfts), "p99_ttft_ms": percentile(ttfts, 0.99),
            "wall_s": time.perf_counter() - t0, "num_steps": steps, "ttfts_ms": ttfts}


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``jaxserve bench prefix-cache``; returns the exit status.

    Raises:
      ValueError: bad flags.
    """
    if ns.num_requests < 1 or ns.system_len < 1 or ns.max_tokens < 1:
        raise ValueError("--num-requests, --system-len and --max-tokens must be >= 1")
    if not 1 <= ns.question_min <= ns.question_max:
        raise ValueError("need 1 <= --question-min <= --question-max")
    if getattr(ns, "max_model_len", None) is None:
        ns.max_model_len = ns.system_len + ns.question_max + ns.max_tokens + 16
    cfg = engine_config_from_args(ns)
    result: dict[str, Any] = {"num_requests": ns.num_requests, "system_len": ns.system_len,
                              "question_len": [ns.question_min, ns.question_max],
                              "max_tokens": ns.max_tokens, "seed": cfg.seed}
    for key, caching in SETTINGS:
        load = LoadConfig(ns.model, ns.load_format)
        engine = LLMEngine(cfg.replace(enable_prefix_caching=caching), load,
                           metrics=EngineMetrics(served_name(load)))
        engine.warmup(progress=False)
        rng = np.random.default_rng(cfg.seed)  # the same prompts for both settings
        lo, hi = 100, engine.tokenizer.vocab_size
        system = rng.integers(lo, hi, ns.system_len).tolist()
        prompts = [system + rng.integers(lo, hi, int(rng.integers(
            ns.question_min, ns.question_max + 1))).tolist() for _ in range(ns.num_requests)]
        run_once(engine, [rng.integers(lo, hi, ns.system_len).tolist()], ns.max_tokens)
        result["model"] = engine.model_name
        result[key] = run_once(engine, prompts, ns.max_tokens)
        del engine
    result["prefill_ratio_on_over_off"] = (result["prefix_caching_on"]["prefill_tokens"]
                                           / result["prefix_caching_off"]["prefill_tokens"])
    print(format_table(result), flush=True)
    write_json(ns.output_json, result)
    return 0


def format_table(result: dict[str, Any]) -> str:
    """Caching off and on side by side, then the prefill ratio."""
    lines = [(f"{result['model']}: {result['num_requests']} requests, a {result['system_len']}"
             f"-token system prompt and {result['question_len'][0]}-{result['question_len'][1]} "
             f"own tokens each"),
             (f"{'':20}{'prefill tok':>12}{'cache hits':>11}{'TTFT p50 ms':>12}"
             f"{'TTFT p99 ms':>12}{'wall s':>8}")]
    for key, _ in SETTINGS:
        r = result[key]
        lines.append(f"{key:20}{r['prefill_tokens']:>12}{r['prefix_cache_hit_tokens']:>11}"
                     f"{r['median_ttft_ms']:>12.1f}{r['p99_ttft_ms']:>12.1f}{r['wall_s']:>8.2f}")
    lines.append(f"prefill tokens on / off: {result['prefill_ratio_on_over_off']:.3f}")
    return "\n".join(lines)
