"""Decode-step time of a batch with quantised weights: none vs int8 vs int4 vs fp8.

The device program of one decode step as the engine runs it (``model.forward`` over ``--batch``
sequences of one new token each, attending to ``--context`` cached tokens through the paged
cache, then ``compute_logits`` and a greedy argmax), jitted once per method with the params and
the KV cache donated-free inputs; each figure is the median wall time of ``--steps`` calls
(``block_until_ready``). Weights: ``--load-format dummy`` weights of ``--model`` (default
smollm2-135m) in ``--dtype``, quantised as ``jaxserve serve --quantization`` does. Memory of
the params (``models.quant.param_bytes``) is reported beside each row. Needs jax, flax and
numpy only, so it also runs on a GPU machine without the server's dependencies.

Usage: python scripts/bench_quant.py [--batch 64] [--context 128] [--steps 20]
           [--methods none,int8,int4,fp8] [--quantize-embeddings] [--out results/quant.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

# runnable as a plain script from anywhere (a GPU machine has no install of this package)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=128, help="cached tokens per sequence")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--methods", default="none,int8,int4,fp8")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--quantize-embeddings", action="store_true")
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 elsewhere")
    p.add_argument("--out", default="results/quant.json")
    a = p.parse_args()

    import jax
    import jax.numpy as jnp

    from models import quant
    from models.architectures import DECODER_QUANT_TARGETS
    from models.config import builtin_config
    from models.interface import AttentionMetadata
    from models.loader import dummy_params
    from models.registry import get_architecture
    from pallas_kernels import allocate_kv_cache

    dtype = jnp.dtype(a.dtype if a.dtype != "auto" else
                      ("float32" if jax.default_backend() == "cpu" else "bfloat16"))
    cfg = builtin_config(a.model)
    model = get_architecture(cfg.architecture).model(cfg, dtype)
    bs = 16
    blocks_per_seq = -(-(a.context + 1) // bs)
    num_blocks = 1 + a.batch * blocks_per_seq
    kv = allocate_kv_cache(cfg.num_layers, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, dtype)
    tables = 1 + np.arange(a.batch * blocks_per_seq, dtype=np.int32).reshape(a.batch, -1)
    pos = np.full(a.batch, a.context, np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(tables[:, a.context // bs] * bs + a.context % bs),
        block_tables=jnp.asarray(tables), seq_lens=jnp.asarray(pos + 1),
        query_start_loc=jnp.arange(a.batch + 1, dtype=jnp.int32),
        num_seqs=jnp.asarray([a.batch], jnp.int32))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, a.batch), jnp.int32)

    @jax.jit
    def step(params, kv, tokens):
        hidden, kv = model.forward(params, tokens, jnp.asarray(pos), kv, md)
        return kv, jnp.argmax(model.compute_logits(params, hidden), axis=-1)

    results = {"model": a.model, "dtype": str(dtype), "backend": jax.default_backend(),
               "batch": a.batch, "context": a.context, "group_size": a.group_size,
               "quantize_embeddings": a.quantize_embeddings, "rows": []}
    print(f"{a.model} {dtype} on {jax.default_backend()}: decode step of {a.batch} sequences "
          f"at context {a.context}")
    print(f"{'method':8s} {'median ms':>10s} {'min ms':>8s} {'compile s':>10s} "
          f"{'params MiB':>11s} {'quantised/f32':>14s}")
    for method in a.methods.split(","):
        params = dummy_params(model, 0)
        qcfg = quant.QuantConfig(method, a.group_size, a.quantize_embeddings and
                                 method != "none")
        params = quant.quantize_params(params, DECODER_QUANT_TARGETS, qcfg, delete_source=True)
        mem = quant.param_bytes(params)
        t0 = time.perf_counter()
        compiled = step.lower(params, kv, tokens).compile()
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(compiled(params, kv, tokens))
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            jax.block_until_ready(compiled(params, kv, tokens))
            times.append(time.perf_counter() - t)
        row = {"method": method, "median_ms": float(np.median(times)) * 1e3,
               "min_ms": min(times) * 1e3, "compile_s": compile_s, **mem}
        results["rows"].append(row)
        print(f"{method:8s} {row['median_ms']:10.2f} {row['min_ms']:8.2f} {compile_s:10.1f} "
              f"{mem['total_bytes'] / 2**20:11.1f} {mem['quantized_ratio']:14.4f}", flush=True)
        del params, compiled
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
