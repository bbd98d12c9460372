"""The weight matmuls of SmolLM2-135M's 30 layers: a scan over stacked weights against a
Python loop over per-layer arrays (issue 16).

    .venv/bin/python experiments/2026-12-02-decode-b16/unrolled_layers.py

In a ``lax.scan`` over stacked ``[30, ...]`` weights, XLA:CPU copies each layer's slice out
(``dynamic-slice`` fusions) before the dot can read it. A Python loop over 30 separate arrays
gives each dot its operand in place, at the price of a 30x larger program. Prints per row
count the compile time and the best / median of 30 calls (ms) of each form.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve  # noqa: F401  (jaxserve's XLA:CPU flags, as the engine runs)

L, H, I, KV = 30, 576, 1536, 192


def main() -> None:
    rng = np.random.default_rng(0)
    shapes = [(H, H), (H, KV), (H, KV), (H, H), (H, I), (H, I), (I, H)]
    ws = [jnp.asarray(rng.standard_normal((L,) + s) * 0.02, jnp.bfloat16) for s in shapes]
    per_layer = [[w[i] for w in ws] for i in range(L)]

    def mm(x, w):
        return jax.lax.dot_general(x.astype(w.dtype), w, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    def layer(x, w):
        q, k, v = mm(x, w[0]), mm(x, w[1]), mm(x, w[2])
        a = q * 0.5 + jnp.concatenate([k, v, k], -1)
        x = x + mm(a, w[3])
        return x + mm(jax.nn.silu(mm(x, w[4])) * mm(x, w[5]), w[6])

    def unrolled(x, pl):
        for w in pl:
            x = layer(x, w)
        return x

    forms = {
        "scan": (jax.jit(lambda x, ws: jax.lax.scan(lambda c, w: (layer(c, w), None), x,
                                                     ws)[0]), ws),
        "python loop": (jax.jit(unrolled), per_layer),
    }
    for m in (1, 4, 8, 16, 64):
        x = jnp.asarray(rng.standard_normal((m, H)), jnp.float32)
        for name, (fn, args) in forms.items():
            t0 = time.perf_counter()
            exe = fn.lower(x, args).compile()
            comp = time.perf_counter() - t0
            exe(x, args).block_until_ready()
            ts = []
            for _ in range(30):
                t0 = time.perf_counter()
                exe(x, args).block_until_ready()
                ts.append(1e3 * (time.perf_counter() - t0))
            print(f"{m:3d} rows, {name:12s}: compile {comp:5.2f} s, best {min(ts):6.2f} ms, "
                  f"median {sorted(ts)[15]:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
