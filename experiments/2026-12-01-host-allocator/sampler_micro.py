"""The sampler program alone at [64, 49152] (SmolLM2's vocabulary), per mode, interleaved.

    .venv/bin/python experiments/2026-12-01-host-allocator/sampler_micro.py [TREE]

TREE (default: the current directory) is put first on ``sys.path``, so that a worktree of
another commit can be compared in the same way. Random normal logits (scale 2.5), 15 rounds,
the modes interleaved within each round; prints the median ms per call.
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.device import sampler as sm

S, V = 64, 49152


def rows(rng, temp=0.0, top_k=0, top_p=1.0, min_p=0.0) -> sm.RowInputs:
    def f(v, d):
        return jnp.full((S,), v, d)
    return sm.RowInputs(f(temp, jnp.float32), f(top_k, jnp.int32), f(top_p, jnp.float32),
                        f(min_p, jnp.float32),
                        jnp.asarray(rng.integers(0, 2**31, (S, 2)).astype(np.uint32)),
                        jnp.arange(S, dtype=jnp.int32), f(10**6, jnp.int32),
                        f(1.0, jnp.float32), f(0.0, jnp.float32), f(0.0, jnp.float32))


def main() -> None:
    rng = np.random.default_rng(0)
    logits = jnp.asarray((rng.standard_normal((S, V)) * 2.5).astype(np.float32))
    modes = {"greedy": rows(rng), "temperature": rows(rng, 1.0),
             "top_k=50": rows(rng, 1.0, top_k=50), "top_k=200": rows(rng, 1.0, top_k=200),
             "top_k=1000": rows(rng, 1.0, top_k=1000),
             "top_p=0.95": rows(rng, 0.7, top_p=0.95), "min_p=0.05": rows(rng, 1.0, min_p=0.05)}
    fn = jax.jit(lambda lg, r: sm.sample(lg, r))
    for r in modes.values():
        jax.block_until_ready(fn(logits, r))
    res: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(15):
        for m, r in modes.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(logits, r))
            res[m].append(time.perf_counter() - t0)
    for m, t in res.items():
        print(f"{m:12s} {1e3 * float(np.median(t)):7.2f} ms")


if __name__ == "__main__":
    main()
