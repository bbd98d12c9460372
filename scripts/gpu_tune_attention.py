"""Tile-size sweep of the Triton paged-attention kernel and two ``write_kv`` forms on a GPU.

Run on a lent GPU machine (jax + CUDA plugin, numpy; no network) after ``scripts/gpu_check.py``:
for decode (Llama-3.1-8B attention shapes: 32 q / 8 kv heads, head_dim 128, bf16) at a few
(batch, context) points and for one 512-token prefill chunk, every combination of ``block_k``,
``num_kv_splits``, ``num_warps``, ``num_stages`` (and ``block_q_rows`` for prefill) is timed; the
table prints each point's default configuration, its best configuration and the fraction of the
KV-read floor (decode) or of the bf16 peak (prefill) each reaches. Then ``write_kv`` as the
engine writes it (``cache.at[layer, block, offset].set``) against a scatter into the flattened
cache with ``unique_indices`` (padding rows all point into reserved block 0, whose contents are
never read, so duplicate padding indices are harmless). ``--json PATH`` writes every timing.

``--dry-run`` runs a few configurations at tiny shapes on the CPU with the kernel in interpret mode
(it checks the script, not the GPU). A deadline (``--budget-s``, default 250 s) stops the sweep
early rather than overrun.
Usage: python scripts/gpu_tune_attention.py [--dry-run] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from gpu_check import H200_BF16_TFLOPS, Report, attention_inputs, bench_s, check_bandwidth

from pallas_kernels import allocate_kv_cache, ragged_paged_attention_pallas, write_kv


def _time_config(args, d: int, interpret: bool, **knobs) -> float | str:
    fn = jax.jit(functools.partial(ragged_paged_attention_pallas, sm_scale=d ** -0.5,
                                   interpret=interpret, **knobs))
    try:
        return bench_s(fn, *args, min_iters=3, max_iters=20, min_total_s=0.05)
    except Exception as e:  # noqa: BLE001 - a config that does not launch is a result
        return f"{type(e).__name__}: {str(e)[:120]}"


def sweep(name: str, args, d: int, interpret: bool, grid: list[dict], floor_s: float,
          floor_kind: str, deadline: float, rows: list[dict]) -> None:
    """Time the default configuration and every ``grid`` entry; print default vs best."""
    results = []
    default = _time_config(args, d, interpret)
    for knobs in grid:
        if time.perf_counter() > deadline:
            print(f"  {name}: deadline reached after {len(results)} configurations", flush=True)
            break
        t = _time_config(args, d, interpret, **knobs)
        results.append((knobs, t))
        rows.append({"point": name, **knobs,
                     "ms": round(t * 1e3, 4) if isinstance(t, float) else None,
                     "error": t if isinstance(t, str) else None})
    ok = [(k, t) for k, t in results if isinstance(t, float)]
    rows.append({"point": name, "config": "default",
                 "ms": round(default * 1e3, 4) if isinstance(default, float) else None,
                 "error": default if isinstance(default, str) else None})
    line = f"{name}: default "
    line += (f"{default * 1e3:.4f} ms ({floor_s / default:.3f} of {floor_kind})"
             if isinstance(default, float) else f"error {default}")
    if ok:
        best_k, best_t = min(ok, key=lambda kt: kt[1])
        line += f"; best {best_t * 1e3:.4f} ms ({floor_s / best_t:.3f} of {floor_kind}) {best_k}"
        top = sorted(ok, key=lambda kt: kt[1])[:5]
        line += "\n    top 5: " + "; ".join(f"{t * 1e3:.4f} ms {k}" for k, t in top)
    failed = len(results) - len(ok)
    if failed:
        line += f"\n    {failed} configurations failed to compile or launch"
    print(line, flush=True)


def write_kv_flat(k_cache, v_cache, layer, k_new, v_new, slot_mapping):
    """``write_kv`` through the flattened cache with ``unique_indices=True`` (see module doc)."""
    nl, nb, bs, h, d = k_cache.shape
    idx = layer * (nb * bs) + slot_mapping
    kf = k_cache.reshape(nl * nb * bs, h, d).at[idx].set(
        k_new.astype(k_cache.dtype), unique_indices=True, mode="promise_in_bounds")
    vf = v_cache.reshape(nl * nb * bs, h, d).at[idx].set(
        v_new.astype(v_cache.dtype), unique_indices=True, mode="promise_in_bounds")
    return kf.reshape(k_cache.shape), vf.reshape(v_cache.shape)


def time_write_kv(num_tokens: int, num_layers: int, num_blocks: int, nkv: int, d: int,
                  rows: list[dict]) -> None:
    rng = np.random.default_rng(0)
    slots = jnp.asarray(rng.choice(np.arange(16, num_blocks * 16), num_tokens, replace=False)
                        .astype(np.int32))
    kn = jnp.ones((num_tokens, nkv, d), jnp.bfloat16)
    line = f"write_kv T{num_tokens} L{num_layers}:"
    for label, fn in (("at[layer, blk, off]", write_kv), ("flat unique_indices", write_kv_flat)):
        cache = allocate_kv_cache(num_layers, num_blocks, 16, nkv, d, jnp.bfloat16)
        f = jax.jit(fn, donate_argnums=(0, 1))
        k, v = f(cache.k, cache.v, jnp.int32(1), kn, kn, slots)
        jax.block_until_ready(k)
        times = []
        for i in range(20):
            t = time.perf_counter()
            k, v = f(k, v, jnp.int32(i % num_layers), kn, kn, slots)
            jax.block_until_ready(k)
            times.append(time.perf_counter() - t)
        us = float(np.median(times)) * 1e6
        rows.append({"point": f"write_kv T{num_tokens}", "form": label, "us": round(us, 1)})
        line += f"  {label} {us:.1f} us"
        del k, v, cache
    print(line, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--budget-s", type=float, default=250.0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dry = a.dry_run
    t0 = time.perf_counter()
    if not dry and jax.devices()[0].platform != "gpu":
        print("no GPU found; use --dry-run on the CPU", file=sys.stderr)
        return 2
    rep = Report(a.budget_s)
    bw = check_bandwidth(rep, (16 << 20) if dry else (4 << 30))
    nq, nkv, d = (4, 2, 16) if dry else (32, 8, 128)
    rows: list[dict] = []
    dec_grid = [{"block_k": bk, "num_kv_splits": sp, "num_warps": w, "num_stages": st}
                for bk, sp, w, st in itertools.product(
                    (16, 32) if dry else (32, 64, 128), (1, 2) if dry else (1, 2, 4, 8),
                    (4,) if dry else (4, 8), (2,) if dry else (2, 3))]
    points = [(8, 64)] if dry else [(64, 4096), (8, 4096), (256, 512), (64, 512)]
    # the budget is shared out by weight: b64 ctx4k (the goal metric) first and longest, then
    # the other decode points, prefill last; write_kv takes the last ~15 s
    weights = [3, 1, 1, 1, 1.5][:len(points)] + [1.5]
    unit = (a.budget_s - (time.perf_counter() - t0) - 15) / sum(weights)
    deadline = time.perf_counter()
    for i, (batch, ctx) in enumerate(points):
        deadline += weights[i] * unit
        args = attention_inputs(batch, 1, ctx, nq=nq, nkv=nkv, d=d)
        floor = 2 * batch * ctx * nkv * d * 2 / (bw * 1e9)
        sweep(f"decode b{batch} ctx{ctx}", args, d, dry, dec_grid, floor, "KV-read floor",
              deadline, rows)
        del args
    q_len, ctx = (16, 64) if dry else (512, 4096)
    args = attention_inputs(1, q_len, ctx, nq=nq, nkv=nkv, d=d)
    flops = 4 * q_len * (ctx - q_len / 2) * nq * d
    pre_grid = [{"block_q_rows": bq, "block_k": bk, "num_warps": w, "num_stages": st}
                for bq, bk, w, st in itertools.product(
                    (16,) if dry else (64, 128), (16,) if dry else (32, 64, 128),
                    (4,) if dry else (4, 8), (2,) if dry else (2, 3))]
    peak_s = flops / (H200_BF16_TFLOPS * 1e12)
    sweep(f"prefill q{q_len} ctx{ctx}", args, d, dry, pre_grid, peak_s, "bf16 peak",
          deadline + weights[-1] * unit, rows)
    del args
    for num_tokens in ((8,) if dry else (64, 512)):
        time_write_kv(num_tokens, 2 if dry else 32, 64 if dry else 16384, nkv, d, rows)
    print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"bandwidth_gbps": bw, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
