"""The Pallas Mosaic GPU ragged paged attention kernel: GPU interpret mode against the numpy
reference, lowering for an H100 / H200 without a GPU, and the engine end to end.

Interpret mode (``plgpu.InterpretGPUParams``) simulates global and shared memory, the three
warpgroups of a CTA, barriers and TMA copies on the CPU; the kernel runs it with the race
detector on and out-of-bounds reads raising, and every call here asserts no race was seen. The
same numeric test body runs on a GPU with ``interpret=False`` (``JAXSERVE_TEST_ON_GPU=1`` and a
CUDA backend of compute capability >= 9.0). Inputs are fresh random draws each run; pages no
sequence owns and slots past each context hold NaN, so a stray read shows.

Tolerances, against the float64 reference of the same inputs rounded as the kernel rounds them
(q to the 16-bit compute dtype): bfloat16 2e-2 (the probabilities enter the P.V product in
bfloat16), float16 5e-3; an 8-bit cache is converted exactly, so its bound is bfloat16's.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device.buckets import make_buckets
from pallas_kernels import ref_ragged_paged_attention
from pallas_kernels.kv_cache import FP8_STORAGE, quantize_kv
from pallas_kernels.ragged_paged_attention_mosaic import (
    compute_dtype,
    ragged_paged_attention_mosaic,
)
from pallas_kernels.testing import make_case

ON_GPU = jax.default_backend() == "gpu" and os.environ.get("JAXSERVE_TEST_ON_GPU") == "1"
INTERPRET = not ON_GPU
TOL = {"bfloat16": 2e-2, "float16": 5e-3}
MOSAIC_CALL = "mosaic_gpu_v2"
BS = 16


def races_found() -> bool:
    """Whether GPU interpret mode's race detector saw a race in the last interpreted kernel
    (jax 0.11.2 keeps the detector's state in this private module; no public accessor)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return gpu_callbacks.get_races().races_found


def check_against_reference(case, q_dtype: str, kv_dtype: str | None = None, *,
                            sliding_window=None, logit_soft_cap=None, layers=(0, 1),
                            **knobs) -> None:
    """Run the kernel on ``case`` (q in ``q_dtype``, the cache in ``kv_dtype``, default q's;
    "fp8"/"int8" quantise it with random scales) at ``layers``; compare with the reference."""
    q, k, v, bt, sl, qsl, ns = case
    head_dim, num_layers, num_kv_heads = q.shape[-1], k.shape[0], k.shape[3]
    kv_dtype = kv_dtype or q_dtype
    scales = {}
    if kv_dtype in ("fp8", "int8"):
        store = FP8_STORAGE if kv_dtype == "fp8" else jnp.dtype(jnp.int8)
        rng = np.random.default_rng()
        ks, vs = (jnp.asarray(rng.uniform(0.5, 2.0, (num_layers, num_kv_heads)) / 100, jnp.float32)
                  for _ in range(2))
        kc = jnp.stack([quantize_kv(jnp.asarray(k[i], jnp.float32), ks[i], store)
                        for i in range(num_layers)])
        vc = jnp.stack([quantize_kv(jnp.asarray(v[i], jnp.float32), vs[i], store)
                        for i in range(num_layers)])
        scales = {"k_scale": ks, "v_scale": vs}
    else:
        kc, vc = jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype)
    dt = compute_dtype(jnp.dtype(q_dtype), kc.dtype)
    q_in = jnp.asarray(q, q_dtype)
    q_ref = np.asarray(q_in.astype(dt).astype(jnp.float32), np.float64)
    k_ref = kc if scales else np.asarray(kc.astype(jnp.float32), np.float64)
    v_ref = vc if scales else np.asarray(vc.astype(jnp.float32), np.float64)
    tol = TOL[jnp.dtype(dt).name]
    for layer in layers:
        got = ragged_paged_attention_mosaic(
            q_in, kc, vc, jnp.int32(layer), jnp.asarray(bt), jnp.asarray(sl), jnp.asarray(qsl),
            jnp.asarray(ns), sm_scale=head_dim ** -0.5, sliding_window=sliding_window,
            logit_soft_cap=logit_soft_cap, interpret=INTERPRET, **scales, **knobs)
        assert got.dtype == jnp.dtype(q_dtype) and got.shape == q.shape
        if INTERPRET:
            assert not races_found(), "the race detector saw a race (printed above)"
        want = ref_ragged_paged_attention(
            q_ref, k_ref, v_ref, layer, bt, sl, qsl, ns, sm_scale=head_dim ** -0.5,
            sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
            **{n: np.asarray(s) for n, s in scales.items()})
        got = np.asarray(got.astype(jnp.float32), np.float64)
        total = int(qsl[-1])
        assert np.all(np.isfinite(got)), "NaN/inf: a read outside the context"
        np.testing.assert_allclose(got[:total], want[:total], rtol=tol, atol=tol)
        assert np.all(got[total:] == 0.0), "padding rows must be zero"


def test_decode_only() -> None:
    """Contexts off and on page boundaries (the last page partly filled, or exactly full), and
    one long enough for several pipeline steps (the ring wraps)."""
    rng = np.random.default_rng()
    ctx = [1, 3, BS - 1, BS, BS + 1, 2 * BS, 300]
    case = make_case(rng, [1] * len(ctx), ctx, block_size=BS, num_seqs_pad=8, tokens_pad=8)
    check_against_reference(case, "bfloat16", block_k=64, num_kv_splits=1, layers=(1,))


def test_decode_kv_splits() -> None:
    """Flash-decoding: the keys split into partial softmaxes merged by the wrapper, one split
    with no key at all for the short contexts."""
    rng = np.random.default_rng()
    ctx = [1, BS + 1, 200]
    case = make_case(rng, [1] * len(ctx), ctx, block_size=BS, num_seqs_pad=4, tokens_pad=4)
    check_against_reference(case, "bfloat16", block_k=64, num_kv_splits=3, layers=(0,))


def test_prefill_and_one_token_prompts() -> None:
    """Fresh prompts, one-token ones among them, one ending exactly on a page boundary and one
    longer than a compute tile's tokens (two query blocks)."""
    rng = np.random.default_rng()
    ctx = [1, 5, 1, 2 * BS, 70]
    case = make_case(rng, ctx, ctx, block_size=BS, num_seqs_pad=8, tokens_pad=112,
                     kv_heads=1, group=2)
    check_against_reference(case, "bfloat16", block_k=64, layers=(0,))


@pytest.mark.parametrize("q_dtype,kv_dtype", [("bfloat16", None), ("float16", None),
                                              ("float32", "bfloat16")])
def test_mixed(q_dtype: str, kv_dtype: str | None) -> None:
    """Decodes beside a fresh prefill and continued chunks, one ending on a page boundary."""
    rng = np.random.default_rng()
    q_lens = [1, 13, 1, 5, 16]
    ctx = [BS, 13, 150, BS + 1, 2 * BS]
    case = make_case(rng, q_lens, ctx, block_size=BS, num_seqs_pad=8, tokens_pad=40)
    check_against_reference(case, q_dtype, kv_dtype, block_k=64, layers=(1,))


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_8bit_cache(kv_dtype: str) -> None:
    """8-bit pages (e4m3 bits in uint8, int8) with per-(layer, kv head) scales, converted in
    shared memory; pages past the contexts hold NaN bit patterns (fp8) or garbage (int8)."""
    rng = np.random.default_rng()
    q_lens = [1, 9, 1]
    ctx = [BS + 3, 9, 140]
    case = make_case(rng, q_lens, ctx, block_size=BS, num_seqs_pad=4, tokens_pad=16,
                     head_dim=64)
    check_against_reference(case, "bfloat16", kv_dtype, layers=(1,))


@pytest.mark.parametrize("window,cap", [(5, None), (None, 20.0), (BS + 3, 10.0)])
def test_sliding_window_and_soft_cap(window: int | None, cap: float | None) -> None:
    rng = np.random.default_rng()
    q_lens = [1, 9, 1, 4]
    ctx = [BS + 1, 9, 100, 2 * BS - 1]
    case = make_case(rng, q_lens, ctx, block_size=BS, num_seqs_pad=4, tokens_pad=16)
    check_against_reference(case, "bfloat16", sliding_window=window, logit_soft_cap=cap,
                            block_k=64, num_kv_splits=2, layers=(0,))


def test_traced_sliding_window() -> None:
    """The window as a traced ``i32`` scalar reaches the kernel as an input: windowed and full
    (window past the context) results from one compiled program."""
    rng = np.random.default_rng()
    q, k, v, bt, sl, qsl, ns = make_case(rng, [1, 9, 1], [BS + 1, 9, 100], block_size=BS,
                                         num_seqs_pad=4, tokens_pad=16)
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))

    @jax.jit
    def run(window):
        return ragged_paged_attention_mosaic(
            qb, kb, vb, jnp.int32(0), jnp.asarray(bt), jnp.asarray(sl), jnp.asarray(qsl),
            jnp.asarray(ns), sm_scale=0.25, sliding_window=window, interpret=INTERPRET)

    total = qsl[-1]
    rounded = [np.asarray(x.astype(jnp.float32), np.float64) for x in (qb, kb, vb)]
    programs = []
    for window, ref_window in ((5, 5), (1 << 30, None), (9, 9)):
        got = np.asarray(run(jnp.int32(window)).astype(jnp.float32))
        want = ref_ragged_paged_attention(*rounded, 0, bt, sl, qsl, ns, sm_scale=0.25,
                                          sliding_window=ref_window)
        np.testing.assert_allclose(got[:total], want[:total], rtol=2e-2, atol=2e-2)
        programs.append(run._cache_size())
    # the first interpreted kernel registers one more jax config value (jax 0.11.2), which
    # changes the trace context once; from the second call on, one program serves every window
    assert programs[2] == programs[1]


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,block_k", [
    (1, 1, 32, 8, 64),  # MHA-like, the smallest pages
    (3, 3, 64, 16, 128),  # SmolLM2's layout: 9 q heads over 3 kv heads
    (2, 4, 128, 16, 128),  # Llama-3.1-8B's group and head_dim (32 / 8 / 128)
    (1, 16, 16, 32, 64),  # a wide group; the tiny test model's head_dim
    (1, 2, 256, 64, 64),  # Gemma's widest head_dim, one page a step
])
def test_head_layouts(kv_heads: int, group: int, head_dim: int, block_size: int,
                      block_k: int) -> None:
    rng = np.random.default_rng()
    q_lens = [1, 7, 1]
    ctx = [block_size + 1, 7, 3 * block_size - 1]
    case = make_case(rng, q_lens, ctx, block_size=block_size, num_seqs_pad=4, tokens_pad=16,
                     kv_heads=kv_heads, group=group, head_dim=head_dim)
    check_against_reference(case, "bfloat16", block_k=block_k, layers=(1,))


def test_validation_names_the_value() -> None:
    meta = (jnp.int32(0), jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32),
            jnp.zeros((3,), jnp.int32), jnp.zeros((1,), jnp.int32))
    call = functools.partial(ragged_paged_attention_mosaic, sm_scale=1.0, interpret=True)
    for d in (24, 80):  # 80: a multiple of 16, not a whole number of 128-byte swizzle spans
        q, kv = jnp.zeros((8, 4, d), jnp.bfloat16), jnp.zeros((1, 4, 16, 2, d), jnp.bfloat16)
        with pytest.raises(ValueError, match=f"head_dim={d}"):
            call(q, kv, kv, *meta)
    q, kv = jnp.zeros((8, 4, 64), jnp.bfloat16), jnp.zeros((1, 4, 16, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="k_cache.dtype=float32"):
        call(q, kv, kv, *meta)
    kv = jnp.zeros((1, 4, 12, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_size=12"):
        call(q, kv, kv, *meta)
    kv = jnp.zeros((1, 4, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_k=96"):
        call(q, kv, kv, *meta, block_k=96)
    with pytest.raises(ValueError, match="k_scale"):
        call(q, kv.astype(jnp.int8), kv.astype(jnp.int8), *meta)
    q, kv = jnp.zeros((8, 4, 128), jnp.bfloat16), jnp.zeros((1, 4, 64, 2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_k=256 and stages=3 .* shared memory"):
        call(q, kv, kv, *meta, block_k=256, stages=3)


# -- lowering for Hopper, no GPU needed ------------------------------------------------------------
def abstract_gpu(kind: str) -> jax.sharding.AbstractMesh:
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind=kind, num_cores=132, platform="gpu"))


def lower_for(kind: str, num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
              head_dim: int, num_layers: int, num_blocks: int, dtype, max_blocks: int,
              kv_dtype=None, block_size: int = 16, **kw) -> str:
    """StableHLO text of the kernel exported for CUDA on an abstract GPU of ``kind`` (the
    Mosaic GPU lowering runs in full: layouts, wgmma shapes, TMA transforms, shared memory)."""
    kv_dtype = kv_dtype or dtype
    quant = jnp.dtype(kv_dtype) in (FP8_STORAGE, jnp.dtype(jnp.int8))
    f = jax.jit(functools.partial(ragged_paged_attention_mosaic, sm_scale=head_dim ** -0.5,
                                  **kw))
    cache = jax.ShapeDtypeStruct((num_layers, num_blocks, block_size, num_kv_heads, head_dim),
                                 kv_dtype)
    i32 = jnp.int32
    scale = jax.ShapeDtypeStruct((num_layers, num_kv_heads), jnp.float32)
    args = (jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype), cache, cache,
            jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((num_seqs, max_blocks), i32),
            jax.ShapeDtypeStruct((num_seqs,), i32), jax.ShapeDtypeStruct((num_seqs + 1,), i32),
            jax.ShapeDtypeStruct((1,), i32))
    with jax.sharding.use_abstract_mesh(abstract_gpu(kind)):
        exported = jax.export.export(f, platforms=["cuda"])(
            *args, **({"k_scale": scale, "v_scale": scale} if quant else {}))
    return exported.mlir_module()


# (name, num_q_heads, num_kv_heads, head_dim, num_layers, num_blocks, dtype, kv dtype, max_len)
MODEL_SHAPES = [
    ("smollm2-135m", 9, 3, 64, 30, 4096, jnp.bfloat16, None, 8192),
    ("llama-3.1-8b", 32, 8, 128, 32, 20000, jnp.bfloat16, None, 131072),
    ("llama-3.1-8b-fp8", 32, 8, 128, 32, 20000, jnp.bfloat16, FP8_STORAGE, 131072),
    ("llama-3.1-8b-int8", 32, 8, 128, 32, 20000, jnp.bfloat16, jnp.int8, 131072),
]


@pytest.mark.parametrize("model", MODEL_SHAPES, ids=lambda m: m[0])
def test_lowers_for_h100_at_engine_buckets(model) -> None:
    """The token buckets of the engine defaults (8..512 tokens, 64 sequences; all of them for
    the 8B's bfloat16 cache, the smallest, a middle and the largest for the others), with P in
    registers (the GPU default, which interpret mode cannot run) and, at one bucket, through
    shared memory (the path the interpret tests run)."""
    name, nq, nkv, d, layers, blocks, dtype, kv_dtype, max_len = model
    buckets = make_buckets(512, 64)
    if name != "llama-3.1-8b":
        buckets = [b for b in buckets if b.num_tokens in (8, 64, 512)]
    for b in buckets:
        text = lower_for("NVIDIA H100 80GB HBM3", b.num_tokens, b.num_seqs, nq, nkv, d, layers,
                         blocks, dtype, max_len // 16, kv_dtype)
        assert MOSAIC_CALL in text, f"{name} T={b.num_tokens}: no Mosaic GPU custom call"
    assert MOSAIC_CALL in lower_for("NVIDIA H200", 64, 64, nq, nkv, d, layers, blocks, dtype,
                                    max_len // 16, kv_dtype, p_in_smem=True)


@pytest.mark.parametrize("kw", [
    {"sliding_window": 4096, "logit_soft_cap": 50.0},
    {"num_kv_splits": 8, "block_k": 64, "stages": 4},
    {"block_k": 128, "block_size": 64, "stages": 3},
])
def test_lowers_for_h100_with_knobs(kw) -> None:
    text = lower_for("NVIDIA H100 80GB HBM3", 64, 64, 32, 8, 128, 32, 1024, jnp.bfloat16,
                     max_blocks=256, **kw)
    assert MOSAIC_CALL in text


@pytest.mark.parametrize("nq,nkv,d,dtype", [(4, 1, 256, jnp.float16), (8, 4, 16, jnp.bfloat16),
                                            (8, 8, 64, jnp.float32)])
def test_lowers_other_layouts(nq: int, nkv: int, d: int, dtype) -> None:
    kv = jnp.bfloat16 if dtype == jnp.float32 else dtype
    text = lower_for("NVIDIA H100 80GB HBM3", 8, 8, nq, nkv, d, 4, 256, dtype, 64, kv)
    assert MOSAIC_CALL in text


# -- the engine through the kernel -----------------------------------------------------------------
def _greedy_tokens(backend: str, prompts: list[list[int]]) -> list[list[int]]:
    from jaxserve.config import EngineConfig, LoadConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(attention_backend=backend, max_model_len=128, num_kv_blocks=32,
                     max_num_batched_tokens=32, max_num_seqs=2, dtype="bfloat16",
                     compilation_cache_dir="", async_scheduling=False),
        LoadConfig(model="tiny", load_format="dummy"))
    fn = engine.model.module.attention_fn
    if backend == "mosaic-interpret":
        assert getattr(fn, "func", fn) is ragged_paged_attention_mosaic
    engine.warmup(progress=False)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {}
    for _ in range(100):
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    return [out[str(i)] for i in range(len(prompts))]


def test_engine_greedy_tokens_match_reference() -> None:
    """The tiny dummy model (bfloat16 weights and cache) generates the same greedy tokens
    through the kernel in GPU interpret mode as through the jnp op: a 20-token prompt beside a
    5-token one, then decodes."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (5, 20)]
    want = _greedy_tokens("reference", prompts)
    got = _greedy_tokens("mosaic-interpret", prompts)
    assert got == want
    assert all(len(t) == 3 for t in got)
