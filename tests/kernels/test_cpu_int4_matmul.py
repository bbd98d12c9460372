"""The native CPU int4 matmul (``cpu_kernels.int4_matmul``) against the dequantised
weight in float64, alone, as the CPU platform's ``NativeInt4Weight`` through
``models.quant.qmatmul`` in a jitted scan, and the engine's choice of it (``cpu_kernels``;
tests/platform/test_platform.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import int4_matmul as cpu_int4_matmul
from jaxserve.config import EngineConfig
from jaxserve.engine.kv_budget import weights_summary
from jaxserve.platform.cpu_weights import NATIVE_INT4_MAX_ROWS, NativeInt4Weight, use_native_int4
from models import quant, quant_formats
from models.quant_formats import QuantizedWeight

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not cpu_int4_matmul.available(),
    reason="the native kernel runs on XLA:CPU and needs its library built (jaxserve "
           "build-kernels)")


def _weight(k: int, n: int, group: int, seed: int = 0) -> QuantizedWeight:
    w = np.random.default_rng(seed).normal(0, 0.05, (k, n)).astype(np.float32)
    w[:, 1] *= 50  # a column of large weights, another all zero
    w[:, 2] = 0.0
    return quant.quantize(jnp.asarray(w), "int4", group)


def _reference(x: np.ndarray, qw: QuantizedWeight) -> np.ndarray:
    return np.asarray(x, np.float64) @ np.asarray(quant.dequantize(qw), np.float64)


def _assert_close(got: np.ndarray, x: np.ndarray, qw: QuantizedWeight) -> None:
    """Within float32 rounding of the sums the kernel forms: relative to ``|x| @ (q + zero /
    16) |scale|``, since ``x q s`` and ``x zero s / 16`` are summed apart and then subtracted."""
    want = _reference(x, qw)
    k = x.shape[1]
    q = np.asarray(quant_formats.unpack_int4(qw.q, 0), np.float64)
    rep = lambda a: np.repeat(np.asarray(a, np.float64), k // a.shape[0], axis=0)
    terms = (q + rep(qw.zero) / 16) * np.abs(rep(qw.scale))
    bound = np.abs(np.asarray(x, np.float64)) @ terms
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= 2e-6 * bound + 1e-30), np.max(np.abs(got - want) / bound)


@pytest.mark.parametrize("k,n,group", [(64, 32, 32), (96, 200, 16), (128, 40, 2),
                                       (64, 7, 64), (576, 192, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11])
def test_matches_the_dequantised_weight(k: int, n: int, group: int, rows: int) -> None:
    """Every row tile (4, 2, 1) and column path (32-column blocks, the scalar tail)."""
    qw = _weight(k, n, group, seed=rows)
    x = np.random.default_rng(100 + rows).normal(0, 1, (rows, k)).astype(np.float32)
    got = np.asarray(cpu_int4_matmul.cpu_int4_matmul(jnp.asarray(x), qw.q, qw.scale, qw.zero))
    _assert_close(got, x, qw)


def test_every_float16_scale_class() -> None:
    """Scales the quantiser never writes (it clips to [2**-14, 65504]) still decode exactly in
    the vector and the scalar column paths: subnormal, zero, the largest, negative."""
    k, n = 32, 44  # 40 columns in vector blocks (32 and 8), 4 in the scalar tail
    q = jnp.asarray(np.random.default_rng(1).integers(0, 256, (k // 2, n)), jnp.uint8)
    scale_vals = np.array([2.0 ** -24, 0.0, 65504.0, -0.5, 2.0 ** -14, 1.0, 3e-6, 0.125],
                          np.float16)
    scale = jnp.asarray(np.concatenate([np.tile(scale_vals, 5), scale_vals[:4]])[None, :],
                        jnp.float16)
    zero = jnp.asarray(np.random.default_rng(2).integers(0, 256, (1, n)), jnp.uint8)
    qw = QuantizedWeight(q, scale, "int4", k, -2, zero)
    x = np.random.default_rng(3).normal(0, 1, (3, k)).astype(np.float32)
    got = np.asarray(cpu_int4_matmul.cpu_int4_matmul(jnp.asarray(x), q, scale, zero))
    _assert_close(got, x, qw)


def test_empty_shapes() -> None:
    """No rows, no columns, or an empty contraction (zeros, as a dot of nothing)."""
    qw = _weight(64, 32, 32)
    none = cpu_int4_matmul.cpu_int4_matmul(jnp.ones((0, 64)), qw.q, qw.scale, qw.zero)
    assert none.shape == (0, 32)
    empty = cpu_int4_matmul.cpu_int4_matmul(
        jnp.ones((2, 0)), jnp.zeros((0, 8), jnp.uint8), jnp.ones((1, 8), jnp.float16),
        jnp.zeros((1, 8), jnp.uint8))
    np.testing.assert_array_equal(np.asarray(empty), np.zeros((2, 8), np.float32))


def test_only_a_native_weight_with_rows_reaches_the_kernel() -> None:
    """A plain int4 weight never reaches the kernel, nor an empty batch of a native one."""
    qw = _weight(64, 32, 32)
    lower = lambda rows, w: jax.jit(quant.qmatmul).lower(jnp.ones((rows, 64)), w).as_text()
    assert "jaxserve_cpu_int4_matmul" not in lower(1, qw)
    assert "jaxserve_cpu_int4_matmul" not in lower(0, use_native_int4(qw, 1))
    assert "jaxserve_cpu_int4_matmul" in lower(1, use_native_int4(qw, 1))


def test_bad_shapes_and_dtypes_name_the_arguments() -> None:
    qw = _weight(64, 32, 32)
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="must be 2-D"):
        cpu_int4_matmul.cpu_int4_matmul(x[None], qw.q, qw.scale, qw.zero)
    with pytest.raises(ValueError, match="K // 2, N"):
        cpu_int4_matmul.cpu_int4_matmul(jnp.ones((2, 62)), qw.q, qw.scale, qw.zero)
    with pytest.raises(ValueError, match="scale float16"):
        cpu_int4_matmul.cpu_int4_matmul(x, qw.q, qw.scale.astype(jnp.float32), qw.zero)


def test_qmatmul_uses_it_up_to_its_rows_inside_a_jitted_scan() -> None:
    """Stacked weights sliced by a scan, as the models run them: the native rows agree with
    the XLA path within float32 reassociation, and above ``max_rows`` the XLA path runs
    (the result is then bit-identical)."""
    layers, k, n = 3, 96, 96
    stacked = quant.quantize(jnp.asarray(np.random.default_rng(5).normal(
        0, 0.05, (layers, k, n)), jnp.float32), "int4", 32)
    native = use_native_int4(stacked, 4)
    assert isinstance(native, NativeInt4Weight) and native.max_rows == 4
    assert native.base is stacked

    @jax.jit
    def run(w, x):
        def body(h, wl):
            return jnp.tanh(quant.qmatmul(h, wl)) * 3.0, None
        return jax.lax.scan(body, x, w)[0]

    for rows, exact in ((1, False), (4, False), (5, True)):
        x = jnp.asarray(np.random.default_rng(rows).normal(0, 1, (rows, k)), jnp.float32)
        want, got = np.asarray(run(stacked, x)), np.asarray(run(native, x))
        if exact:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            hlo = run.lower(native, x).as_text()
            assert "jaxserve_cpu_int4_matmul" in hlo


def test_the_start_up_line_names_the_kernel() -> None:
    w = quant.quantize(jnp.asarray(np.random.default_rng(0).normal(0, 0.05, (64, 32)),
                                   jnp.float32), "int4", 32)
    cfg = EngineConfig(quantization="int4")
    assert "native" not in weights_summary({"w": w}, cfg, jnp.dtype("float32"))
    line = weights_summary({"w": use_native_int4(w, 4)}, cfg, jnp.dtype("float32"))
    assert line.startswith("int4 group 32 weights computing in float32 (up to 4 rows in the "
                           "native CPU kernel), ")


def test_use_native_int4_wraps_int4_linears_only() -> None:
    w = jnp.asarray(np.random.default_rng(0).normal(0, 0.05, (64, 32)), jnp.float32)
    params = {"lin": quant.quantize(w, "int4", 32), "emb": quant.quantize(w, "int4", 32, axis=-1),
              "i8": quant.quantize(w, "int8"), "plain": w}
    out = use_native_int4(params, NATIVE_INT4_MAX_ROWS)
    assert isinstance(out["lin"], NativeInt4Weight) and out["lin"].base is params["lin"]
    assert out["lin"].max_rows == NATIVE_INT4_MAX_ROWS
    assert out["emb"] is params["emb"] and out["i8"] is params["i8"]
    assert out["plain"] is w
    again = use_native_int4(out, 2)["lin"]  # a native weight gets the new bound, not a wrapper
    assert again.base is params["lin"] and again.max_rows == 2
    with pytest.raises(ValueError, match="max_rows=0 must be >= 1"):
        use_native_int4(params, 0)


def test_a_model_step_of_one_row_agrees_with_the_xla_path() -> None:
    """The tiny Llama (int4, group 16) on one token: the logits of the native matmuls equal the
    dequantise-then-dot ones within float32 reassociation; at two rows both run XLA's path."""
    from models.architectures import DECODER_QUANT_TARGETS
    from models.config import builtin_config
    from models.llama import LlamaForCausalLM
    from models.loader import dummy_params
    from tests.support.prefill import prefill_logits

    model = LlamaForCausalLM(builtin_config("tiny"), jnp.float32)
    params = jax.tree_util.tree_map(lambda a: a * 10 if a.ndim > 1 else a,
                                    dummy_params(model, 1))
    qp = quant.quantize_params(params, DECODER_QUANT_TARGETS, quant.QuantConfig("int4", 16))
    native = use_native_int4(qp, 1)
    assert native["layers"]["wq"].max_rows == 1
    (want,) = prefill_logits(model, qp, [[17]])
    (got,) = prefill_logits(model, native, [[17]])
    assert np.std(want) > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    (want2,) = prefill_logits(model, qp, [[17, 5]])
    (got2,) = prefill_logits(model, native, [[17, 5]])
    np.testing.assert_array_equal(got2, want2)
