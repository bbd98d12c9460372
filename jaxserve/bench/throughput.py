"""``jaxserve bench throughput``: offline engine throughput, continuous against static batching.

    jaxserve bench throughput --dataset-name sharegpt-like --num-prompts 128 --max-num-seqs 32 \\
        --kv-cache-memory-gib 4 --output-json results/throughput.json

One in-process ``LLMEngine`` (loaded and compiled once) runs the same workload twice, all
requests present at the start (offline, as ``vllm bench throughput``), every request generating
exactly its output length (EOS ignored), sampled with its own seed:
  continuous  the engine itself: requests join and leave the batch at every step;
  static      ``StaticBatchEngine`` (static_batch.py) on the same runner: batches of
              ``max_num_seqs`` in arrival order, padded prompts, rows held to the batch's end.
Both report elapsed time, process CPU time, requests/s, output tokens/s and total tokens/s; static adds its token
accounting and a time decomposition of its loss: each phase's time is shared out in proportion to
token slots, so ``padding_s = prefill_s * prefill_padding / prefill_slots`` and
``idle_slots_s = decode_s * decode_idle / decode_slots``. How much of the continuous-over-static
gap those explain is printed beside the gap itself. Figures include host time (Python scheduling,
packing), as a server's would.

Each mode's useful work is also given as model FLOP/s and as a fraction of this device's float32
matmul rate (a ``--matmul-ceiling-size``-cubed dot, measured here). Model FLOPs count 2 x the
linear-layer parameters per processed token (every prompt token and every output token but the
last), 2 x hidden x vocab per output token (the LM head), and 4 x context x heads x head_dim per
token and layer (attention scores and values); static batching's padding is not useful work.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.bench.datasets import SampleRequest
from jaxserve.bench.serve import add_dataset_args, build_workload
from jaxserve.bench.static_batch import StaticBatchEngine, StaticRequest
from jaxserve.config import LoadConfig
from jaxserve.config_args import add_engine_args, engine_config_from_args
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

MODES = ("both", "continuous", "static")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``jaxserve bench throughput``'s flags: model, workload, run and engine flags."""
    a = p.add_argument
    a("--model", default=None, help="a GGUF file, or a built-in config with --load-format dummy "
                                    "(default: SmolLM2-135M-Instruct)")
    a("--load-format", default="auto", choices=["auto", "gguf", "dummy"],
      help="dummy: random weights of a built-in config")
    a("--config", default=None, help="YAML file with engine settings (flag names)")
    add_dataset_args(p, num_prompts=128)
    a("--mode", default="both", choices=MODES, help="which batching modes to run")
    a("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    a("--matmul-ceiling-size", type=int, default=2048,
      help="N of the float32 N x N x N dot whose measured rate is the ceiling")
    a("--output-json", default=None, help="write the results here")
    add_engine_args(p)  # its --seed also seeds the workload and the requests' sampling


def _requests(samples: list[SampleRequest], temperature: float, seed: int
              ) -> list[StaticRequest]:
    out = []
    for i, s in enumerate(samples):
        if not isinstance(s.prompt, list):
            raise ValueError("bench throughput needs token-id prompts")
        out.append(StaticRequest(list(s.prompt), s.expected_output_len, temperature,
                                 seed * 1_000_003 + i))
    return out


def run_continuous(engine: LLMEngine, requests: list[StaticRequest]) -> tuple[float, list[list[int]]]:
    """All ``requests`` into ``engine`` at once, stepped until done; returns (elapsed s, the
    generated ids in request order)."""
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"tput-{i}", r.prompt_token_ids, SamplingParams(
            max_tokens=r.num_output_tokens, ignore_eos=True, temperature=r.temperature,
            seed=r.seed, skip_special_tokens=False))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    return elapsed, [outs[f"tput-{i}"] for i in range(len(requests))]


def matmul_ceiling_gflops(n: int, reps: int = 5) -> float:
    """Measured float32 ``[n, n] @ [n, n]`` rate of the default device, in GFLOP/s."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        f(a).block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def model_flops(mc: Any, requests: list[StaticRequest]) -> float:
    """The useful FLOPs of generating ``requests`` with a model of config ``mc`` (see the
    module docstring for what is counted)."""
    linear = mc.num_layers * (mc.hidden_size * mc.head_dim * (2 * mc.num_heads
                                                               + 2 * mc.num_kv_heads)
                              + 3 * mc.hidden_size * mc.intermediate_size)
    lengths = [len(r.prompt_token_ids) + r.num_output_tokens for r in requests]
    num_out = sum(r.num_output_tokens for r in requests)
    # a request of n tokens processes n - 1 of them, attending to 1 .. n - 1 positions
    attn = 4 * mc.num_heads * mc.head_dim * mc.num_layers * sum(n * (n - 1) // 2 for n in lengths)
    return (2 * linear * (sum(lengths) - len(requests)) + 2 * mc.hidden_size * mc.vocab_size
            * num_out + attn)


def _rates(elapsed: float, num_requests: int, num_input: int, num_output: int) -> dict[str, Any]:
    return {"elapsed_time": elapsed, "num_requests": num_requests,
            "total_num_tokens": num_input + num_output, "total_output_tokens": num_output,
            "requests_per_second": num_requests / elapsed,
            "tokens_per_second": (num_input + num_output) / elapsed,
            "output_tokens_per_second": num_output / elapsed}


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``jaxserve bench throughput``; returns the exit status.

    Raises:
      ValueError: bad flags, or a static batch that does not fit the KV cache.
    """
    if ns.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if ns.dataset_name == "trace":
        raise ValueError("bench throughput is offline: every request is present at the start; "
                         "use random, sharegpt-like, a profile (chat-like, ...) or prefix")
    cfg = engine_config_from_args(ns)
    ns.seed = cfg.seed
    samples, _ = build_workload(ns, chat=False)
    requests = _requests(samples, ns.temperature, cfg.seed)
    engine = LLMEngine(cfg, LoadConfig(ns.model, ns.load_format))
    warm = engine.warmup(progress=True)
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    num_out = sum(r.num_output_tokens for r in requests)
    result: dict[str, Any] = {
        "model": engine.model_name, "dataset_name": ns.dataset_name,
        "num_prompts": len(requests), "seed": ns.seed, "temperature": ns.temperature,
        "engine_config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "num_kv_blocks": engine.num_blocks, "compile_s": warm["compile_s"],
        "total_input_tokens": num_in, "total_output_tokens": num_out,
        "model_flops": model_flops(engine.model_config, requests),
        "matmul_ceiling_gflops": matmul_ceiling_gflops(ns.matmul_ceiling_size),
    }
    static = StaticBatchEngine(engine)
    if ns.mode in ("both", "static"):
        static.check(requests)  # fail now, not after the continuous run
    cont_out = static_out = None
    if ns.mode in ("both", "continuous"):
        cpu0 = time.process_time()
        elapsed, cont_out = run_continuous(engine, requests)
        result["continuous"] = {**_rates(elapsed, len(requests), num_in, num_out),
                                "process_cpu_s": time.process_time() - cpu0}
    if ns.mode in ("both", "static"):
        cpu0 = time.process_time()
        st = static.run(requests)
        static_cpu_s = time.process_time() - cpu0
        static_out = st.outputs
        elapsed = st.prefill_s + st.decode_s
        padding_s = st.prefill_s * st.prefill_padding / max(st.prefill_slots, 1)
        idle_s = st.decode_s * st.decode_idle / max(st.decode_slots, 1)
        result["static"] = {
            **_rates(elapsed, len(requests), num_in, num_out),
            "process_cpu_s": static_cpu_s,
            "num_batches": st.num_batches, "num_prefill_steps": st.num_prefill_steps,
            "num_decode_steps": st.num_decode_steps,
            "prefill_slots": st.prefill_slots, "prefill_padding_tokens": st.prefill_padding,
            "decode_slots": st.decode_slots, "decode_idle_slots": st.decode_idle,
            "prefill_s": st.prefill_s, "decode_s": st.decode_s,
            "padding_s": padding_s, "idle_slots_s": idle_s,
        }
    for m in MODES[1:]:
        if m in result:
            r = result[m]
            r["model_gflops_per_s"] = result["model_flops"] / r["elapsed_time"] / 1e9
            r["fraction_of_ceiling"] = r["model_gflops_per_s"] / result["matmul_ceiling_gflops"]
    if cont_out is not None and static_out is not None:
        c, s = result["continuous"], result["static"]
        gap = s["elapsed_time"] - c["elapsed_time"]
        result["speedup_output_tokens_per_second"] = (c["output_tokens_per_second"]
                                                      / s["output_tokens_per_second"])
        result["gap_s"] = gap
        result["outputs_identical_fraction"] = sum(
            a == b for a, b in zip(cont_out, static_out)) / len(requests)
    print(format_table(result), flush=True)
    if ns.output_json:
        os.makedirs(os.path.dirname(ns.output_json) or ".", exist_ok=True)
        with open(ns.output_json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
        print(f"Saved result to {ns.output_json}")
    return 0


def format_table(result: dict[str, Any]) -> str:
    """Both modes side by side, then static batching's loss decomposition."""
    modes = [m for m in ("continuous", "static") if m in result]
    lines = [(f"{result['num_prompts']} requests ({result['dataset_name']}), "
             f"{result['total_input_tokens']} prompt + {result['total_output_tokens']} output "
             f"tokens, max_num_seqs {result['engine_config']['max_num_seqs']}"),
             (f"{'mode':<12}{'elapsed s':>10}{'cpu s':>9}{'req/s':>9}{'out tok/s':>11}"
              f"{'tot tok/s':>11}{'GFLOP/s':>9}{'of ceiling':>11}")]
    for m in modes:
        r = result[m]
        lines.append(f"{m:<12}{r['elapsed_time']:>10.2f}{r.get('process_cpu_s', 0.0):>9.1f}"
                     f"{r['requests_per_second']:>9.3f}"
                     f"{r['output_tokens_per_second']:>11.1f}{r['tokens_per_second']:>11.1f}"
                     f"{r['model_gflops_per_s']:>9.1f}{r['fraction_of_ceiling']:>11.1%}")
    lines.append(f"float32 matmul ceiling {result['matmul_ceiling_gflops']:.1f} GFLOP/s")
    if "static" in result:
        s = result["static"]
        pad = s["prefill_padding_tokens"] / max(s["prefill_slots"], 1)
        idle = s["decode_idle_slots"] / max(s["decode_slots"], 1)
        lines.append(
            f"static: {s['num_batches']} batches; prefill {s['prefill_slots']} token slots, "
            f"{s['prefill_padding_tokens']} padding ({pad:.0%}), {s['prefill_s']:.2f} s; "
            f"decode {s['decode_slots']} row slots, {s['decode_idle_slots']} idle ({idle:.0%}), "
            f"{s['decode_s']:.2f} s")
        lines.append(f"static time lost to padding ~{s['padding_s']:.2f} s, to idle slots "
                     f"~{s['idle_slots_s']:.2f} s")
    if "speedup_output_tokens_per_second" in result:
        lines.append(f"continuous / static output tok/s: "
                     f"{result['speedup_output_tokens_per_second']:.2f}x (gap "
                     f"{result['gap_s']:.2f} s); identical outputs: "
                     f"{result['outputs_identical_fraction']:.0%}")
    return "\n".join(lines)
