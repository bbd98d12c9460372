"""Worker: matmul formulations of SmolLM2-135M's step, weights the real size (30 stacked layers,
536 MB float32, so they stream from memory as in serving), under this process's XLA_FLAGS.

    XLA_FLAGS=... python forms.py OUT.json [M ...]

Forms timed per row count M (the bucket's tokens; logits rows = M here):
  layers_sep     30x (x@wq, x@wk, x@wv, x@wo, x@w_gate, x@w_up, x@w_down) in a lax.scan, as models/llama.py
  layers_fused   the same with [wq|wk|wv] and [w_gate|w_up] one matmul each
  lm_head        x @ E.T (E: the tied [49152, 576] embedding), as models/llama.py
  lm_head_t      x @ Et (a pre-transposed [576, 49152] copy)
  lm_head_split2 / split4: x @ E.T as 2 / 4 vocabulary slices, concatenated
Elementwise work (norm, silu) is kept so the forms differ only in the dots.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from dots import cpu_s

L, H, Q, KV, I, V = 30, 576, 576, 192, 1536, 49152


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)


def layers_sep(x, p):
    def body(x, w):
        y = rms(x)
        q, k, v = y @ w["wq"], y @ w["wk"], y @ w["wv"]
        a = q + jnp.tile(k + v, (1, 3))  # stands in for attention: [T, 576]
        x = x + a @ w["wo"]
        y = rms(x)
        x = x + (jax.nn.silu(y @ w["w_gate"]) * (y @ w["w_up"])) @ w["w_down"]
        return x, None
    return jax.lax.scan(body, x, p)[0]


def layers_fused(x, p):
    def body(x, w):
        y = rms(x)
        qkv = y @ w["wqkv"]
        q, k, v = qkv[:, :Q], qkv[:, Q:Q + KV], qkv[:, Q + KV:]
        a = q + jnp.tile(k + v, (1, 3))
        x = x + a @ w["wo"]
        y = rms(x)
        gu = y @ w["w_gate_up"]
        x = x + (jax.nn.silu(gu[:, :I]) * gu[:, I:]) @ w["w_down"]
        return x, None
    return jax.lax.scan(body, x, p)[0]


def split(n):
    def f(x, e):
        c = V // n
        return jnp.concatenate([x @ e[i * c:(i + 1) * c].T for i in range(n)], axis=-1)
    return f


def run(f, args, budget_s=1.0):
    f(*args).block_until_ready()
    times, c0, t0 = [], cpu_s(), time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - t0 < budget_s and len(times) < 100):
        t = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return {"ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "cpu_ms": 1e3 * (cpu_s() - c0) / len(times), "reps": len(times)}


def main():
    ms = [int(a) for a in sys.argv[2:]] or [8, 16, 64, 512]
    ks = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    n = lambda *s: jax.random.normal(next(ks), s, jnp.float32) * 0.02
    sep = {"wq": n(L, H, Q), "wk": n(L, H, KV), "wv": n(L, H, KV), "wo": n(L, Q, H),
           "w_gate": n(L, H, I), "w_up": n(L, H, I), "w_down": n(L, I, H)}
    fused = {"wqkv": jnp.concatenate([sep["wq"], sep["wk"], sep["wv"]], -1), "wo": sep["wo"],
             "w_gate_up": jnp.concatenate([sep["w_gate"], sep["w_up"]], -1),
             "w_down": sep["w_down"]}
    e = n(V, H)
    et = jnp.asarray(e.T)
    forms = {"layers_sep": (layers_sep, sep), "layers_fused": (layers_fused, fused),
             "lm_head": (lambda x, e: x @ e.T, e), "lm_head_t": (lambda x, et: x @ et, et),
             "lm_head_split2": (split(2), e), "lm_head_split4": (split(4), e)}
    out = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": {}}
    for m in ms:
        x = jax.random.normal(next(ks), (m, H), jnp.float32)
        ref = {}
        for name, (fn, w) in forms.items():
            f = jax.jit(fn)
            r = run(f, (x, w))
            y = f(x, w)
            base = ref.setdefault(name.split("_")[0], y)  # layers_* and lm_head* compared
            r["max_abs_diff"] = float(jnp.max(jnp.abs(y - base)))
            out["rows"][f"M={m} {name}"] = r
            print(f"M={m:<4}{name:<16}{r['ms']:>9.3f} ms{r['min_ms']:>9.3f} min"
                  f"{r['cpu_ms']:>9.3f} cpu-ms  diff {r['max_abs_diff']:.1e}", flush=True)
    if len(sys.argv) > 1 and sys.argv[1] != "-":
        with open(sys.argv[1], "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
