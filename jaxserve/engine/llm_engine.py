"""The engine: requests in, one batched step at a time, outputs out.

Start-up: ``load_model`` (weights onto one device or the tensor-parallel mesh, quantised if
asked) -> ``plan_kv_cache`` (storage dtype, block count from the memory budget, 8-bit scales)
-> the paged KV cache, the host tier and the ``ModelRunner``.

``add_request`` checks a request (``validate_request``) and queues one scheduler sequence per
choice. ``step()`` then runs:
  ``scheduler.schedule()`` (host Python plan) -> ``runner.pack_step`` (numpy, padded to a
  bucket; constrained rows' allowed-token masks from their grammars) -> ``runner.execute``
  (one compiled XLA program, KV cache donated, sampling on device) -> each grammar advanced
  by its sampled token -> ``scheduler.update`` (token-id stop checks, block frees) -> incremental
  detokenisation and stop strings -> one ``RequestOutput`` per request that changed
  (``request_state``).
With async scheduling (``EngineConfig.async_scheduling``, the default) a call plans, packs
and dispatches step N+1 first and then reads step N, which ran on the device meanwhile; step
N+1's tokens that step N samples are gathered on the device (docs/architecture.md#async-scheduling).
A step with a structured-output row is completed in its own call.
The async server (``AsyncEngine``) and the offline ``LLM`` both drive this object
(docs/architecture.md#one-requests-path).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxserve import sharding
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.core.scheduler import PLACEHOLDER_TOKEN, Scheduler, SchedulerConfig, SchedulerOutput
from jaxserve.core.sequence import SeqState
from jaxserve.device.buckets import Bucket
from jaxserve.device.executable_cache import ExecutableCache
from jaxserve.device.host_tier import HostKVTier
from jaxserve.device.runner import ModelRunner, RowParams, StepOutput
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.kv_budget import GIB, KVLayout, plan_kv_cache, weights_summary
from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.request_state import (
    Choice,
    RequestGroup,
    emit,
    group_output,
    record_logprobs,
    record_prompt_logprobs,
)
from jaxserve.engine.step_trace import StepTrace
from jaxserve.engine.structured_output import Grammar, GrammarCompiler
from jaxserve.engine.validation import (
    RequestBounds,
    stop_ids_of,
    truncate_prompt,
    validate_request,
)
from jaxserve.loading.load import load_model, setup_compilation_cache
from jaxserve.outputs import RequestOutput
from jaxserve.platform import current_platform
from jaxserve.platform.base import attention_fn
from jaxserve.sampling_params import SamplingParams
from models.quant import QuantConfig
from models.registry import get_architecture
from pallas_kernels import allocate_kv_cache, kv_cache_bytes_per_block

log = logging.getLogger(__name__)
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads choice seeds (SplitMix64)


@dataclass
class _Step:
    """A dispatched step: its plan, what the host needs to read its results, and times
    (``time.perf_counter`` seconds)."""

    plan: SchedulerOutput
    choices: list[Choice]  # per scheduled row, the choice it ran for
    rows: list[RowParams]
    out: StepOutput
    bucket: Bucket
    want_lp: bool
    prompt_lp_rows: list[int]
    num_prompt_tokens: int
    constrained: bool  # a row samples under a grammar
    mask_s: float
    t_dispatch: float
    t_ready: float | None = None  # when its sampled ids were on the host
    row_of: dict[str, int] = field(init=False)  # sequence id -> batch row

    def __post_init__(self) -> None:
        self.row_of = {s.request_id: i for i, s in enumerate(self.plan.scheduled)}


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
      config: engine settings.
      load: where weights come from.
      metrics: an ``EngineMetrics`` (or None) updated every step.
      devices: the ``tensor_parallel_size`` devices this engine runs on (a data-parallel
        replica's group); None: the first ones. With a mesh (``tensor_parallel_size > 1`` or
        ``devices`` given) each device reads its own slice of the weights where the format
        allows, and ``load_report`` holds the per-device ``LoadReport``; otherwise it is None.
    The KV cache (``kv_layout``) may hold fewer tokens than ``max_model_len``; a request that
    can never fit in it is refused by ``validate``. ``load_s`` is the seconds this took and
    ``startup_s`` its stages' seconds (load_weights, plan_kv, kv_cache, runner, engine);
    ``attention_backend`` the attention backend in use (``config.attention_backend`` with
    "auto" resolved).

    Raises:
      ValueError: invalid settings (max_model_len above the model's, a host tier smaller than
        one block, or one the device cannot place in pinned host memory), or a model the
        settings cannot load (as ``load_model``).
    """

    def __init__(self, config: EngineConfig | None = None, load: LoadConfig | None = None,
                 metrics=None, devices: Sequence[jax.Device] | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.load_config = load = load or LoadConfig()
        self.metrics = metrics
        setup_compilation_cache(config.compilation_cache_dir)
        t0 = time.perf_counter()
        self.platform = platform = current_platform()
        self.dtype = platform.resolve_dtype(config.dtype)
        self.attention_backend = platform.attention_backend(config)
        attention = attention_fn(self.attention_backend)
        tp = config.tensor_parallel_size
        self.mesh = sharding.make_mesh(tp, devices) if tp > 1 or devices is not None else None
        loaded = load_model(load, self.dtype, config.seed, self.mesh, quantization=QuantConfig(
            config.quantization, config.quantization_group_size, config.quantize_embeddings))
        t_load = time.perf_counter()
        params, self.tokenizer, self.load_report = loaded.params, loaded.tokenizer, loaded.report
        self.model_name = load.served_model_name or loaded.name
        if metrics is not None and metrics.model_name != self.model_name:
            raise ValueError(f"metrics are labelled model_name={metrics.model_name!r}; the "
                             f"engine serves {self.model_name!r} (build them with "
                             f"EngineMetrics(loading.served_name(load)))")
        self.model_config = mc = loaded.model_config
        kv_sharding = scale_sharding = None
        if self.mesh is not None:
            self.model_config = mc = sharding.sharded_config(mc, tp)
            attention = sharding.shard_attention(attention, self.mesh)
            kv_sharding = jax.sharding.NamedSharding(self.mesh, sharding.kv_cache_spec())
            scale_sharding = jax.sharding.NamedSharding(self.mesh, sharding.kv_scale_spec())
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's context "
                             f"window of {mc.max_position_embeddings}")
        self.compute_dtype = platform.compute_dtype(self.dtype)
        arch = get_architecture(mc.architecture)
        self.model = arch.model(mc, self.compute_dtype, attention_fn=attention)
        params = platform.prepare_weights(params, config, self.dtype, arch.quant_targets)
        self.kv_layout: KVLayout = plan_kv_cache(config, load, self.model, params, self.dtype,
                                                 self.tokenizer, self.mesh, kv_sharding)
        self.num_blocks = self.kv_layout.num_blocks
        t_plan = time.perf_counter()
        max_blocks = -(-self.max_model_len // config.block_size)
        scales = {} if self.kv_layout.scales is None else {
            "k_scale": self.kv_layout.scales[0], "v_scale": self.kv_layout.scales[1],
            "scale_sharding": scale_sharding}
        kv = allocate_kv_cache(mc.num_layers, self.num_blocks, config.block_size,
                               mc.num_kv_heads, mc.head_dim, self.kv_layout.dtype,
                               sharding=kv_sharding, **scales)
        self.host_kv: HostKVTier | None = None
        if config.kv_offloading_size is not None:
            per_block = kv_cache_bytes_per_block(mc.num_layers, config.block_size,
                                                 mc.num_kv_heads, mc.head_dim,
                                                 self.kv_layout.dtype)
            n = int(config.kv_offloading_size * GIB // per_block)
            if n < 1:
                raise ValueError(f"kv_offloading_size={config.kv_offloading_size} GiB is less "
                                 f"than one KV block ({per_block} bytes)")
            self.host_kv = HostKVTier(kv, n + 1, max_blocks_per_copy=max_blocks)
        vocab_limit = self.tokenizer.vocab_size if self.tokenizer.vocab_size < mc.vocab_size \
            else None
        t_kv = time.perf_counter()
        # programs over a mesh are not cached (their device assignment is the mesh's)
        exe_cache = ExecutableCache(os.path.join(os.path.expanduser(
            config.compilation_cache_dir), "jaxserve-executables")) \
            if config.compilation_cache_dir and self.mesh is None else None
        buckets = platform.buckets(config)
        self.runner = ModelRunner(self.model, params, kv,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs,
                                  small_buckets=buckets.small,
                                  mid_buckets_up_to=buckets.mid_up_to,
                                  max_blocks_per_seq=max_blocks, vocab_limit=vocab_limit,
                                  mesh=self.mesh, executable_cache=exe_cache,
                                  program_description=repr((
                                      type(self.model).__module__,
                                      type(self.model).__qualname__, mc, str(self.dtype),
                                      # where the caches live does not change a program
                                      dataclasses.replace(config, compilation_cache_dir=""))))
        t_runner = time.perf_counter()
        if self.host_kv is not None and self.runner.multiprocess:
            raise ValueError("kv_offloading_size is not supported when one model spans several "
                             "processes (--num-processes > 1): the host-tier copies would run "
                             "on process 0 alone")
        self.bounds = RequestBounds(self.tokenizer.vocab_size, self.max_model_len,
                                    self.num_blocks, config.block_size, self.runner.multiprocess,
                                    self.tokenizer.eos_token_ids)
        sched_config = dataclasses.replace(
            SchedulerConfig.from_engine_config(
                config, self.num_blocks, self.max_model_len,
                self.host_kv.num_blocks if self.host_kv is not None else 0),
            token_buckets=tuple(b.num_tokens for b in self.runner.buckets),
            step_overhead_tokens=platform.step_overhead_tokens)
        if self.runner.multiprocess:
            sched_config.async_scheduling = False
        self.scheduler = Scheduler(sched_config)
        if metrics is not None:
            metrics.set_batch_limits(config.max_num_seqs, config.max_num_batched_tokens)
            metrics.set_cache_config(config.block_size, self.num_blocks)
        self.requests: dict[str, Choice] = {}  # by sequence id
        self.groups: dict[str, RequestGroup] = {}  # by request id
        self.slots = PenaltySlots(self.runner)
        self.step_trace = StepTrace(config.step_trace_file) if config.step_trace_file else None
        # one model over several processes: the followers replay the steps (runner.follow)
        # without the engine's overlap, so the loop stays synchronous there
        self.async_scheduling = config.async_scheduling and not self.runner.multiprocess
        self._inflight: _Step | None = None  # async scheduling: the step on the device
        self._last_dispatched: _Step | None = None  # step trace: for host_gap_ms
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size,
                                        config.grammar_compile_timeout_s)
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        t_end = time.perf_counter()
        self.load_s = t_end - t0
        # seconds of each start-up stage before warm-up (the server prints them)
        self.startup_s: dict[str, float] = {
            "load_weights": t_load - t0, "plan_kv": t_plan - t_load, "kv_cache": t_kv - t_plan,
            "runner": t_runner - t_kv, "engine": t_end - t_runner}

    def weights_summary(self) -> str:
        """One line for start-up logs: the weights' format and size (``kv_budget``)."""
        return weights_summary(self.runner.params, self.config, self.dtype, self.compute_dtype)

    def kv_cache_summary(self) -> str:
        """One line for start-up logs: the KV cache's dtype, size per token and scales."""
        return self.kv_layout.summary()

    def warmup(self, progress: bool = True,
               on_compiled: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """Compile every step program (and the host tier's copy programs); returns
        {"num_programs", "compile_s", "compile_cpu_s"}; ``on_compiled(done, total)`` is called
        as step programs compile (``ModelRunner.warmup``). The grammar compiler's tokenizer is built meanwhile,
        in its own thread (``GrammarCompiler.prepare``)."""
        self.grammars.prepare()
        stats = self.runner.warmup(progress, on_compiled)
        if self.host_kv is not None:
            host = self.host_kv.warmup()
            stats = {k: stats[k] + host.get(k, 0.0) for k in stats}
        return stats

    def probe(self) -> float:
        """Run one step of the smallest program on the padding block and wait for it (no
        request, no metrics); returns its seconds. Start-up runs it once after ``warmup``."""
        return self.runner.probe()

    # -- requests ------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request without touching engine state (safe from any thread); returns the
        effective max_tokens.

        Raises:
          InvalidRequest: as ``validate_request`` (naming the field): an empty prompt, ids out
            of range, or a request the KV cache can never hold.
        """
        return validate_request(prompt_token_ids, params, self.bounds)

    def compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """The compiled ``params.structured_outputs`` (None without one), cached; safe from any
        thread, and meant to run off the engine thread (``AsyncEngine`` does).

        Raises:
          InvalidRequest: ``param="structured_outputs"``: a constraint the grammar engine
            refuses, or one that takes longer than ``grammar_compile_timeout_s`` to compile.
        """
        if params.structured_outputs is None:
            return None
        return self.grammars.compile(params.structured_outputs)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, prompt: str | None = None,
                    arrival_time: float | None = None, grammar: Grammar | None = None) -> None:
        """Queue a request (``params.n`` sequences); ``grammar``: its
        ``compile_grammar(params)``, compiled here when None. Raises ValueError (see
        ``validate`` and ``compile_grammar``; also a duplicate id)."""
        params = params or SamplingParams()
        n = params.n
        seq_ids = [request_id] if n == 1 else [f"{request_id}[{i}]" for i in range(n)]
        if request_id in self.groups or any(i in self.requests for i in seq_ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        if grammar is None:
            grammar = self.compile_grammar(params)
        prompt_token_ids = [int(t) for t in truncate_prompt(prompt_token_ids, params,
                                                            self.bounds)]
        stop_ids = stop_ids_of(params, self.tokenizer.eos_token_ids)
        group = RequestGroup(request_id, prompt, prompt_token_ids, params,
                             arrival_time if arrival_time is not None else time.monotonic())
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
        base_seed = params.seed % 2**64 if params.seed is not None else None
        for i, sid in enumerate(seq_ids):
            seq = SeqState(
                request_id=sid, token_ids=list(prompt_token_ids),
                num_prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens,
                stop_token_ids=stop_ids,
                skip_prefix_cache=params.uses_penalty_state or (
                    i == 0 and params.prompt_logprobs is not None))
            self.scheduler.add(seq)
            if base_seed is None:
                seed = int(self._rng.integers(2**63))
            else:  # choice 0 keeps the seed; the others get distinct streams derived from it
                seed = (base_seed + i * _GOLDEN_GAMMA) % 2**64
            req = Choice(
                sid, group, i, params, seed, seq,
                IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens),
                logprobs=[] if params.logprobs is not None else None,
                grammar=grammar.start() if grammar is not None else None)
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
            self.slots.release(self.requests.pop(sid))
        if self.metrics is not None:
            for g in groups:
                self.metrics.record_finished(
                    "abort", time.monotonic() - g.arrival_time,
                    num_prompt_tokens=len(g.prompt_token_ids),
                    num_generation_tokens=sum(len(c.output_token_ids) for c in g.choices))
        if aborted:
            self._record_step()  # the gauges must show the freed blocks even if no step follows
        return aborted

    def _release_idle_slots(self) -> None:
        """Free the slots of requests no longer running (preempted; ``PenaltySlots``)."""
        if self.slots.holders:
            running = {s.request_id for s in self.scheduler.running}
            self.slots.release_all_but(running)

    def _record_step(self, num_prompt_tokens: int = 0, num_generation_tokens: int = 0,
                     num_preemptions: int = 0, plan: SchedulerOutput | None = None) -> None:
        if self.metrics is not None:
            self.metrics.record_step(len(self.scheduler.running), len(self.scheduler.waiting),
                                     self.scheduler.block_pool.usage, num_prompt_tokens,
                                     num_generation_tokens, num_preemptions)
            if plan is not None:  # batch occupancy of the step that ran (0, 0 when idle)
                self.metrics.record_batch(len(plan.scheduled), plan.num_scheduled_tokens)
            self.metrics.record_tokens_pending(*self.scheduler.num_tokens_pending())
            host = self.scheduler.host_pool
            self.metrics.record_kv_stats(self.scheduler.kv_stats,
                                         None if host is None else 1 - host.num_free_blocks /
                                         host.num_usable_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block in both tiers (blocks of running requests are kept),
        e.g. between benchmark runs. Returns how many blocks were dropped."""
        kv = self.scheduler.kv
        return kv.device.reset_prefix_cache() + (kv.host.reset_prefix_cache() if kv.host else 0)

    def set_async_scheduling(self, on: bool) -> None:
        """Switch between the async and the synchronous loop (``EngineConfig.async_scheduling``)
        while idle, e.g. to compare them on one engine.

        Raises:
          RuntimeError: while requests are unfinished.
          ValueError: ``on`` when one model spans several processes.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("set_async_scheduling while requests are unfinished")
        if on and self.runner.multiprocess:
            raise ValueError("async scheduling is not supported when one model spans several "
                             "processes")
        self.async_scheduling = self.scheduler.config.async_scheduling = on

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
        """Run one engine step; returns outputs of requests with new text or a finish.

        With async scheduling the outputs are those of the step dispatched by the previous
        call (and of this call's own step when it ran synchronously, see ``_needs_sync``);
        this call's step is still running on the device when it returns.
        """
        t0 = time.perf_counter()
        preempted_before = self.scheduler.num_preemptions_total
        plan = self.scheduler.schedule()
        self._copy_blocks(plan)
        prev, self._inflight = self._inflight, None
        if plan.is_empty and prev is None:
            self._record_step(plan=plan)
            return []
        t_sched = time.perf_counter()
        new = None
        if not plan.is_empty:
            self._release_idle_slots()
            new = self._dispatch(plan, prev)
        t_pack = time.perf_counter()
        outputs, num_generated = [], 0
        waits = []
        for done in (prev, new if new is not None and self._needs_sync(new) else None):
            if done is not None:
                t_wait = time.perf_counter()
                done.out.ids  # noqa: B018 (waits for the step's sampled ids)
                t_ready = time.perf_counter()
                waits.append(t_ready - t_wait)
                done.t_ready = t_ready
                n, outs = self._complete(done)
                num_generated += n
                outputs += outs
        if new is not None and new.t_ready is None:
            self._inflight = new
        self._record_step(new.num_prompt_tokens if new else 0, num_generated,
                          self.scheduler.num_preemptions_total - preempted_before, plan)
        if self.step_trace is not None:
            t_end = time.perf_counter()
            wait = sum(waits)
            gap = None  # from the previous step's ids reaching the host to this dispatch
            last = self._last_dispatched
            if new is not None and last is not None and last.t_ready is not None:
                gap = max(0.0, new.t_dispatch - last.t_ready)
            if new is not None:
                self._last_dispatched = new
            b = new.bucket if new is not None else prev.bucket
            self.step_trace.write({
                "t": time.time(), "bucket_tokens": b.num_tokens, "bucket_seqs": b.num_seqs,
                "num_seqs": len(plan.scheduled), "num_tokens": plan.num_scheduled_tokens,
                "num_prompt_tokens": new.num_prompt_tokens if new else 0,
                "async": self.async_scheduling and new is not None and new.t_ready is None,
                "schedule_ms": 1e3 * (t_sched - t0), "pack_ms": 1e3 * (t_pack - t_sched),
                "mask_ms": 1e3 * (new.mask_s if new else 0.0),
                "device_ms": 1e3 * wait, "post_ms": 1e3 * (t_end - t_pack - wait),
                "step_ms": 1e3 * (t_end - t0),
                **({} if gap is None else {"host_gap_ms": 1e3 * gap})})
        return outputs

    def _needs_sync(self, step: _Step) -> bool:
        """Whether ``step`` is finished before the next is planned: always without async
        scheduling, and for a step with a constrained row (its next token mask needs this
        step's token on the host)."""
        return not self.async_scheduling or step.constrained

    def _dispatch(self, plan: SchedulerOutput, prev: _Step | None) -> _Step:
        """Build the plan's sampling rows and packed buffer and start the step on the device.
        ``prev``: the step still in flight, whose sampled ids stand in for the plan's
        placeholder tokens."""
        now = time.monotonic()
        rows, num_prompt_tokens, want_lp, prompt_lp_rows = [], 0, False, []
        constrained: list[tuple[int, Choice, bool]] = []  # rows sampling under a grammar
        choices, src_rows = [], []
        vocab = self.tokenizer.vocab_size
        for i, s in enumerate(plan.scheduled):
            req = self.requests[s.request_id]
            choices.append(req)
            g, p = req.group, req.params
            if g.first_scheduled_time is None:
                g.first_scheduled_time = now
            num_prompt = len(g.prompt_token_ids)
            end = s.start_pos + len(s.token_ids)
            src_rows.append(prev.row_of[s.request_id]
                            if s.token_ids[-1] == PLACEHOLDER_TOKEN else -1)
            targets = None
            if g.prompt_logprobs is not None and req.index == 0 and s.start_pos < num_prompt - 1:
                targets = [g.prompt_token_ids[q + 1] if q + 1 < num_prompt else -1
                           for q in range(s.start_pos, end)]
                prompt_lp_rows.append(i)
            want_lp |= s.sample and p.logprobs is not None
            short = end - num_prompt < p.min_tokens  # EOS and stop ids are masked
            if req.grammar is not None and s.sample:
                constrained.append((i, req, short))
                short = False  # the row's grammar mask carries it (fill_masks)
            rows.append(RowParams(
                p.temperature, p.top_k if 0 < p.top_k < vocab else 0, p.top_p, req.seed,
                end - num_prompt, min_p=p.min_p,
                slot=self.slots.acquire(req) if p.uses_penalty_state else -1,
                repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, reset=s.start_pos == 0,
                num_prompt_tokens=num_prompt, prompt_targets=targets,
                suppress_ids=tuple(req.seq.stop_token_ids) if short else ()))
            num_prompt_tokens += max(0, min(num_prompt, end) - s.start_pos)
        bucket, packed = self.runner.pack_step([s.token_ids for s in plan.scheduled],
                                               [s.start_pos for s in plan.scheduled],
                                               [s.block_ids for s in plan.scheduled], rows,
                                               want_logprobs=want_lp, src_rows=src_rows)
        allowed, t_mask = None, time.perf_counter()
        if constrained:  # a row short of min_tokens withholds its stop ids where it can
            allowed = self.runner.mask_buffer(bucket)
            self.grammars.fill_masks([(req.grammar, i, req.seq.stop_token_ids if short else ())
                                      for i, req, short in constrained], allowed)
        mask_s = time.perf_counter() - t_mask
        t_dispatch = time.perf_counter()
        out = self.runner.execute(bucket, packed, allowed)
        return _Step(plan, choices, rows, out, bucket, want_lp, prompt_lp_rows,
                     num_prompt_tokens, bool(constrained), mask_s, t_dispatch)

    def _complete(self, step: _Step) -> tuple[int, list[RequestOutput]]:
        """Read a dispatched step's results into the scheduler and the requests; returns the
        number of tokens kept and the outputs. A row whose choice finished or was aborted
        since the step was planned (async scheduling) is dropped."""
        plan, out = step.plan, step.out
        live = [self.requests.get(s.request_id) is c for s, c in zip(plan.scheduled,
                                                                       step.choices)]
        lp_rows = [i for i in step.prompt_lp_rows if live[i]]
        if lp_rows:
            record_prompt_logprobs(self.tokenizer, plan.scheduled, self.requests, step.rows,
                                   lp_rows, out.prompt_logprobs())
        lp = out.logprobs() if step.want_lp else None
        sampled = [int(out.ids[i]) if s.sample else None for i, s in enumerate(plan.scheduled)]
        result = self.scheduler.update(plan, sampled)
        if self.metrics is not None:  # the ids are on the host: the step's device work is done
            self.metrics.record_prefill_rate(step.num_prompt_tokens,
                                             step.t_ready - step.t_dispatch)
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        for rid, tok in result.new_token_ids.items():
            req = self.requests[rid]
            if req.logprobs is not None and lp is not None:
                record_logprobs(self.tokenizer, req, tok, lp, step.row_of[rid])
            finish = result.finished.get(rid)
            if req.grammar is not None:
                finish = self._advance_grammar(req, tok, finish)
            if self._process(req, tok, finish, now):
                touched[req.group.request_id] = req.group
        return len(result.new_token_ids), [self._group_output(g, now) for g in touched.values()]

    def _advance_grammar(self, req: Choice, token: int, finish: str | None) -> str | None:
        """Feed a sampled token to the choice's grammar; returns its finish reason, "stop"
        once the grammar has taken an EOS the request does not stop at (``ignore_eos``)."""
        if not req.grammar.advance(token):
            log.warning("request %s: the structured-output grammar refused token %d (%s); it "
                        "allows only EOS from here", req.request_id, token, req.grammar.error)
        if finish is None and req.grammar.done and token in self.tokenizer.eos_token_ids:
            self.scheduler.finish([req.request_id])
            return "stop"
        return finish

    def _copy_blocks(self, plan: SchedulerOutput) -> None:
        """Run the plan's host-tier copies, offloads then loads, before its forward pass."""
        if plan.offloads:
            self.host_kv.offload(self.runner.kv_cache, plan.offloads)
        if plan.loads:
            self.runner.kv_cache = self.host_kv.load(self.runner.kv_cache, plan.loads)

    def _process(self, req: Choice, token: int, finish: str | None, now: float) -> bool:
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
        if not delta and finish is None:
            return False  # text held back (partial UTF-8 or a possible stop string)
        emit(req, delta, finish, stop_reason)
        if finish is not None:
            req.finished = True
            g.num_finished += 1
            del self.requests[rid]
            self.slots.release(req)
        return True

    def _group_output(self, g: RequestGroup, now: float) -> RequestOutput:
        """The request's output after a step in which some choice changed; a finished request
        is forgotten."""
        out = group_output(g, now)
        if out.finished:
            del self.groups[g.request_id]
            if self.metrics is not None:
                self.metrics.record_finished(
                    g.choices[0].output.finish_reason, now - g.arrival_time,
                    num_prompt_tokens=len(g.prompt_token_ids),
                    num_generation_tokens=sum(len(c.output_token_ids) for c in g.choices))
        return out

    def next_request_id(self) -> str:
        """A fresh id for callers that have none."""
        return f"req-{next(self._ids)}"
