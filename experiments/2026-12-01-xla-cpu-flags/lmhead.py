"""Worker: formulations of the tied LM head ``h[M,576] -> logits[M,49152]`` under XLA_FLAGS.

    XLA_FLAGS=... python lmhead.py OUT.json
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

V, H = 49152, 576
FORMS = {
    "x@E.T": lambda x, e, et: x @ e.T,           # current: E [V, H]
    "x@Et": lambda x, e, et: x @ et,             # pre-transposed copy Et [H, V]
    "(E@x.T).T": lambda x, e, et: (e @ x.T).T,
    "dot_general": lambda x, e, et: jax.lax.dot_general(x, e, (((1,), (1,)), ((), ()))),
}


def run(f, args, budget_s=0.8):
    f(*args).block_until_ready()
    times, c0, t0 = [], cpu_s(), time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - t0 < budget_s and len(times) < 100):
        t = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return {"ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "cpu_ms": 1e3 * (cpu_s() - c0) / len(times)}


def main():
    k = jax.random.PRNGKey(0)
    e = jax.random.normal(k, (V, H), jnp.float32) * 0.02
    et = jnp.asarray(e.T)
    out = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": {}}
    for m in (8, 16, 64):
        x = jax.random.normal(k, (m, H), jnp.float32)
        ref = None
        for name, fn in FORMS.items():
            r = run(jax.jit(fn), (x, e, et))
            y = jax.jit(fn)(x, e, et)
            ref = y if ref is None else ref
            r["max_abs_diff_vs_first"] = float(jnp.max(jnp.abs(y - ref)))
            out["rows"][f"M={m} {name}"] = r
            print(f"M={m:<3} {name:<12}{r['ms']:>9.3f} ms{r['min_ms']:>9.3f} min"
                  f"{r['cpu_ms']:>9.3f} cpu-ms  diff {r['max_abs_diff_vs_first']:.2e}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
