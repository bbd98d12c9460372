"""Quality and speed of the 8-bit KV cache: perplexity per ``kv_cache_dtype`` / scale mode, and
the decode step time at batch 64.

1. Perplexity of a model (default: SmolLM2-135M-Instruct, float32 on the CPU) over the first
   ``--num-tokens`` tokens of ``jaxserve/data/pride_and_prejudice_ch1-12.txt``, through the
   engine (``SamplingParams(prompt_logprobs=1, max_tokens=1)``: the logprob and the top-1 token
   at every prompt position), for each configuration of ``--configs``:
   ``auto`` (the float cache), ``fp8`` / ``int8`` with calibrated scales (``...@P``: calibrated
   at percentile P; ``fp8x4``: with headroom 4, see ``kv_calibration.HEADROOM``), ``fp8-unit`` /
   ``int8-unit`` (every scale 1.0). Per row: ppl, delta vs auto
   in %, max / mean |delta logprob| of the prompt tokens and the top-1 agreement with auto.
2. Decode step time (``--decode-batch`` sequences at ``--decode-context`` tokens, one token each)
   through ``ModelRunner`` with the float and the fp8 cache, median of ``--decode-steps`` steps.

Prints a table and writes JSON (``--output``). On a shared, loaded machine the timings are noisy;
the perplexities are not.
Usage: python experiments/2026-12-01-kv-quant-scales/kv_quant.py [--configs auto,fp8,int8,fp8-unit,int8-unit]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np

TEXT = os.path.join(ROOT, "jaxserve", "cli", "bench", "data", "pride_and_prejudice_ch1-12.txt")


def parse_config(name: str) -> tuple[dict, float | None]:
    """``auto`` | ``fp8`` | ``int8`` | ``fp8-unit`` | ``int8-unit`` | ``fp8@99.9`` (calibrated
    at that percentile) | ``fp8x4`` (calibration headroom 4) -> (EngineConfig fields,
    headroom or None)."""
    base, _, pct = name.partition("@")
    base, _, headroom = base.partition("x")
    dtype, _, mode = base.partition("-")
    fields = {"kv_cache_dtype": dtype}
    if mode:
        if mode != "unit":
            raise ValueError(f"config {name!r}: the suffix after '-' can only be 'unit'")
        fields["kv_scale_mode"] = "unit"
    if pct:
        fields["kv_calibration_percentile"] = float(pct)
    return fields, (float(headroom) if headroom else None)


def prompt_logprobs(cfg_fields: dict, ids: list[int], model: str | None,
                    headroom: float | None = None) -> dict:
    from jaxserve.config import EngineConfig, LoadConfig
    from jaxserve.device import kv_calibration
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams
    from pallas_kernels.kv_cache import KV_QUANT_DTYPES

    saved = dict(kv_calibration.HEADROOM)
    if headroom is not None:  # an experiment knob, not an engine setting: patch the table
        kv_calibration.HEADROOM[KV_QUANT_DTYPES[cfg_fields["kv_cache_dtype"]]] = headroom
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(max_model_len=len(ids) + 16, num_kv_blocks=len(ids) // 16 + 8,
                                 max_num_seqs=1, max_num_batched_tokens=256,
                                 compilation_cache_dir="", **cfg_fields), LoadConfig(model=model))
    kv_calibration.HEADROOM.update(saved)
    eng.warmup(progress=False)
    setup_s = time.perf_counter() - t0
    eng.add_request("ppl", ids, SamplingParams(prompt_logprobs=1, max_tokens=1,
                                               temperature=0.0))
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out = o
    lp = np.array([d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])])
    top1 = np.array([next(iter(d)) for d in out.prompt_logprobs[1:]])
    res = {"logprobs": lp, "top1": top1, "kv_bytes_per_token": eng.kv_layout.bytes_per_token,
           "setup_s": setup_s, "summary": eng.kv_cache_summary()}
    del eng
    gc.collect()
    return res


def decode_step_ms(kv_dtype: str, batch: int, context: int, steps: int) -> float:
    """Median wall time of one decode step of the dummy SmolLM2 (float32, reference attention)
    at ``batch`` x ``context`` through ``ModelRunner`` (host sync on the sampled ids)."""
    import jax.numpy as jnp

    from jaxserve.device.runner import ModelRunner, RowParams
    from models.config import builtin_config
    from models.llama import LlamaForCausalLM
    from models.loader import dummy_params
    from pallas_kernels import allocate_kv_cache
    from pallas_kernels.kv_cache import KV_QUANT_DTYPES

    cfg = builtin_config("smollm2-135m")
    bs = 16
    bps = -(-context // bs)
    model = LlamaForCausalLM(cfg, jnp.float32)
    params = dummy_params(model, 0)
    scales, dt = {}, jnp.float32
    if kv_dtype != "auto":
        dt = KV_QUANT_DTYPES[kv_dtype]
        one = np.full((cfg.num_layers, cfg.num_kv_heads), 0.05, np.float32)
        scales = {"k_scale": one, "v_scale": one}
    kv = allocate_kv_cache(cfg.num_layers, 1 + batch * bps, bs, cfg.num_kv_heads, cfg.head_dim,
                           dt, **scales)
    runner = ModelRunner(model, params, kv, max_num_batched_tokens=batch, max_num_seqs=batch,
                         max_blocks_per_seq=bps)
    bucket = runner.buckets[-1]
    runner.compile_bucket(bucket)
    rows = [RowParams(0.0, 0, 1.0, i, 0) for i in range(batch)]
    blocks = [list(range(1 + i * bps, 1 + (i + 1) * bps)) for i in range(batch)]
    times = []
    for i in range(steps + 2):
        b, packed = runner.pack_step([[100 + i]] * batch, [context - 1] * batch, blocks, rows)
        t = time.perf_counter()
        runner.execute(b, packed)
        times.append(time.perf_counter() - t)
    return float(np.median(times[2:])) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    p.add_argument("--configs", default="auto,fp8,int8,fp8-unit,int8-unit")
    p.add_argument("--num-tokens", type=int, default=2048)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=10)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-ppl", action="store_true")
    p.add_argument("--output", default="results/kv_quant.json")
    a = p.parse_args()

    from jaxserve.loading.model_files import default_gguf_path
    from jaxserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(a.model or default_gguf_path())
    with open(TEXT, encoding="utf-8") as fh:
        ids = tok.encode(fh.read())[:a.num_tokens]
    names = [] if a.skip_ppl else [c.strip() for c in a.configs.split(",") if c.strip()]
    if names and "auto" not in names:
        names.insert(0, "auto")
    names.sort(key=lambda n: n != "auto")
    results: dict[str, dict] = {}
    rows = []
    for name in names:
        fields, headroom = parse_config(name)
        r = prompt_logprobs(fields, ids, a.model, headroom)
        results[name] = r
        base = results["auto"]
        nll = -float(np.mean(r["logprobs"]))
        d = np.abs(r["logprobs"] - base["logprobs"])
        row = {"config": name, "ppl": round(math.exp(nll), 4),
               "delta_ppl_pct": round(100 * (math.exp(nll) / math.exp(
                   -float(np.mean(base["logprobs"]))) - 1), 3),
               "max_abs_dlogprob": round(float(d.max()), 4),
               "mean_abs_dlogprob": round(float(d.mean()), 5),
               "top1_agreement": round(float(np.mean(r["top1"] == base["top1"])), 4),
               "kv_bytes_per_token": r["kv_bytes_per_token"], "setup_s": round(r["setup_s"], 1),
               "engine": r["summary"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    decode = []
    if not a.skip_decode:
        for kv in ("auto", "fp8", "int8"):
            ms = decode_step_ms(kv, a.decode_batch, a.decode_context, a.decode_steps)
            decode.append({"kv_cache_dtype": kv, "batch": a.decode_batch,
                           "context": a.decode_context, "step_ms": round(ms, 2)})
            print(json.dumps(decode[-1]), flush=True)
            gc.collect()

    print(f"\nperplexity over {len(ids)} tokens of {os.path.basename(TEXT)}")
    cols = ["config", "ppl", "delta_ppl_pct", "max_abs_dlogprob", "mean_abs_dlogprob",
            "top1_agreement", "kv_bytes_per_token"]
    print("  ".join(f"{c:>18}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>18}" for c in cols))
    for d in decode:
        print(f"decode b{d['batch']} ctx{d['context']} kv {d['kv_cache_dtype']}: "
              f"{d['step_ms']} ms/step")
    with open(a.output, "w", encoding="utf-8") as fh:
        json.dump({"num_tokens": len(ids), "text": os.path.basename(TEXT), "rows": rows,
                   "decode": decode}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
