"""SmolLM2-135M's seven layer matmuls (576 hidden, 1536 MLP, 9 x 64 query and 3 x 64 key/value
heads) over 30 stacked layers in a jitted scan, bfloat16 weights under float32 activations:
XLA's dot of each layer's slice (what the model ran before) against the native kernel over the
packed stack with the layer index (pallas_kernels.cpu_bf16_matmul). Prints ms per scan (median
of 20) and writes JSON.

    .venv/bin/python experiments/2026-12-04-bf16-packed/matmul_scan.py --rows 1,16,64,256 \
        --out experiments/2026-12-04-bf16-packed/results/matmul_scan.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_bf16_matmul as kernel

SHAPES = {"wq": (576, 576), "wk": (576, 192), "wv": (576, 192), "wo": (576, 576),
          "w_gate": (576, 1536), "w_up": (576, 1536), "w_down": (1536, 576)}
LAYERS = 30


def layer(mm, x):
    q, k, v = mm(x, "wq"), mm(x, "wk"), mm(x, "wv")
    x = x + mm(q, "wo") + 1e-3 * (k.sum() + v.sum())
    return x + mm(jax.nn.silu(mm(x, "w_gate")) * mm(x, "w_up"), "w_down")


def xla_scan(ws, x):
    def body(x, w):
        mm = lambda a, n: jax.lax.dot_general(a.astype(jnp.bfloat16), w[n], (((1,), (0,)), ((), ())),
                                              preferred_element_type=jnp.float32)
        return layer(mm, x) * 0.1, None
    return jax.lax.scan(body, x, ws)[0]


def kernel_scan(packed, x):
    def body(carry, _):
        x, i = carry
        mm = lambda a, n: kernel.cpu_bf16_matmul(a, packed[n], i, SHAPES[n][1])
        return (layer(mm, x) * 0.1, i + 1), None
    return jax.lax.scan(body, (x, jnp.int32(0)), None, length=LAYERS)[0][0]


def median_ms(f, *args, n: int = 20) -> float:
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    ws = {n: jnp.asarray(rng.normal(0, 0.03, (LAYERS, *s)), jnp.bfloat16)
          for n, s in SHAPES.items()}
    packed = {n: kernel.pack(w) for n, w in ws.items()}
    fx, fk = jax.jit(xla_scan), jax.jit(kernel_scan)
    res = []
    for m in (int(r) for r in a.rows.split(",")):
        x = jnp.asarray(rng.normal(0, 1, (m, 576)), jnp.float32)
        want, got = fx(ws, x), fk(packed, x)
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        for r in range(a.rounds):  # interleaved
            row = {"rows": m, "round": r, "xla_ms": median_ms(fx, ws, x),
                   "kernel_ms": median_ms(fk, packed, x), "max_rel_diff": err}
            res.append(row)
            print(f"rows {m:5d}: xla {row['xla_ms']:7.1f} ms | kernel {row['kernel_ms']:7.1f} ms"
                  f" (max rel diff {err:.1e})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
