"""The native CPU bfloat16 matmul over packed weights (``cpu_kernels.bf16_matmul``):
its layout against the plain weight, its sums against XLA's bfloat16 dot, the CPU platform's
``PackedWeight`` (``jaxserve.platform.cpu_weights``) in ``models.quant.qmatmul`` (kernel and
unpacked paths) and in a model's layer scan, and the engine's choice of it (``cpu_kernels``;
tests/platform/test_platform.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import bf16_matmul as kernel
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.platform.cpu_weights import PackedWeight, use_packed_bf16
from jaxserve.sampling_params import SamplingParams
from models import quant
from models.architectures import DECODER_QUANT_TARGETS

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not kernel.available(),
    reason="the native kernel runs on XLA:CPU and needs its library built (jaxserve "
           "build-kernels)")


def _w(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(0, 0.1, shape), jnp.bfloat16)


def _xla(x: jax.Array, w: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.dot_general(x.astype(jnp.bfloat16), w, (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32))


@pytest.mark.parametrize("shape", [(576, 192), (33, 40), (1, 1), (2, 3, 17), (4, 64, 48)])
def test_pack_is_the_documented_layout_and_unpack_inverts_it(shape) -> None:
    w = _w(shape)
    p = kernel.pack(w)
    *lead, k, n = shape
    assert p.shape == (*lead, *kernel.packed_shape(k, n)) and p.dtype == jnp.bfloat16
    wn, pn = np.asarray(w.astype(jnp.float32)), np.asarray(p.astype(jnp.float32))
    wn = wn.reshape(-1, k, n)
    pn = pn.reshape(-1, *p.shape[-3:])
    for layer in range(wn.shape[0]):
        for b, pp, c, j in [(0, 0, 0, 0), (0, 0, 0, 1), (p.shape[-3] - 1, p.shape[-2] - 1, 3, 1)]:
            row, col = 2 * pp + j, 16 * b + c
            want = wn[layer, row, col] if row < k and col < n else 0.0
            assert pn[layer, b, pp, 2 * c + j] == want
    assert (kernel.unpack(p, k, n) == w).all()


@pytest.mark.parametrize("m,k,n", [(1, 576, 192), (5, 576, 576), (16, 1536, 576), (17, 33, 40),
                                   (9, 64, 16), (3, 2, 300), (64, 96, 80),
                                   # several 64-row conversion tasks; odd K after larger calls
                                   # left the reused activation buffer dirty
                                   (130, 1536, 48), (200, 577, 48), (129, 33, 40)])
def test_matches_xla_bfloat16_dot_per_layer(m: int, k: int, n: int) -> None:
    w = _w((3, k, n), seed=m)
    p = kernel.pack(w)
    x = jnp.asarray(np.random.default_rng(k).normal(0, 1, (m, k)), jnp.float32)
    for layer in range(3):
        got = np.asarray(kernel.cpu_bf16_matmul(x, p, layer, n))
        want = _xla(x, w[layer])
        assert got.shape == (m, n) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # an unstacked weight, and a traced layer index inside jit
    np.testing.assert_allclose(np.asarray(kernel.cpu_bf16_matmul(x, kernel.pack(w[1]), 0, n)),
                               _xla(x, w[1]), rtol=1e-5, atol=1e-5 * np.abs(_xla(x, w[1])).max())
    f = jax.jit(lambda x, p, i: kernel.cpu_bf16_matmul(x, p, i, n))
    np.testing.assert_allclose(np.asarray(f(x, p, jnp.int32(2))), _xla(x, w[2]), rtol=1e-5,
                               atol=1e-5 * np.abs(_xla(x, w[2])).max())


def test_bad_shapes_are_named() -> None:
    p = kernel.pack(_w((2, 64, 32)))
    x = jnp.ones((4, 64), jnp.float32)
    with pytest.raises(ValueError, match="x must be"):
        kernel.cpu_bf16_matmul(jnp.ones((64,)), p, 0, 32)
    with pytest.raises(ValueError, match="do not fit x's K=48"):
        kernel.cpu_bf16_matmul(jnp.ones((4, 48)), p, 0, 32)
    with pytest.raises(ValueError, match="do not fit"):
        kernel.cpu_bf16_matmul(x, p, 0, 64)
    with pytest.raises(ValueError, match="packed must be"):
        kernel.cpu_bf16_matmul(x, p.astype(jnp.float32), 0, 32)


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_qmatmul_of_a_packed_weight_in_a_scan_matches_the_plain_weight(rows: int) -> None:
    """Both paths: the kernel (rows <= max_rows) and XLA's dot of the unpacked layer."""
    w = _w((4, 96, 48))
    x = jnp.asarray(np.random.default_rng(1).normal(0, 1, (rows, 96)), jnp.float32)

    def scan(weight_of):
        def body(i, acc):
            return acc + quant.qmatmul(x, weight_of(i)).sum(0)
        return jax.jit(lambda: jax.lax.fori_loop(0, 4, body, jnp.zeros(48)))()

    want = np.asarray(scan(lambda i: w[i]))
    for max_rows in (8, 64):  # 40 rows: unpacked at 8, kernel at 64
        packed = kernel.pack(w)
        got = np.asarray(scan(lambda i, p=packed, r=max_rows: PackedWeight(p, 96, 48, r,
                                                                          layer=i)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="layer bound"):
        quant.qmatmul(x, PackedWeight(kernel.pack(w), 96, 48, 64))
    with pytest.raises(ValueError, match="with transpose=False only"):
        quant.qmatmul(x, PackedWeight(kernel.pack(w[0]), 96, 48, 64), transpose=True)


def test_use_packed_bf16_packs_only_bfloat16_targets_and_flax_variables_splits_them() -> None:
    params = {"embed": _w((10, 8)), "layers": {"wq": _w((2, 8, 8)), "wk": jnp.ones((2, 8, 4)),
                                               "attn_norm": {"weight": jnp.ones((2, 8))}}}
    out = use_packed_bf16(params, DECODER_QUANT_TARGETS)
    assert isinstance(out["layers"]["wq"], PackedWeight) and out["layers"]["wq"].shape == (8, 8)
    assert out["layers"]["wk"] is params["layers"]["wk"]  # float32: left alone
    assert out["embed"].transposed  # tied (no lm_head): the LM head's layout
    variables = quant.flax_variables(out)
    assert set(variables) == {"params", quant.BROADCAST}
    broadcast = variables[quant.BROADCAST]
    assert set(broadcast["layers"]) == {"wq"} and "embed" in broadcast
    assert "wq" not in variables["params"]["layers"]
    assert variables["params"]["layers"]["attn_norm"]["weight"] is params["layers"][
        "attn_norm"]["weight"]
    assert quant.flax_variables(params) == {"params": params}


def test_a_tied_embedding_packed_transposed_serves_lookup_and_lm_head() -> None:
    """``use_packed_bf16`` packs a tied table as the LM head's ``[hidden, vocab]``; its rows are
    gathered from that layout exactly, and an untied ``lm_head`` is packed as stored instead
    (the table then stays plain: it only serves lookups)."""
    emb = _w((100, 24))
    tied = use_packed_bf16({"embed": emb, "layers": {}}, DECODER_QUANT_TARGETS)["embed"]
    assert isinstance(tied, PackedWeight) and tied.transposed and tied.shape == (100, 24)
    ids = jnp.array([0, 5, 99, 16, 17, 31, 5])
    assert (quant.embed_lookup(tied, ids, jnp.float32) == emb[ids].astype(jnp.float32)).all()
    x = jnp.asarray(np.random.default_rng(3).normal(0, 1, (3, 24)), jnp.float32)
    np.testing.assert_allclose(np.asarray(quant.qmatmul(x, tied, transpose=True)),
                               np.asarray(quant.qmatmul(x, emb, transpose=True)), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="with transpose=True only"):
        quant.qmatmul(x, tied)
    head = _w((24, 100))
    untied = use_packed_bf16({"embed": emb, "lm_head": head, "layers": {}},
                             DECODER_QUANT_TARGETS)
    assert untied["embed"] is emb and not untied["lm_head"].transposed
    np.testing.assert_allclose(np.asarray(quant.qmatmul(x, untied["lm_head"])),
                               np.asarray(quant.qmatmul(x, head)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed transposed"):
        quant.embed_lookup(untied["lm_head"], ids, jnp.float32)


def _greedy(cpu_kernels: str, budget: int) -> tuple[list[list[int]], dict]:
    engine = LLMEngine(EngineConfig(
        max_model_len=256, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=budget,
        dtype="bfloat16", compilation_cache_dir="", cpu_kernels=cpu_kernels,
        attention_backend="reference"),  # only the matmuls differ between the two runs
        LoadConfig(model="tiny", load_format="dummy"))
    engine.warmup(progress=False)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (5, 40, 17, 100)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[str(i)] for i in range(len(prompts))], engine.runner.params


def test_engine_greedy_tokens_equal_with_packed_weights() -> None:
    """The tiny dummy model in bfloat16: chunked prefills beside decodes give the same greedy
    tokens through the packed kernel as through XLA's dot."""
    got, packed = _greedy("on", 64)
    want, plain = _greedy("off", 64)
    head = "lm_head" if "lm_head" in packed else "embed"
    assert isinstance(packed["layers"]["wq"], PackedWeight) and isinstance(packed[head],
                                                                           PackedWeight)
    assert not isinstance(plain["layers"]["wq"], PackedWeight)
    assert got == want and all(len(t) == 6 for t in got)
