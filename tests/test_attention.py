"""The pure-jnp ragged paged attention and write_kv against the naive numpy reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention, ref_ragged_paged_attention, write_kv


def _case(rng: np.random.Generator, q_lens: list[int], ctx_lens: list[int], *, block_size: int,
          num_seqs_pad: int, tokens_pad: int, num_layers: int = 2, kv_heads: int = 2,
          group: int = 3, head_dim: int = 16):
    """Random cache with NaN in every page no sequence owns, randomly permuted block tables."""
    max_blocks = max(-(-c // block_size) for c in ctx_lens) + 1
    need = sum(-(-c // block_size) for c in ctx_lens)
    num_blocks = need + 5
    k = rng.standard_normal((num_layers, num_blocks, block_size, kv_heads, head_dim))
    v = rng.standard_normal((num_layers, num_blocks, block_size, kv_heads, head_dim))
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((num_seqs_pad, max_blocks), np.int32)
    owned = set()
    used = 0
    for s, c in enumerate(ctx_lens):
        nb = -(-c // block_size)
        tables[s, :nb] = perm[used:used + nb]
        used += nb
        for j in range(nb):
            owned.add(int(tables[s, j]))
    for b in range(num_blocks):
        if b not in owned:
            k[:, b] = np.nan
            v[:, b] = np.nan
    # positions past each context inside owned blocks are garbage too
    for s, c in enumerate(ctx_lens):
        for p in range(c, -(-c // block_size) * block_size):
            k[:, tables[s, p // block_size], p % block_size] = np.nan
            v[:, tables[s, p // block_size], p % block_size] = np.nan
    qsl = np.zeros(num_seqs_pad + 1, np.int32)
    qsl[1:len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1:] = qsl[len(q_lens)]
    seq_lens = np.zeros(num_seqs_pad, np.int32)
    seq_lens[:len(ctx_lens)] = ctx_lens
    q = rng.standard_normal((tokens_pad, kv_heads * group, head_dim))
    return q, k, v, tables, seq_lens, qsl, np.array([len(q_lens)], np.int32)


@pytest.mark.parametrize("tiles", [(128, 128), (4, 8)], ids=["default-tiles", "small-tiles"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 20.0)])
def test_matches_naive_reference(block_size: int, window: int | None, cap: float | None,
                                 tiles: tuple[int, int]) -> None:
    rng = np.random.default_rng()
    # a mix: decodes (q_len 1), a fresh prefill, continued chunks; lengths off block boundaries
    q_lens = [1, 1, 13, 5, 1, 3]
    ctx_lens = [1, 37, 13, 23, 65, 133]
    q, k, v, bt, sl, qsl, ns = _case(rng, q_lens, ctx_lens, block_size=block_size,
                                     num_seqs_pad=8, tokens_pad=32)
    scale = 16 ** -0.5
    for layer in (0, 1):
        got = ragged_paged_attention(
            jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
            jnp.int32(layer), jnp.asarray(bt), jnp.asarray(sl), jnp.asarray(qsl), jnp.asarray(ns),
            sm_scale=scale, sliding_window=window, logit_soft_cap=cap, q_tile=tiles[0],
            kv_chunk=tiles[1])
        want = ref_ragged_paged_attention(q, k, v, layer, bt, sl, qsl, ns, sm_scale=scale,
                                          sliding_window=window, logit_soft_cap=cap)
        got = np.asarray(got)
        total = qsl[-1]
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got[:total], want[:total], rtol=1e-5, atol=1e-5)
        assert np.all(got[total:] == 0.0), "padding rows must be zero"


def test_write_kv_scatters_to_slots() -> None:
    rng = np.random.default_rng()
    layers, blocks, bs, kvh, d = 3, 6, 4, 2, 8
    k = jnp.zeros((layers, blocks, bs, kvh, d))
    v = jnp.zeros((layers, blocks, bs, kvh, d))
    slots = np.array([5, 6, 17, 0], np.int32)  # last one is padding into block 0
    kn = rng.standard_normal((4, kvh, d)).astype(np.float32)
    vn = rng.standard_normal((4, kvh, d)).astype(np.float32)
    k2, v2 = write_kv(k, v, jnp.int32(1), jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(slots))
    k2, v2 = np.asarray(k2), np.asarray(v2)
    for i, s in enumerate(slots[:3]):
        np.testing.assert_array_equal(k2[1, s // bs, s % bs], kn[i])
        np.testing.assert_array_equal(v2[1, s // bs, s % bs], vn[i])
    assert np.all(k2[0] == 0) and np.all(k2[2] == 0), "other layers untouched"
    assert np.count_nonzero(np.abs(k2[1, 1:]).sum(axis=(-1, -2))) == 3
