"""The engine: requests in, one batched step at a time, outputs out.

Start-up (``jaxserve.engine.startup.assemble``): the platform's dtype and kernels, the weights,
the KV cache plan and cache, the ``ModelRunner``. ``add_request`` checks a request once
(``validate_request``) and queues one scheduler sequence per choice. ``step()`` then runs:
  ``scheduler.schedule()`` (host Python plan) -> the plan's host-tier copies
  (``runner.copy_blocks``) -> ``StepDispatcher.dispatch`` (sampling rows, the packed buffer,
  grammar masks; one compiled XLA program started, KV cache donated, sampling on device) ->
  once its ids are on the host, ``OutputProcessor.complete``: ``scheduler.update``, grammars,
  detokenisation and stop strings, one ``RequestOutput`` per request that changed.
With async scheduling (``EngineConfig.async_scheduling``, the default) a call plans, packs
and dispatches step N+1 first and then reads step N, which ran on the device meanwhile; step
N+1's tokens that step N samples are gathered on the device (docs/architecture.md#async-scheduling).
A step with a structured-output row is completed in its own call.
With ``kv_events_config`` enabled, the KV manager's prefix-cache changes are handed to the
events publisher (``jaxserve.kv_events``) after each step, without waiting on it.
The async server (``AsyncEngine``) and the offline ``LLM`` both drive this object
(docs/architecture.md#one-requests-path).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.core.plan import SchedulerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_cost import OnlineStepCost, StepCostModel, StepSample
from jaxserve.device.buckets import ready_buckets
from jaxserve.engine.calibration import calibrate
from jaxserve.engine.kv_budget import weights_summary
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.request_state import Choice, RequestGroup, open_request
from jaxserve.engine.startup import assemble
from jaxserve.engine.step_inputs import InflightStep, StepDispatcher
from jaxserve.engine.step_trace import StepTimes, StepTrace
from jaxserve.engine.structured_output import Grammar, GrammarCompiler
from jaxserve.engine.validation import stop_ids_of, truncate_prompt, validate_request
from jaxserve.outputs import RequestOutput
from jaxserve.request_ids import IdCounter, choice_ids
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads choice seeds (SplitMix64)


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
      data_parallel_rank: the replica's index among data-parallel replicas (stamped on KV-cache
        events and added to their ports).
    The attributes built at start-up are ``startup.EngineParts``' fields (``platform``,
    ``dtype``, ``attention_backend``, ``model``, ``tokenizer``, ``kv_layout``, ``runner``, ...).
    The KV cache may hold fewer tokens than ``max_model_len``; a request that can never fit in
    it is refused by ``validate``. ``load_s`` is the seconds start-up took and ``startup_s``
    its stages' seconds.

    Raises:
      ValueError: as ``startup.assemble``: invalid settings or a model they cannot load.
    """

    def __init__(self, config: EngineConfig | None = None, load: LoadConfig | None = None,
                 metrics=None, devices: Sequence[jax.Device] | None = None,
                 data_parallel_rank: int = 0) -> None:
        self.config = config = config or EngineConfig()
        self.load_config = load = load or LoadConfig()
        self.metrics = metrics
        t0 = time.perf_counter()
        # the events publisher first: a taken or bad endpoint fails before the weights load
        self.kv_events = None  # the KV-cache events publisher (None: events off)
        if config.kv_events_enabled:
            self.kv_events = _start_kv_events(config, data_parallel_rank)
        try:
            parts = assemble(config, load, devices, metrics.model_name if metrics else None)
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.shutdown()
            raise
        self.platform, self.mesh = parts.platform, parts.mesh
        self.dtype, self.compute_dtype = parts.dtype, parts.compute_dtype
        self.attention_backend = parts.attention_backend
        self.model_config, self.model, self.tokenizer = (parts.model_config, parts.model,
                                                         parts.tokenizer)
        self.model_name, self.load_report = parts.model_name, parts.load_report
        self.max_model_len, self.kv_layout = parts.max_model_len, parts.kv_layout
        self.num_blocks = parts.kv_layout.num_blocks
        self.runner, self.bounds = parts.runner, parts.bounds
        self.scheduler = Scheduler(parts.scheduler_config)
        if metrics is not None:
            metrics.set_batch_limits(config.max_num_seqs, config.max_num_batched_tokens)
            metrics.set_cache_config(config.block_size, self.num_blocks)
        self.requests: dict[str, Choice] = {}  # by sequence id
        self.groups: dict[str, RequestGroup] = {}  # by request id
        self.slots = PenaltySlots(self.runner)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        config.grammar_compile_timeout_s)
        self.dispatcher = StepDispatcher(self.runner, self.slots, self.grammars,
                                         self.tokenizer.vocab_size)
        self.outputs = OutputProcessor(self.scheduler, self.requests, self.groups, self.slots,
                                       self.tokenizer, metrics)
        self.step_trace = StepTrace(config.step_trace_file) if config.step_trace_file else None
        self._inflight: InflightStep | None = None  # async scheduling: the step on the device
        # the ITL target's step-cost model, refitted from measured steps (None: no target)
        cost = parts.scheduler_config.step_cost
        self.step_cost = OnlineStepCost(cost) if cost and parts.scheduler_config.itl_on else None
        self._usable = self.runner.packer.usable  # the buckets the scheduler plans for
        self._t_last_ready: float | None = None  # the last completed step's ids on the host
        self._rng = np.random.default_rng(config.seed)
        self._ids = IdCounter()
        self.load_s = time.perf_counter() - t0
        self.startup_s: dict[str, float] = parts.startup_s

    def weights_summary(self) -> str:
        """One line for start-up logs: the weights' format and size (``kv_budget``)."""
        return weights_summary(self.runner.params, self.config, self.dtype, self.compute_dtype)

    def kv_cache_summary(self) -> str:
        """One line for start-up logs: the KV cache's dtype, size per token and scales."""
        return self.kv_layout.summary()

    def warmup(self, progress: bool = True,
               on_compiled: Callable[[int, int], None] | None = None,
               defer: bool = False) -> dict[str, float]:
        """Compile the step programs (and the host tier's copy programs); returns
        ``ModelRunner.warmup``'s stats; ``on_compiled(done, total)`` is called as step
        programs compile. ``defer``: only ``ready_buckets``' programs where the platform
        defers (``BucketSet.defer_compile``) and the model runs in one process; the others are
        left to ``ModelRunner.compile_pending``. The grammar compiler's tokenizer is built
        meanwhile, in its own thread (``GrammarCompiler.prepare``)."""
        self.grammars.prepare()
        first = None
        if defer and self.platform.buckets(self.config).defer_compile \
                and not self.runner.multiprocess:
            first = ready_buckets(self.runner.buckets)
        return self.runner.warmup(progress, on_compiled, first)

    def probe(self) -> float:
        """Run one step of the smallest program on the padding block and wait for it (no
        request, no metrics); with an ITL target, also time prompt steps of two sizes and fit
        the step-cost model's fixed and per-token terms to them (``calibrate_step_cost``).
        Returns the seconds it all took. Start-up runs it once after ``warmup``."""
        t0 = time.perf_counter()
        self.runner.probe()
        self.calibrate_step_cost()
        return time.perf_counter() - t0

    def calibrate_step_cost(self, sizes: tuple[int, ...] = (1, 128), repeats: int = 2
                            ) -> StepCostModel | None:
        """Fit the step-cost model to timed probe steps (``calibration.calibrate``) and plan
        with it from now on, as the prior of the online fit too. ~0.3 s on a 2-core CPU.
        Returns the model (None without an ITL target)."""
        if self.step_cost is None:
            return None
        model = calibrate(self.runner, self.step_cost.prior, self.max_model_len, sizes, repeats)
        self.step_cost.prior = self.step_cost.model = self.scheduler.step_cost = model
        return model

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
                    arrival_time: float | None = None, grammar: Grammar | None = None,
                    max_tokens: int | None = None) -> None:
        """Queue a request (``params.n`` sequences); ``grammar``: its
        ``compile_grammar(params)``, compiled here when None; ``max_tokens``: what
        ``validate`` returned for it, where the caller validated it already (None: validated
        here). Raises ValueError (see ``validate`` and ``compile_grammar``; also a duplicate
        id)."""
        params = params or SamplingParams()
        seq_ids = choice_ids(request_id, params.n)
        if request_id in self.groups or any(i in self.requests for i in seq_ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if max_tokens is None:
            max_tokens = self.validate(prompt_token_ids, params)
        if grammar is None:
            grammar = self.compile_grammar(params)
        prompt_token_ids = [int(t) for t in truncate_prompt(prompt_token_ids, params,
                                                            self.bounds)]
        if params.seed is None:
            seeds = [int(self._rng.integers(2**63)) for _ in seq_ids]
        else:  # choice 0 keeps the seed; the others get distinct streams derived from it
            seeds = [(params.seed % 2**64 + i * _GOLDEN_GAMMA) % 2**64
                     for i in range(len(seq_ids))]
        group = open_request(
            request_id, seq_ids, seeds, prompt, prompt_token_ids, params,
            arrival_time if arrival_time is not None else time.monotonic(), max_tokens,
            stop_ids_of(params, self.tokenizer.eos_token_ids), self.tokenizer, grammar)
        for c in group.choices:
            self.scheduler.add(c.seq)
            self.requests[c.request_id] = c
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
        for g in groups:
            self.outputs.record_finished(g, "abort", time.monotonic())
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
            if self.kv_events is not None:
                self.metrics.record_kv_events(self.kv_events.num_events_published,
                                              self.kv_events.num_events_dropped)

    def _publish_kv_events(self) -> None:
        """Hand the prefix-cache changes since the last call to the publisher (never waits)."""
        if self.kv_events is not None:
            records = self.scheduler.kv.take_events()
            if records:
                self.kv_events.publish(records)

    def close(self) -> None:
        """Stop the KV-cache events publisher (sending what it has queued); the engine keeps
        working without it."""
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.shutdown()
            self.kv_events = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block in both tiers (blocks of running requests are kept),
        e.g. between benchmark runs; publishes ``AllBlocksCleared`` when events are on.
        Returns how many blocks were dropped."""
        dropped = self.scheduler.kv.reset_prefix_cache()
        self._publish_kv_events()
        return dropped

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
        self.scheduler.config = dataclasses.replace(self.scheduler.config, async_scheduling=on)

    @property
    def async_scheduling(self) -> bool:
        """Whether the async loop runs (the scheduler's setting: off when one model spans
        several processes)."""
        return self.scheduler.config.async_scheduling

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
        times = StepTimes(time.perf_counter())
        preempted_before = self.scheduler.num_preemptions_total
        if self.runner.packer.usable is not self._usable:  # a background compile published
            self._usable = self.runner.packer.usable  # plan steps for the compiled buckets
            self.scheduler.config = dataclasses.replace(
                self.scheduler.config, token_buckets=tuple(b.num_tokens for b in self._usable))
        plan = self.scheduler.schedule()
        self.runner.copy_blocks(plan.offloads, plan.loads)
        prev, self._inflight = self._inflight, None
        if plan.is_empty and prev is None:
            self._publish_kv_events()
            self._record_step(plan=plan)
            return []
        times.t_sched = time.perf_counter()
        new = None
        if not plan.is_empty:
            self._release_idle_slots()
            new = self.dispatcher.dispatch(plan, self.requests, prev)
            new.t_start = times.t0
            if self.step_cost is not None:
                new.predicted_s = self.step_cost.model.predict(
                    new.bucket.num_tokens, plan.num_decode_rows, plan.num_context_tokens,
                    plan.num_prefill_pairs)
        times.t_pack = time.perf_counter()
        outputs, num_generated = [], 0
        for done in (prev, new if new is not None and self._needs_sync(new) else None):
            if done is not None:
                t_wait = time.perf_counter()
                done.out.ids  # noqa: B018 (waits for the step's sampled ids)
                done.t_ready = time.perf_counter()
                times.wait_s += done.t_ready - t_wait
                self._observe_step(done)
                n, outs = self.outputs.complete(done)
                num_generated += n
                outputs += outs
        if new is not None and new.t_ready is None:
            self._inflight = new
        self._publish_kv_events()
        self._record_step(new.num_prompt_tokens if new else 0, num_generated,
                          self.scheduler.num_preemptions_total - preempted_before, plan)
        if self.step_trace is not None:
            self.step_trace.record(times, plan, new, prev)
        return outputs

    def _observe_step(self, done: InflightStep) -> None:
        """Give the step-cost model one measured step: from the later of its planning and the
        previous step's ids on the host (the step before it ran) to its own ids on the host,
        which is the gap a decoding stream sees between the two steps' tokens."""
        last, self._t_last_ready = self._t_last_ready, done.t_ready
        if self.step_cost is None or done.t_ready is None:
            return
        start = done.t_start if last is None else max(done.t_start, last)
        done.measured_s = done.t_ready - start
        model = self.step_cost.observe(StepSample(
            done.bucket.num_tokens, done.plan.num_decode_rows, done.plan.num_context_tokens,
            done.t_ready - start, done.plan.num_prefill_pairs))
        if model is not None:
            self.scheduler.step_cost = model

    def _needs_sync(self, step: InflightStep) -> bool:
        """Whether ``step`` is finished before the next is planned: always without async
        scheduling, and for a step with a constrained row (its next token mask needs this
        step's token on the host)."""
        return not self.async_scheduling or step.constrained

    def next_request_id(self) -> str:
        """A fresh id for callers that have none."""
        return self._ids.next()


def _start_kv_events(config: EngineConfig, data_parallel_rank: int):
    """The KV-cache events publisher of ``config.kv_events``, started. Imported here, not at the
    top: msgspec and pyzmq are needed only with events on (the engine core imports with jax,
    flax and numpy alone)."""
    from jaxserve.kv_events.publisher import start_publisher

    return start_publisher(config.kv_events, config.block_size, data_parallel_rank,
                           config.prefix_caching_hash_algo)
