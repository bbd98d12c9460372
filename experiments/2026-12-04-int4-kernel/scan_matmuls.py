"""SmolLM2-135M's 30 layers of 7 int4 matmuls in a jitted scan: XLA's dequantise-then-dot
against the native CPU kernel, by row count (issue 16).

    .venv/bin/python experiments/2026-12-04-int4-kernel/scan_matmuls.py [--rows 1,2,4,8]

Random weights of the model's shapes (group 32), stacked as the models stack them; the layer
body chains the seven matmuls so none is dead. Prints the median and minimum of 20 calls.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from models import quant

L, H, I, KV = 30, 576, 1536, 192
SHAPES = {"wq": (H, H), "wk": (H, KV), "wv": (H, KV), "wo": (H, H), "w_gate": (H, I),
          "w_up": (H, I), "w_down": (I, H)}


def timeit(f, *a, n: int = 20) -> tuple[float, float]:
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts)), 1e3 * min(ts)


@jax.jit
def layers(w, x):
    def body(h, w):
        kv = quant.qmatmul(h, w["wk"]) + quant.qmatmul(h, w["wv"])
        y = quant.qmatmul(h, w["wq"]) + jnp.pad(kv, ((0, 0), (0, H - KV)))
        h = h + quant.qmatmul(y, w["wo"])
        g = quant.qmatmul(h, w["w_gate"]) * quant.qmatmul(h, w["w_up"])
        return h + quant.qmatmul(g, w["w_down"]) * 1e-3, None
    return jax.lax.scan(body, x, w)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ns = ap.parse_args()
    rng = np.random.default_rng(0)
    w = {n: quant.quantize(jnp.asarray(rng.normal(0, 0.05, (L,) + s), jnp.float32), "int4", 32)
         for n, s in SHAPES.items()}
    for rows in map(int, ns.rows.split(",")):
        x = jnp.asarray(rng.normal(0, 1, (rows, H)), jnp.float32)
        for name, max_rows in (("xla", 0), ("native", rows)):
            med, low = timeit(layers, quant.use_native_int4(w, max_rows), x)
            print(f"rows {rows} {name:>6s}: median {med:6.2f} ms, min {low:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
