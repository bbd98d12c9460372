"""One layer's attention for a prefill step, the jnp prefill path against the native kernel's
tiles, interleaved in one process (issue 16).

    .venv/bin/python experiments/2026-12-04-native-prefill/attn_layer.py \
        [--seqs 4 --len 256 --rounds 5 --out results/attn_layer.json]

SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head_dim 64), a bfloat16 cache of
16-token pages, ``--seqs`` fresh prompts of ``--len`` tokens in one step of 64 sequence slots.
Prints (and writes as JSON) the median ms per call of each path, and the largest difference
between their outputs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve  # noqa: F401  (jaxserve's XLA:CPU flags, as served)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    rng = np.random.default_rng(0)
    slots, bs, per, nseq = 64, 16, ns.len, ns.seqs
    pages = -(-per // bs)
    num_tokens = nseq * per
    nb = 1 + nseq * pages
    kc = jnp.asarray(rng.standard_normal((1, nb, bs, 3, 64)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((1, nb, bs, 3, 64)), jnp.bfloat16)
    tables = np.zeros((slots, max(pages, 64)), np.int32)
    for s in range(nseq):
        tables[s, :pages] = 1 + s * pages + np.arange(pages)
    seq_lens = np.zeros(slots, np.int32)
    seq_lens[:nseq] = per
    qsl = np.full(slots + 1, num_tokens, np.int32)
    qsl[:nseq + 1] = np.arange(nseq + 1) * per
    q = jnp.asarray(rng.standard_normal((num_tokens, 9, 64)), jnp.float32)
    args = (q, kc, vc, jnp.int32(0), jnp.asarray(tables), jnp.asarray(seq_lens),
            jnp.asarray(qsl), jnp.asarray([nseq], jnp.int32))
    fns = {name: jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125,
                                           native_decode=True, native_prefill=pf))
           for name, pf in (("jnp prefill path", False), ("native tiles", True))}
    outs = {name: np.asarray(f(*args)) for name, f in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ns.rounds):
        for name, f in fns.items():
            for _ in range(ns.calls):
                t = time.perf_counter()
                f(*args).block_until_ready()
                times[name].append(1e3 * (time.perf_counter() - t))
    res = {"seqs": nseq, "len": per, "median_ms": {k: statistics.median(v)
                                                    for k, v in times.items()},
           "max_abs_diff": float(np.abs(outs["jnp prefill path"] - outs["native tiles"]).max())}
    for k, v in res["median_ms"].items():
        print(f"{nseq} x {per} tokens, one layer: {k:17s} {v:6.2f} ms")
    print(f"max |difference| {res['max_abs_diff']:.2e}")
    if ns.out:
        with open(ns.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
