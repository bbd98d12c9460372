"""The prefill attention alone: one fresh prefill over a bfloat16 cache, 30 layers.

    .venv/bin/python experiments/2026-12-01-host-allocator/prefill_attn_micro.py TREE [T [QT KC]]

``ragged_paged_attention`` from source tree TREE (first on ``sys.path``) in a ``lax.scan`` over
30 layers at SmolLM2-135M's shapes (3 kv heads x 3 queries x 64 dims, 2900 blocks of 16 tokens,
a permuted block table), one fresh prefill of T tokens (default 1000) in a 1024-row batch,
q_tile QT and kv_chunk KC (default 128 128). Prints the best and median of 5 calls in ms.
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, sys.argv[1])

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import ragged_paged_attention

L, NB, BS, KV, D, H = 30, 2900, 16, 3, 64, 9


def main() -> None:
    t = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    qt, kc = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (128, 128)
    rng = np.random.default_rng(0)
    kv = [jnp.asarray(rng.standard_normal((L, NB, BS, KV, D)).astype(np.float32))
          .astype(jnp.bfloat16) for _ in range(2)]
    q = jnp.asarray(rng.standard_normal((1024, H, D)).astype(np.float32))
    max_blocks = 64
    bt = np.zeros((64, max_blocks), np.int32)
    bt[0] = rng.permutation(NB)[:max_blocks]
    sl = np.zeros(64, np.int32)
    sl[0] = t
    qsl = np.full(65, t, np.int32)
    qsl[0] = 0

    @jax.jit
    def run(q, kc_, vc_, bt, sl, qsl):
        def body(c, layer):
            o = ragged_paged_attention(q, kc_, vc_, layer, bt, sl, qsl, jnp.array([1], jnp.int32),
                                       sm_scale=0.125, q_tile=qt, kv_chunk=kc)
            return c + o[:8].sum(), None
        return jax.lax.scan(body, 0.0, jnp.arange(L))[0]

    args = (q, *kv, jnp.asarray(bt), jnp.asarray(sl), jnp.asarray(qsl))
    jax.block_until_ready(run(*args))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        ts.append(time.perf_counter() - t0)
    print(sys.argv[1], t, qt, kc, f"{min(ts) * 1e3:.1f} ms min, {np.median(ts) * 1e3:.1f} med")


if __name__ == "__main__":
    main()
