"""Prometheus metrics of the engine, under vLLM's names with the ``jaxserve:`` prefix.

The engine loop calls the ``record_*`` methods (cheap, thread-safe: prometheus-client guards
each value with a lock); the HTTP server's ``GET /metrics`` returns ``render()``. Each engine owns
its own ``CollectorRegistry`` unless one is passed in, so several engines (tests) never clash.
Every series carries a ``model_name`` label (the served model name), as vLLM's do.
``vllm_compat(registry)`` re-exports the series vLLM also has under its ``vllm:`` names, for
routers and autoscalers configured for vLLM.

Exposed series (prometheus-client appends ``_total`` to counters and ``_bucket``/``_sum``/``_count``
to histograms; importing this module turns off the ``_created`` series process-wide):

  gauges     jaxserve:num_requests_running, jaxserve:num_requests_waiting,
             jaxserve:kv_cache_usage_perc (0-1); batch occupancy of the last step:
             jaxserve:num_scheduled_seqs, jaxserve:num_scheduled_tokens, their limits
             jaxserve:max_num_seqs, jaxserve:max_num_batched_tokens, and the ratios
             jaxserve:batch_seqs_usage_perc, jaxserve:batch_tokens_usage_perc (0-1);
             jaxserve:cache_config_info{block_size,num_gpu_blocks} (1)
  work left  jaxserve:num_tokens_in_flight (prompt tokens still to prefill plus tokens still to
             generate up to max_tokens, ``Scheduler.num_tokens_pending``),
             jaxserve:prefill_tokens_per_second (measured: prompt tokens per second of the steps
             that prefilled, a moving average), jaxserve:prefill_backlog_seconds (prefill
             tokens left over that rate; 0 until a prefill step has been measured)
  counters   jaxserve:prompt_tokens_total, jaxserve:generation_tokens_total,
             jaxserve:request_success_total{finished_reason}, jaxserve:num_preemptions_total,
             jaxserve:num_aborted_requests_total, jaxserve:num_compiles_after_warmup_total
             (XLA compiles on the engine thread, ``compile_events``; 0 unless warm-up missed a
             program); the gauge jaxserve:step_programs_pending (programs a server ready
             before they compiled still has to compile in the background; 0 once none is
             left, ``--background-compile``)
  prefix cache and host tier (kv_manager.KVStats; tokens where the name says so):
             jaxserve:prefix_cache_queries_total (prompt tokens looked up),
             jaxserve:prefix_cache_hits_total (of those, found in either tier),
             jaxserve:host_prefix_cache_hits_total (of those, found on the host tier),
             jaxserve:kv_cache_evictions_total (cached device blocks evicted),
             jaxserve:kv_offloaded_blocks_total (of those, copied to the host tier),
             jaxserve:num_swaps_total (preemptions that swapped to the host tier),
             jaxserve:kv_swapped_out_blocks_total, jaxserve:kv_swapped_in_blocks_total;
             gauge jaxserve:kv_offload_usage_perc (0-1: host blocks held by swapped-out
             requests plus cached-free ones; absent without a host tier)
  KV-cache events (with --kv-events-config; jaxserve.kv_events): jaxserve:kv_events_published_total
             (events sent by the publisher), jaxserve:kv_events_dropped_total (events dropped
             because the publisher's queue was full)
  histograms jaxserve:time_to_first_token_seconds, jaxserve:inter_token_latency_seconds,
             jaxserve:e2e_request_latency_seconds, jaxserve:request_queue_time_seconds;
             lengths of finished requests: jaxserve:request_prompt_tokens,
             jaxserve:request_generation_tokens (all choices)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from jaxserve.core.kv_manager import KVStats

PREFIX = "jaxserve:"
VLLM_PREFIX = "vllm:"
MODEL_LABEL = "model_name"



def _without_created(samples, family: str):
    """A family's samples less its ``_created`` series: a timestamp per label set that no
    dashboard reads; 17 of them doubled the scrape of an idle server. Filtered per exposition,
    since prometheus-client's own switch (``disable_created_metrics``) is process-wide."""
    return [s for s in samples if s.name != family + "_created"]


class _Exposed(Collector):
    """``source``'s families as scraped: without ``_created`` series (``_without_created``)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for m in self.source.collect():
            out = Metric(m.name, m.documentation, m.type, m.unit)
            out.samples = _without_created(m.samples, m.name)
            yield out

# KVStats field -> (counter name without the prefix, help)
KV_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "host_cache_hits": ("host_prefix_cache_hits", "Prompt tokens loaded from the host tier."),
    "num_evicted_blocks": ("kv_cache_evictions", "Cached KV blocks evicted from the device."),
    "num_offloaded_blocks": ("kv_offloaded_blocks", "Evicted KV blocks copied to the host tier."),
    "num_swaps": ("num_swaps", "Preemptions resolved by swapping to the host tier."),
    "num_swapped_out_blocks": ("kv_swapped_out_blocks", "KV blocks swapped out to the host tier."),
    "num_swapped_in_blocks": ("kv_swapped_in_blocks", "KV blocks swapped in from the host tier."),
}

# Families (names without a prefix) that vLLM exports with the same meaning, re-exported as
# ``vllm:<name>`` by ``vllm_compat``; kv_cache_usage_perc also as gpu_cache_usage_perc, the
# name vLLM used before 0.9 and older Gateway API Inference Extension releases read.
VLLM_NAMES = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "cache_config_info": ("cache_config_info",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "num_preemptions": ("num_preemptions",),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
}

# Bucket edges in seconds, after vLLM's, with finer low edges for small models on fast devices.
# fmt: off
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS_S = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on
# Token counts of a request: 1, 2, 5, 10, ..., 500000 (vLLM's 1-2-5 series).
LENGTH_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
ABORT = "abort"
PREFILL_RATE_WEIGHT = 0.2  # weight of the newest step in the prefill-rate moving average


class EngineMetrics:
    """The engine's Prometheus metrics and the calls that update them.

    Args:
      model_name: the served model name, the ``model_name`` label of every series.
      registry: where to register the metrics; None creates a private registry.
    Attributes:
      prefill_tokens_per_s: the measured prefill rate (None before the first prefill step).
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._exposed = CollectorRegistry(auto_describe=False)
        self._exposed.register(_Exposed(self.registry))
        self._limits = (0, 0)  # (max_num_seqs, max_num_batched_tokens) once set_batch_limits ran
        self.prefill_tokens_per_s: float | None = None
        self._prefill_pending = 0

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(PREFIX + name, text, (MODEL_LABEL,), registry=self.registry
                         ).labels(model_name)

        def counter(name: str, text: str) -> Counter:
            return Counter(PREFIX + name, text, (MODEL_LABEL,), registry=self.registry
                           ).labels(model_name)

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, text, (MODEL_LABEL,), registry=self.registry,
                             buckets=buckets).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction (0-1) of KV-cache blocks held by live requests.")
        self.num_scheduled_seqs = gauge("num_scheduled_seqs",
                                        "Sequences in the last engine step's batch.")
        self.num_scheduled_tokens = gauge(
            "num_scheduled_tokens", "Tokens (prefill chunks + decode tokens) in the last engine step.")
        self.max_num_seqs = gauge("max_num_seqs", "Most sequences one step may hold (max_num_seqs).")
        self.max_num_batched_tokens = gauge(
            "max_num_batched_tokens", "Token budget of one step (max_num_batched_tokens).")
        self.ttft_slo = gauge("ttft_slo_seconds",
                              "First-token objective the scheduler plans for, seconds (0: none).")
        self.itl_slo = gauge("itl_slo_seconds", "Largest-gap objective the scheduler plans for, "
                             "seconds (0: none).")
        self.batch_seqs_usage_perc = gauge("batch_seqs_usage_perc",
                                           "Last step's sequences over max_num_seqs (0-1).")
        self.batch_tokens_usage_perc = gauge(
            "batch_tokens_usage_perc", "Last step's tokens over max_num_batched_tokens (0-1).")
        self.cache_config_info = Gauge(
            PREFIX + "cache_config_info", "KV cache layout (1): tokens per block, blocks.",
            (MODEL_LABEL, "block_size", "num_gpu_blocks"), registry=self.registry)
        self.num_tokens_in_flight = gauge(
            "num_tokens_in_flight",
            "Prompt tokens still to prefill plus tokens still to generate (up to max_tokens) of "
            "the waiting and running requests.")
        self.prefill_rate = gauge(
            "prefill_tokens_per_second",
            "Measured prefill rate: prompt tokens per second of the steps that prefilled.")
        self.prefill_backlog = gauge(
            "prefill_backlog_seconds",
            "Prompt tokens still to prefill over the measured prefill rate, seconds.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed (prefill).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            PREFIX + "request_success", "Requests finished, by finish reason.",
            (MODEL_LABEL, "finished_reason"), registry=self.registry)
        for reason in ("stop", "length"):
            self._request_success.labels(model_name, reason)
        self.num_preemptions = counter("num_preemptions", "Requests preempted to free KV blocks.")
        self.num_aborted_requests = counter("num_aborted_requests",
                                            "Requests aborted (client disconnect or cancel).")
        self.step_programs_pending = gauge(
            "step_programs_pending",
            "Step programs still to compile in the background after ready (0: none left).")
        self.num_compiles_after_warmup = counter(
            "num_compiles_after_warmup",
            "XLA compiles on the engine thread after warm-up (0 unless warm-up missed a program).")
        self.kv_counters = {field: counter(name, text)
                            for field, (name, text) in KV_COUNTERS.items()}
        self._kv_seen: dict[str, int] = dict.fromkeys(KV_COUNTERS, 0)
        self.kv_events_published = counter("kv_events_published",
                                           "KV-cache events sent to subscribers.")
        self.kv_events_dropped = counter(
            "kv_events_dropped", "KV-cache events dropped because the publisher's queue was full.")
        self._kv_events_seen = (0, 0)
        self.kv_offload_usage_perc = gauge(
            "kv_offload_usage_perc",
            "Fraction (0-1) of host-tier KV blocks in use (swapped out or cached).")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token, seconds.",
            TTFT_BUCKETS_S)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive output tokens of a request, seconds.", ITL_BUCKETS_S)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish of a request, seconds.",
            REQUEST_LATENCY_BUCKETS_S)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling of a request, seconds.",
            REQUEST_LATENCY_BUCKETS_S)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of a finished request.", LENGTH_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated for a finished request (all choices).",
            LENGTH_BUCKETS)

    @property
    def content_type(self) -> str:
        """The Content-Type of ``render()``'s text."""
        return CONTENT_TYPE_LATEST

    def record_step(
        self,
        num_running: int,
        num_waiting: int,
        kv_usage: float,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        num_preemptions: int,
    ) -> None:
        """Record one engine step: the queue gauges and the tokens/preemptions of this step."""
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.kv_cache_usage_perc.set(kv_usage)
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens:
            self.generation_tokens.inc(num_generation_tokens)
        if num_preemptions:
            self.num_preemptions.inc(num_preemptions)

    def record_compile(self) -> None:
        """Count one XLA compile after warm-up (``compile_events.counting_compiles``)."""
        self.num_compiles_after_warmup.inc()

    def record_tokens_pending(self, num_prefill_tokens: int, num_decode_tokens: int) -> None:
        """Set the work-left gauges from ``Scheduler.num_tokens_pending()``."""
        self._prefill_pending = num_prefill_tokens
        self.num_tokens_in_flight.set(num_prefill_tokens + num_decode_tokens)
        self._set_backlog()

    def record_prefill_rate(self, num_prompt_tokens: int, step_s: float) -> None:
        """Fold one step that prefilled ``num_prompt_tokens`` in ``step_s`` seconds into the
        prefill rate (an exponential moving average); steps without prompt tokens are skipped."""
        if num_prompt_tokens <= 0 or step_s <= 0:
            return
        rate = num_prompt_tokens / step_s
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (
            old + PREFILL_RATE_WEIGHT * (rate - old))
        self.prefill_rate.set(self.prefill_tokens_per_s)
        self._set_backlog()

    def _set_backlog(self) -> None:
        rate = self.prefill_tokens_per_s
        self.prefill_backlog.set(self._prefill_pending / rate if rate else 0.0)

    def set_batch_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Publish the engine's per-step limits (the denominators of the usage ratios)."""
        self._limits = (max_num_seqs, max_num_batched_tokens)
        self.max_num_seqs.set(max_num_seqs)
        self.max_num_batched_tokens.set(max_num_batched_tokens)

    def set_objectives(self, ttft_slo_s: float, itl_slo_s: float) -> None:
        """Publish the service objectives the scheduler plans for (s; 0: none), which
        ``jaxserve sweep`` takes as its SLOs when none are given."""
        self.ttft_slo.set(ttft_slo_s)
        self.itl_slo.set(itl_slo_s)

    def set_cache_config(self, block_size: int, num_blocks: int) -> None:
        """Publish the KV cache layout: ``num_blocks`` blocks (block 0 included, as vLLM counts
        its null block) of ``block_size`` tokens."""
        self.cache_config_info.clear()
        self.cache_config_info.labels(self.model_name, str(block_size), str(num_blocks)).set(1)

    def record_batch(self, num_seqs: int, num_tokens: int) -> None:
        """Record the last step's batch: ``num_seqs`` sequences and ``num_tokens`` tokens
        scheduled (0 and 0 for an idle step); the ratios use the limits of
        ``set_batch_limits`` (0 before it is called)."""
        self.num_scheduled_seqs.set(num_seqs)
        self.num_scheduled_tokens.set(num_tokens)
        max_seqs, max_tokens = self._limits
        self.batch_seqs_usage_perc.set(num_seqs / max_seqs if max_seqs else 0.0)
        self.batch_tokens_usage_perc.set(num_tokens / max_tokens if max_tokens else 0.0)

    def record_kv_stats(self, stats: KVStats, host_usage: float | None) -> None:
        """Bring the KV counters up to the scheduler's cumulative ``stats``; set the host-tier
        usage gauge (None: no host tier, left at 0)."""
        for field, counter in self.kv_counters.items():
            value = getattr(stats, field)
            if value > self._kv_seen[field]:
                counter.inc(value - self._kv_seen[field])
                self._kv_seen[field] = value
        if host_usage is not None:
            self.kv_offload_usage_perc.set(host_usage)

    def record_kv_events(self, num_published: int, num_dropped: int) -> None:
        """Bring the KV-cache event counters up to the publisher's cumulative counts."""
        old_published, old_dropped = self._kv_events_seen
        if num_published > old_published:
            self.kv_events_published.inc(num_published - old_published)
        if num_dropped > old_dropped:
            self.kv_events_dropped.inc(num_dropped - old_dropped)
        self._kv_events_seen = (max(num_published, old_published), max(num_dropped, old_dropped))

    def record_first_token(self, ttft_s: float, queue_s: float) -> None:
        """Record a request's first output token: time to first token and time spent queued."""
        self.time_to_first_token.observe(ttft_s)
        self.request_queue_time.observe(queue_s)

    def record_inter_token(self, itl_s: float) -> None:
        """Record the gap between two consecutive output tokens of one request."""
        self.inter_token_latency.observe(itl_s)

    def record_finished(self, finish_reason: str, e2e_s: float, *, num_prompt_tokens: int,
                        num_generation_tokens: int) -> None:
        """Record a finished request (its lengths in tokens); ``"abort"`` counts as aborted,
        not as a success, and enters no histogram."""
        if finish_reason == ABORT:
            self.num_aborted_requests.inc()
            return
        self._request_success.labels(self.model_name, finish_reason).inc()
        self.e2e_request_latency.observe(e2e_s)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (no ``_created`` series)."""
        return generate_latest(self._exposed)


class _VllmNames(Collector):
    """Re-exports the ``VLLM_NAMES`` families of ``source`` under ``vllm:`` names."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for m in self.source.collect():
            base = m.name.removeprefix(PREFIX)
            for name in VLLM_NAMES.get(base, ()) if m.name.startswith(PREFIX) else ():
                out = Metric(VLLM_PREFIX + name, m.documentation, m.type, m.unit)
                # sample names are the family's plus a suffix (_total, ...)
                for s in _without_created(m.samples, m.name):
                    out.add_sample(VLLM_PREFIX + name + s.name[len(m.name):], s.labels, s.value,
                                   s.timestamp, s.exemplar)
                yield out


def vllm_compat(source: CollectorRegistry) -> CollectorRegistry:
    """A registry that exports ``source``'s series that vLLM also has (``VLLM_NAMES``) under
    vLLM's names, read from ``source`` at each scrape (nothing is recorded twice)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_VllmNames(source))
    return registry
