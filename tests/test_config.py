"""jaxserve/config.py names what the kernels and quantisers implement without importing them (the
CLI parser imports no jax); these tests keep the copies equal."""

from __future__ import annotations

from jaxserve import attention_backend, config
from models import quant
from pallas_kernels import kv_cache


def test_config_names_match_implementations() -> None:
    assert config.ATTENTION_BACKENDS == attention_backend.ATTENTION_BACKENDS
    assert config.QUANTIZATION_METHODS == quant.METHODS
    assert set(config.KV_CACHE_DTYPES) == {"auto", "bfloat16", *kv_cache.KV_QUANT_DTYPES}
    assert set(config.KV_8BIT_DTYPES) == set(kv_cache.KV_QUANT_DTYPES)
