"""jaxserve/config.py names what the kernels and quantisers implement without importing them (the
CLI parser imports no jax); these tests keep the copies equal."""

from __future__ import annotations

from jaxserve import config
from jaxserve.platform.base import attention_fn
from models import quant
from pallas_kernels import kv_cache


def test_config_names_match_implementations() -> None:
    assert config.ATTENTION_BACKENDS[0] == "auto"
    for backend in (*config.ATTENTION_BACKENDS[1:], "native"):  # "native": auto on a CPU
        assert callable(attention_fn(backend))
    assert config.QUANTIZATION_METHODS == quant.METHODS
    assert set(config.KV_CACHE_DTYPES) == {"auto", "bfloat16", *kv_cache.KV_QUANT_DTYPES}
    assert set(config.KV_8BIT_DTYPES) == set(kv_cache.KV_QUANT_DTYPES)
