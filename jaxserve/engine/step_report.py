"""What one engine step reports, and to whom.

``LLMEngine.step`` ends with one ``StepReporter.report(StepReport)``: the step's clock, its
plan, the step it dispatched and the steps whose sampled ids it read. The reporter hands the
KV manager's prefix-cache changes to the events publisher and each completed step's record to
the forward-pass metrics publisher (never waiting on either), brings the metrics up to date
(gauges from the scheduler's state, counters from the report), writes the step trace line
(``--step-trace``) and calls the listeners registered with
``LLMEngine.add_step_listener``: the engine's timing hook, which ``jaxserve bench step`` reads
instead of wrapping the engine's parts. A call that ran nothing (``report_idle``) updates the
gauges and events only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.core.plan import SchedulerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.step_inputs import InflightStep
from jaxserve.engine.step_trace import StepTimes, StepTrace


@dataclass(frozen=True)
class StepReport:
    """One ``LLMEngine.step`` call that ran something.

    Fields:
      times: the call's clock (``StepTimes``, ``time.perf_counter`` seconds).
      plan: the scheduler's plan of this call (empty when it only read the step in flight).
      dispatched: the step this call started (None: nothing planned); with async scheduling it
        may still be running on the device (``t_ready`` None).
      completed: the steps whose sampled ids this call read, in order: the one in flight
        before it, and this call's own when it ran synchronously.
      num_generated: tokens those steps added to the requests.
      num_preemptions: sequences preempted while planning.
    """

    times: StepTimes
    plan: SchedulerOutput
    dispatched: InflightStep | None
    completed: tuple[InflightStep, ...]
    num_generated: int
    num_preemptions: int


StepListener = Callable[[StepReport], None]


class StepReporter:
    """Hands each step's report to the metrics, the KV-cache events publisher, the forward-pass
    metrics publisher, the step trace and the listeners (module docstring); each of the first
    four may be None (off).

    Args:
      scheduler: read for the gauges and the waiting queue; its KV-cache events are taken from
        it.
      publishers: the KV-cache events and ForwardPassMetrics publishers (``Publishers``).
      step_trace_file: where to append the step trace's lines (``StepTrace``); None: no trace.
      metrics: an ``EngineMetrics`` or None.
    """

    def __init__(self, scheduler: Scheduler, publishers: Publishers | None = None,
                 step_trace_file: str | None = None, metrics=None) -> None:
        self.scheduler, self.metrics = scheduler, metrics
        publishers = publishers or Publishers()
        self.kv_events, self.forward_pass = publishers.kv_events, publishers.forward_pass
        self.step_trace = StepTrace(step_trace_file, scheduler_settings(scheduler)) \
            if step_trace_file else None
        self.listeners: list[StepListener] = []

    def report(self, r: StepReport) -> None:
        """One step that ran something."""
        self.publish_kv_events()
        if self.forward_pass is not None and r.completed:
            self.forward_pass.record([(done.plan, done.measured_s) for done in r.completed],
                                     self.scheduler.waiting)
        self.record_gauges(r.plan, r.dispatched.num_prompt_tokens if r.dispatched else 0,
                           r.num_generated, r.num_preemptions)
        if self.step_trace is not None:
            self.step_trace.record(r.times, r.plan, r.dispatched,
                                   r.completed[0] if r.completed else None)
        for listener in self.listeners:
            listener(r)

    def report_idle(self, plan: SchedulerOutput) -> None:
        """A step call with nothing to run or read."""
        self.publish_kv_events()
        self.record_gauges(plan)

    def publish_kv_events(self) -> None:
        """Hand the prefix-cache changes since the last call to the publisher (never waits)."""
        if self.kv_events is not None:
            records = self.scheduler.take_kv_events()
            if records:
                self.kv_events.publish(records)

    def record_gauges(self, plan: SchedulerOutput | None = None, num_prompt_tokens: int = 0,
                      num_generation_tokens: int = 0, num_preemptions: int = 0) -> None:
        """The metrics after a step (or an abort: ``plan`` None), from the scheduler's state."""
        m, sched = self.metrics, self.scheduler
        if m is None:
            return
        m.record_step(len(sched.running), len(sched.waiting), sched.block_pool.usage,
                      num_prompt_tokens, num_generation_tokens, num_preemptions)
        if plan is not None:  # batch occupancy of the step that ran (0, 0 when idle)
            m.record_batch(len(plan.scheduled), plan.num_scheduled_tokens)
        m.record_tokens_pending(*sched.num_tokens_pending())
        host = sched.host_pool
        m.record_kv_stats(sched.kv_stats, None if host is None else
                          1 - host.num_free_blocks / host.num_usable_blocks)
        if self.kv_events is not None:
            m.record_kv_events(self.kv_events.num_events_published,
                               self.kv_events.num_events_dropped)

    def close(self) -> None:
        """Publish what is left and stop the publishers (the engine keeps working)."""
        if self.kv_events is not None:
            self.publish_kv_events()
            self.kv_events.shutdown()
            self.kv_events = None
        if self.forward_pass is not None:
            self.forward_pass.shutdown()
            self.forward_pass = None


def scheduler_settings(scheduler: Scheduler) -> dict[str, object]:
    """What ``scheduler`` plans with now, as plain data (JSON-ready; the step trace's first
    line): ``SchedulerConfig``'s fields, the token buckets, the loop and the step-cost model
    (its coefficients, or None)."""
    out: dict[str, object] = {f.name: getattr(scheduler.config, f.name)
                              for f in dataclasses.fields(scheduler.config)}
    cost = scheduler.step_cost
    out.update(token_buckets=list(scheduler.token_buckets),
               async_scheduling=scheduler.async_scheduling,
               step_cost=None if cost is None else dataclasses.asdict(cost))
    return out


@dataclass
class Publishers:
    """The engine's side channels, each None when off: the KV-cache events publisher
    (``jaxserve.kv_events``) and the ForwardPassMetrics publisher (``jaxserve.fleet_metrics``).
    Their modules are imported only when started: msgspec and pyzmq are needed only then (the
    engine core imports with jax, flax and numpy alone)."""

    kv_events: Any = None
    forward_pass: Any = None

    @classmethod
    def start(cls, config: EngineConfig, data_parallel_rank: int) -> Publishers:
        """Start the publishers ``config`` turns on (their ports offset by the replica's rank).

        Raises:
          ValueError, OSError: a bad or taken endpoint (those started are stopped first).
        """
        out = cls()
        try:
            if config.kv_events_enabled:
                from jaxserve.kv_events.publisher import start_publisher

                out.kv_events = start_publisher(config.kv_events, config.block_size,
                                                data_parallel_rank,
                                                config.prefix_caching_hash_algo)
            if config.forward_pass_metrics_port is not None:
                from jaxserve.fleet_metrics.publisher import ForwardPassPublisher

                out.forward_pass = ForwardPassPublisher(
                    config.forward_pass_metrics_port, config.forward_pass_metrics_worker_id,
                    data_parallel_rank)
        except BaseException:
            out.shutdown()
            raise
        return out

    def shutdown(self) -> None:
        """Stop every publisher started."""
        for publisher in (self.kv_events, self.forward_pass):
            if publisher is not None:
                publisher.shutdown()
        self.kv_events = self.forward_pass = None
