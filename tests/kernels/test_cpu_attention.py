"""The native CPU attention kernel (``cpu_kernels.attention``) against the numpy reference, alone
and inside the jnp op (``native_attention_fn``): decode rows only (``prefill=False``, beside the
jnp prefill path) and prefill rows too (``prefill=True``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import attention as cpu_attention
from pallas_kernels import ragged_paged_attention, ref_ragged_paged_attention
from pallas_kernels.kv_cache import KV_QUANT_DTYPES, kv_to_numpy, quantize_kv
from pallas_kernels.testing import make_case

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not cpu_attention.available(),
    reason="the native kernel runs on XLA:CPU and needs its library built (jaxserve "
           "build-kernels)")


def _op(q, k, v, layer, bt, sl, qsl, ns, native_prefill=True, invariant=False, **kw):
    return np.asarray(cpu_attention.native_attention_fn(native_prefill, invariant)(
        jnp.asarray(q, jnp.float32), k, v, jnp.int32(layer), jnp.asarray(bt), jnp.asarray(sl),
        jnp.asarray(qsl), jnp.asarray(ns), **kw))


@pytest.mark.parametrize("native_prefill", [False, True])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 20.0), (40, 30.0)])
def test_mixed_batch_matches_reference(head_dim: int, block_size: int, window: int | None,
                                       cap: float | None, native_prefill: bool) -> None:
    """Decode rows (the kernel) beside a fresh prefill and continued chunks (the kernel's tiles,
    or the jnp path), with NaN in every page and slot no sequence owns, padding sequences and
    padding tokens."""
    rng = np.random.default_rng()
    q_lens = [1, 1, 13, 5, 1, 3, 1]
    ctx_lens = [1, 37, 13, 23, 65, 133, 300]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx_lens, block_size=block_size,
                                         num_seqs_pad=8, tokens_pad=32, head_dim=head_dim)
    scale = head_dim ** -0.5
    for layer in (0, 1):
        got = _op(q, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), layer, bt, sl,
                  qsl, ns, native_prefill, sm_scale=scale, sliding_window=window,
                  logit_soft_cap=cap)
        want = ref_ragged_paged_attention(q, k, v, layer, bt, sl, qsl, ns, sm_scale=scale,
                                          sliding_window=window, logit_soft_cap=cap)
        total = qsl[-1]
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got[:total], want[:total], rtol=2e-5, atol=2e-5)
        assert np.all(got[total:] == 0.0), "padding rows must be zero"


def test_kernel_alone_writes_only_decode_rows() -> None:
    """``cpu_decode_attention`` fills each one-row sequence's row (the queries pre-scaled) and
    leaves the prefill and padding rows 0; a traced window gives what a static one does."""
    rng = np.random.default_rng()
    q_lens = [1, 4, 1, 1]
    ctx_lens = [90, 20, 1, 513]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx_lens, block_size=16, num_seqs_pad=6,
                                         tokens_pad=12)
    args = [jnp.asarray(x, jnp.float32) for x in (q * 0.25, k, v)] + [
        jnp.int32(1), jnp.asarray(bt), jnp.asarray(sl), jnp.asarray(qsl), jnp.asarray(ns)]
    got = np.asarray(cpu_attention.cpu_decode_attention(*args))
    traced = jax.jit(lambda w, *a: cpu_attention.cpu_decode_attention(*a, sliding_window=w))
    windowed = np.asarray(traced(jnp.int32(50), *args))
    want = ref_ragged_paged_attention(q, k, v, 1, bt, sl, qsl, ns, sm_scale=0.25)
    want_w = ref_ragged_paged_attention(q, k, v, 1, bt, sl, qsl, ns, sm_scale=0.25,
                                        sliding_window=50)
    decode_rows = [qsl[i] for i, n in enumerate(q_lens) if n == 1]
    np.testing.assert_allclose(got[decode_rows], want[decode_rows], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(windowed[decode_rows], want_w[decode_rows], rtol=2e-5, atol=2e-5)
    others = np.setdiff1d(np.arange(q.shape[0]), decode_rows)
    assert np.all(got[others] == 0.0)
    assert np.abs(windowed[decode_rows[-1]] - got[decode_rows[-1]]).max() > 1e-3


@pytest.mark.parametrize("native_prefill", [False, True])
def test_bfloat16_cache_reads_stored_values(native_prefill: bool) -> None:
    rng = np.random.default_rng()
    q_lens = [1, 1, 9, 1]
    ctx_lens = [70, 129, 40, 17]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx_lens, block_size=16, num_seqs_pad=8,
                                         tokens_pad=16)
    kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    got = _op(q, kb, vb, 1, bt, sl, qsl, ns, native_prefill, sm_scale=0.25)
    want = ref_ragged_paged_attention(q, np.asarray(kb), np.asarray(vb), 1, bt, sl, qsl, ns,
                                      sm_scale=0.25)
    total = qsl[-1]
    np.testing.assert_allclose(got[:total], want[:total], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("native_prefill", [False, True])
@pytest.mark.parametrize("kv_dtype", sorted(KV_QUANT_DTYPES))
def test_8bit_cache_with_scales(kv_dtype: str, native_prefill: bool) -> None:
    """An fp8 (e4m3 bits in uint8) or int8 cache with per-(layer, head) scales equals the
    reference on the dequantised stored values."""
    rng = np.random.default_rng()
    q_lens = [1, 1, 6, 1]
    ctx_lens = [33, 200, 6, 64]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx_lens, block_size=16, num_seqs_pad=4,
                                         tokens_pad=12)
    dt = KV_QUANT_DTYPES[kv_dtype]
    ks = (rng.uniform(0.5, 2.0, (2, k.shape[3])) / 100).astype(np.float32)
    vs = (rng.uniform(0.5, 2.0, (2, k.shape[3])) / 100).astype(np.float32)
    quant = jax.vmap(lambda x, s: quantize_kv(x, s, dt))
    kq = quant(jnp.asarray(np.nan_to_num(k), jnp.float32), jnp.asarray(ks))
    vq = quant(jnp.asarray(np.nan_to_num(v), jnp.float32), jnp.asarray(vs))
    got = _op(q, kq, vq, 1, bt, sl, qsl, ns, native_prefill, sm_scale=0.25,
              k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
    k_deq = kv_to_numpy(kq) * ks[:, None, None, :, None]
    v_deq = kv_to_numpy(vq) * vs[:, None, None, :, None]
    want = ref_ragged_paged_attention(q, k_deq, v_deq, 1, bt, sl, qsl, ns, sm_scale=0.25)
    total = qsl[-1]
    np.testing.assert_allclose(got[:total], want[:total], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head_dim", [8, 24, 128])
def test_kernel_alone_fills_prefill_rows(head_dim: int) -> None:
    """With ``prefill=True`` every real row is the reference's: chunks longer than a 16-row
    tile (and not a multiple of it), a chunk continuing a cached context, a window that ends
    inside a tile, head sizes that are not a multiple of 16; padding rows stay 0."""
    rng = np.random.default_rng()
    q_lens = [37, 1, 16, 20, 2]
    ctx_lens = [37, 60, 100, 250, 2]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx_lens, block_size=8, num_seqs_pad=7,
                                         tokens_pad=90, head_dim=head_dim)
    args = [jnp.asarray(x, jnp.float32) for x in (q * 0.3, k, v)] + [
        jnp.int32(0), jnp.asarray(bt), jnp.asarray(sl), jnp.asarray(qsl), jnp.asarray(ns)]
    total = qsl[-1]
    for window in (None, 9, 70):
        got = np.asarray(cpu_attention.cpu_decode_attention(*args, sliding_window=window,
                                                            prefill=True))
        want = ref_ragged_paged_attention(q, k, v, 0, bt, sl, qsl, ns, sm_scale=0.3,
                                          sliding_window=window)
        np.testing.assert_allclose(got[:total], want[:total], rtol=2e-5, atol=2e-5)
        assert np.all(got[total:] == 0.0)


def _cache(rng, k, v, cache: str):
    """``k``, ``v`` (float64, 2 layers x 2 kv heads) stored as ``cache`` ("float32", "bfloat16"
    or a KV_QUANT_DTYPES key, with random per-(layer, head) scales): ``(k_cache, v_cache, the
    op's scale kwargs, k and v as stored, dequantised to float64)`` for the reference."""
    if cache not in KV_QUANT_DTYPES:
        kc, vc = jnp.asarray(k, cache), jnp.asarray(v, cache)
        return kc, vc, {}, np.asarray(kc, np.float64), np.asarray(vc, np.float64)
    dt = KV_QUANT_DTYPES[cache]
    ks = (rng.uniform(0.5, 2.0, (2, 2)) / 100).astype(np.float32)
    vs = (rng.uniform(0.5, 2.0, (2, 2)) / 100).astype(np.float32)
    quant = jax.vmap(lambda x, s: quantize_kv(x, s, dt))
    kc = quant(jnp.asarray(np.nan_to_num(k), jnp.float32), jnp.asarray(ks))
    vc = quant(jnp.asarray(np.nan_to_num(v), jnp.float32), jnp.asarray(vs))
    return (kc, vc, {"k_scale": jnp.asarray(ks), "v_scale": jnp.asarray(vs)},
            kv_to_numpy(kc) * ks[:, None, None, :, None],
            kv_to_numpy(vc) * vs[:, None, None, :, None])


def _check_as_stored(rng, case, cache: str, head_dim: int, native_prefill: bool,
                     window: int, invariant: bool = False) -> None:
    """The op on ``case`` (``make_case``'s tuple, layer 1) with its cache stored as ``cache``
    equals the reference on the stored values, plain and with ``window`` and a soft cap; padding
    rows stay 0."""
    q, k, v, bt, sl, qsl, ns = case
    kc, vc, kw, k_deq, v_deq = _cache(rng, k, v, cache)
    total = qsl[-1]
    for win, cap in ((None, None), (window, 25.0)):
        got = _op(q, kc, vc, 1, bt, sl, qsl, ns, native_prefill, invariant,
                  sm_scale=head_dim ** -0.5, sliding_window=win, logit_soft_cap=cap, **kw)
        want = ref_ragged_paged_attention(q, k_deq, v_deq, 1, bt, sl, qsl, ns,
                                          sm_scale=head_dim ** -0.5, sliding_window=win,
                                          logit_soft_cap=cap)
        np.testing.assert_allclose(got[:total], want[:total], rtol=1e-4, atol=1e-4)
        assert np.all(got[total:] == 0.0)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8", "int8"])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (64, 3), (64, 4), (64, 5), (128, 2),
                                            (128, 3), (256, 1)])
def test_decode_rows_by_group_head_dim_and_cache(cache: str, head_dim: int, group: int) -> None:
    """Decode rows only, at the group sizes and head sizes the vectorised decode item is built
    for (and (64, 5), which takes the generic one), for each cache dtype: contexts shorter than
    a block of 16 keys, not a multiple of it and spanning many pages, with a window and a soft
    cap; pages nobody owns hold NaN."""
    rng = np.random.default_rng()
    ctx_lens = [1, 15, 16, 17, 300, 61]
    case = make_case(rng, [1] * len(ctx_lens), ctx_lens, block_size=16, num_seqs_pad=8,
                     tokens_pad=8, kv_heads=2, group=group, head_dim=head_dim)
    _check_as_stored(rng, case, cache, head_dim, native_prefill=False, window=40)


@pytest.mark.parametrize("cache,head_dim,group", [
    ("bfloat16", 64, 3), ("fp8", 64, 8), ("float32", 128, 4), ("int8", 256, 2),
    ("bfloat16", 64, 5)])
def test_invariant_decode_rows_by_group_head_dim_and_cache(cache: str, head_dim: int,
                                                           group: int) -> None:
    """Decode rows in the batch-invariant mode (with AVX-512 the invariant decode item at the
    shapes it is built for; (64, 5) and other CPUs: one-row prefill tiles) against the
    reference, as the decode item above; their bit-identity with prefill rows is
    test_cpu_attention_invariance.py's."""
    rng = np.random.default_rng()
    ctx_lens = [1, 15, 16, 17, 300, 61]
    case = make_case(rng, [1] * len(ctx_lens), ctx_lens, block_size=16, num_seqs_pad=8,
                     tokens_pad=8, kv_heads=2, group=group, head_dim=head_dim)
    _check_as_stored(rng, case, cache, head_dim, native_prefill=True, window=40, invariant=True)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8", "int8"])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (64, 3), (64, 4), (64, 8), (128, 2),
                                            (256, 1), (48, 3)])
def test_prefill_rows_by_group_head_dim_and_cache(cache: str, head_dim: int, group: int) -> None:
    """Prefill tiles at the head sizes the vectorised tile is built for (and 48, which takes the
    generic one), with 1 to 8 query heads per kv head (16 to 128 query vectors a tile), for each
    cache dtype: a fresh prompt longer than a tile, chunks continuing a cached context (one
    ending past a page boundary, one of 2 rows), beside decode rows; a window and a soft cap;
    pages nobody owns hold NaN."""
    rng = np.random.default_rng()
    q_lens = [37, 1, 16, 20, 2, 1]
    ctx_lens = [37, 60, 100, 131, 2, 17]
    case = make_case(rng, q_lens, ctx_lens, block_size=16, num_seqs_pad=8, tokens_pad=80,
                     kv_heads=2, group=group, head_dim=head_dim)
    _check_as_stored(rng, case, cache, head_dim, native_prefill=True, window=23)


def test_kernel_prefill_needs_a_rows_kernel() -> None:
    kv = jnp.zeros((1, 2, 4, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="rows_kernel_prefill=True needs a rows_kernel"):
        ragged_paged_attention(jnp.zeros((2, 1, 8)), kv, kv, jnp.int32(0),
                               jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                               jnp.array([0, 1], jnp.int32), jnp.ones((1,), jnp.int32),
                               sm_scale=1.0, rows_kernel_prefill=True)


def test_unsupported_cache_dtype_is_refused() -> None:
    kv = jnp.zeros((1, 2, 4, 1, 8), jnp.float16)
    with pytest.raises(ValueError, match="k_cache.dtype=float16"):
        cpu_attention.cpu_decode_attention(
            jnp.zeros((2, 2, 8)), kv, kv, jnp.int32(0), jnp.zeros((1, 2), jnp.int32),
            jnp.ones((1,), jnp.int32), jnp.array([0, 1], jnp.int32), jnp.ones((1,), jnp.int32))
