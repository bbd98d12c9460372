"""jaxserve/config.py names what the kernels and quantisers implement without importing them (the
CLI parser imports no jax); these tests keep the copies equal."""

from __future__ import annotations

import dataclasses
import inspect

from jaxserve import config
from jaxserve.config import EngineConfig
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


def test_the_objectives_help_takes_its_numbers_from_the_code() -> None:
    """The default objectives, the minimum prefill chunk and the bypass bound are defined once
    (config.py) and the flags' help says them; the CPU platform and the policy use them."""
    from jaxserve.config import DEFAULT_SLOS_MS, MAX_PREFILL_SKIPS, MIN_PREFILL_TOKENS
    from jaxserve.core.plan import SchedulerConfig
    from jaxserve.core.step_cost import prefill_token_budget
    from jaxserve.platform.cpu import CpuPlatform

    fields = {f.name: f.metadata["help"] for f in dataclasses.fields(EngineConfig)}
    (cpu_ttft, cpu_itl), (gpu_ttft, gpu_itl) = DEFAULT_SLOS_MS["cpu"], DEFAULT_SLOS_MS["gpu"]
    assert f"{cpu_ttft:g} on a CPU, {gpu_ttft:g} on a GPU" in fields["ttft_slo_ms"]
    assert f"{cpu_itl:g} on a CPU" in fields["itl_slo_ms"]
    assert f"{gpu_itl:g} on a GPU" in fields["itl_slo_ms"]
    assert f"at least {MIN_PREFILL_TOKENS} tokens" in fields["itl_slo_ms"]
    assert f"bypassed {MAX_PREFILL_SKIPS} steps" in fields["prefill_order"]
    assert CpuPlatform.default_slos_ms == DEFAULT_SLOS_MS["cpu"]
    assert SchedulerConfig(1, 8, 8, 8, 2).max_prefill_skips == MAX_PREFILL_SKIPS
    assert inspect.signature(prefill_token_budget).parameters[
        "min_prefill_tokens"].default == MIN_PREFILL_TOKENS
