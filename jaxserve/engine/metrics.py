"""Prometheus metrics of the engine, under vLLM's names with the ``jaxserve:`` prefix.

The engine loop calls the ``record_*`` methods (cheap, thread-safe: prometheus-client guards
each value with a lock); the HTTP server's ``GET /metrics`` returns ``render()``. Each engine owns
its own ``CollectorRegistry`` unless one is passed in, so several engines (tests) never clash.

Exposed series (prometheus-client appends ``_total`` to counters and ``_bucket``/``_sum``/``_count``
to histograms):

  gauges     jaxserve:num_requests_running, jaxserve:num_requests_waiting,
             jaxserve:kv_cache_usage_perc (0-1); batch occupancy of the last step:
             jaxserve:num_scheduled_seqs, jaxserve:num_scheduled_tokens, their limits
             jaxserve:max_num_seqs, jaxserve:max_num_batched_tokens, and the ratios
             jaxserve:batch_seqs_usage_perc, jaxserve:batch_tokens_usage_perc (0-1)
  counters   jaxserve:prompt_tokens_total, jaxserve:generation_tokens_total,
             jaxserve:request_success_total{finished_reason}, jaxserve:num_preemptions_total,
             jaxserve:num_aborted_requests_total
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
  histograms jaxserve:time_to_first_token_seconds, jaxserve:inter_token_latency_seconds,
             jaxserve:e2e_request_latency_seconds, jaxserve:request_queue_time_seconds
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from jaxserve.core.kv_manager import KVStats

PREFIX = "jaxserve:"

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
ABORT = "abort"


class EngineMetrics:
    """The engine's Prometheus metrics and the calls that update them.

    Args:
      registry: where to register the metrics; None creates a private registry.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._limits = (0, 0)  # (max_num_seqs, max_num_batched_tokens) once set_batch_limits ran
        self.num_requests_running = Gauge(
            PREFIX + "num_requests_running", "Requests in the running batch.", registry=r
        )
        self.num_requests_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", registry=r
        )
        self.kv_cache_usage_perc = Gauge(
            PREFIX + "kv_cache_usage_perc",
            "Fraction (0-1) of KV-cache blocks held by live requests.",
            registry=r,
        )
        self.num_scheduled_seqs = Gauge(
            PREFIX + "num_scheduled_seqs", "Sequences in the last engine step's batch.", registry=r
        )
        self.num_scheduled_tokens = Gauge(
            PREFIX + "num_scheduled_tokens",
            "Tokens (prefill chunks + decode tokens) in the last engine step.",
            registry=r,
        )
        self.max_num_seqs = Gauge(
            PREFIX + "max_num_seqs", "Most sequences one step may hold (max_num_seqs).", registry=r
        )
        self.max_num_batched_tokens = Gauge(
            PREFIX + "max_num_batched_tokens",
            "Token budget of one step (max_num_batched_tokens).",
            registry=r,
        )
        self.batch_seqs_usage_perc = Gauge(
            PREFIX + "batch_seqs_usage_perc",
            "Last step's sequences over max_num_seqs (0-1).",
            registry=r,
        )
        self.batch_tokens_usage_perc = Gauge(
            PREFIX + "batch_tokens_usage_perc",
            "Last step's tokens over max_num_batched_tokens (0-1).",
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed (prefill).", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", registry=r
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests finished, by finish reason.",
            labelnames=("finished_reason",),
            registry=r,
        )
        for reason in ("stop", "length"):
            self.request_success.labels(finished_reason=reason)
        self.num_preemptions = Counter(
            PREFIX + "num_preemptions", "Requests preempted to free KV blocks.", registry=r
        )
        self.num_aborted_requests = Counter(
            PREFIX + "num_aborted_requests",
            "Requests aborted (client disconnect or cancel).",
            registry=r,
        )
        self.kv_counters = {
            field: Counter(PREFIX + name, text, registry=r)
            for field, (name, text) in KV_COUNTERS.items()
        }
        self._kv_seen: dict[str, int] = dict.fromkeys(KV_COUNTERS, 0)
        self.kv_offload_usage_perc = Gauge(
            PREFIX + "kv_offload_usage_perc",
            "Fraction (0-1) of host-tier KV blocks in use (swapped out or cached).",
            registry=r,
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first output token, seconds.",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive output tokens of a request, seconds.",
            buckets=ITL_BUCKETS_S,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to finish of a request, seconds.",
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduling of a request, seconds.",
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=r,
        )

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

    def set_batch_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Publish the engine's per-step limits (the denominators of the usage ratios)."""
        self._limits = (max_num_seqs, max_num_batched_tokens)
        self.max_num_seqs.set(max_num_seqs)
        self.max_num_batched_tokens.set(max_num_batched_tokens)

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

    def record_first_token(self, ttft_s: float, queue_s: float) -> None:
        """Record a request's first output token: time to first token and time spent queued."""
        self.time_to_first_token.observe(ttft_s)
        self.request_queue_time.observe(queue_s)

    def record_inter_token(self, itl_s: float) -> None:
        """Record the gap between two consecutive output tokens of one request."""
        self.inter_token_latency.observe(itl_s)

    def record_finished(self, finish_reason: str, e2e_s: float) -> None:
        """Record a finished request; ``"abort"`` counts as aborted, not as a success."""
        if finish_reason == ABORT:
            self.num_aborted_requests.inc()
            return
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.e2e_request_latency.observe(e2e_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
