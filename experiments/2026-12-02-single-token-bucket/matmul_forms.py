"""Weight matmuls of SmolLM2-135M's 30 layers at M rows, three ways (issue 16).

    .venv/bin/python experiments/2026-12-02-single-token-bucket/matmul_forms.py

The 7 bfloat16 weights of a layer (q, k, v, o, gate, up, down; 212 MB for 30 layers, so they
stream from memory) contracted as ``models.quant.qmatmul``'s CPU mixed mode does (float32
activations cast to bfloat16, float32 accumulation), in a ``lax.scan`` over stacked weights as
the model runs them. Prints per row count the best and median of 30 calls (ms). On XLA:CPU a
1-row dot is emitted as a matrix-vector product on converted weights, 2+ rows go to YNNPACK:
the reason for the 1-token bucket (jaxserve/device/buckets.py).
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

    def mm(x, w):
        return jax.lax.dot_general(x.astype(w.dtype), w, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    def layer(x, w):
        q, k, v = mm(x, w[0]), mm(x, w[1]), mm(x, w[2])
        a = q * 0.5 + jnp.concatenate([k, v, k], -1)
        x = x + mm(a, w[3])
        return x + mm(jax.nn.silu(mm(x, w[4])) * mm(x, w[5]), w[6])

    run = jax.jit(lambda x, ws: jax.lax.scan(lambda c, w: (layer(c, w), None), x, ws)[0])
    for m in (1, 2, 4, 8, 16):
        x = jnp.asarray(rng.standard_normal((m, H)), jnp.float32)
        run(x, ws).block_until_ready()
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            run(x, ws).block_until_ready()
            ts.append(1e3 * (time.perf_counter() - t0))
        print(f"{m:3d} rows: best {min(ts):6.2f} ms, median {sorted(ts)[15]:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
