"""The decode path of the CPU attention op alone, in several forms (issue 16).

    .venv/bin/python experiments/2026-12-02-decode-b16/decode_attn_forms.py --batch 16

A copy of ``ragged_paged_attention``'s decode loop (one query row per sequence, bfloat16
cache, SmolLM2-135M's 3 kv heads x 3 queries x 64 dims, block size 16) in a ``lax.scan`` over 30
layers, so forms can be compared side by side in one process (rounds interleaved; best of 3
calls per round, ms). Forms:

- ``base``: as the op is today: scores ``[S, C, kv * g]`` from a block-diagonal bfloat16 dot,
  values gathered, masked and converted, then a multiply-and-sum over the chunk;
- ``t``: the scores transposed, ``[S, kv * g, C]``, so the mask / exp fusions run along the
  chunk (their minor dimension is 64 keys, not 9 heads), p transposed back for the values;
- ``tdot``: as ``t``, and p . v as a bfloat16 block-diagonal dot ``[S, 9, C] x [S, C, 192]``
  on the values as stored, the diagonal blocks taken.

Prints each form's best ms and its largest difference from ``base``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve  # noqa: F401  (jaxserve's XLA:CPU flags)

NEG = -1e30
L, KV, G, D, BS = 30, 3, 3, 64, 16


def make(form: str, chunk: int):
    ppc = chunk // BS

    def attn(q, k_cache, v_cache, layer, tables, ctx):
        s_ = q.shape[0]
        width = KV * G
        qf = q.reshape(s_, KV, G, D) * D ** -0.5
        eye = jnp.eye(KV, dtype=jnp.float32)
        q_blk = jnp.einsum("skgd,kj->skdjg", qf, eye).reshape(s_, KV * D, width)
        q_blk = q_blk.astype(jnp.bfloat16)
        qpos = ctx - 1
        kpos0 = jnp.arange(chunk, dtype=jnp.int32)
        flat = (s_, chunk, KV * D)

        def body(c, carry):
            m, l, acc = carry
            pages = jax.lax.dynamic_slice_in_dim(tables, c * ppc, ppc, axis=1)
            kpos = c * chunk + kpos0
            mask = kpos[None, :] <= qpos[:, None]  # [S, C]
            k = k_cache[layer, pages].reshape(flat)
            if form in ("bdot", "bdotf"):
                m3 = mask[:, :, None]
                qk = jnp.einsum("scx,sxy->scy", k, q_blk, preferred_element_type=jnp.float32)
                s = jnp.where(m3, qk, NEG)
                m_new = jnp.maximum(m, s.max(axis=1))
                p = jnp.where(m3, jnp.exp(s - m_new[:, None, :]), 0.0)
                alpha = jnp.exp(m - m_new)
                vr = v_cache[layer, pages].reshape(flat)
                if form == "bdot":
                    vm = jnp.where(m3, vr, jnp.zeros((), vr.dtype))
                    pd = p.astype(jnp.bfloat16)
                else:
                    vm = jnp.where(m3, vr.astype(jnp.float32), 0.0)
                    pd = p
                full = jnp.einsum("scy,scx->syx", pd, vm, preferred_element_type=jnp.float32)
                full = full.reshape(s_, KV, G, KV, D)
                o = jnp.stack([full[:, i, :, i, :] for i in range(KV)], axis=1)
                return m_new, l * alpha + p.sum(axis=1), \
                    acc * alpha.reshape(s_, KV, G)[..., None] + o
            if form == "base":
                v = v_cache[layer, pages].reshape(flat).astype(jnp.float32)
                m3 = mask[:, :, None]
                qk = jnp.einsum("scx,sxy->scy", k, q_blk, preferred_element_type=jnp.float32)
                s = jnp.where(m3, qk, NEG)
                m_new = jnp.maximum(m, s.max(axis=1))
                p = jnp.where(m3, jnp.exp(s - m_new[:, None, :]), 0.0)
                alpha = jnp.exp(m - m_new)
                vm = jnp.where(m3, v, 0.0).reshape(s_, chunk, KV, 1, D)
                o = jnp.sum(p.reshape(s_, chunk, KV, G, 1) * vm, axis=1)
                return m_new, l * alpha + p.sum(axis=1), \
                    acc * alpha.reshape(s_, KV, G)[..., None] + o
            m3 = mask[:, None, :]
            qk = jnp.einsum("sxy,scx->syc", q_blk, k, preferred_element_type=jnp.float32)
            s = jnp.where(m3, qk, NEG)  # [S, 9, C]
            m_new = jnp.maximum(m, s.max(axis=2))
            p = jnp.where(m3, jnp.exp(s - m_new[:, :, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            if form == "t":
                v = v_cache[layer, pages].reshape(flat).astype(jnp.float32)
                vm = jnp.where(mask[:, :, None], v, 0.0).reshape(s_, chunk, KV, 1, D)
                pt = p.transpose(0, 2, 1).reshape(s_, chunk, KV, G, 1)
                o = jnp.sum(pt * vm, axis=1)
            else:
                vr = v_cache[layer, pages].reshape(flat)
                vm = jnp.where(mask[:, :, None], vr, jnp.zeros((), vr.dtype))
                full = jnp.einsum("syc,scx->syx", p.astype(jnp.bfloat16), vm,
                                  preferred_element_type=jnp.float32)
                full = full.reshape(s_, KV, G, KV, D)
                o = jnp.stack([full[:, i, :, i, :] for i in range(KV)], axis=1)
            return m_new, l * alpha + p.sum(axis=2), \
                acc * alpha.reshape(s_, KV, G)[..., None] + o

        init = (jnp.full((s_, width), NEG, jnp.float32), jnp.zeros((s_, width), jnp.float32),
                jnp.zeros((s_, KV, G, D), jnp.float32))
        n = (jnp.max(ctx) + chunk - 1) // chunk
        _, l, acc = jax.lax.fori_loop(0, n, body, init)
        out = acc / l.reshape(s_, KV, G)[..., None]
        return out.reshape(s_, KV * G * D)

    @jax.jit
    def run(q, k, v, tables, ctx):
        def body(c, layer):
            o = attn(q + c, k, v, layer, tables, ctx)
            return c + o.mean() * 1e-6, o
        return jax.lax.scan(body, jnp.float32(0), jnp.arange(L, dtype=jnp.int32))

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--forms", default="base,t,tdot")
    ap.add_argument("--chunks", default="64")
    ap.add_argument("--rounds", type=int, default=7)
    ns = ap.parse_args()
    rng = np.random.default_rng(0)
    s = ns.batch
    ctx = rng.integers(ns.context - 20, ns.context + 20, s)
    nblk = 2900
    nb = -(-ctx // BS)
    perm = rng.permutation(np.arange(1, nblk))
    tables = np.zeros((s, 128), np.int32)
    used = 0
    for i in range(s):
        tables[i, :nb[i]] = perm[used:used + nb[i]]
        used += nb[i]
    kf = jax.random.normal(jax.random.PRNGKey(0), (L, nblk, BS, KV, D), jnp.float32)
    k, v = kf.astype(jnp.bfloat16), (kf + 1).astype(jnp.bfloat16)
    del kf
    q = jnp.asarray(rng.standard_normal((s, KV * G * D)).astype(np.float32))
    args = (q, k, v, jnp.asarray(tables), jnp.asarray(ctx, jnp.int32))
    cases = {}
    for ch in map(int, ns.chunks.split(",")):
        for f in ns.forms.split(","):
            cases[f"{f}/c{ch}"] = make(f, ch)
    outs = {n: fn(*args)[1] for n, fn in cases.items()}
    ref = outs[next(iter(cases))]
    best = {n: 1e9 for n in cases}
    for _ in range(ns.rounds):
        for n, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(3):
                r = fn(*args)
            jax.block_until_ready(r)
            best[n] = min(best[n], (time.perf_counter() - t0) / 3 * 1e3)
    for n in cases:
        err = float(jnp.max(jnp.abs(outs[n] - ref)))
        print(f"batch {s} {n:10s}: {best[n]:7.2f} ms   max |diff| {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
