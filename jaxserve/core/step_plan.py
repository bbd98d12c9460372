"""One step's plan while ``Scheduler.schedule`` builds it (plain data, no jax, no I/O).

``PlanBuilder`` holds what the scheduler has planned so far in a step: the chunks, the
sequences it preempted, and what is left of the step's token budget and of its prefill budget
(the ITL target's), with the step's shape for its cost (decode rows, their context, prompt
chunks). ``Scheduler.schedule`` calls ``add`` for each chunk and ``build`` once at the end;
nothing else changes it.
"""

from __future__ import annotations

from jaxserve.core.plan import PLACEHOLDER_TOKEN, ScheduledSeq, SchedulerOutput
from jaxserve.core.sequence import SeqState, decodes
from jaxserve.core.step_cost import prefill_pairs


class PlanBuilder:
    """The plan of the step being scheduled (module docstring).

    Args:
      budget: the step's tokens (``max_num_batched_tokens``).
      prefill_budget: the prompt tokens it may take (``StepPolicy.prefill_budget``; >= budget
        without an ITL target).
    """

    def __init__(self, budget: int, prefill_budget: int) -> None:
        self.max_tokens = budget
        self.budget = budget  # tokens left for the step
        self.prefill_left = prefill_budget  # prompt tokens left under the ITL target
        self.scheduled: list[ScheduledSeq] = []
        self.preempted: list[str] = []  # in the order they were preempted
        self.planned: set[str] = set()
        self.admitted = False  # a waiting sequence was admitted
        self._decoding: set[str] = set()
        self.num_decode_rows = self.num_context_tokens = self.num_prefill_chunks = 0

    @property
    def limit(self) -> int:
        """The most tokens a prompt chunk may take now."""
        return min(self.budget, self.prefill_left)

    def add(self, seq: SeqState, num_new: int) -> None:
        """Plan ``num_new`` tokens of ``seq`` from where its computed and in-flight tokens end
        (the last ones ``PLACEHOLDER_TOKEN`` where they are in-flight samples)."""
        start = seq.num_computed_tokens + seq.num_inflight_tokens
        if decodes(seq, start):
            self.num_decode_rows += 1
            self.num_context_tokens += start + 1
            self._decoding.add(seq.seq_id)
        else:
            self.prefill_left -= num_new
            self.num_prefill_chunks += 1
        end = start + num_new
        known = seq.token_ids[start:end]
        self.scheduled.append(ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=(*known, *[PLACEHOLDER_TOKEN] * (num_new - len(known))),
            start_pos=start,
            block_ids=tuple(seq.block_ids),
            sample=end == len(seq.token_ids) + seq.num_output_placeholders,
            arrival_index=seq.arrival_index,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens + seq.num_output_placeholders,
        ))
        self.planned.add(seq.seq_id)
        self.budget -= num_new

    def build(self, num_tokens: int, offloads: tuple[tuple[int, int], ...],
              loads: tuple[tuple[int, int], ...]) -> SchedulerOutput:
        """The plan: ``num_tokens`` the step's token count (after ``StepPolicy.fit_bucket``
        shortened chunks in ``scheduled``), with the host-tier copies to run before it."""
        pairs = sum(prefill_pairs(len(c.token_ids), c.start_pos) for c in self.scheduled
                    if c.seq_id not in self._decoding)
        return SchedulerOutput(
            scheduled=tuple(self.scheduled),
            num_scheduled_tokens=num_tokens,
            preempted_ids=tuple(self.preempted),
            offloads=offloads,
            loads=loads,
            num_decode_rows=self.num_decode_rows,
            num_context_tokens=self.num_context_tokens,
            num_prefill_pairs=pairs,
        )
