"""int4 weight matmuls of SmolLM2-135M's 30 layers at 1 row, several forms (issue 16).

    .venv/bin/python experiments/2026-12-02-decode-b16/int4_forms.py

The 7 weights of a layer quantised as ``--quantization int4`` stores them (``models.quant``,
group 32 along the contraction axis), in a ``lax.scan`` over stacked weights. Forms:
``f32`` (today: dequantise to float32, then a float32 dot), ``bf16`` (dequantise to bfloat16,
dot accumulating in float32) and ``sum`` (``sum_i x[i] * w[i, :]`` as one multiply-reduce, no
dequantised weight materialised). Prints per form the best / median of 30 calls (ms) and the
largest difference from ``f32``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve  # noqa: F401  (jaxserve's XLA:CPU flags, as the engine runs)
from models.quant import dequantize, quantize

L, H, I, KV = 30, 576, 1536, 192


def main() -> None:
    rng = np.random.default_rng(0)
    shapes = [(H, H), (H, KV), (H, KV), (H, H), (H, I), (H, I), (I, H)]
    ws = [quantize(jnp.asarray(rng.standard_normal((L,) + s) * 0.02, jnp.float32), "int4", 32)
          for s in shapes]

    def mm_f32(x, w):
        return x @ dequantize(w, jnp.float32)

    def mm_bf16(x, w):
        return jax.lax.dot_general(x.astype(jnp.bfloat16), dequantize(w, jnp.bfloat16),
                                   (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    def mm_sum(x, w):
        return jnp.sum(x[0][:, None] * dequantize(w, jnp.float32), axis=0)[None]

    def layer(mm, x, w):
        q, k, v = mm(x, w[0]), mm(x, w[1]), mm(x, w[2])
        a = q * 0.5 + jnp.concatenate([k, v, k], -1)
        x = x + mm(a, w[3])
        return x + mm(jax.nn.silu(mm(x, w[4])) * mm(x, w[5]), w[6])

    def build(mm):
        return jax.jit(lambda x, ws: jax.lax.scan(lambda c, w: (layer(mm, c, w), None), x,
                                                  ws)[0])

    x = jnp.asarray(rng.standard_normal((1, H)), jnp.float32)
    forms = {"f32": build(mm_f32), "bf16": build(mm_bf16), "sum": build(mm_sum)}
    ref = forms["f32"](x, ws)
    times = {n: [] for n in forms}
    diffs = {n: float(jnp.max(jnp.abs(f(x, ws) - ref))) for n, f in forms.items()}
    for _ in range(30):
        for n, f in forms.items():
            t0 = time.perf_counter()
            f(x, ws).block_until_ready()
            times[n].append(1e3 * (time.perf_counter() - t0))
    for n, ts in times.items():
        print(f"{n:5s}: best {min(ts):6.2f} ms, median {sorted(ts)[15]:6.2f} ms, "
              f"max |diff| {diffs[n]:.2e}", flush=True)


if __name__ == "__main__":
    main()
