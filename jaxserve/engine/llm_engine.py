"""The engine: requests in, one batched step at a time, outputs out.

Start-up: ``startup.assemble`` builds the parts (weights, KV cache, ``ModelRunner``), ``warmup``
compiles, ``probe`` calibrates. ``add_request`` validates a request once and adds it to the
``RequestTable``, one scheduler sequence per choice. ``step()``: ``scheduler.schedule()`` ->
host-tier copies -> ``StepDispatcher.dispatch`` (rows and grammar masks, handed to the runner
once) -> when its ids are on the host, ``OutputProcessor.complete`` (``scheduler.update``, the
one place where a sequence finishes; detokenisation; ``RequestOutput``s) ->
``StepReporter.report`` (metrics, KV-cache events, step trace, listeners). The engine tells the
scheduler what it measures through the scheduler's methods only. With async scheduling (the
default) a call dispatches step N+1 before it reads step N, which ran meanwhile; a step with a
structured-output row completes in its own call (docs/architecture.md#async-scheduling).
``AsyncEngine`` (the server) and ``LLM`` (offline) drive this object.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.core.plan import SchedulerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_cost import StepCostModel
from jaxserve.device.buckets import ready_buckets
from jaxserve.engine.calibration import calibrate
from jaxserve.engine.kv_budget import weights_summary
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.request_state import RequestTable, choice_seeds, open_request
from jaxserve.engine.startup import assemble
from jaxserve.engine.step_inputs import InflightStep, StepDispatcher
from jaxserve.engine.step_report import Publishers, StepListener, StepReport, StepReporter
from jaxserve.engine.step_trace import StepTimes
from jaxserve.engine.structured_output import Grammar, GrammarCompiler
from jaxserve.engine.validation import stop_ids_of, truncate_prompt, validate_request
from jaxserve.outputs import RequestOutput
from jaxserve.request_ids import IdCounter, choice_ids
from jaxserve.sampling_params import SamplingParams


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
    Attributes: ``startup.EngineParts``' fields (``platform``, ``dtype``, ``model``,
    ``tokenizer``, ``kv_layout``, ``runner``, ...); ``load_s``, ``startup_s``: seconds of
    start-up and of its stages. A request the KV cache can never hold is refused by ``validate``.

    Raises:
      ValueError: as ``startup.assemble``: invalid settings or a model they cannot load.
    """

    def __init__(self, config: EngineConfig | None = None, load: LoadConfig | None = None,
                 metrics=None, devices: Sequence[jax.Device] | None = None,
                 data_parallel_rank: int = 0) -> None:
        self.config = config = config or EngineConfig()
        self.load_config = load = load or LoadConfig()
        t0 = time.perf_counter()
        # the publishers first: a taken or bad endpoint fails before the weights load
        publishers = Publishers.start(config, data_parallel_rank)
        try:
            parts = assemble(config, load, devices, metrics.model_name if metrics else None)
        except BaseException:
            publishers.shutdown()
            raise
        self.platform, self.mesh, self.dtype = parts.platform, parts.mesh, parts.dtype
        self.compute_dtype, self.attention_backend = parts.compute_dtype, parts.attention_backend
        self.model_config, self.model = parts.model_config, parts.model
        self.tokenizer, self.model_name = parts.tokenizer, parts.model_name
        self.load_report, self.max_model_len = parts.load_report, parts.max_model_len
        self.kv_layout, self.num_blocks = parts.kv_layout, parts.kv_layout.num_blocks
        self.runner, self.bounds = parts.runner, parts.bounds
        self.scheduler = Scheduler(parts.scheduler_config)
        self.requests = RequestTable()
        self.slots = PenaltySlots(self.runner)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        config.grammar_compile_timeout_s)
        self.dispatcher = StepDispatcher(self.runner, self.requests, self.slots, self.grammars,
                                         self.tokenizer.vocab_size)
        self.outputs = OutputProcessor(self.scheduler, self.requests, self.slots,
                                       self.tokenizer)
        self.reporter = StepReporter(self.scheduler, publishers, config.step_trace_file)
        self.set_metrics(metrics)
        self._inflight: InflightStep | None = None  # async scheduling: the step on the device
        self._usable = self.runner.usable_buckets  # the buckets the scheduler plans for
        self._t_last_ready: float | None = None  # the last completed step's ids on the host
        self._rng = np.random.default_rng(config.seed)
        self._ids = IdCounter()
        self.load_s = time.perf_counter() - t0
        self.startup_s: dict[str, float] = parts.startup_s

    def weights_summary(self) -> str:
        """One line for start-up logs: the weights' format and size (``kv_budget``)."""
        return weights_summary(self.runner.params, self.config, self.dtype, self.compute_dtype)

    def warmup(self, progress: bool = True,
               on_compiled: Callable[[int, int], None] | None = None,
               defer: bool = False) -> dict[str, float]:
        """Compile the step programs (``ModelRunner.warmup``, whose stats it returns;
        ``on_compiled(done, total)`` follows them). ``defer``: only ``ready_buckets``' where the
        platform defers and one process runs the model; ``ModelRunner.compile_pending`` does
        the others. The grammar compiler's tokenizer is built meanwhile, on its own thread."""
        self.grammars.prepare()
        first = None
        if defer and self.platform.buckets(self.config).defer_compile \
                and not self.runner.multiprocess:
            first = ready_buckets(self.runner.buckets)
        return self.runner.warmup(progress, on_compiled, first)

    def probe(self) -> float:
        """Run one step of the smallest program on the padding block and wait for it (no
        request, no metrics), then ``calibrate_step_cost``; returns the seconds it all took.
        Start-up runs it once after ``warmup``."""
        t0 = time.perf_counter()
        self.runner.probe()
        self.calibrate_step_cost()
        return time.perf_counter() - t0

    def calibrate_step_cost(self, sizes: tuple[int, ...] = (1, 128), repeats: int = 2
                            ) -> StepCostModel | None:
        """Fit the step-cost model to timed probe steps (``calibration.calibrate``) and have
        the scheduler plan with it from now on (``Scheduler.calibrate``). ~0.3 s on a 2-core
        CPU. Returns the model (None without an ITL target)."""
        prior = self.scheduler.step_cost
        if prior is None:
            return None
        model = calibrate(self.runner, prior, self.max_model_len, sizes, repeats)
        self.scheduler.calibrate(model)
        return model

    def set_metrics(self, metrics) -> None:
        """Update ``metrics`` (an ``EngineMetrics``; None: none) from now on."""
        self.metrics = self.outputs.metrics = self.reporter.metrics = metrics
        if metrics is not None:
            metrics.set_batch_limits(self.config.max_num_seqs, self.config.max_num_batched_tokens)
            metrics.set_cache_config(self.config.block_size, self.num_blocks)
            metrics.set_objectives(self.scheduler.config.ttft_slo_s,
                                   self.scheduler.config.itl_slo_s)

    def add_step_listener(self, listener: StepListener) -> None:
        """Call ``listener(StepReport)`` after each step that ran something (engine thread):
        the engine's timing hook (``jaxserve.engine.step_report``)."""
        self.reporter.listeners.append(listener)

    def use_ready_buckets_only(self, on: bool) -> None:
        """Pad steps to the ready buckets only, as before a background compile ends (on), or to
        every compiled bucket (off): for measuring what the background compile changes."""
        self.runner.restrict_buckets(ready_buckets(self.runner.buckets) if on else None)

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
        if max_tokens is None:
            max_tokens = self.validate(prompt_token_ids, params)
        if grammar is None:
            grammar = self.compile_grammar(params)
        prompt_token_ids = [int(t) for t in truncate_prompt(prompt_token_ids, params,
                                                            self.bounds)]
        group = open_request(
            request_id, seq_ids, choice_seeds(params.seed, len(seq_ids), self._rng), prompt,
            prompt_token_ids, params,
            arrival_time if arrival_time is not None else time.monotonic(), max_tokens,
            stop_ids_of(params, self.tokenizer.eos_token_ids), self.tokenizer, grammar)
        self.requests.add(group)
        for c in group.choices:
            self.scheduler.add(c.seq)

    def abort_request(self, request_ids: str | list[str]) -> list[str]:
        """Abort requests (unknown ids ignored; every choice of a request); their blocks go
        back at once. Returns the aborted sequence ids that were waiting or running."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        groups = [g for rid in dict.fromkeys(ids) if (g := self.requests.pop(rid))]
        choices = [c for g in groups for c in g.choices if not c.finished]
        aborted = self.scheduler.abort([c.seq_id for c in choices])
        for c in choices:
            self.slots.release(c)
        for g in groups:
            self.outputs.record_finished(g, "abort", time.monotonic())
        if aborted:
            self.reporter.record_gauges()  # the freed blocks show even if no step follows
        return aborted

    def request_ids(self) -> list[str]:
        """The unfinished requests' ids, oldest first."""
        return self.requests.request_ids()

    def close(self) -> None:
        """Stop the KV-cache events and forward-pass metrics publishers, sending what they have
        queued (the engine goes on)."""
        self.reporter.close()

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block in both tiers (blocks of running requests are kept),
        e.g. between benchmark runs; publishes ``AllBlocksCleared`` when events are on.
        Returns how many blocks were dropped."""
        dropped = self.scheduler.reset_prefix_cache()
        self.reporter.publish_kv_events()
        return dropped

    def set_async_scheduling(self, on: bool) -> None:
        """Switch between the async and the synchronous loop while idle (e.g. to compare them).

        Raises:
          RuntimeError: while requests are unfinished.
          ValueError: ``on`` when one model spans several processes.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("set_async_scheduling while requests are unfinished")
        if on and self.runner.multiprocess:
            raise ValueError("async scheduling is not supported when one model spans several "
                             "processes")
        self.scheduler.set_async_scheduling(on)

    @property
    def async_scheduling(self) -> bool:
        """Whether the async loop runs (off when one model spans several processes)."""
        return self.scheduler.async_scheduling

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """The share of usable KV blocks held by live requests (0-1; cached-free excluded)."""
        return self.scheduler.block_pool.usage

    @property
    def num_preemptions_total(self) -> int:
        """Sequences preempted since start-up."""
        return self.scheduler.num_preemptions_total

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of requests with new text or a finish.

        With async scheduling the outputs are those of the step dispatched by the previous
        call (and of this call's own step where it is read at once); this call's step is
        still running on the device when it returns.
        """
        times = StepTimes(time.perf_counter())
        self._plan_for_compiled_buckets()
        preempted_before = self.scheduler.num_preemptions_total
        plan = self.scheduler.schedule(time.monotonic())
        self.runner.copy_blocks(plan.offloads, plan.loads)
        times.t_sched = time.perf_counter()
        prev, self._inflight = self._inflight, None
        if plan.is_empty and prev is None:
            self.reporter.report_idle(plan)
            return []
        new = None if plan.is_empty else self._dispatch(plan, prev, times.t0)
        times.t_pack = time.perf_counter()
        # read now: the previous step, and this one without async scheduling or with a
        # constrained row (its next token mask needs this step's token on the host)
        completed = tuple(s for s in (prev, new) if s is not None and (
            s is prev or not self.async_scheduling or s.constrained))
        results = [self._read(done, times) for done in completed]
        if new is not None and new.t_ready is None:
            self._inflight = new
        self.reporter.report(StepReport(times, plan, new, completed, sum(n for n, _ in results),
                                        self.scheduler.num_preemptions_total - preempted_before))
        return [out for _, outs in results for out in outs]

    def _dispatch(self, plan: SchedulerOutput, prev: InflightStep | None, t_start: float
                  ) -> InflightStep:
        """Start ``plan``'s step (``StepDispatcher.dispatch``), with the step-cost model's
        prediction of its time; first free the penalty slots of preempted requests."""
        if self.slots.holders:
            self.slots.release_all_but({s.seq_id for s in self.scheduler.running})
        new = self.dispatcher.dispatch(plan, prev, t_start)
        new.predicted_s = self.scheduler.predict_step_s(plan, new.bucket.num_tokens)
        return new

    def _read(self, done: InflightStep, times: StepTimes) -> tuple[int, list[RequestOutput]]:
        """Wait for a step's ids, report its time to the scheduler, apply it (``complete``).
        Its time: from the later of its planning and the previous step's ids on the host to
        its own ids on the host, the gap a stream sees between the two steps' tokens."""
        t_wait = time.perf_counter()
        done.out.ids  # noqa: B018 (waits for the step's sampled ids)
        done.t_ready = time.perf_counter()
        times.wait_s += done.t_ready - t_wait
        last, self._t_last_ready = self._t_last_ready, done.t_ready
        done.measured_s = done.t_ready - (done.t_start if last is None
                                          else max(done.t_start, last))
        self.scheduler.observe_step(done.plan, done.bucket.num_tokens, done.measured_s)
        return self.outputs.complete(done)

    def _plan_for_compiled_buckets(self) -> None:
        """Once a background compile has published more buckets, plan steps for them."""
        usable = self.runner.usable_buckets
        if usable is not self._usable:
            self._usable = usable
            self.scheduler.set_token_buckets(b.num_tokens for b in usable)

    def next_request_id(self) -> str:
        """A fresh id for callers that have none."""
        return self._ids.next()

