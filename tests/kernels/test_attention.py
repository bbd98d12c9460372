"""The pure-jnp ragged paged attention and write_kv against the naive numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention, ref_ragged_paged_attention, write_kv
from pallas_kernels.ragged_paged_attention import decode_chunk_for
from pallas_kernels.testing import make_case


@pytest.mark.parametrize("tiles", [(128, 128, None), (4, 8, 8)], ids=["default-tiles", "small-tiles"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 20.0)])
def test_matches_naive_reference(block_size: int, window: int | None, cap: float | None,
                                 tiles: tuple[int, int]) -> None:
    rng = np.random.default_rng()
    # a mix: decodes (q_len 1), a fresh prefill, continued chunks; lengths off block boundaries
    q_lens = [1, 1, 13, 5, 1, 3]
    ctx_lens = [1, 37, 13, 23, 65, 133]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx_lens, block_size=block_size,
                                         num_seqs_pad=8, tokens_pad=32)
    scale = 16 ** -0.5
    for layer in (0, 1):
        got = ragged_paged_attention(
            jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
            jnp.int32(layer), jnp.asarray(bt), jnp.asarray(sl), jnp.asarray(qsl), jnp.asarray(ns),
            sm_scale=scale, sliding_window=window, logit_soft_cap=cap, q_tile=tiles[0],
            kv_chunk=tiles[1], decode_kv_chunk=tiles[2])
        want = ref_ragged_paged_attention(q, k, v, layer, bt, sl, qsl, ns, sm_scale=scale,
                                          sliding_window=window, logit_soft_cap=cap)
        got = np.asarray(got)
        total = qsl[-1]
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got[:total], want[:total], rtol=1e-5, atol=1e-5)
        assert np.all(got[total:] == 0.0), "padding rows must be zero"


@pytest.mark.parametrize("num_slots", [4, 32])
def test_default_decode_chunk_by_slots(num_slots: int) -> None:
    """The decode path's default step (``decode_chunk_for``: 512 keys up to 16 slots, 128
    above) matches the reference with contexts across several of its chunks, beside a prefill."""
    rng = np.random.default_rng()
    q_lens = [1, 1, 7, 1]
    ctx_lens = [300, 1100, 7, 513]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx_lens, block_size=16,
                                         num_seqs_pad=num_slots, tokens_pad=16)
    got = np.asarray(ragged_paged_attention(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.int32(0), jnp.asarray(bt),
        jnp.asarray(sl), jnp.asarray(qsl), jnp.asarray(ns), sm_scale=0.25))
    want = ref_ragged_paged_attention(q, k, v, 0, bt, sl, qsl, ns, sm_scale=0.25)
    total = qsl[-1]
    np.testing.assert_allclose(got[:total], want[:total], rtol=1e-5, atol=1e-5)
    assert max(ctx_lens) > 2 * decode_chunk_for(num_slots), "the case must span 3+ chunks"


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


def test_traced_sliding_window_one_program() -> None:
    """A window passed as a traced ``i32`` scalar (as Gemma 3's layer scan passes it) gives the
    windowed result, a window past the context gives full causal attention, and both run in one
    compiled program."""
    rng = np.random.default_rng()
    q_lens = [1, 13, 5, 1]
    ctx_lens = [40, 13, 23, 133]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx_lens, block_size=4, num_seqs_pad=4,
                                         tokens_pad=32)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]

    @jax.jit
    def run(window):
        return ragged_paged_attention(*args, jnp.int32(1), jnp.asarray(bt), jnp.asarray(sl),
                                      jnp.asarray(qsl), jnp.asarray(ns), sm_scale=0.25,
                                      sliding_window=window, q_tile=4, kv_chunk=8,
                                      decode_kv_chunk=8)

    total = qsl[-1]
    for window, ref_window in ((7, 7), (1, 1), (1 << 30, None)):
        got = np.asarray(run(jnp.int32(window)))
        want = ref_ragged_paged_attention(q, k, v, 1, bt, sl, qsl, ns, sm_scale=0.25,
                                          sliding_window=ref_window)
        np.testing.assert_allclose(got[:total], want[:total], rtol=1e-5, atol=1e-5)
    assert run._cache_size() == 1


@pytest.mark.parametrize("block_size", [4, 16])
def test_bfloat16_cache_matches_reference_on_stored_values(block_size: int) -> None:
    """A bfloat16 cache (``kv_cache_dtype=bfloat16``) is read exactly: the op on bf16 pages (NaN
    in every page no sequence owns) equals the float64 reference on the same stored values, on
    the decode path (many one-row sequences, contexts across several chunks; its score dot
    takes the queries rounded to bfloat16) and the prefill path."""
    rng = np.random.default_rng()
    q_lens = [1, 1, 1, 1, 9, 1]
    ctx_lens = [1, 70, 129, 200, 40, 17]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx_lens, block_size=block_size,
                                         num_seqs_pad=8, tokens_pad=16)
    kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    got = np.asarray(ragged_paged_attention(
        jnp.asarray(q, jnp.float32), kb, vb, jnp.int32(1), jnp.asarray(bt), jnp.asarray(sl),
        jnp.asarray(qsl), jnp.asarray(ns), sm_scale=0.25))
    q_ref = np.array(q)
    for i, n in enumerate(q_lens):  # the decode rows' queries as the score dot reads them
        if n == 1:
            row = qsl[i]
            q_ref[row] = np.asarray(jnp.asarray(q[row] * 0.25, jnp.bfloat16), np.float64) / 0.25
    want = ref_ragged_paged_attention(q_ref, np.asarray(kb), np.asarray(vb), 1, bt, sl, qsl, ns,
                                      sm_scale=0.25)
    total = qsl[-1]
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:total], want[:total], rtol=1e-5, atol=1e-5)
    assert np.all(got[total:] == 0.0)
