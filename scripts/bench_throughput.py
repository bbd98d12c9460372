"""Offline throughput: a random workload batched vs one request at a time, against the measured
float32 matmul ceiling of this machine.

Workload (fixed seed): N prompts of random token ids, input lengths uniform in [in_min, in_max],
output lengths uniform in [out_min, out_max], ``ignore_eos``, greedy. Batched: all submitted at
once with ``max_num_seqs``; sequential: the first ``--sequential-prompts`` of them one at a time.

Model FLOPs per step are counted as 2 x (linear-layer params) per processed token, plus
2 x hidden x vocab per sampled token (lm head), plus 4 x context x heads x head_dim per token and
layer (attention scores and values); "fraction of ceiling" divides their rate by the float32
matmul rate measured here with a 2048^3 dot.

Usage: .venv/bin/python scripts/bench_throughput.py [--num-prompts 64] [--out results/throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def matmul_ceiling_gflops(n: int = 2048, reps: int = 5) -> float:
    """Measured float32 matmul rate (GFLOP/s) of the default device."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        f(a).block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


def workload(n: int, in_rng: tuple[int, int], out_rng: tuple[int, int], vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    ins = rng.integers(in_rng[0], in_rng[1] + 1, n)
    outs = rng.integers(out_rng[0], out_rng[1] + 1, n)
    return [(rng.integers(100, vocab - 100, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def run(engine, reqs) -> dict[str, float]:
    from jaxserve.sampling_params import SamplingParams

    mc = engine.model_config
    linear = mc.num_layers * (mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
                              + 3 * mc.hidden_size * mc.intermediate_size)
    t0 = time.perf_counter()
    for i, (ids, out_len) in enumerate(reqs):
        engine.add_request(f"b{i}-{time.perf_counter_ns()}", ids,
                           SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    n_in = sum(len(i) for i, _ in reqs)
    n_out = sum(o for _, o in reqs)
    attn = sum(sum(4 * c * mc.num_heads * mc.head_dim * mc.num_layers
                   for c in range(1, len(i) + o)) for i, o in reqs)
    flops = 2 * linear * (n_in + n_out - len(reqs)) + 2 * mc.hidden_size * mc.vocab_size * n_out \
        + attn
    return {"seconds": dt, "steps": steps, "input_tokens": n_in, "output_tokens": n_out,
            "output_tokens_per_s": n_out / dt, "total_tokens_per_s": (n_in + n_out) / dt,
            "model_gflops_per_s": flops / dt / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--sequential-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 512])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/throughput.json")
    a = p.parse_args()

    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    ceiling = matmul_ceiling_gflops()
    engine = LLMEngine(EngineConfig(max_model_len=1024, max_num_seqs=a.max_num_seqs,
                                    max_num_batched_tokens=a.max_num_batched_tokens))
    engine.warmup(progress=False)
    reqs = workload(a.num_prompts, tuple(a.input_len), tuple(a.output_len),
                    engine.tokenizer.vocab_size, a.seed)
    run(engine, reqs[:2])  # touch every code path once
    batched = run(engine, reqs)
    seq = [run(engine, [r]) for r in reqs[:a.sequential_prompts]]
    sequential = {
        "seconds": sum(s["seconds"] for s in seq),
        "output_tokens": sum(s["output_tokens"] for s in seq),
        "input_tokens": sum(s["input_tokens"] for s in seq),
    }
    sequential["output_tokens_per_s"] = sequential["output_tokens"] / sequential["seconds"]
    sequential["total_tokens_per_s"] = (sequential["output_tokens"] + sequential["input_tokens"]) \
        / sequential["seconds"]
    sequential["model_gflops_per_s"] = sum(s["model_gflops_per_s"] * s["seconds"] for s in seq) \
        / sequential["seconds"]
    result = {
        "device": str(jax.devices()[0]), "matmul_ceiling_gflops": ceiling,
        "config": vars(a), "batched": batched, "sequential": sequential,
        "batched_fraction_of_ceiling": batched["model_gflops_per_s"] / ceiling,
        "sequential_fraction_of_ceiling": sequential["model_gflops_per_s"] / ceiling,
        "batched_over_sequential_output_tps": batched["output_tokens_per_s"]
        / sequential["output_tokens_per_s"],
    }
    print(f"{'':12}{'out tok/s':>10}{'all tok/s':>10}{'GFLOP/s':>9}{'of ceiling':>11}")
    for name in ("batched", "sequential"):
        r = result[name]
        print(f"{name:12}{r['output_tokens_per_s']:10.1f}{r['total_tokens_per_s']:10.1f}"
              f"{r['model_gflops_per_s']:9.1f}{result[name + '_fraction_of_ceiling']:11.1%}")
    print(f"matmul ceiling {ceiling:.1f} GFLOP/s; batched/sequential output tok/s "
          f"{result['batched_over_sequential_output_tps']:.2f}x")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
