"""jaxserve/config.py names what the kernels and quantisers implement without importing them (the
CLI parser imports no jax); these tests keep the copies equal."""

from __future__ import annotations

import pallas_kernels
from jaxserve import config
from models import quant
from pallas_kernels import kv_cache


def test_config_names_match_implementations() -> None:
    assert config.ATTENTION_BACKENDS == pallas_kernels.ATTENTION_BACKENDS
    assert config.QUANTIZATION_METHODS == quant.METHODS
    assert set(config.KV_CACHE_DTYPES) == {"auto", "bfloat16", *kv_cache.KV_QUANT_DTYPES}
    assert set(config.KV_8BIT_DTYPES) == set(kv_cache.KV_QUANT_DTYPES)
