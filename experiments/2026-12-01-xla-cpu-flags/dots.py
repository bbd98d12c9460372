"""Worker: float32 dots at SmolLM2-135M's shapes under this process's XLA_FLAGS.

    XLA_FLAGS=... python dots.py OUT.json

Prints and writes ``{shape: {"ms": median, "min_ms", "gflops", "cpu_ms"}}`` plus the
2048^3 ceiling dot (the one ``jaxserve bench throughput`` uses) and the cold compile time of
each dot. Weights are jit arguments (as in the served step program), not constants.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp

# (name, m, k, n, transpose_rhs): rhs is [k, n], or [n, k] when transposed (the tied lm_head)
SHAPES = [
    ("qkv_fused  1x576x960", 1, 576, 960, False),
    ("gate_up    1x576x3072", 1, 576, 3072, False),
    ("lm_head^T  1x576x49152", 1, 576, 49152, True),
    ("q         16x576x576", 16, 576, 576, False),
    ("gate      16x576x1536", 16, 576, 1536, False),
    ("down      16x1536x576", 16, 1536, 576, False),
    ("lm_head^T 16x576x49152", 16, 576, 49152, True),
    ("gate      64x576x1536", 64, 576, 1536, False),
    ("gate_up   64x576x3072", 64, 576, 3072, False),
    ("down      64x1536x576", 64, 1536, 576, False),
    ("lm_head^T 64x576x49152", 64, 576, 49152, True),
    ("lm_head   64x576x49152", 64, 576, 49152, False),
    ("gate     512x576x1536", 512, 576, 1536, False),
    ("down     512x1536x576", 512, 1536, 576, False),
    ("ceiling 2048^3", 2048, 2048, 2048, False),
]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bench(m: int, k: int, n: int, transpose: bool, budget_s: float = 0.6) -> dict:
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (m, k), jnp.float32)
    w = jax.random.normal(key, (n, k) if transpose else (k, n), jnp.float32) * 0.02
    f = jax.jit((lambda a, b: a @ b.T) if transpose else (lambda a, b: a @ b))
    t0 = time.perf_counter()
    f(x, w).block_until_ready()
    compile_s = time.perf_counter() - t0
    f(x, w).block_until_ready()
    times, c0, t_start = [], cpu_s(), time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - t_start < budget_s and len(times) < 200):
        t = time.perf_counter()
        f(x, w).block_until_ready()
        times.append(time.perf_counter() - t)
    cpu_ms = 1e3 * (cpu_s() - c0) / len(times)
    med = statistics.median(times)
    return {"ms": 1e3 * med, "min_ms": 1e3 * min(times), "cpu_ms": cpu_ms, "reps": len(times),
            "gflops": 2 * m * k * n / med / 1e9, "first_call_s": compile_s}


def main() -> None:
    out = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": {}}
    for name, m, k, n, tr in SHAPES:
        r = bench(m, k, n, tr)
        out["rows"][name] = r
        print(f"{name:<26}{r['ms']:>9.3f} ms{r['min_ms']:>9.3f} min{r['gflops']:>8.1f} GF/s"
              f"{r['cpu_ms']:>9.3f} cpu-ms", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
