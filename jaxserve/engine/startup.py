"""Start-up assembly: settings in, the parts an ``LLMEngine`` runs with out.

``assemble`` runs the stages in order, timing each (``EngineParts.startup_s``):
  load_weights: the platform's dtype and attention op; ``load_model`` onto one device or the
                tensor-parallel mesh (quantised if asked); the model; weights prepared for
                the platform's kernels (``Platform.prepare_weights``)
  plan_kv:      ``plan_kv_cache`` (storage dtype, block count from the memory budget, 8-bit
                scales)
  kv_cache:     the paged KV cache and the host tier
  runner:       the ``ModelRunner`` over the platform's bucket set, with the executable cache
  engine:       request bounds and the scheduler's config (with the platform's step-cost prior)
Nothing here runs a step or compiles a program: ``LLMEngine.warmup`` does.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve import sharding
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.core.plan import SchedulerConfig
from jaxserve.core.step_cost import StepCostModel
from jaxserve.device.executable_cache import ExecutableCache
from jaxserve.device.host_tier import HostKVTier
from jaxserve.device.runner import ModelRunner
from jaxserve.engine.kv_budget import GIB, KVLayout, plan_kv_cache
from jaxserve.engine.validation import RequestBounds
from jaxserve.loading.load import load_model, setup_compilation_cache
from jaxserve.loading.sharded import LoadReport
from jaxserve.platform import current_platform
from jaxserve.platform.base import Platform, attention_fn
from jaxserve.tokenizer import Tokenizer
from models.config import ModelConfig
from models.interface import CausalLM
from models.quant import QuantConfig
from models.registry import get_architecture
from pallas_kernels import allocate_kv_cache, kv_cache_bytes_per_block


@dataclass(frozen=True)
class EngineParts:
    """What ``assemble`` built (the engine keeps what it uses as attributes of the same name).

    Fields:
      platform: the backend's policy (``jaxserve.platform``).
      dtype, compute_dtype: the weights' storage dtype and the activations' dtype.
      attention_backend: ``config.attention_backend`` with "auto" resolved.
      mesh: the tensor-parallel (or replica) mesh; None on one device.
      model_config: the model's config (on a mesh: ``sharding.sharded_config``).
      model, tokenizer, model_name: the model, its tokenizer and served name.
      load_report: per-device figures of a load onto a mesh; None without one.
      max_model_len: the longest request in tokens.
      kv_layout: the KV cache's storage (dtype, ``num_blocks`` incl. block 0, scales).
      runner: params, KV cache (and its host tier) and the step programs.
      bounds: what ``validate_request`` checks against.
      scheduler_config: the scheduler's settings, token buckets included.
      startup_s: seconds per stage (load_weights, plan_kv, kv_cache, runner, engine).
    """

    platform: Platform
    dtype: jnp.dtype
    compute_dtype: jnp.dtype
    attention_backend: str
    mesh: jax.sharding.Mesh | None
    model_config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    model_name: str
    load_report: LoadReport | None
    max_model_len: int
    kv_layout: KVLayout
    runner: ModelRunner
    bounds: RequestBounds
    scheduler_config: SchedulerConfig
    startup_s: dict[str, float]


def resolve_slos_ms(config: EngineConfig, platform: Platform, has_prior: bool
                    ) -> tuple[float, float]:
    """The service objectives ``(ttft_ms, itl_ms)`` the scheduler plans for (0: none):
    ``config.ttft_slo_ms`` / ``itl_slo_ms`` where given, else the platform's defaults;
    ``has_prior``: the platform has a step-cost prior for this model.

    Raises:
      ValueError: an objective on a platform without a step-cost model (nothing to plan with).
    """
    default = (platform.default_slos_ms or (0.0, 0.0)) if has_prior else (0.0, 0.0)
    ttft = default[0] if config.ttft_slo_ms is None else config.ttft_slo_ms
    itl = default[1] if config.itl_slo_ms is None else config.itl_slo_ms
    if (ttft or itl) and not has_prior:
        raise ValueError(f"ttft_slo_ms={ttft:g} and itl_slo_ms={itl:g} need a step-cost model, "
                         f"which the {platform.name!r} platform does not have; set both to 0")
    return ttft, itl


def assemble(config: EngineConfig, load: LoadConfig, devices: Sequence[jax.Device] | None = None,
             metrics_name: str | None = None) -> EngineParts:
    """Build everything an engine needs (the module docstring lists the stages).

    Args:
      config, load: the engine's and the loader's settings.
      devices: the ``tensor_parallel_size`` devices to run on (None: the first ones); with
        ``tensor_parallel_size > 1`` or ``devices`` given the engine runs on a mesh.
      metrics_name: the ``model_name`` label of the caller's metrics, checked against the
        served name once it is known (None: no metrics).

    Raises:
      ValueError: invalid settings (max_model_len above the model's, a host tier smaller than
        one block or one the device cannot place in pinned host memory, a host tier when one
        model spans several processes, ``itl_slo_ms`` on a platform without a step-cost
        prior), metrics labelled with another name, or a model the settings cannot load (as
        ``load_model``).
    """
    setup_compilation_cache(config.compilation_cache_dir)
    t0 = time.perf_counter()
    platform = current_platform()
    dtype = platform.resolve_dtype(config.dtype)
    backend = platform.attention_backend(config)
    invariant = platform.batch_invariant(config)
    attention = attention_fn(backend, invariant)
    tp = config.tensor_parallel_size
    mesh = sharding.make_mesh(tp, devices) if tp > 1 or devices is not None else None
    loaded = load_model(load, dtype, config.seed, mesh, quantization=QuantConfig(
        config.quantization, config.quantization_group_size, config.quantize_embeddings))
    t_load = time.perf_counter()
    model_name = load.served_model_name or loaded.name
    if metrics_name is not None and metrics_name != model_name:
        raise ValueError(f"metrics are labelled model_name={metrics_name!r}; the engine "
                         f"serves {model_name!r} (build them with "
                         f"EngineMetrics(loading.served_name(load)))")
    mc, tokenizer = loaded.model_config, loaded.tokenizer
    kv_sharding = scale_sharding = None
    if mesh is not None:
        mc = sharding.sharded_config(mc, tp)
        attention = sharding.shard_attention(attention, mesh)
        kv_sharding = jax.sharding.NamedSharding(mesh, sharding.kv_cache_spec())
        scale_sharding = jax.sharding.NamedSharding(mesh, sharding.kv_scale_spec())
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context "
                         f"window of {mc.max_position_embeddings}")
    compute_dtype = platform.compute_dtype(dtype)
    arch = get_architecture(mc.architecture)
    model = arch.model(mc, compute_dtype, attention_fn=attention)
    params = platform.prepare_weights(loaded.params, config, dtype, arch.quant_targets)
    kv_layout = plan_kv_cache(config, load, model, params, dtype, tokenizer, mesh, kv_sharding)
    t_plan = time.perf_counter()
    max_blocks = -(-max_model_len // config.block_size)
    scales = {} if kv_layout.scales is None else {
        "k_scale": kv_layout.scales[0], "v_scale": kv_layout.scales[1],
        "scale_sharding": scale_sharding}
    kv = allocate_kv_cache(mc.num_layers, kv_layout.num_blocks, config.block_size,
                           mc.num_kv_heads, mc.head_dim, kv_layout.dtype,
                           sharding=kv_sharding, **scales)
    host_kv = None
    if config.kv_offloading_size is not None:
        per_block = kv_cache_bytes_per_block(mc.num_layers, config.block_size,
                                             mc.num_kv_heads, mc.head_dim, kv_layout.dtype)
        n = int(config.kv_offloading_size * GIB // per_block)
        if n < 1:
            raise ValueError(f"kv_offloading_size={config.kv_offloading_size} GiB is less "
                             f"than one KV block ({per_block} bytes)")
        host_kv = HostKVTier(kv, n + 1, max_blocks_per_copy=max_blocks)
    t_kv = time.perf_counter()
    # programs over a mesh are not cached (their device assignment is the mesh's)
    exe_cache = ExecutableCache(os.path.join(os.path.expanduser(
        config.compilation_cache_dir), "jaxserve-executables")) \
        if config.compilation_cache_dir and mesh is None else None
    buckets = platform.buckets(config)
    runner = ModelRunner(
        model, params, kv, max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs, small_buckets=buckets.small,
        mid_buckets_up_to=buckets.mid_up_to, sampler_rows=buckets.sampler_rows,
        min_bucket_tokens=buckets.min_tokens,
        max_blocks_per_seq=max_blocks,
        vocab_limit=tokenizer.vocab_size if tokenizer.vocab_size < mc.vocab_size else None,
        mesh=mesh, executable_cache=exe_cache, host_tier=host_kv,
        program_description=repr((
            type(model).__module__, type(model).__qualname__, mc, str(dtype),
            # where the caches live does not change a program
            dataclasses.replace(config, compilation_cache_dir=""))))
    t_runner = time.perf_counter()
    if host_kv is not None and runner.multiprocess:
        raise ValueError("kv_offloading_size is not supported when one model spans several "
                         "processes (--num-processes > 1): the host-tier copies would run "
                         "on process 0 alone")
    bounds = RequestBounds(tokenizer.vocab_size, max_model_len, kv_layout.num_blocks,
                           config.block_size, runner.multiprocess, tokenizer.eos_token_ids)
    prior = platform.step_cost_prior(mc, dtype)
    ttft_ms, itl_ms = resolve_slos_ms(config, platform, prior is not None)
    step_cost = None  # the prior; the scheduler refits it as steps run
    if ttft_ms or itl_ms:
        step_cost = StepCostModel.prior(prior.step_overhead_tokens, prior.prompt_token_s,
                                        prior.prefill_pair_s)
    sched_config = dataclasses.replace(
        SchedulerConfig.from_engine_config(config, kv_layout.num_blocks, max_model_len,
                                           host_kv.num_blocks if host_kv is not None else 0,
                                           step_cost, ttft_ms / 1000, itl_ms / 1000),
        token_buckets=tuple(b.num_tokens for b in runner.buckets),
        step_overhead_tokens=platform.step_overhead_tokens,
        # one model over several processes: the followers replay the steps (runner.follow)
        # without the engine's overlap, so the loop stays synchronous there
        async_scheduling=config.async_scheduling and not runner.multiprocess)
    t_end = time.perf_counter()
    return EngineParts(
        platform=platform, dtype=dtype, compute_dtype=compute_dtype, attention_backend=backend,
        mesh=mesh, model_config=mc, model=model, tokenizer=tokenizer, model_name=model_name,
        load_report=loaded.report, max_model_len=max_model_len, kv_layout=kv_layout,
        runner=runner, bounds=bounds, scheduler_config=sched_config,
        startup_s={"load_weights": t_load - t0, "plan_kv": t_plan - t_load,
                   "kv_cache": t_kv - t_plan, "runner": t_runner - t_kv,
                   "engine": t_end - t_runner})
