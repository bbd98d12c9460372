"""The synchronous engine core: requests in, one batched step at a time, outputs out.

``LLMEngine.step()`` is the whole data flow of design.md:
  ``scheduler.schedule()`` (pure Python plan) -> ``runner.pack_step`` (numpy, padded to a bucket) ->
  ``runner.execute`` (one compiled XLA program, KV cache donated, sampling on device) ->
  ``update(plan, sampled)`` (token-id stop checks, block frees) -> incremental detokenisation and
  stop strings -> ``RequestOutput`` per request that changed.
The async server (``AsyncEngine``) and the offline ``LLM`` both drive this object.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxserve.core.sequence import SeqState
from jaxserve.device.host_tier import HostKVTier
from jaxserve.device.runner import ModelRunner, RowParams
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.loading.load import load_model, resolve_dtype, setup_compilation_cache
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from jaxserve.sampling_params import SamplingParams
from pallas_kernels import allocate_kv_cache, attention_fn_for_backend, kv_cache_bytes_per_block
from pallas_kernels.kv_cache import KV_FORMAT_NAMES, KV_QUANT_DTYPES

GIB = 1 << 30


@dataclass
class _Group:
    """One user request: its ``n`` choices share the prompt and the metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    choices: list[_Request] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_finished: int = 0


@dataclass
class _Request:
    """One choice of a group: one scheduler sequence (id: the group's id when n == 1, else
    ``<id>[<index>]``)."""

    request_id: str
    group: _Group
    index: int
    params: SamplingParams
    seed: int  # u64
    seq: SeqState
    detok: IncrementalDetokenizer
    last_token_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0
    slot: int = -1  # penalty-state slot while running, else -1
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    output: CompletionOutput | None = None  # the latest one
    finished: bool = False


_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads choice seeds (SplitMix64)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
      config: engine settings.
      load: where weights come from.
      metrics: an ``EngineMetrics`` (or None) updated every step.
      devices: the ``tensor_parallel_size`` devices this engine runs on (a data-parallel
        replica's group); None: the first ones. With a mesh (``tensor_parallel_size > 1`` or
        ``devices`` given) the weights are loaded by ``jaxserve.loading.sharded`` (each device reads
        its own slice where the format allows) and ``load_report`` holds its per-device
        ``LoadReport``; otherwise ``load_report`` is None.
    The KV cache may hold fewer tokens than ``max_model_len``; a request that can never fit
    in it is refused by ``validate`` (see there).

    With ``kv_cache_dtype`` "fp8" / "int8" the cache is allocated at 1 byte per element (its
    block count from the same memory budget grows accordingly) with per-(layer, kv-head)
    scales from a calibration prefill (``jaxserve.device.kv_calibration``) or 1.0
    (``kv_scale_mode="unit"``). Attributes for reports: ``kv_cache_dtype`` (the storage dtype),
    ``kv_bytes_per_token`` (bytes one token's K and V take across all layers and devices),
    ``kv_scales`` (``(k_scale, v_scale)`` numpy ``f32[num_layers, num_kv_heads]``, or None),
    ``kv_scales_source`` ("calibrated", "checkpoint": stored by ``jaxserve convert
    --kv-cache-dtype``, "unit", or None), ``kv_calibration_tokens`` and ``kv_calibration_s``.

    Raises:
      ValueError: invalid settings (max_model_len above the model's, a host tier smaller than
        one block, or one the device cannot place in pinned host memory).
    """

    def __init__(self, config: EngineConfig | None = None, load: LoadConfig | None = None,
                 metrics=None, devices: Sequence[jax.Device] | None = None) -> None:
        from models.registry import get_architecture

        self.config = config = config or EngineConfig()
        self.load_config = load = load or LoadConfig()
        self.metrics = metrics
        setup_compilation_cache(config.compilation_cache_dir)
        t0 = time.perf_counter()
        self.dtype = resolve_dtype(config.dtype)
        self.mesh = None
        self.load_report = None  # a sharded_load.LoadReport when loaded onto a mesh
        attention_fn = attention_fn_for_backend(config.attention_backend)
        if config.tensor_parallel_size > 1 or devices is not None:
            from jaxserve import sharding
            from jaxserve.loading import sharded as sharded_load

            tp = config.tensor_parallel_size
            self.mesh = sharding.make_mesh(tp, devices)
            # each device reads only its slice where the format allows; refuses a model the
            # mesh cannot split (naming the numbers) before reading weights
            loaded = sharded_load.load_sharded(load, self.dtype, config.seed, self.mesh)
            params, self.tokenizer, name = loaded.params, loaded.tokenizer, loaded.name
            self.load_report = loaded.report
            self.model_config = sharding.sharded_config(loaded.cfg, tp)
            attention_fn = sharding.shard_attention(attention_fn, self.mesh)
        else:
            self.model_config, params, self.tokenizer, name = load_model(load, self.dtype,
                                                                         config.seed)
        self.model_name = load.served_model_name or name
        mc = self.model_config
        params = self._quantize(params)
        if self.mesh is not None and config.quantization != "none":
            from jaxserve.sharding import place_params

            params = place_params(params, mc, self.mesh)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's context "
                             f"window of {mc.max_position_embeddings}")
        self.kv_cache_dtype = (self.dtype if config.kv_cache_dtype == "auto"
                               else KV_QUANT_DTYPES[config.kv_cache_dtype])
        self.kv_bytes_per_token = kv_cache_bytes_per_block(
            mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, self.kv_cache_dtype)
        self.num_blocks = self._num_kv_blocks(params)
        max_blocks = -(-self.max_model_len // config.block_size)
        # the most tokens one request (prompt + output) can hold: the context window, or the
        # whole KV cache when that is smaller
        self.max_request_tokens = min(self.max_model_len,
                                      (self.num_blocks - 1) * config.block_size)
        kv_sharding = scale_sharding = None
        if self.mesh is not None:
            from jaxserve.sharding import kv_cache_spec, kv_scale_spec

            kv_sharding = jax.sharding.NamedSharding(self.mesh, kv_cache_spec())
            scale_sharding = jax.sharding.NamedSharding(self.mesh, kv_scale_spec())
        self.model = get_architecture(mc.architecture).model(mc, self.dtype,
                                                             attention_fn=attention_fn)
        self.kv_scales = self._kv_scales(params, kv_sharding)
        scales = {} if self.kv_scales is None else {
            "k_scale": self.kv_scales[0], "v_scale": self.kv_scales[1],
            "scale_sharding": scale_sharding}
        kv = allocate_kv_cache(mc.num_layers, self.num_blocks, config.block_size,
                               mc.num_kv_heads, mc.head_dim, self.kv_cache_dtype,
                               sharding=kv_sharding, **scales)
        self.host_kv: HostKVTier | None = None
        if config.kv_offloading_size is not None:
            per_block = kv_cache_bytes_per_block(mc.num_layers, config.block_size,
                                                 mc.num_kv_heads, mc.head_dim,
                                                 self.kv_cache_dtype)
            n = int(config.kv_offloading_size * GIB // per_block)
            if n < 1:
                raise ValueError(f"kv_offloading_size={config.kv_offloading_size} GiB is less "
                                 f"than one KV block ({per_block} bytes)")
            self.host_kv = HostKVTier(kv, n + 1, max_blocks_per_copy=max_blocks)
        vocab_limit = self.tokenizer.vocab_size if self.tokenizer.vocab_size < mc.vocab_size \
            else None
        self.runner = ModelRunner(self.model, params, kv,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs,
                                  max_blocks_per_seq=max_blocks, vocab_limit=vocab_limit,
                                  mesh=self.mesh)
        if self.host_kv is not None and self.runner.multiprocess:
            raise ValueError("kv_offloading_size is not supported when one model spans several "
                             "processes (--num-processes > 1): the host-tier copies would run "
                             "on process 0 alone")
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(
            config, self.num_blocks, self.max_model_len,
            self.host_kv.num_blocks if self.host_kv is not None else 0))
        if metrics is not None:
            metrics.set_batch_limits(config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, _Request] = {}  # by sequence id
        self.groups: dict[str, _Group] = {}  # by request id
        self._free_slots = list(range(self.runner.num_penalty_slots - 1, -1, -1))
        self._slot_owner: dict[int, _Request] = {}
        self._biased_slots: set[int] = set()  # slots whose bias row is not all zeros
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.load_s = time.perf_counter() - t0

    def _quantize(self, params):
        """Load-time weight quantisation (``config.quantization``), or the check that a
        quantised checkpoint matches it; the float leaves are freed as they are replaced."""
        from models.quant import QuantConfig, apply_quantization
        from models.registry import get_architecture

        c = self.config
        arch = get_architecture(self.model_config.architecture)
        qcfg = QuantConfig(c.quantization, c.quantization_group_size, c.quantize_embeddings)
        return apply_quantization(params, arch.quant_targets, qcfg, arch.name,
                                  delete_source=True)

    def _kv_scales(self, params, kv_sharding) -> tuple[np.ndarray, np.ndarray] | None:
        """The 8-bit cache's ``(k_scale, v_scale)``, ``f32[num_layers, num_kv_heads]`` (None
        for a float cache): all 1.0 in "unit" mode, else those stored in an orbax checkpoint
        (unless a calibration file is given), else from the calibration prefill."""
        c, mc = self.config, self.model_config
        self.kv_calibration_s = 0.0
        self.kv_calibration_tokens = 0
        self.kv_scales_source = None
        if c.kv_cache_dtype == "auto":
            return None
        shape = (mc.num_layers, mc.num_kv_heads)
        if c.kv_scale_mode == "unit":
            self.kv_scales_source = "unit"
            return np.ones(shape, np.float32), np.ones(shape, np.float32)
        from jaxserve.device import kv_calibration as cal

        path = self.load_config.model
        if c.kv_calibration_file is None and self.load_config.load_format != "dummy" and path:
            stored = cal.checkpoint_kv_scales(path, mc.num_layers, mc.num_kv_heads,
                                              self.kv_cache_dtype)
            if stored is not None:
                self.kv_scales_source = "checkpoint"
                return stored
        self.kv_scales_source = "calibrated"
        t0 = time.perf_counter()
        ids = cal.calibration_token_ids(self.tokenizer, c.kv_calibration_file, min(
            cal.MAX_CALIBRATION_TOKENS, mc.max_position_embeddings))
        k_amax, v_amax = cal.calibration_amax(
            self.model, params, ids, block_size=c.block_size, dtype=self.dtype,
            percentile=c.kv_calibration_percentile, cache_sharding=kv_sharding)
        self.kv_calibration_s = time.perf_counter() - t0
        self.kv_calibration_tokens = len(ids)
        return (cal.scales_from_amax(k_amax, self.kv_cache_dtype),
                cal.scales_from_amax(v_amax, self.kv_cache_dtype))

    def weights_summary(self) -> str:
        """One line for start-up logs: the weights' format and size, e.g. ``"float32 weights,
        513 MiB"`` or ``"int8 weights (+embeddings) computing in float32, 129 MiB"``."""
        from models.quant import param_bytes

        c = self.config
        size = param_bytes(self.runner.params)["total_bytes"] / 2 ** 20
        if c.quantization == "none":
            return f"{self.dtype} weights, {size:.0f} MiB"
        group = f" group {c.quantization_group_size}" if c.quantization == "int4" else ""
        emb = " (+embeddings)" if c.quantize_embeddings else ""
        return f"{c.quantization}{group} weights{emb} computing in {self.dtype}, {size:.0f} MiB"

    def kv_cache_summary(self) -> str:
        """One line for start-up logs: the cache dtype, bytes per token, and for an 8-bit
        cache how its scales were set (e.g. ``"kv fp8 (float8_e4m3fn bits in uint8), 23040
        B/token, scales calibrated on 868 tokens in 1.2 s"``)."""
        c = self.config
        line = f"kv {c.kv_cache_dtype}"
        if c.kv_cache_dtype != "auto":
            line += f" ({KV_FORMAT_NAMES[self.kv_cache_dtype]})"
        line += f", {self.kv_bytes_per_token} B/token"
        if self.kv_scales_source == "calibrated":
            line += (f", scales calibrated on {self.kv_calibration_tokens} tokens in "
                     f"{self.kv_calibration_s:.1f} s")
        elif self.kv_scales_source is not None:
            line += f", {self.kv_scales_source} scales"
        return line

    def _num_kv_blocks(self, params) -> int:
        c, mc = self.config, self.model_config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        # per device: with tensor parallelism each device holds num_kv_heads / tp heads, and
        # both memory settings are budgets of one device (as vLLM's gpu_memory_utilization)
        per_block = kv_cache_bytes_per_block(mc.num_layers, c.block_size, mc.num_kv_heads,
                                             mc.head_dim, self.kv_cache_dtype) \
            // c.tensor_parallel_size
        if c.kv_cache_memory_gib is not None:
            budget = c.kv_cache_memory_gib * GIB
        else:
            dev = jax.local_devices()[0] if self.mesh is None else next(
                d for d in self.mesh.devices.flat if d.process_index == jax.process_index())
            stats = dev.memory_stats() or {}
            if "bytes_limit" in stats:
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
                budget = c.kv_cache_memory_fraction * free
            else:  # the CPU reports no statistics
                budget = 2 * GIB
        return max(2, int(budget // per_block))

    def warmup(self, progress: bool = True) -> dict[str, float]:
        """Compile every step program (and the host tier's copy programs); returns
        {"num_programs", "compile_s"}."""
        stats = self.runner.warmup(progress)
        if self.host_kv is not None:
            host = self.host_kv.warmup()
            stats = {k: stats[k] + host[k] for k in stats}
        return stats

    # -- requests ------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request without touching engine state (safe from any thread).

        Returns the effective max_tokens: at most what the context window leaves, and when
        max_tokens is None, what the KV cache leaves (``max_request_tokens``, the smaller of
        max_model_len and the cache's size in tokens, minus the prompt).
        Raises ValueError naming the problem: empty prompt, prompt too long, ids out of range,
        or a request the KV cache can never hold (prompt + max_tokens over its size, with the
        numbers), so that it is refused at once instead of waiting forever.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        vocab = self.tokenizer.vocab_size
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is out of range [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens; max_model_len is {self.max_model_len}, which leaves no "
                f"room for output (the prompt must have at most {self.max_model_len - 1})")
        params.validate()
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {vocab})")
        for t in params.logit_bias or {}:
            if t >= vocab:
                raise ValueError(f"logit_bias holds token id {t}, outside the vocabulary "
                                 f"[0, {vocab})")
        if params.logit_bias and self.runner.multiprocess:
            raise ValueError("logit_bias is not supported when one model spans several "
                             "processes (--num-processes > 1)")
        cache_tokens = (self.num_blocks - 1) * self.config.block_size
        if n >= self.max_request_tokens:
            raise ValueError(
                f"prompt has {n} tokens; the KV cache holds {cache_tokens} tokens "
                f"({self.num_blocks - 1} blocks of {self.config.block_size}), which leaves no "
                f"room for output (the prompt must have at most {self.max_request_tokens - 1})")
        if params.max_tokens is None:
            return self.max_request_tokens - n
        max_tokens = min(params.max_tokens, self.max_model_len - n)
        if n + max_tokens > cache_tokens:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens "
                f"can never fit in the KV cache of {cache_tokens} tokens "
                f"({self.num_blocks - 1} blocks of {self.config.block_size}); lower max_tokens "
                f"to at most {cache_tokens - n}")
        return max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, prompt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request (``params.n`` sequences). Raises ValueError (see ``validate``; also
        a duplicate id)."""
        params = params or SamplingParams()
        n = params.n
        seq_ids = [request_id] if n == 1 else [f"{request_id}[{i}]" for i in range(n)]
        if request_id in self.groups or any(i in self.requests for i in seq_ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        group = _Group(request_id, prompt, prompt_token_ids, params,
                       arrival_time if arrival_time is not None else time.monotonic())
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
        base_seed = params.seed % 2**64 if params.seed is not None else None
        for i, sid in enumerate(seq_ids):
            seq = SeqState(
                request_id=sid, token_ids=list(prompt_token_ids),
                num_prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens,
                stop_token_ids=frozenset(stop_ids),
                skip_prefix_cache=params.uses_penalty_state or (
                    i == 0 and params.prompt_logprobs is not None))
            self.scheduler.add(seq)
            if base_seed is None:
                seed = int(self._rng.integers(2**63))
            else:  # choice 0 keeps the seed; the others get distinct streams derived from it
                seed = (base_seed + i * _GOLDEN_GAMMA) % 2**64
            req = _Request(
                sid, group, i, params, seed, seq,
                IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output),
                logprobs=[] if params.logprobs is not None else None)
            group.choices.append(req)
            self.requests[sid] = req
        self.groups[request_id] = group

    def abort_request(self, request_ids: str | list[str]) -> list[str]:
        """Abort requests (unknown ids ignored; every choice of a request); their blocks go
        back at once. Returns the aborted sequence ids that were waiting or running."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        groups = [g for rid in dict.fromkeys(ids) if (g := self.groups.pop(rid, None))]
        seq_ids = [c.request_id for g in groups for c in g.choices if not c.finished]
        aborted = self.scheduler.abort(seq_ids)
        for sid in seq_ids:
            self._release_slot(self.requests.pop(sid))
        if self.metrics is not None:
            for g in groups:
                self.metrics.record_finished("abort", time.monotonic() - g.arrival_time)
        if aborted:
            self._record_step()  # the gauges must show the freed blocks even if no step follows
        return aborted

    # -- penalty-state slots ---------------------------------------------------------------------
    def _acquire_slot(self, req: _Request) -> int:
        if req.slot < 0:
            req.slot = self._free_slots.pop()  # never empty: slots >= running >= holders
            self._slot_owner[req.slot] = req
            if req.params.logit_bias:
                self.runner.set_logit_bias(req.slot, req.params.logit_bias)
                self._biased_slots.add(req.slot)
            elif req.slot in self._biased_slots:
                self.runner.set_logit_bias(req.slot, {})
                self._biased_slots.discard(req.slot)
        return req.slot

    def _release_slot(self, req: _Request) -> None:
        if req.slot >= 0:
            del self._slot_owner[req.slot]
            self._free_slots.append(req.slot)
            req.slot = -1

    def _release_idle_slots(self) -> None:
        """Free the slots of requests no longer running (preempted): they restart at position
        0, where a fresh slot is reset, so holders never outnumber ``max_num_seqs``."""
        if self._slot_owner:
            running = {s.request_id for s in self.scheduler.running}
            for req in [r for r in self._slot_owner.values() if r.request_id not in running]:
                self._release_slot(req)

    def _record_step(self, num_prompt_tokens: int = 0, num_generation_tokens: int = 0,
                     num_preemptions: int = 0, plan: SchedulerOutput | None = None) -> None:
        if self.metrics is not None:
            self.metrics.record_step(len(self.scheduler.running), len(self.scheduler.waiting),
                                     self.scheduler.block_pool.usage, num_prompt_tokens,
                                     num_generation_tokens, num_preemptions)
            if plan is not None:  # batch occupancy of the step that ran (0, 0 when idle)
                self.metrics.record_batch(len(plan.scheduled), plan.num_scheduled_tokens)
            host = self.scheduler.host_pool
            self.metrics.record_kv_stats(self.scheduler.kv_stats,
                                         None if host is None else 1 - host.num_free_blocks /
                                         host.num_usable_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block in both tiers (blocks of running requests are kept),
        e.g. between benchmark runs. Returns how many blocks were dropped."""
        kv = self.scheduler.kv
        return kv.device.reset_prefix_cache() + (kv.host.reset_prefix_cache() if kv.host else 0)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of requests with new text or a finish."""
        preempted_before = self.scheduler.num_preemptions_total
        plan = self.scheduler.schedule()
        self._copy_blocks(plan)
        if plan.is_empty:
            self._record_step(plan=plan)
            return []
        self._release_idle_slots()
        now = time.monotonic()
        rows, num_prompt_tokens, want_lp, prompt_lp_rows = [], 0, False, []
        vocab = self.tokenizer.vocab_size
        for i, s in enumerate(plan.scheduled):
            req = self.requests[s.request_id]
            g, p = req.group, req.params
            if g.first_scheduled_time is None:
                g.first_scheduled_time = now
            num_prompt = len(g.prompt_token_ids)
            end = s.start_pos + len(s.token_ids)
            targets = None
            if g.prompt_logprobs is not None and req.index == 0 and s.start_pos < num_prompt - 1:
                targets = [g.prompt_token_ids[q + 1] if q + 1 < num_prompt else -1
                           for q in range(s.start_pos, end)]
                prompt_lp_rows.append(i)
            want_lp |= s.sample and p.logprobs is not None
            rows.append(RowParams(
                p.temperature, p.top_k if 0 < p.top_k < vocab else 0, p.top_p, req.seed,
                end - num_prompt, min_p=p.min_p,
                slot=self._acquire_slot(req) if p.uses_penalty_state else -1,
                repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, reset=s.start_pos == 0,
                num_prompt_tokens=num_prompt, prompt_targets=targets))
            num_prompt_tokens += max(0, min(num_prompt, end) - s.start_pos)
        bucket, packed = self.runner.pack_step([s.token_ids for s in plan.scheduled],
                                               [s.start_pos for s in plan.scheduled],
                                               [s.block_ids for s in plan.scheduled], rows,
                                               want_logprobs=want_lp)
        out = self.runner.execute(bucket, packed)
        if prompt_lp_rows:
            self._record_prompt_logprobs(plan, rows, prompt_lp_rows, out.prompt_logprobs())
        lp = out.logprobs() if want_lp else None
        row_of = {s.request_id: i for i, s in enumerate(plan.scheduled)}
        sampled = [int(out.ids[i]) if s.sample else None for i, s in enumerate(plan.scheduled)]
        result = self.scheduler.update(plan, sampled)
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        for rid, tok in result.new_token_ids.items():
            req = self.requests[rid]
            if req.logprobs is not None and lp is not None:
                self._record_logprobs(req, tok, lp, row_of[rid])
            if self._process(req, tok, result.finished.get(rid), now):
                touched[req.group.request_id] = req.group
        outputs = [self._group_output(g, now) for g in touched.values()]
        self._record_step(num_prompt_tokens, len(result.new_token_ids),
                          self.scheduler.num_preemptions_total - preempted_before, plan)
        return outputs

    def _copy_blocks(self, plan: SchedulerOutput) -> None:
        """Run the plan's host-tier copies, offloads then loads, before its forward pass."""
        if plan.offloads:
            self.host_kv.offload(self.runner.kv_cache, plan.offloads)
        if plan.loads:
            self.runner.kv_cache = self.host_kv.load(self.runner.kv_cache, plan.loads)

    def _entry(self, ids, vals, n: int, chosen: int, chosen_lp: float, chosen_rank: int,
               skip_special: bool) -> TokenLogprobs:
        tok = self.tokenizer
        text = lambda t: tok.token_bytes(t, skip_special).decode("utf-8", "replace")
        entry = {int(ids[j]): Logprob(float(vals[j]), j + 1, text(int(ids[j]))) for j in range(n)}
        if chosen not in entry:
            entry[chosen] = Logprob(float(chosen_lp), int(chosen_rank), text(chosen))
        return entry

    def _record_logprobs(self, req: _Request, tok: int, lp, row: int) -> None:
        entry = self._entry(lp.top_ids[row], lp.top_logprobs[row], req.params.logprobs, tok,
                            lp.chosen_logprob[row], lp.chosen_rank[row],
                            req.params.skip_special_tokens)
        req.logprobs.append(entry)
        req.cumulative_logprob += entry[tok].logprob

    def _record_prompt_logprobs(self, plan, rows: list[RowParams], which: list[int], plp
                                ) -> None:
        starts = np.cumsum([0] + [len(s.token_ids) for s in plan.scheduled])
        for i in which:
            s, g = plan.scheduled[i], self.requests[plan.scheduled[i].request_id].group
            for j, target in enumerate(rows[i].prompt_targets):
                q = s.start_pos + j + 1  # the prompt position this token's logits predict
                if target < 0 or g.prompt_logprobs[q] is not None:
                    continue  # recomputed after a preemption: keep the first values
                t = starts[i] + j
                g.prompt_logprobs[q] = self._entry(
                    plp.top_ids[t], plp.top_logprobs[t], g.params.prompt_logprobs, target,
                    plp.chosen_logprob[t], plp.chosen_rank[t], g.params.skip_special_tokens)

    def _process(self, req: _Request, token: int, finish: str | None, now: float) -> bool:
        """Advance one choice by a sampled token; True if it has a new output."""
        rid, g, m = req.request_id, req.group, self.metrics
        req.output_token_ids.append(token)
        if g.first_token_time is None:
            g.first_token_time = now
            if m is not None:
                m.record_first_token(now - g.arrival_time,
                                     (g.first_scheduled_time or now) - g.arrival_time)
        elif m is not None and req.last_token_time is not None:
            m.record_inter_token(now - req.last_token_time)
        req.last_token_time = now
        stop_reason: str | int | None = None
        if finish == "stop":
            # a stop token's own text is not part of the output (as vLLM)
            delta = ""
            if token not in self.tokenizer.eos_token_ids or token in req.params.stop_token_ids:
                stop_reason = token
        else:
            delta = req.detok.add_tokens([token])
            if req.detok.stopped:
                finish, stop_reason = "stop", req.detok.stop_reason
                self.scheduler.finish([rid])
        if finish is not None and not req.detok.stopped:
            delta += req.detok.finish()
        new_ids = req.output_token_ids[req.num_emitted_tokens:]
        if not delta and finish is None:
            return False  # text held back (partial UTF-8 or a possible stop string)
        req.num_emitted_tokens = len(req.output_token_ids)
        req.output = CompletionOutput(
            index=req.index, text=req.detok.text, token_ids=list(req.output_token_ids),
            finish_reason=finish, stop_reason=stop_reason, delta_text=delta,
            delta_token_ids=new_ids,
            logprobs=None if req.logprobs is None else list(req.logprobs),
            cumulative_logprob=None if req.logprobs is None else req.cumulative_logprob)
        if finish is not None:
            req.finished = True
            g.num_finished += 1
            del self.requests[rid]
            self._release_slot(req)
        return True

    def _group_output(self, g: _Group, now: float) -> RequestOutput:
        """The request's output after a step in which some choice changed."""
        outs = []
        for c in g.choices:
            o = c.output
            if o is None:
                o = CompletionOutput(index=c.index, text="", token_ids=[],
                                     logprobs=None if c.logprobs is None else [])
            elif o.delta_text or o.delta_token_ids:
                c.output = dataclasses.replace(o, delta_text="", delta_token_ids=[])
            outs.append(o)
        metrics = {"arrival_time": g.arrival_time}
        if g.first_token_time is not None:
            metrics["first_token_time"] = g.first_token_time
        if g.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = g.first_scheduled_time
        finished = g.num_finished == len(g.choices)
        if finished:
            metrics["finished_time"] = now
            del self.groups[g.request_id]
            if self.metrics is not None:
                self.metrics.record_finished(g.choices[0].output.finish_reason,
                                             now - g.arrival_time)
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs,
                             finished=finished, metrics=metrics,
                             prompt_logprobs=g.prompt_logprobs)

    def next_request_id(self) -> str:
        """A fresh id for callers that have none."""
        return f"req-{next(self._ids)}"
