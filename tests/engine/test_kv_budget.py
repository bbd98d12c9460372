"""KV-cache sizing and scales (``jaxserve.engine.kv_budget``) for the tiny model, without
allocating a cache: blocks from a memory budget, 1-byte storage, unit scales, the summary line.
Calibrated and checkpoint scales run through whole engines in tests/device/test_kv_quant.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.kv_budget import KVLayout, plan_kv_cache
from models.config import builtin_config
from models.llama import LlamaForCausalLM
from pallas_kernels import kv_cache_bytes_per_block
from pallas_kernels.kv_cache import KV_QUANT_DTYPES

TINY = builtin_config("tiny")
MODEL = LlamaForCausalLM(TINY)  # holds no weights
DUMMY = LoadConfig("tiny", "dummy")


def _plan(**kw) -> KVLayout:
    config = EngineConfig(compilation_cache_dir="", **kw)
    return plan_kv_cache(config, DUMMY, MODEL, None, jnp.dtype(jnp.float32), None, None, None)


def test_float_cache_from_a_memory_budget() -> None:
    got = _plan(kv_cache_memory_gib=0.01)
    per_block = kv_cache_bytes_per_block(TINY.num_layers, 16, TINY.num_kv_heads, TINY.head_dim,
                                         jnp.float32)
    assert got.num_blocks == int(0.01 * 2**30 // per_block)
    assert got.dtype == jnp.float32 and got.bytes_per_token == per_block // 16
    assert (got.scales, got.scales_source, got.calibration_tokens) == (None, None, 0)
    assert got.summary() == f"kv auto (float32), {got.bytes_per_token} B/token"


def test_bfloat16_cache_is_half_of_float32_and_has_no_scales() -> None:
    f32 = _plan(kv_cache_memory_gib=0.01)
    got = _plan(kv_cache_dtype="bfloat16", kv_cache_memory_gib=0.01)
    assert got.dtype == jnp.bfloat16 and 2 * got.bytes_per_token == f32.bytes_per_token
    assert 2 * f32.num_blocks <= got.num_blocks < 2 * (f32.num_blocks + 1)
    assert (got.scales, got.scales_source, got.calibration_tokens) == (None, None, 0)
    assert got.summary() == f"kv bfloat16, {got.bytes_per_token} B/token"


def test_calibration_file_is_refused_for_a_float_cache(tmp_path) -> None:
    cal = tmp_path / "cal.txt"
    cal.write_text("some text")
    for kv in ("auto", "bfloat16"):
        with pytest.raises(ValueError, match="kv_calibration_file"):
            EngineConfig(kv_cache_dtype=kv, kv_calibration_file=str(cal))


def test_unit_scales_for_a_one_byte_cache() -> None:
    got = _plan(kv_cache_dtype="fp8", kv_scale_mode="unit", num_kv_blocks=7)
    assert got.num_blocks == 7 and got.dtype == KV_QUANT_DTYPES["fp8"]
    assert got.bytes_per_token == 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim
    for s in got.scales:
        assert s.shape == (TINY.num_layers, TINY.num_kv_heads) and s.dtype == np.float32
        np.testing.assert_array_equal(s, 1.0)
    assert got.summary() == (f"kv fp8 (float8_e4m3fn bits in uint8), {got.bytes_per_token} "
                             f"B/token, unit scales")


def test_summary_of_calibrated_scales() -> None:
    layout = KVLayout("int8", jnp.dtype(jnp.int8), 10, 512, None, "calibrated",
                      calibration_tokens=868, calibration_s=1.23)
    assert layout.summary() == ("kv int8 (int8), 512 B/token, scales calibrated on 868 tokens "
                                "in 1.2 s")
