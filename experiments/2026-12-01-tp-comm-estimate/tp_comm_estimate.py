"""Tensor-parallel communication per token, read from the compiled, sharded step (no GPU).

For each model and TP size the engine's decode step is compiled for simulated CPU devices with
abstract (never allocated) bf16 params and KV cache, exactly as the engine shards them
(jaxserve.sharding). The collectives XLA's SPMD partitioner inserted are read from the HLO: those
in the layer loop's body run once per layer, the rest once per step. From their shapes:

- bytes per token per layer that each all-reduce carries (payload);
- the time a ring all-reduce of that payload takes at NVLink 4 bandwidth: every device sends and
  receives ``2 (N-1)/N`` times the payload (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce
  algorithms"), over 450 GB/s each way per H100/H200 (900 GB/s bidirectional);
- against the compute per token per layer on one device: ``2 * params_per_layer / N`` FLOPs at
  989 TFLOP/s (H100/H200 SXM dense bf16), and the weight read time per layer per device at
  4.8 TB/s HBM (H200), which bounds a small-batch decode step.

This is a paper estimate: it ignores all-reduce latency (microseconds per hop, which dominates
at small batch) and overlap. Usage:
  python experiments/2026-12-01-tp-comm-estimate/tp_comm_estimate.py [--batch 64] [--json results/tp_comm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxserve import sharding
from jaxserve.device.runner import ModelRunner
from models.config import builtin_config
from models.llama import LlamaForCausalLM
from pallas_kernels import KVCache, ragged_paged_attention

NVLINK_ONE_WAY_BPS = 450e9
BF16_FLOPS = 989e12
HBM_BPS = 4.8e12


def _collectives(text: str) -> dict[str, list[tuple[str, int, str]]]:
    """{computation: [(op, payload elements, HLO shape)]} for every collective in the HLO."""
    out: dict[str, list[tuple[str, int]]] = {}
    comp = ""
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            comp = m.group(1)
        m = re.search(r"= (\(?[^=]*?)\s*(all-reduce|all-gather|all-to-all|reduce-scatter|"
                      r"collective-permute)(-start)?\(", line)
        if m:
            shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
            elems = sum(eval_dims(dims) for _, dims in shapes)
            out.setdefault(comp, []).append(
                (m.group(2), elems, " ".join(f"{dt}[{d}]" for dt, d in shapes)))
    return out


def eval_dims(dims: str) -> int:
    n = 1
    for d in dims.split(","):
        if d:
            n *= int(d)
    return n


def measure(name: str, tp: int, batch: int) -> dict:
    cfg0 = builtin_config(name)
    cfg = sharding.sharded_config(cfg0, tp)
    mesh = sharding.make_mesh(tp)
    model = LlamaForCausalLM(cfg, jnp.bfloat16,
                             attention_fn=sharding.shard_attention(ragged_paged_attention, mesh))
    shapes = model.param_shapes()
    specs = sharding.param_partition_specs(shapes, cfg)
    params = jax.tree_util.tree_map(
        lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, p)),
        shapes, specs)
    kv_shape = (cfg.num_layers, 64, 16, cfg.num_kv_heads, cfg.head_dim)
    kv_s = NamedSharding(mesh, sharding.kv_cache_spec())
    kv = KVCache(jax.ShapeDtypeStruct(kv_shape, jnp.bfloat16, sharding=kv_s),
                 jax.ShapeDtypeStruct(kv_shape, jnp.bfloat16, sharding=kv_s))
    runner = ModelRunner(model, params, kv, max_num_batched_tokens=batch, max_num_seqs=batch,
                         max_blocks_per_seq=8, mesh=mesh)
    runner.buckets = [b for b in runner.buckets if b.num_tokens == batch]  # the decode bucket
    runner.warmup(progress=False)
    text = runner.compiled[runner.buckets[0]].as_text()
    coll = _collectives(text)
    h = cfg.hidden_size
    body = [ops for ops in coll.values() if sum(n == batch * h for _, n, _ in ops) >= 2]
    if len(body) != 1:
        raise RuntimeError(f"could not find the layer body's collectives: {coll}")
    per_layer = body[0]
    per_step = [op for ops in coll.values() if ops is not body[0] for op in ops]
    # bytes as the GPU program sends them: activations in bf16 (the CPU compiler runs bf16
    # arithmetic, collectives included, in f32, so the HLO here shows f32 shapes)
    layer_payload_per_token = 2 * sum(n for _, n, _ in per_layer) / batch
    ring = 2 * (tp - 1) / tp
    comm_s = ring * layer_payload_per_token / NVLINK_ONE_WAY_BPS
    layer_params = (h * cfg.head_dim * (2 * cfg0.num_heads + 2 * cfg0.num_kv_heads)
                    + 3 * h * cfg.intermediate_size)
    flops_s = 2 * layer_params / tp / BF16_FLOPS
    weight_read_s = 2 * layer_params / tp / HBM_BPS
    return {
        "model": name, "tp": tp, "batch_tokens": batch,
        "layer_collectives": [f"{op} {shape}" for op, _, shape in per_layer],
        "step_collectives": [f"{op} {shape}" for op, _, shape in per_step],
        "layer_bytes_per_token": layer_payload_per_token,
        "ring_traffic_bytes_per_token_per_device": ring * layer_payload_per_token,
        "comm_us_per_token_per_layer": comm_s * 1e6,
        "compute_us_per_token_per_layer": flops_s * 1e6,
        "comm_over_compute": comm_s / flops_s,
        "weight_read_us_per_layer_per_step": weight_read_s * 1e6,
        "comm_us_per_layer_at_batch": comm_s * batch * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="decode tokens per step")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    rows = []
    print(f"{'model':15} {'tp':>3} {'B/tok/layer':>12} {'comm us/tok':>12} "
          f"{'compute us/tok':>15} {'comm/compute':>13} {'comm us/layer@B':>16} "
          f"{'wt read us/layer':>17}")
    for name in ("llama-3.1-8b", "llama-3.1-70b"):
        for tp in (2, 4, 8):
            r = measure(name, tp, args.batch)
            rows.append(r)
            print(f"{name:15} {tp:>3} {r['layer_bytes_per_token']:>12.0f} "
                  f"{r['comm_us_per_token_per_layer']:>12.4f} "
                  f"{r['compute_us_per_token_per_layer']:>15.4f} "
                  f"{r['comm_over_compute']:>13.2f} {r['comm_us_per_layer_at_batch']:>16.2f} "
                  f"{r['weight_read_us_per_layer_per_step']:>17.2f}")
            print(f"    per layer: {r['layer_collectives']}; per step: {r['step_collectives']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
