"""The scheduler's settings and what one step's plan and update hand to the engine.

``SchedulerConfig`` holds the limits of a step and of the KV cache; ``SchedulerOutput`` is the
plan of one step (``Scheduler.schedule``), ``UpdateResult`` what ``Scheduler.update`` changed.
Plain data: no jax, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from jaxserve.config import MAX_PREFILL_SKIPS, PREFILL_ORDERS, EngineConfig
from jaxserve.core.step_cost import StepCostModel

PREEMPTION_POLICIES = ("newest", "least_progress")
PLACEHOLDER_TOKEN = -1  # in a plan's token_ids: the token the in-flight step samples


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step and of the KV cache (see EngineConfig for the meaning of each)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    num_blocks: int  # including the reserved padding block 0
    long_prefill_token_threshold: int = 0  # > 0: most prompt tokens one request gets per step
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0  # host-tier blocks including its reserved block 0; 0: no host tier
    # victim when the pool is short: "newest" (latest admitted) or "least_progress" (fewest
    # computed tokens); default: least work lost (docs/decisions/0016-preemption-policy.md)
    preemption_policy: str = "least_progress"
    # the compiled step shapes, ascending (``device.buckets.token_buckets``); () plans without
    # them. With them, a step just past a bucket gives prefill tokens back (``_fit_bucket``).
    token_buckets: tuple[int, ...] = ()
    # the fixed cost of one step (weights read, dispatch, host work) in prompt tokens of compute
    step_overhead_tokens: int = 32
    async_scheduling: bool = False  # plans may run one step ahead of update (module docstring)
    # the service objectives (s; 0: none): a request's first token within ttft_slo_s of its
    # arrival, no gap between its tokens over itl_slo_s (core/step_policy.py plans for both:
    # while streams decode, prefill is cut so the model predicts the step within itl_slo_s)
    ttft_slo_s: float = 0.0
    itl_slo_s: float = 0.0
    step_cost: StepCostModel | None = None  # the model to start from (Scheduler.step_cost)
    prefill_order: str = "fcfs"  # PREFILL_ORDERS
    max_prefill_skips: int = MAX_PREFILL_SKIPS  # then a bypassed prompt goes by arrival
    prefix_caching_hash_algo: str = "sha256"  # block_hash.HASH_ALGOS
    record_kv_events: bool = False  # the KV manager records prefix-cache changes (cache_events)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name}={getattr(self, name)} must be >= 1")
        if self.num_blocks < 2:
            raise ValueError(f"SchedulerConfig.{self.num_blocks=} must be >= 2 (block 0 reserved)")
        if self.preemption_policy not in PREEMPTION_POLICIES:
            raise ValueError(f"SchedulerConfig.{self.preemption_policy=} must be one of "
                             f"{PREEMPTION_POLICIES}")
        if min(self.ttft_slo_s, self.itl_slo_s) < 0 or (
                max(self.ttft_slo_s, self.itl_slo_s) > 0 and self.step_cost is None):
            raise ValueError(f"SchedulerConfig.{self.ttft_slo_s=} and {self.itl_slo_s=} must be "
                             ">= 0, and > 0 only with a step_cost model")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"SchedulerConfig.{self.prefill_order=} must be one of "
                             f"{PREFILL_ORDERS}")
        if self.max_prefill_skips < 0:
            raise ValueError(f"SchedulerConfig.{self.max_prefill_skips=} must be >= 0")

    @classmethod
    def from_engine_config(
        cls, cfg: EngineConfig, num_blocks: int, max_model_len: int, num_host_blocks: int = 0,
        step_cost: StepCostModel | None = None, ttft_slo_s: float = 0.0, itl_slo_s: float = 0.0,
    ) -> SchedulerConfig:
        """The scheduler's settings from the engine's; the service objectives as resolved by
        the caller (``EngineConfig.ttft_slo_ms`` / ``itl_slo_ms`` None mean the platform's)."""
        return cls(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            block_size=cfg.block_size,
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            enable_prefix_caching=cfg.enable_prefix_caching,
            num_host_blocks=num_host_blocks,
            prefix_caching_hash_algo=cfg.prefix_caching_hash_algo,
            record_kv_events=cfg.kv_events_enabled,
            async_scheduling=cfg.async_scheduling,
            ttft_slo_s=ttft_slo_s,
            itl_slo_s=itl_slo_s,
            step_cost=step_cost,
            prefill_order=cfg.prefill_order,
        )


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    seq_id: str
    token_ids: tuple[int, ...]  # at positions start_pos .. start_pos + len - 1; async
    #   scheduling: the last may be PLACEHOLDER_TOKEN (the in-flight step's sample)
    start_pos: int
    block_ids: tuple[int, ...]  # the whole block table after allocation
    sample: bool  # the chunk reaches the end of the sequence's token_ids
    arrival_index: int = -1  # the sequence's (ids may be reused once it has finished)
    # the sequence's prompt length, and its outputs when planned (in-flight samples included;
    # vLLM's NewRequestData.prompt_token_ids and CachedRequestData.num_output_tokens)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step; run ``offloads`` then ``loads`` before its forward pass, even
    when ``scheduled`` is empty."""

    scheduled: tuple[ScheduledSeq, ...]  # batch order: running ones, then newly admitted
    num_scheduled_tokens: int
    preempted_ids: tuple[str, ...] = ()  # lost their device blocks this step
    offloads: tuple[tuple[int, int], ...] = ()  # (device block, host block) copies
    loads: tuple[tuple[int, int], ...] = ()  # (host block, device block) copies
    # the step's shape for its cost (step_cost.StepSample): rows decoding one token, the K/V
    # tokens their attention reads, and the query-key pairs of the prompt chunks' attention
    num_decode_rows: int = 0
    num_context_tokens: int = 0
    num_prefill_pairs: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class UpdateResult:
    """What ``Scheduler.update`` changed."""

    new_token_ids: dict[str, int] = field(default_factory=dict)  # sequence -> token appended
    finished: dict[str, str] = field(default_factory=dict)  # sequence -> "stop" | "length"
    # sequence -> what stopped it, for "stop" finishes that have one: the stop id (int), or
    # the ``TextStop.stop_reason`` the engine's stop check gave (a stop string)
    stop_reasons: dict[str, str | int] = field(default_factory=dict)


@dataclass(frozen=True)
class TextStop:
    """A stop only the engine sees in the output (``StopCheck``): a stop string
    (``stop_reason`` the string), or a structured-output grammar that has ended (None)."""

    stop_reason: str | int | None = None


# the engine's rule for stops in the text: ``(seq_id, token) -> TextStop | None``, asked by
# ``Scheduler.update`` for each appended token that is not a stop id (it may advance the
# sequence's detokeniser and grammar: it is asked once per token, in order)
StopCheck = Callable[[str, int], TextStop | None]


