"""The platform's answers (jaxserve/platform/): attention op, weight preparation for the native
CPU kernels under ``cpu_kernels``, buckets and step cost, per backend."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest

from cpu_kernels.attention import cpu_decode_attention
from jaxserve.config import EngineConfig
from jaxserve.device.buckets import token_buckets
from jaxserve.platform import cpu, current_platform
from jaxserve.platform import gpu as gpu_module
from jaxserve.platform.base import attention_fn
from jaxserve.platform.cpu_weights import NativeInt4Weight, PackedWeight
from jaxserve.platform.gpu import GpuPlatform
from models.architectures import DECODER_QUANT_TARGETS
from models.config import builtin_config
from models.quant import QuantConfig, quantize_params
from pallas_kernels import (
    ragged_paged_attention,
    ragged_paged_attention_mosaic,
    ragged_paged_attention_pallas,
)

CPU = cpu.CpuPlatform()
NATIVE = {"rows_kernel": cpu_decode_attention, "rows_kernel_prefill": True}
LLAMA_8B = builtin_config("llama-3.1-8b")


def test_this_machine_is_the_cpu_platform() -> None:
    assert jax.default_backend() == "cpu" and isinstance(current_platform(), cpu.CpuPlatform)
    assert current_platform() is current_platform()


def test_the_attention_fn_of_each_backend() -> None:
    assert attention_fn("reference") is ragged_paged_attention
    assert attention_fn("pallas") is ragged_paged_attention_pallas
    native = attention_fn("native")
    assert native.func is ragged_paged_attention and native.keywords == NATIVE
    f = attention_fn("pallas-interpret")
    assert f.func is ragged_paged_attention_pallas and f.keywords == {"interpret": True}
    assert attention_fn("mosaic") is ragged_paged_attention_mosaic
    f = attention_fn("mosaic-interpret")
    assert f.func is ragged_paged_attention_mosaic and f.keywords == {"interpret": True}
    for unresolved in ("auto", "triton"):
        with pytest.raises(ValueError, match=repr(unresolved)):
            attention_fn(unresolved)


@pytest.mark.parametrize("available", [True, False])
def test_cpu_attention_follows_cpu_kernels(monkeypatch, available: bool) -> None:
    monkeypatch.setattr(cpu.cpu_attention, "available", lambda: available)
    want = "native" if available else "reference"
    assert CPU.attention_backend(EngineConfig()) == want
    assert CPU.attention_backend(EngineConfig(cpu_kernels="off")) == "reference"
    assert CPU.attention_backend(EngineConfig(attention_backend="reference")) == "reference"
    assert CPU.attention_backend(EngineConfig(attention_backend="pallas-interpret")
                                 ) == "pallas-interpret"
    if available:
        assert CPU.attention_backend(EngineConfig(cpu_kernels="on")) == "native"
    else:
        with pytest.raises(RuntimeError, match="cpu_kernels='on' needs the native CPU kernels"):
            CPU.check(EngineConfig(cpu_kernels="on"))
    for backend in ("pallas", "mosaic"):
        with pytest.raises(ValueError, match=f"attention_backend='{backend}'.*GPUs only, not on "
                                             "'cpu'"):
            CPU.check(EngineConfig(attention_backend=backend))


@dataclass(frozen=True)
class StubDevice:
    device_kind: str
    compute_capability: str


H100 = StubDevice("NVIDIA H100 80GB HBM3", "9.0")
A100 = StubDevice("NVIDIA A100-SXM4-80GB", "8.0")


def test_gpu_answers() -> None:
    gpu = GpuPlatform("gpu", H100)
    assert gpu.attention_backend(EngineConfig()) == "mosaic"
    assert gpu.attention_backend(EngineConfig(attention_backend="reference")) == "reference"
    assert gpu.attention_backend(EngineConfig(attention_backend="pallas")) == "pallas"
    with pytest.raises(ValueError, match="cpu_kernels='on'.*CPUs only, not on 'gpu'"):
        gpu.check(EngineConfig(cpu_kernels="on"))
    other = GpuPlatform("tpu", H100)  # another accelerator: the jnp op, no Pallas GPU kernel
    assert other.attention_backend(EngineConfig()) == "reference"
    for backend in ("pallas", "mosaic"):
        with pytest.raises(ValueError, match="GPUs only, not on 'tpu'"):
            other.check(EngineConfig(attention_backend=backend))
    assert other.step_cost_prior(LLAMA_8B, jnp.bfloat16) is None
    assert gpu.resolve_dtype("auto") == jnp.bfloat16
    assert gpu.compute_dtype(jnp.bfloat16) == jnp.bfloat16
    assert gpu.buckets(EngineConfig()) == type(gpu.buckets(EngineConfig()))()  # powers of two
    assert gpu.step_overhead_tokens > CPU.step_overhead_tokens
    params = {"w": jnp.ones((2, 2), jnp.bfloat16)}
    assert gpu.prepare_weights(params, EngineConfig(), jnp.bfloat16, DECODER_QUANT_TARGETS
                               ) is params


def test_gpu_attention_by_compute_capability_and_cache_dtype() -> None:
    """Mosaic GPU (TMA, wgmma) from compute capability 9.0 with a 16- or 8-bit cache and pages of
    a multiple of 8 tokens; the Triton kernel below it, for a float32 cache or smaller pages."""
    hopper, ampere = GpuPlatform("gpu", H100), GpuPlatform("cuda", A100)
    assert ampere.attention_backend(EngineConfig()) == "pallas"
    assert hopper.attention_backend(EngineConfig(dtype="float32")) == "pallas"
    assert hopper.attention_backend(EngineConfig(dtype="float32", kv_cache_dtype="fp8")
                                    ) == "mosaic"
    assert GpuPlatform("gpu", StubDevice("NVIDIA B200", "10.0")).attention_backend(
        EngineConfig()) == "mosaic"
    with pytest.raises(ValueError, match="compute capability >= 9.0.*A100.*8.0"):
        ampere.check(EngineConfig(attention_backend="mosaic"))
    with pytest.raises(ValueError, match="16-bit or 8-bit KV cache"):
        hopper.check(EngineConfig(attention_backend="mosaic", dtype="float32"))
    assert hopper.attention_backend(EngineConfig(block_size=4)) == "pallas"
    with pytest.raises(ValueError, match="block_size a multiple of 8"):
        hopper.check(EngineConfig(attention_backend="mosaic", block_size=4))


def test_gpu_step_cost_prior_from_device_figures() -> None:
    """The roofline of the datasheet figures: the weights' read is a step's fixed cost, a prompt
    token costs its matmul FLOPs, a pair its attention FLOPs; a faster device costs less."""
    h100 = GpuPlatform("gpu", H100).step_cost_prior(LLAMA_8B, jnp.bfloat16)
    f = gpu_module.device_figures(H100.device_kind)
    assert f == gpu_module.DeviceFigures(3.35e12, 989e12)
    token_s = 2 * LLAMA_8B.num_params / (989e12 * gpu_module.MATMUL_EFFICIENCY)
    assert h100.prompt_token_s == pytest.approx(token_s)
    fixed_s = 2 * LLAMA_8B.num_params / (3.35e12 * gpu_module.BANDWIDTH_EFFICIENCY)
    assert h100.step_overhead_tokens == round(fixed_s / token_s)
    assert h100.prefill_pair_s == pytest.approx(4 * 32 * 128 * 32 / (989e12 * 0.5))
    # an 8-bit copy of the weights halves the read, not the FLOPs
    fp8 = GpuPlatform("gpu", H100).step_cost_prior(LLAMA_8B, jnp.int8)
    assert fp8.prompt_token_s == h100.prompt_token_s
    assert fp8.step_overhead_tokens == pytest.approx(h100.step_overhead_tokens / 2, abs=1)
    a100 = GpuPlatform("gpu", A100).step_cost_prior(LLAMA_8B, jnp.bfloat16)
    assert a100.prompt_token_s > h100.prompt_token_s
    for kind, want in (("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H200", 4.8e12),
                       ("NVIDIA A100-SXM4-40GB", 1.555e12), ("NVIDIA L40S", 864e9),
                       ("NVIDIA GeForce RTX 4090", 1.008e12)):
        assert gpu_module.device_figures(kind).memory_bytes_s == want, kind
    assert gpu_module.device_figures("NVIDIA GeForce GTX 1080") is None
    odd = GpuPlatform("gpu", StubDevice("NVIDIA GeForce GTX 1080", "6.1"))
    assert odd.figures == gpu_module.UNKNOWN_DEVICE
    assert odd.step_cost_prior(LLAMA_8B, jnp.bfloat16).prompt_token_s > 0


def test_cpu_buckets_add_small_and_mid_shapes() -> None:
    b = CPU.buckets(EngineConfig(max_num_seqs=48))
    assert b.small == cpu.SMALL_BUCKETS == (1, 4) and b.mid_up_to == 48
    # samplers for fewer row counts than buckets: 8 rows sample with 16, 24 with 32
    assert b.sampler_rows == (1, 4, 16, 32, 48)
    assert cpu.cpu_sampler_rows(64) == (1, 4, 16, 32, 64)
    assert cpu.cpu_sampler_rows(4) == (1, 4) and cpu.cpu_sampler_rows(1) == (1,)


@pytest.mark.parametrize("native", [True, False])
def test_cpu_batch_invariance_is_opt_in_and_refuses_what_it_cannot_run(
        monkeypatch, native: bool) -> None:
    """"auto" and "off" leave the mode off for every dtype (it costs tokens:
    docs/configuration.md#batch-invariance); "on" needs the native attention kernel,
    unquantised weights and one device, and says which it lacks."""
    monkeypatch.setattr(cpu.cpu_attention, "available", lambda: native)
    monkeypatch.setattr(cpu.cpu_bf16_matmul, "vectorized", lambda: False)
    inv = lambda **kw: CPU.batch_invariant(EngineConfig(**kw))
    for mode in ("auto", "off"):
        assert inv(dtype="bfloat16", batch_invariant=mode) is False
        assert inv(dtype="float32", batch_invariant=mode) is False
    assert inv(dtype="bfloat16", quantization="int8") is False  # nothing to refuse when off
    if not native:
        with pytest.raises(ValueError, match="batch_invariant='on' needs the native attention"):
            CPU.check(EngineConfig(batch_invariant="on"))
        return
    assert inv(dtype="float32", batch_invariant="on") is True
    assert inv(dtype="bfloat16", batch_invariant="on") is True
    for bad, why in (({"attention_backend": "reference"}, "attention_backend='reference'"),
                     ({"cpu_kernels": "off"}, "native attention kernel .got cpu_kernels='off'"),
                     ({"quantization": "int4"}, "quantization='none'"),
                     ({"tensor_parallel_size": 2}, "tensor_parallel_size=1")):
        with pytest.raises(ValueError, match=f"batch_invariant='on' needs.*{why}"):
            CPU.check(EngineConfig(batch_invariant="on", **bad))


def test_batch_invariant_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="batch_invariant='always' must be one of"):
        EngineConfig(batch_invariant="always")
    with pytest.raises(ValueError, match="batch_invariant='on' is built for the CPU only"):
        GpuPlatform("gpu", H100).check(EngineConfig(batch_invariant="on"))
    assert GpuPlatform("gpu", H100).batch_invariant(EngineConfig()) is False


def test_cpu_batch_invariant_buckets_start_at_the_dot_row_floor(monkeypatch) -> None:
    """Invariant steps run no bucket below the dtype's matmul row floor: XLA's mixed bfloat16
    dot 2 rows (no 1-token bucket), float32 64; the native bfloat16 kernel 1."""
    monkeypatch.setattr(cpu.cpu_attention, "available", lambda: True)
    monkeypatch.setattr(cpu.cpu_bf16_matmul, "vectorized", lambda: False)
    b = CPU.buckets(EngineConfig(dtype="bfloat16", batch_invariant="on"))
    assert (b.min_tokens, b.sampler_rows) == (2, (4, 16, 32, 64))
    assert token_buckets(1024, b.small, b.mid_up_to, b.min_tokens)[0] == 4
    b = CPU.buckets(EngineConfig(dtype="float32", batch_invariant="on"))
    assert (b.min_tokens, b.sampler_rows) == (64, (64,))
    assert token_buckets(1024, b.small, b.mid_up_to, b.min_tokens)[0] == 64
    for dtype in ("float32", "bfloat16"):  # auto: off, every bucket
        assert CPU.buckets(EngineConfig(dtype=dtype)).min_tokens == 1
    monkeypatch.setattr(cpu.cpu_bf16_matmul, "vectorized", lambda: True)
    b = CPU.buckets(EngineConfig(dtype="bfloat16", batch_invariant="on"))
    assert (b.min_tokens, b.small) == (1, cpu.SMALL_BUCKETS)
    invariant = attention_fn("native", invariant=True)
    assert invariant.keywords["rows_kernel"].keywords == {"invariant": True}
    with pytest.raises(ValueError, match="native CPU kernel only"):
        attention_fn("reference", invariant=True)


def _prepared(monkeypatch, *, vectorized: bool = True, int4: bool = True, **config) -> list:
    """Which weight preparations ``CpuPlatform.prepare_weights`` asks for under ``config``."""
    calls = []
    monkeypatch.setattr(cpu.cpu_bf16_matmul, "vectorized", lambda: vectorized)
    monkeypatch.setattr(cpu.cpu_int4_matmul, "available", lambda: int4)
    monkeypatch.setattr(cpu, "use_packed_bf16", lambda p, t: calls.append("bf16") or p)
    monkeypatch.setattr(cpu, "use_native_int4", lambda p, rows: calls.append(f"int4/{rows}") or p)
    dtype = jnp.dtype(config.pop("dtype", "bfloat16"))
    CPU.prepare_weights({}, EngineConfig(**config), dtype, DECODER_QUANT_TARGETS)
    return calls


def test_cpu_weight_preparation(monkeypatch) -> None:
    rows = f"int4/{cpu.NATIVE_INT4_MAX_ROWS}"
    assert _prepared(monkeypatch) == ["bf16"]
    assert _prepared(monkeypatch, vectorized=False) == []  # no AVX512-BF16: XLA's dot
    assert _prepared(monkeypatch, vectorized=False, cpu_kernels="on") == ["bf16"]
    assert _prepared(monkeypatch, dtype="float32") == []
    assert _prepared(monkeypatch, cpu_kernels="off") == []
    assert _prepared(monkeypatch, tensor_parallel_size=2) == []  # custom calls XLA can't split
    assert _prepared(monkeypatch, quantization="int8") == []
    assert _prepared(monkeypatch, quantization="int4") == [rows]
    assert _prepared(monkeypatch, quantization="int4", int4=False) == []
    assert _prepared(monkeypatch, quantization="int4", int4=False, cpu_kernels="on") == [rows]
    assert _prepared(monkeypatch, quantization="int4", cpu_kernels="off") == []


@pytest.mark.skipif(not cpu.cpu_bf16_matmul.vectorized(),
                    reason="bfloat16 weights are packed where the avx512bf16 build of the native "
                           "kernels loads (a CPU with AVX512-BF16)")
def test_this_cpu_packs_bfloat16_weights_and_runs_int4_natively() -> None:
    """Nothing stubbed: the default settings on this CPU swap in its kernel-backed weights."""
    layers = {"wq": jnp.ones((2, 32, 32), jnp.bfloat16), "wk": jnp.ones((2, 32, 16), jnp.bfloat16)}
    params = {"embed": jnp.ones((64, 32), jnp.bfloat16), "layers": layers}
    out = CPU.prepare_weights(params, EngineConfig(dtype="bfloat16"), jnp.dtype(jnp.bfloat16),
                              DECODER_QUANT_TARGETS)
    assert isinstance(out["layers"]["wq"], PackedWeight) and out["embed"].transposed
    f32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)
    q4 = quantize_params(f32, DECODER_QUANT_TARGETS, QuantConfig("int4", 16))
    out = CPU.prepare_weights(q4, EngineConfig(quantization="int4", quantization_group_size=16),
                              jnp.dtype(jnp.float32), DECODER_QUANT_TARGETS)
    wq = out["layers"]["wq"]
    assert isinstance(wq, NativeInt4Weight) and wq.base is q4["layers"]["wq"]
    assert wq.max_rows == cpu.NATIVE_INT4_MAX_ROWS


def test_cpu_kernels_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="cpu_kernels='fast' must be one of"):
        EngineConfig(cpu_kernels="fast")
    with pytest.raises(ValueError, match="attention_backend='native'"):
        EngineConfig(attention_backend="native")  # now cpu_kernels' to choose


@pytest.mark.parametrize("itl_slo_ms,objectives_s", [(40, (1.0, 0.04)), (None, (1.0, 0.1))])
def test_objectives_start_on_a_gpu_platform(monkeypatch, itl_slo_ms, objectives_s) -> None:
    """Start-up on a (stubbed) H100 takes the platform's prior for the tiny dummy model, so
    ``--itl-slo-ms`` and the GPU's default objectives work there; nothing is compiled or run."""
    from jaxserve.config import LoadConfig
    from jaxserve.engine import startup

    gpu = GpuPlatform("gpu", H100)
    monkeypatch.setattr(startup, "current_platform", lambda: gpu)
    parts = startup.assemble(
        EngineConfig(attention_backend="reference", itl_slo_ms=itl_slo_ms, max_model_len=128,
                     num_kv_blocks=16, compilation_cache_dir=""),
        LoadConfig(model="tiny", load_format="dummy"))
    sched = parts.scheduler_config
    prior = gpu.step_cost_prior(parts.model_config, parts.dtype)
    assert sched.step_cost.per_token_s == pytest.approx(prior.prompt_token_s)
    assert sched.step_cost.fixed_s == pytest.approx(prior.step_overhead_tokens
                                                    * prior.prompt_token_s)
    assert sched.step_cost.per_prefill_pair_s == pytest.approx(prior.prefill_pair_s)
    assert (sched.ttft_slo_s, sched.itl_slo_s) == pytest.approx(objectives_s)
