"""The scheduler's step policy: how far a step's prefill may grow, and in which order prompts
get it. Plain Python over the scheduler's sequences (no jax, no I/O), owned by the ``Scheduler``.

The policy holds what the engine measures and tells the scheduler: the compiled token buckets a
step is planned for (``set_token_buckets``) and the step-cost model an ITL target plans with
(``core.step_cost``: the platform's prior, calibrated at start-up, refitted online from each
measured step). From them it answers the scheduler's three questions of a step:
  ``prefill_budget``  prompt tokens the step may take beside the sequences that decode, under
                      the ITL target (all of ``max_num_batched_tokens`` without one);
  ``prefill_order``   the order in which running prompt chunks and waiting prompts get it;
  ``fit_bucket``      whether to give back a few prompt tokens so the step fills a smaller
                      bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxserve.core.plan import ScheduledSeq, SchedulerConfig, SchedulerOutput
from jaxserve.core.sequence import SeqState, decodes, last_sample_pending
from jaxserve.core.step_cost import (
    OnlineStepCost,
    StepCostModel,
    StepSample,
    fit_bucket,
    itl_target_s,
    prefill_token_budget,
)


class StepPolicy:
    """The ITL target's budget and the prefill order of ``config`` (module docstring).

    Args:
      config: the scheduler's settings (``itl_target_s``, ``itl_decode_ratio``, ``step_cost``,
        ``prefill_order``, ``max_prefill_skips``, ``token_buckets``, ...).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._token_buckets = config.token_buckets
        self._cost = OnlineStepCost(config.step_cost) if config.itl_on else None

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
        """The step-cost model the ITL target plans with now (None without a target)."""
        return None if self._cost is None else self._cost.model

    def calibrate(self, model: StepCostModel) -> None:
        """Plan with ``model`` from now on and fit measured steps toward it (ignored without
        an ITL target)."""
        if self._cost is not None:
            self._cost.prior = self._cost.model = model

    def observe(self, plan: SchedulerOutput, num_tokens: int, seconds: float) -> None:
        """One measured step for the online fit (``OnlineStepCost.observe``)."""
        if self._cost is not None:
            self._cost.observe(StepSample(num_tokens, plan.num_decode_rows,
                                          plan.num_context_tokens, seconds,
                                          plan.num_prefill_pairs))

    def predict_s(self, plan: SchedulerOutput, num_tokens: int) -> float | None:
        """The model's seconds for ``plan`` padded to ``num_tokens`` (None without a target)."""
        if self._cost is None:
            return None
        return self._cost.model.predict(num_tokens, plan.num_decode_rows,
                                        plan.num_context_tokens, plan.num_prefill_pairs)

    # -- the step's questions ---------------------------------------------------------------------
    def prefill_budget(self, running: Sequence[SeqState], num_waiting: int) -> int:
        """Prompt tokens this step may take within the ITL target beside the ``running``
        sequences that decode (all of ``max_num_batched_tokens`` without a target or when
        none decodes); ``num_waiting``: the prompts queued behind them."""
        cfg, model = self.config, self.step_cost
        if not cfg.itl_on:
            return cfg.max_num_batched_tokens
        rows = context = prefill_start = prompts = 0
        for seq in running:
            start = seq.num_computed_tokens + seq.num_inflight_tokens
            if decodes(seq, start):
                if not last_sample_pending(seq, cfg.max_model_len):
                    rows += 1
                    context += start + 1
            else:  # its chunk's attention reads what it has computed: count the furthest
                prefill_start = max(prefill_start, start)
                prompts += 1
        if not rows:
            return cfg.max_num_batched_tokens
        assert model is not None
        # the automatic rule scales with the batch the queued prompts will join: streams see
        # that batch's decode step once they are in, and a queue of prompts is not held to
        # the step of the few that decode already (each assumed at the decodes' mean context)
        batch = min(cfg.max_num_seqs, rows + prompts + num_waiting) \
            if cfg.itl_decode_ratio > 0 else rows
        target = itl_target_s(model, cfg.itl_target_s, cfg.itl_decode_ratio, batch,
                              context * batch // rows, self._token_buckets)
        return prefill_token_budget(model, target, rows, context, cfg.max_num_batched_tokens,
                                    self._token_buckets, prefill_start=prefill_start)

    def prefill_order(self, pending: Sequence[SeqState], waiting: Iterable[SeqState]
                      ) -> list[SeqState]:
        """The running sequences ``pending`` a prompt chunk and the ``waiting`` ones, in the
        order they get the step's prefill budget. "fcfs": running ones oldest first, then
        waiting ones in queue order. "shortest-first" (Shortest-Remaining-Prefill, against
        head-of-line blocking as in sgl-project/sglang#22831): preempted sequences first (they
        were streaming), then prompts bypassed ``max_prefill_skips`` times in arrival order
        (so a long prompt always progresses), then the rest by prompt tokens left."""
        if self.config.prefill_order == "fcfs":
            return [*pending, *waiting]
        max_skips = self.config.max_prefill_skips

        def key(item: tuple[int, SeqState]) -> tuple[int, int, int]:
            pos, seq = item
            if seq.num_preemptions and not seq.block_ids:  # preempted, waiting: queue order
                return (0, pos, 0)
            if seq.num_prefill_skips >= max_skips:
                return (1, seq.arrival_index, 0)
            left = (len(seq.token_ids) + seq.num_output_placeholders - seq.num_computed_tokens
                    - seq.num_inflight_tokens)
            return (2, left, seq.arrival_index)

        return [s for _, s in sorted(enumerate([*pending, *waiting]), key=key)]

    def fit_bucket(self, scheduled: list[ScheduledSeq], num_tokens: int) -> int:
        """``step_cost.fit_bucket`` with the planned buckets and the step overhead (no buckets:
        ``num_tokens`` unchanged)."""
        if not self._token_buckets:
            return num_tokens
        return fit_bucket(scheduled, num_tokens, self._token_buckets,
                          self.config.step_overhead_tokens)
