"""Quantised weight matmuls of SmolLM2-135M's 30 layers, float32 or bfloat16 operands (issue 16).

    .venv/bin/python experiments/2026-12-02-quant-dot-dtype/matmul_forms.py 1,16,64 \
        [bf16,i8_f32,i8_bf16,i4_f32,i4_bf16,f8_f32,f8_bf16]

The 7 weights of a layer (random, std 0.02) stacked for 30 layers in a ``lax.scan``, so they
stream from memory as in the served step, under float32 activations of the given row counts.
Forms: ``bf16`` (plain bfloat16 weights, the CPU default: ``qmatmul``'s mixed mode); ``i8_*``,
``i4_*`` and ``f8_*`` (``--quantization`` int8, int4 group 32, fp8) with the dot in float32
(``*_f32``: the weight dequantised to float32, as every quantised dot ran before
``NARROW_DOT_MIN_ROWS``) or with bfloat16 operands accumulating in float32 (``*_bf16``). Forms
run interleaved, 20 rounds; prints best and median ms and the largest difference from ``bf16``
relative to its largest output.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve  # noqa: F401  (jaxserve's XLA:CPU flags, as the engine runs)
from models.quant import dequantize, qmatmul, quantize

L, H, I, KV = 30, 576, 1536, 192
DIMS = (((1,), (0,)), ((), ()))


def f32_form(x, w):  # the dot in float32, whatever the stored format
    if w.method == "int4":
        return x @ dequantize(w, jnp.float32)
    return (x @ w.q.astype(jnp.float32)) * w.scale.reshape(-1)


def bf16_form(x, w):  # bfloat16 operands, float32 accumulation
    if w.method == "int4":
        return jax.lax.dot_general(x.astype(jnp.bfloat16), dequantize(w, jnp.bfloat16), DIMS,
                                   preferred_element_type=jnp.float32)
    y = jax.lax.dot_general(x.astype(jnp.bfloat16), w.q.astype(jnp.bfloat16), DIMS,
                            preferred_element_type=jnp.float32)
    return y * w.scale.reshape(-1)


def layer(mm, x, w):
    q, k, v = mm(x, w[0]), mm(x, w[1]), mm(x, w[2])
    a = q * 0.5 + jnp.concatenate([k, v, k], -1)
    x = x + mm(a, w[3])
    return x + mm(jax.nn.silu(mm(x, w[4])) * mm(x, w[5]), w[6])


def build(mm):
    return jax.jit(lambda x, ws: jax.lax.scan(lambda c, w: (layer(mm, c, w), None), x, ws)[0])


def main() -> None:
    rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,16,64").split(",")]
    rng = np.random.default_rng(0)
    shapes = [(H, H), (H, KV), (H, KV), (H, H), (H, I), (H, I), (I, H)]
    wf = [jnp.asarray(rng.standard_normal((L,) + s) * 0.02, jnp.float32) for s in shapes]
    w_bf = [w.astype(jnp.bfloat16) for w in wf]
    stores = {"i8": [quantize(w, "int8") for w in wf], "i4": [quantize(w, "int4", 32) for w in wf],
              "f8": [quantize(w, "fp8") for w in wf]}
    forms = {"bf16": (qmatmul, w_bf)}
    for k, ws in stores.items():
        forms[f"{k}_f32"] = (f32_form, ws)
        forms[f"{k}_bf16"] = (bf16_form, ws)
    if len(sys.argv) > 2:
        forms = {k: v for k, v in forms.items() if k in sys.argv[2].split(",") or k == "bf16"}
    fns = {n: build(mm) for n, (mm, _) in forms.items()}
    for rows in rows_list:
        x = jnp.asarray(rng.standard_normal((rows, H)) * 0.1, jnp.float32)
        outs = {n: f(x, forms[n][1]) for n, f in fns.items()}
        ref = outs["bf16"]
        times = {n: [] for n in fns}
        for _ in range(20):
            for n, f in fns.items():
                t0 = time.perf_counter()
                f(x, forms[n][1]).block_until_ready()
                times[n].append(1e3 * (time.perf_counter() - t0))
        for n, ts in times.items():
            d = float(jnp.max(jnp.abs(outs[n] - ref)) / jnp.max(jnp.abs(ref)))
            print(f"rows {rows:3d} {n:8s}: best {min(ts):6.2f} median {sorted(ts)[10]:6.2f} ms"
                  f"  rel. diff {d:.1e}", flush=True)


if __name__ == "__main__":
    main()
