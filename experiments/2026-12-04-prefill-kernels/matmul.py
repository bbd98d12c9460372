"""The packed bfloat16 matmul alone: M rows times a [K, N] weight of each of 30 stacked layers in
a scan (the model's layout), as `jaxserve`'s layers call it. Prints the median ms per 30 calls and
GFLOP/s for each `MxKxN` argument; run it from each tree to compare.

    PYTHONPATH=<tree> .venv/bin/python experiments/2026-12-04-prefill-kernels/matmul.py \
        1024x576x1536 1024x1536x576 1024x576x576 1024x576x192
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_bf16_matmul as kernel

L = 30
rng = np.random.default_rng(0)
for arg in sys.argv[1:]:
    M, K, N = map(int, arg.split("x"))
    w = kernel.pack(jnp.asarray(rng.normal(0, 0.03, (L, K, N)), jnp.bfloat16))
    x = jnp.asarray(rng.normal(0, 1, (M, K)), jnp.float32)

    @jax.jit
    def scan(w, x, N=N, M=M):
        def body(c, _):
            acc, i = c
            y = kernel.cpu_bf16_matmul(x + acc * 1e-9, w, i, N)
            return (acc + jnp.sum(y, axis=1, keepdims=True) * 1e-9, i + 1), None
        return jax.lax.scan(body, (jnp.zeros((M, 1), jnp.float32), jnp.int32(0)), None,
                            length=L)[0][0]

    jax.block_until_ready(scan(w, x))
    ts = []
    for _ in range(15):
        t = time.perf_counter()
        jax.block_until_ready(scan(w, x))
        ts.append(time.perf_counter() - t)
    ms = np.median(ts) * 1e3
    print(f"{M}x{K}x{N}: {ms:.1f} ms per 30 calls, {2 * M * K * N * L / ms / 1e6:.0f} GFLOP/s")
