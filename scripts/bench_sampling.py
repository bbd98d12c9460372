"""Decode-step time of a full batch with and without the sampling features.

One engine (``--load-format dummy`` weights of ``--model``, default smollm2-135m: vocabulary
49152), ``--batch`` requests of ``--prompt-len`` random token ids, ``ignore_eos``; after their
prefill, every step decodes one token for each of them. For each mode the median wall time of
``engine.step()`` over ``--steps`` decode steps is reported (host work, the device program and
the token transfer, as served). Modes: ``greedy`` (temperature 0: the path requests that use
no feature take), ``sampled`` (temperature 1, top_p 0.9), ``logprobs`` (greedy + logprobs=5 on
every request), ``penalties`` (greedy + repetition 1.1, frequency 0.5 on every request),
``n4`` (batch/4 requests with n=4). ``host_bias`` is not a serving mode: it times the
alternative design for penalties that was not chosen, a ``[batch, vocab]`` count array built on
the host each step (``np.bincount`` of each row's history) and sent to the device. Modes the code under test lacks are skipped, so the same
script measures an older checkout (``PYTHONPATH=<checkout>``). Warm-up figures (programs,
compile seconds, with the persistent cache off) come first.

Usage: python scripts/bench_sampling.py [--batch 64] [--steps 20] [--out results/sampling.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", default="greedy,sampled,logprobs,penalties,n4,host_bias")
    p.add_argument("--compilation-cache-dir", default="",
                   help="persistent XLA cache for repeated runs (default: off, so the warm-up "
                        "figure is a cold compile)")
    p.add_argument("--out", default="results/sampling.json")
    a = p.parse_args()

    from jaxserve.config import EngineConfig, LoadConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(max_num_seqs=a.batch,
                                 compilation_cache_dir=a.compilation_cache_dir,
                                 max_model_len=a.prompt_len + a.steps + 16,
                                 num_kv_blocks=a.batch * 8 + 8),
                    LoadConfig(a.model, "dummy"))
    warm = eng.warmup(progress=False)
    print(f"warm-up: {int(warm['num_programs'])} programs in {warm['compile_s']:.1f} s")
    rng = np.random.default_rng(0)
    vocab = eng.tokenizer.vocab_size
    modes = {"greedy": ({"temperature": 0.0}, 1), "sampled": ({"top_p": 0.9}, 1),
             "logprobs": ({"temperature": 0.0, "logprobs": 5}, 1),
             "penalties": ({"temperature": 0.0, "repetition_penalty": 1.1,
                            "frequency_penalty": 0.5}, 1),
             "n4": ({"n": 4}, 4)}
    results = {"model": a.model, "batch": a.batch, "prompt_len": a.prompt_len,
               "num_programs": warm["num_programs"], "compile_s": warm["compile_s"],
               "step_ms": {}}
    for name in a.modes.split(","):
        if name == "host_bias":
            results["host_bias_ms"] = host_bias_ms(a.batch, eng.model_config.vocab_size,
                                                   a.prompt_len + a.steps, rng)
            print(f"host_bias  [batch, vocab] counts built on the host and sent: median "
                  f"{results['host_bias_ms']:7.2f} ms per step")
            continue
        kw, n = modes[name]
        try:
            sp = SamplingParams(max_tokens=a.steps + 4, ignore_eos=True, **kw)
        except TypeError:
            print(f"{name:10s} skipped (not supported by this checkout)")
            continue
        for i in range(a.batch // n):
            eng.add_request(f"{name}-{i}", rng.integers(0, vocab, a.prompt_len).tolist(), sp)
        while any(r.seq.num_computed_tokens < a.prompt_len for r in eng.requests.values()):
            eng.step()  # prefill (and the first token)
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        while eng.has_unfinished_requests():
            eng.step()
        ms = float(np.median(times)) * 1e3
        results["step_ms"][name] = ms
        results.setdefault("step_min_ms", {})[name] = min(times) * 1e3
        print(f"{name:10s} decode step, batch {a.batch}: median {ms:7.2f} ms "
              f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f})")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)


def host_bias_ms(batch: int, vocab: int, history: int, rng: np.random.Generator,
                 reps: int = 20) -> float:
    """Median ms to build ``i32[batch, vocab]`` token counts from ``history`` ids per row with
    numpy and put them on the device (the rejected alternative to the device penalty state)."""
    import jax

    hist = rng.integers(0, vocab, (batch, history))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        counts = np.stack([np.bincount(h, minlength=vocab).astype(np.int32) for h in hist])
        jax.device_put(counts).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


if __name__ == "__main__":
    main()
