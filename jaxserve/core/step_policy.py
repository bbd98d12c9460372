"""The scheduler's step policy: how far a step's prefill may grow, and in which order prompts
get it, planned for the service objectives. Plain Python over the scheduler's sequences (no jax,
no I/O), owned by the ``Scheduler``; the one room where the SLO policy lives.

Each request carries two objectives (``SchedulerConfig.ttft_slo_s`` and ``itl_slo_s``; 0: none):
its first token within ``ttft_slo_s`` of its arrival, and no gap over ``itl_slo_s`` between two
of its tokens. The goodput the policy plans for is the share of requests that meet both
(DistServe, Zhong et al., OSDI 2024). It holds what the engine measures and tells the scheduler:
the compiled token buckets (``set_token_buckets``) and the step-cost model (``core.step_cost``:
the platform's prior, calibrated at start-up, refitted from each measured step, with the
recent steps' errors). From them it answers the scheduler's questions of a step:

``prefill_budget``  prompt tokens the step may take beside the streams that decode: the step
                    is planned to ``itl_slo_s``, less the model's error at the
                    ``ITL_PLAN_QUANTILE`` of recent steps with a prompt chunk (the steps
                    it plans; short decode-only steps jitter more). Stall-free batching
                    (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference
                    with Sarathi-Serve", OSDI 2024), with the step's size from the gap
                    objective instead of a fixed token budget. A stream that has missed an
                    objective already (its request can no longer count) holds steps to
                    ``LOST_STREAM_GAP_SLOS`` times it instead, so the queue gets the cores
                    while its gaps stay bounded; with no stream decoding the step takes all
                    of ``max_num_batched_tokens``.
``prefill_order``   who gets that budget: "shortest-first" (the default), preempted streams
                    first, then the fewest prompt tokens left, a prompt bypassed
                    ``max_prefill_skips`` steps by arrival. "slo": preempted streams first,
                    then ``_slo_order``: the prompts that can still meet their first-token
                    deadline at the step's prefill rate (Moore and Hodgson's rule), shortest
                    first where all of them still do; then those that cannot, shortest first,
                    each of them first of all once it has waited ``LATE_PROMOTION_SLOS``
                    objectives (none starves). Measured on a server, "slo" kept fewer requests
                    within both objectives near and above saturation: above it nearly every
                    prompt has waited that long and the order becomes arrival order. "fcfs".
``fit_bucket``      whether to give back a few prompt tokens so the step fills a smaller bucket.

The constants were chosen by replaying production-shaped traces (``jaxserve bench replay``) and
checked on a server (docs/decisions/0041-slo-scheduling.md).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

from jaxserve.core.plan import ScheduledSeq, SchedulerConfig, SchedulerOutput
from jaxserve.core.sequence import SeqState, decodes, last_sample_pending
from jaxserve.core.step_cost import (
    OnlineStepCost,
    StepCostModel,
    StepSample,
    fit_bucket,
    prefill_pairs,
    prefill_token_budget,
)

ITL_PLAN_QUANTILE = 0.95  # plan a step so that this share of steps stays within the objective
ITL_PLAN_FRACTION = 0.9  # ... and to this share of what that leaves (the error drifts)
LOST_STREAM_GAP_SLOS = 1.5  # beside streams that missed an objective: steps of this many of it
LATE_PROMOTION_SLOS = 1.5  # a prompt that has waited this many first-token objectives goes first


class StepPolicy:
    """The budget and the order of ``config`` (module docstring).

    Args:
      config: the scheduler's settings (``ttft_slo_s``, ``itl_slo_s``, ``step_cost``,
        ``prefill_order``, ``max_prefill_skips``, ``token_buckets``, ...).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._token_buckets = config.token_buckets
        self._cost = OnlineStepCost(config.step_cost) if config.step_cost is not None else None
        self._rate = math.inf  # prompt tokens a second at the last step's budget

    # -- what the engine measures -----------------------------------------------------------------
    @property
    def token_buckets(self) -> tuple[int, ...]:
        """The token buckets steps are planned for (() : none)."""
        return self._token_buckets

    def set_token_buckets(self, buckets: Iterable[int]) -> None:
        """Plan steps for these compiled token buckets (ascending sizes)."""
        self._token_buckets = tuple(buckets)

    @property
    def step_cost(self) -> StepCostModel | None:
        """The step-cost model the policy plans with now (None without one)."""
        return None if self._cost is None else self._cost.model

    def calibrate(self, model: StepCostModel) -> None:
        """Plan with ``model`` from now on and fit measured steps toward it (ignored without a
        step-cost model)."""
        if self._cost is not None:
            self._cost.prior = self._cost.model = model

    def observe(self, plan: SchedulerOutput, num_tokens: int, seconds: float) -> None:
        """One measured step for the online fit and its error (``OnlineStepCost.observe``)."""
        if self._cost is not None:
            self._cost.observe(StepSample(num_tokens, plan.num_decode_rows,
                                          plan.num_context_tokens, seconds,
                                          plan.num_prefill_pairs))

    def predict_s(self, plan: SchedulerOutput, num_tokens: int) -> float | None:
        """The model's seconds for ``plan`` padded to ``num_tokens`` (None without a model)."""
        if self._cost is None:
            return None
        return self._cost.model.predict(num_tokens, plan.num_decode_rows,
                                        plan.num_context_tokens, plan.num_prefill_pairs)

    def missed(self, seq: SeqState, now: float) -> bool:
        """Whether ``seq`` has missed an objective already: its first token later than
        ``ttft_slo_s`` after arrival (or, still without one, ``now`` past that), or a gap over
        ``itl_slo_s`` (an objective of 0 is none)."""
        cfg = self.config
        if cfg.ttft_slo_s > 0:
            first = now if seq.first_token_time is None else seq.first_token_time
            if first - seq.arrival_time > cfg.ttft_slo_s:
                return True
        return cfg.itl_slo_s > 0 and seq.max_gap_s > cfg.itl_slo_s

    # -- the step's questions ---------------------------------------------------------------------
    def prefill_budget(self, running: Sequence[SeqState], now: float = 0.0) -> int:
        """Prompt tokens this step may take beside the ``running`` sequences that decode
        (module docstring); ``now``: the engine's clock (s). Also sets the prefill rate (prompt
        tokens a second) that ``prefill_order`` plans with."""
        cfg, model = self.config, self.step_cost
        self._rate = math.inf
        if model is None:
            return cfg.max_num_batched_tokens
        rows = context = prefill_start = 0
        good = False  # a decoding stream that still meets its objectives
        for seq in running:
            start = seq.num_computed_tokens + seq.num_inflight_tokens
            if decodes(seq, start):
                if not last_sample_pending(seq, cfg.max_model_len):
                    rows += 1
                    context += start + 1
                    good = good or not self.missed(seq, now)
            else:  # its chunk's attention reads what it has computed: count the furthest
                prefill_start = max(prefill_start, start)
        budget = cfg.max_num_batched_tokens
        if rows and cfg.itl_slo_s > 0:
            error = max(1.0, self._cost.error_quantile(ITL_PLAN_QUANTILE, prefill=True))
            target = cfg.itl_slo_s / error * (ITL_PLAN_FRACTION if good else
                                              LOST_STREAM_GAP_SLOS)
            budget = prefill_token_budget(model, target, rows, context, budget,
                                          self._token_buckets, prefill_start=prefill_start)
        step_s = model.predict(self._padded(rows + budget), rows, context,
                               prefill_pairs(budget, prefill_start))
        if step_s > 0:
            self._rate = budget / step_s
        return budget

    def prefill_order(self, pending: Sequence[SeqState], waiting: Iterable[SeqState],
                      now: float = 0.0) -> list[SeqState]:
        """The running sequences ``pending`` a prompt chunk and the ``waiting`` ones, in the
        order they get the step's prefill budget. "fcfs": running ones oldest first, then
        waiting ones in queue order. "shortest-first" (Shortest-Remaining-Prefill, against
        head-of-line blocking as in sgl-project/sglang#22831): preempted sequences first (they
        were streaming), then prompts bypassed ``max_prefill_skips`` times in arrival order
        (so a long prompt always progresses), then the rest by prompt tokens left. "slo":
        preempted sequences first, then ``_slo_order``."""
        cands = [*pending, *waiting]
        if self.config.prefill_order == "fcfs":
            return cands
        preempted = [s for s in cands if s.num_preemptions and not s.block_ids]
        first = {id(s) for s in preempted}
        rest = [s for s in cands if id(s) not in first]
        if self.config.prefill_order == "slo" and self.config.ttft_slo_s > 0:
            return preempted + self._slo_order(rest, now)
        skips = self.config.max_prefill_skips
        return preempted + sorted(rest, key=lambda s: (
            s.num_prefill_skips < skips, _prompt_left(s) if s.num_prefill_skips < skips else 0,
            s.arrival_index))

    def _slo_order(self, cands: list[SeqState], now: float) -> list[SeqState]:
        """Prompts in the order that lets the most of them meet their first-token deadline
        (arrival + ``ttft_slo_s``), with none starving (module docstring).

        Moore and Hodgson's rule ("An n job, one machine sequencing algorithm for minimizing
        the number of late jobs", Management Science 15(1), 1968), with a prompt's work its
        tokens left at the step's prefill rate (``prefill_budget``): in deadline order, each
        time the next deadline would be missed, the longest prompt taken so far is set aside.
        The prompts kept meet their deadlines: shortest first where that still holds for all
        of them (the median first token comes sooner), else in deadline order. The prompts set
        aside and those past their deadline follow, shortest first; one that has waited
        ``LATE_PROMOTION_SLOS`` objectives goes before every other, by arrival.
        """
        ttft, rate = self.config.ttft_slo_s, self._rate
        late = [s for s in cands if now - s.arrival_time > ttft]
        kept: list[SeqState] = []
        work = 0
        for s in sorted((s for s in cands if now - s.arrival_time <= ttft),
                        key=lambda s: (s.arrival_time, s.arrival_index)):
            kept.append(s)
            work += _prompt_left(s)
            if now + work / rate > s.arrival_time + ttft:
                longest = max(kept, key=_prompt_left)
                kept.remove(longest)
                work -= _prompt_left(longest)
                late.append(longest)
        shortest = sorted(kept, key=lambda s: (_prompt_left(s), s.arrival_index))
        if _on_time(shortest, now, rate, ttft):
            kept = shortest
        overdue = sorted((s for s in late if now - s.arrival_time >= LATE_PROMOTION_SLOS * ttft),
                         key=lambda s: s.arrival_index)
        rest = sorted((s for s in late if now - s.arrival_time < LATE_PROMOTION_SLOS * ttft),
                      key=lambda s: (_prompt_left(s), s.arrival_index))
        return overdue + kept + rest

    def _padded(self, num_tokens: int) -> int:
        """The compiled bucket a step of ``num_tokens`` runs in (itself without buckets)."""
        i = bisect.bisect_left(self._token_buckets, num_tokens)
        return self._token_buckets[i] if i < len(self._token_buckets) else num_tokens

    def fit_bucket(self, scheduled: list[ScheduledSeq], num_tokens: int) -> int:
        """``step_cost.fit_bucket`` with the planned buckets and the step overhead (no buckets:
        ``num_tokens`` unchanged)."""
        if not self._token_buckets:
            return num_tokens
        return fit_bucket(scheduled, num_tokens, self._token_buckets,
                          self.config.step_overhead_tokens)


def _prompt_left(seq: SeqState) -> int:
    """Tokens ``seq`` has yet to compute before it samples again (its prompt, or what a
    preemption dropped), counting those already in flight as done."""
    return (len(seq.token_ids) + seq.num_output_placeholders - seq.num_computed_tokens
            - seq.num_inflight_tokens)


def _on_time(order: Sequence[SeqState], now: float, rate: float, ttft: float) -> bool:
    """Whether each prompt of ``order``, prefilled one after the other at ``rate`` tokens a
    second from ``now``, finishes within ``ttft`` of its arrival."""
    work = 0
    for s in order:
        work += _prompt_left(s)
        if now + work / rate > s.arrival_time + ttft:
            return False
    return True
