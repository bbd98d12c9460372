"""Batch invariance of the native CPU attention kernel (``invariant=True``): a query row's output
is bit-identical whether it is a decode row, in one prompt chunk or another, in a tile with
other rows, or beside other sequences (``cpu_kernels/csrc/attention.cc``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import attention as cpu_attention
from pallas_kernels.kv_cache import KV_QUANT_DTYPES, quantize_kv

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not cpu_attention.available(),
    reason="the native kernel runs on XLA:CPU and needs its library built (jaxserve "
           "build-kernels)")

BLOCK = 16
KV_HEADS = 2


def _store(x: np.ndarray, cache: str) -> jax.Array:
    """``x`` as a cache of dtype ``cache``: float32, bfloat16, or an 8-bit KV_QUANT_DTYPES key
    (scale 0.05: the kernel reads the stored values; scales are the caller's)."""
    if cache in KV_QUANT_DTYPES:
        return quantize_kv(jnp.asarray(x, jnp.float32), jnp.full((KV_HEADS,), 0.05, jnp.float32),
                           KV_QUANT_DTYPES[cache])
    return jnp.asarray(x, cache)


class Pool:
    """A paged cache holding a few sequences' keys and values, and their query rows."""

    def __init__(self, rng: np.random.Generator, ctx_lens: list[int], group: int,
                 head_dim: int, cache: str) -> None:
        nbs = [-(-c // BLOCK) for c in ctx_lens]
        num_blocks = 1 + sum(nbs)
        shape = (1, num_blocks, BLOCK, KV_HEADS, head_dim)
        self.k = _store(rng.standard_normal(shape), cache)
        self.v = _store(rng.standard_normal(shape), cache)
        perm = rng.permutation(np.arange(1, num_blocks))
        self.tables, used = [], 0
        for nb in nbs:
            self.tables.append(perm[used:used + nb])
            used += nb
        self.max_blocks = max(nbs)
        self.ctx = ctx_lens
        # every position's query rows, already scaled (the kernel's input)
        self.q = [rng.standard_normal((c, KV_HEADS * group, head_dim)).astype(np.float32) * 0.3
                  for c in ctx_lens]

    def run(self, segments: list[tuple[int, int, int]], invariant: bool, window=None, cap=None,
            tokens_pad: int = 64, seqs_pad: int = 8) -> list[np.ndarray]:
        """One kernel call over ``segments`` (sequence, first row, end row): each the query
        rows ``[a, b)`` of a sequence whose context then ends at ``b``. Returns each segment's
        output rows."""
        n_tok = sum(b - a for _, a, b in segments)
        q = np.zeros((tokens_pad, *self.q[0].shape[1:]), np.float32)
        tables = np.zeros((seqs_pad, self.max_blocks), np.int32)
        seq_lens = np.zeros(seqs_pad, np.int32)
        qsl = np.full(seqs_pad + 1, n_tok, np.int32)
        off = 0
        for i, (s, a, b) in enumerate(segments):
            q[off:off + b - a] = self.q[s][a:b]
            tables[i, :len(self.tables[s])] = self.tables[s]
            seq_lens[i] = b
            qsl[i] = off
            off += b - a
        out = np.asarray(cpu_attention.cpu_decode_attention(
            jnp.asarray(q), self.k, self.v, jnp.int32(0), jnp.asarray(tables),
            jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.asarray([len(segments)], jnp.int32),
            sliding_window=window, logit_soft_cap=cap, prefill=True, invariant=invariant))
        rows, off = [], 0
        for _, a, b in segments:
            rows.append(out[off:off + b - a])
            off += b - a
        return rows


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 2), (16, 2)])
@pytest.mark.parametrize("window,cap", [(None, None), (40, 30.0)])
def test_rows_bit_identical_however_computed(cache: str, head_dim: int, group: int, window,
                                             cap) -> None:
    """Sequence 0's rows 96..130 as one chunk are the reference. The same rows computed as
    decode rows (beside other sequences' decode and prefill rows), split into chunks at other
    places, and with another sequence's chunk first in the batch, are equal to the bit. With
    AVX-512, (64, 3) and (128, 2) take the invariant decode item, (16, 2) a one-row tile."""
    rng = np.random.default_rng(7)
    pool = Pool(rng, [131, 300, 45], group, head_dim, cache)
    [ref] = pool.run([(0, 96, 131)], True, window, cap)
    assert np.all(np.isfinite(ref)) and np.abs(ref).max() > 0
    got = {}
    for r in (96, 97, 111, 112, 113, 130):  # each row as a decode row, among other rows
        _, row, _ = pool.run([(1, 299, 300), (0, r, r + 1), (2, 0, 45)], True, window, cap)
        got[f"decode {r}"] = (row, ref[r - 96:r - 95])
    for cut in (97, 100, 112, 128):  # two chunks, cut elsewhere, the second beside others
        first = pool.run([(0, 96, cut)], True, window, cap)[0]
        _, second = pool.run([(2, 40, 45), (0, cut, 131)], True, window, cap)
        got[f"chunks cut at {cut}"] = (np.concatenate([first, second]), ref)
    for name, (a, b) in got.items():
        assert np.array_equal(a, b), f"{name}: max |diff| {np.abs(a - b).max()}"


def test_invariant_needs_prefill_rows_in_the_kernel() -> None:
    with pytest.raises(ValueError, match="invariant=True needs prefill=True"):
        cpu_attention.native_attention_fn(prefill=False, invariant=True)
