"""The decode attention alone at SmolLM2-135M's shapes, per KV dtype and block size.

    PYTHONPATH=. .venv/bin/python experiments/2026-12-01-kv-attention/attn_micro.py \\
        --tree . --batch 64 --context 300 --dtypes f32,bf16,int8 --block-sizes 16,64 \\
        --out results/attn_micro.json [--decode-kv-chunks 64,128]

``ragged_paged_attention`` from source tree ``--tree`` (so two trees can be compared) runs in a
``lax.scan`` over 30 layers, as the model calls it: ``--batch`` one-row (decode) sequences of
contexts ``--context`` +- 20 over a 2 GiB-sized float32 cache (2900 blocks of 16 tokens, the
same bytes at other block sizes) with permuted block tables, 3 kv heads x 3 queries x 64 dims.
Per setting: the best of 5 rounds of 3 calls, wall ms and process CPU ms per call (the
settings are interleaved round by round), and the load average. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=".")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--dtypes", default="f32,bf16,int8")
    ap.add_argument("--block-sizes", default="16")
    ap.add_argument("--decode-kv-chunks", default="64",
                    help="the op's decode_kv_chunk values to compare")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    sys.path.insert(0, os.path.abspath(ns.tree))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    layers, kvh, group, dim, s = 30, 3, 3, 64, ns.batch
    rng = np.random.default_rng(0)
    ctx = rng.integers(ns.context - 20, ns.context + 20, s)
    q = jnp.asarray(rng.standard_normal((s, kvh * group, dim)).astype(np.float32))
    md_tail = (jnp.asarray(ctx, jnp.int32), jnp.asarray(np.arange(s + 1, dtype=np.int32)),
               jnp.array([s], jnp.int32))

    def run_fn(kw):
        @jax.jit
        def run(q, k, v, tables):
            def body(c, layer):
                o = ragged_paged_attention(q + c, k, v, layer, tables, *md_tail,
                                           sm_scale=dim ** -0.5, **kw)
                return c + o.mean() * 1e-6, None
            return jax.lax.scan(body, jnp.float32(0), jnp.arange(layers, dtype=jnp.int32))[0]
        return run

    cases = {}
    for bs in [int(x) for x in ns.block_sizes.split(",")]:
        nblk = 2900 * 16 // bs
        nb = -(-ctx // bs)
        perm = rng.permutation(np.arange(1, nblk))
        tables = np.zeros((s, 2048 // bs), np.int32)
        used = 0
        for i in range(s):
            tables[i, :nb[i]] = perm[used:used + nb[i]]
            used += nb[i]
        kf = jax.random.normal(jax.random.PRNGKey(bs), (layers, nblk, bs, kvh, dim), jnp.float32)
        for dt in ns.dtypes.split(","):
            if dt == "f32":
                k, v, kw = kf, kf + 1, {}
            elif dt == "bf16":
                k, v, kw = kf.astype(jnp.bfloat16), (kf + 1).astype(jnp.bfloat16), {}
            elif dt == "int8":
                k = v = jnp.clip(jnp.round(kf * 30), -127, 127).astype(jnp.int8)
                sc = jnp.full((layers, kvh), 1 / 30, jnp.float32)
                kw = {"k_scale": sc, "v_scale": sc}
            else:
                raise ValueError(f"dtype {dt!r} not in f32, bf16, int8")
            for dc in [int(x) for x in ns.decode_kv_chunks.split(",")]:
                f = run_fn({**kw, "decode_kv_chunk": dc, "kv_chunk": max(128, dc)})
                args = (q, k, v, jnp.asarray(tables))
                jax.block_until_ready(f(*args))
                cases[f"{dt}/bs{bs}" + (f"/dc{dc}" if dc != 64 else "")] = \
                    functools.partial(f, *args)
        del kf
    best = {n: (1e9, 1e9) for n in cases}
    for _ in range(ns.rounds):
        for n, f in cases.items():
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(3):
                out = f()
            jax.block_until_ready(out)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            wall = (time.perf_counter() - t0) / 3
            cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / 3
            best[n] = (min(best[n][0], wall), min(best[n][1], cpu))
    load = os.getloadavg()
    print(f"tree {os.path.abspath(ns.tree)}: decode attention, 30 layers, batch {s}, context "
          f"~{ns.context}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for n, (w, c) in best.items():
        print(f"  {n:>10s}: {1e3 * w:7.1f} ms wall  {1e3 * c:7.1f} ms CPU")
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump({"argv": sys.argv, "tree": os.path.abspath(ns.tree), "load": load,
                       "ms": {n: {"wall": 1e3 * w, "cpu": 1e3 * c} for n, (w, c) in best.items()}},
                      fh, indent=1)


if __name__ == "__main__":
    main()
