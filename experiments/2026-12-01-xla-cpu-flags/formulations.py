"""A/B of matmul formulations in the served step (``jaxserve bench step``'s measurement).

    python experiments/2026-12-01-xla-cpu-flags/formulations.py --form fused_qkv_mlp OUT.json

Forms (patched into models.llama for this process only):
  base            the model as it is
  fused_qkv_mlp   [wq|wk|wv] and [w_gate|w_up] concatenated once after loading: 2 matmuls per
                  layer instead of 5
  lm_head_halves  the tied LM head as one batched dot over the two vocabulary halves of the
                  embedding (a free reshape of it, no copy)
  both            fused_qkv_mlp and lm_head_halves
Decode at batch 1, 16 and 64 after 64-token prompts (512-token prefill steps); wall and process
CPU ms per step.
"""
from __future__ import annotations

import argparse
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench import step as bench_step
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from models import llama
from models.quant import qmatmul


class FusedDecoderLayer(llama.DecoderLayer):
    @nn.compact
    def __call__(self, carry, consts):
        x, k_cache, v_cache, layer = carry
        md, cos, sin, scales = consts
        cfg, dt = self.cfg, self.dtype
        h, nq, nkv, hd, i = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size)
        t = x.shape[0]
        p = lambda name, shape: self.param(name, nn.initializers.normal(0.02), shape, dt)
        y = llama.RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        qkv = qmatmul(y, p("wqkv", (h, (nq + 2 * nkv) * hd)))
        q, k, v = jnp.split(qkv, [nq * hd, (nq + nkv) * hd], axis=-1)
        q = llama.apply_rope(q.reshape(t, nq, hd), cos, sin)
        k = llama.apply_rope(k.reshape(t, nkv, hd), cos, sin)
        v = v.reshape(t, nkv, hd)
        kw = llama.kv_scale_kwargs(scales)
        k_cache, v_cache = llama.write_kv(k_cache, v_cache, layer, k, v, md.slot_mapping, **kw)
        attn = self.attention_fn(
            q, k_cache, v_cache, layer, md.block_tables, md.seq_lens, md.query_start_loc,
            md.num_seqs, sm_scale=hd ** -0.5, sliding_window=cfg.sliding_window, **kw)
        x = x + qmatmul(attn.reshape(t, nq * hd).astype(dt), p("wo", (nq * hd, h)))
        y = llama.RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
        gu = qmatmul(y, p("w_gate_up", (h, 2 * i)))
        x = x + qmatmul(jax.nn.silu(gu[:, :i]) * gu[:, i:], p("w_down", (i, h)))
        return (x, k_cache, v_cache, layer + 1), None


def fuse(params):
    lay = dict(params["layers"])
    lay["wqkv"] = jnp.concatenate([lay.pop("wq"), lay.pop("wk"), lay.pop("wv")], axis=-1)
    lay["w_gate_up"] = jnp.concatenate([lay.pop("w_gate"), lay.pop("w_up")], axis=-1)
    return {**params, "layers": lay}


def logits_halves(self, hidden):
    h = hidden.astype(self.dtype)
    v, d = self.embed.shape
    y = jnp.einsum("mk,bnk->mbn", h, self.embed.reshape(2, v // 2, d))
    return y.reshape(h.shape[0], v).astype(jnp.float32)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--form", default="base",
                   choices=["base", "fused_qkv_mlp", "lm_head_halves", "both"])
    p.add_argument("--num-steps", type=int, default=8)
    p.add_argument("out", nargs="?")
    a = p.parse_args()
    if a.form in ("lm_head_halves", "both"):
        llama.LlamaModel.logits = logits_halves
    batches = [1, 16, 64]
    cfg = EngineConfig(max_num_seqs=64, max_model_len=64 + a.num_steps + 18,
                       compilation_cache_dir="/tmp/xc/cache", enable_prefix_caching=False)
    engine = LLMEngine(cfg, LoadConfig(None, "auto"))
    if a.form in ("fused_qkv_mlp", "both"):
        llama.DecoderLayer = FusedDecoderLayer
        engine.runner.params = fuse(engine.runner.params)
    warm = engine.warmup(progress=False)
    timer, masks = bench_step._ExecuteTimer(engine.runner), bench_step._MaskTimer(engine)
    rng = np.random.default_rng(0)
    rows = {}
    for b in batches:
        r = bench_step.measure(engine, timer, masks, "greedy", b, 64, a.num_steps, rng)
        rows[f"decode b{b}"] = r["decode"]
        for pf in r["prefill"]:
            if pf["bucket_tokens"] == 512:
                rows.setdefault("prefill 512", pf)
    # greedy continuation of one prompt: the tokens must not change with the form
    from jaxserve.sampling_params import SamplingParams
    engine.add_request("check", list(range(100, 164)), SamplingParams(temperature=0.0,
                                                                       max_tokens=12))
    toks = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                toks = list(o.outputs[0].token_ids)
    res = {"form": a.form, "compile_s": warm["compile_s"], "rows": rows, "greedy_tokens": toks}
    print(json.dumps({"form": a.form, "compile_s": round(warm["compile_s"], 1),
                      **{k: (round(v["median_step_ms"], 1), round(v["median_cpu_ms"], 1))
                         for k, v in rows.items()}, "tokens": toks}), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
