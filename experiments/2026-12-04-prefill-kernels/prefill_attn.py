"""Prefill attention alone: S sequences of Q prompt tokens each (a fresh prompt: context Q),
SmolLM2-135M's heads (9 query, 3 KV, head dim 64), a bfloat16 paged cache of 16-token pages in
shuffled order, 30 layers in a fori_loop through the native kernel's prefill tiles. Prints the
median ms per 30 layers and a checksum; run it from each tree to compare.

    PYTHONPATH=<tree> .venv/bin/python experiments/2026-12-04-prefill-kernels/prefill_attn.py 4 256
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_paged_attention

S, Q = int(sys.argv[1]), int(sys.argv[2])
L, BS, H, HKV, D = 30, 16, 9, 3, 64
nb_per = -(-Q // BS)
NB = S * nb_per + 1
rng = np.random.default_rng(0)
k = jnp.asarray(rng.normal(0, 1, (L, NB, BS, HKV, D)), jnp.bfloat16)
v = jnp.asarray(rng.normal(0, 1, (L, NB, BS, HKV, D)), jnp.bfloat16)
tables = jnp.asarray(rng.permutation(np.arange(1, NB))[:S * nb_per].reshape(S, nb_per), jnp.int32)
seq_lens = jnp.full((S,), Q, jnp.int32)
qsl = jnp.arange(S + 1, dtype=jnp.int32) * Q
q = jnp.asarray(rng.normal(0, 1, (S * Q, H, D)), jnp.float32)


@jax.jit
def layers(q, k, v):
    def body(i, acc):
        return acc + ragged_paged_attention(
            q + acc * 1e-3, k, v, i, tables, seq_lens, qsl, jnp.array([S], jnp.int32),
            sm_scale=D ** -0.5, native_decode=True, native_prefill=True)
    return jax.lax.fori_loop(0, L, body, jnp.zeros_like(q))


out = jax.block_until_ready(layers(q, k, v))
ts = []
for _ in range(15):
    t = time.perf_counter()
    jax.block_until_ready(layers(q, k, v))
    ts.append(time.perf_counter() - t)
print(f"{S} x {Q}: {np.median(ts) * 1e3:.1f} ms per 30 layers (min {min(ts) * 1e3:.1f}), "
      f"checksum {float(jnp.abs(out).sum()):.6g}")
