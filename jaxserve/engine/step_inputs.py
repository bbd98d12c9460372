"""From a scheduler plan to a step running on the device, and what the host keeps to read it.

``StepDispatcher.dispatch(plan, prev)`` builds each scheduled row's sampling inputs
(``RowParams``: temperature, top-k/p, seed, penalties, prompt-logprob targets, stop ids held
back under ``min_tokens``), packs the plan into the bucket's buffer (``ModelRunner.pack_step``),
fills constrained rows' allowed-token masks from their grammars, and starts the compiled
program (``ModelRunner.execute``). It returns an ``InflightStep``: the plan, the choices the rows
ran for and the device's output, read by ``LLMEngine`` when the sampled ids reach the host.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from jaxserve.core.plan import PLACEHOLDER_TOKEN, SchedulerOutput
from jaxserve.device.buckets import Bucket
from jaxserve.device.runner import ModelRunner, StepOutput
from jaxserve.device.step_buffer import RowParams
from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.request_state import Choice
from jaxserve.engine.structured_output import GrammarCompiler


@dataclass
class InflightStep:
    """A dispatched step: its plan, what the host needs to read its results, and times
    (``time.perf_counter`` seconds)."""

    plan: SchedulerOutput
    choices: list[Choice]  # per scheduled row, the choice it ran for
    rows: list[RowParams]
    out: StepOutput
    bucket: Bucket
    want_lp: bool
    prompt_lp_rows: list[int]  # rows whose chunk has prompt-logprob targets
    num_prompt_tokens: int
    constrained: bool  # a row samples under a grammar
    mask_s: float  # seconds spent filling the grammar masks
    t_dispatch: float
    t_ready: float | None = None  # when its sampled ids were on the host
    t_start: float = 0.0  # when the engine step that planned it began (set by the engine)
    # the ITL target's step-cost model: its prediction at dispatch, and the step's measured
    # time (LLMEngine._observe_step); None without a target
    predicted_s: float | None = None
    measured_s: float | None = None
    row_of: dict[str, int] = field(init=False)  # sequence id -> batch row

    def __post_init__(self) -> None:
        self.row_of = {s.request_id: i for i, s in enumerate(self.plan.scheduled)}


class StepDispatcher:
    """Builds a plan's step inputs and starts it on the device (module docstring).

    Args:
      runner: packs and runs the step.
      slots: penalty-state rows, lent to choices with penalties or ``logit_bias``.
      grammars: fills constrained rows' token masks.
      vocab_size: the tokenizer's vocabulary (``top_k`` at or above it is off).
    """

    def __init__(self, runner: ModelRunner, slots: PenaltySlots, grammars: GrammarCompiler,
                 vocab_size: int) -> None:
        self.runner, self.slots, self.grammars = runner, slots, grammars
        self.vocab_size = vocab_size

    def dispatch(self, plan: SchedulerOutput, requests: Mapping[str, Choice],
                 prev: InflightStep | None) -> InflightStep:
        """Start ``plan``'s step; ``requests`` maps sequence ids to choices; ``prev`` is the step
        still in flight, whose sampled ids stand in for the plan's placeholder tokens."""
        now = time.monotonic()
        rows, choices, src_rows, prompt_lp_rows = [], [], [], []
        num_prompt_tokens, want_lp = 0, False
        constrained: list[tuple[int, Choice, bool]] = []  # rows sampling under a grammar
        for i, s in enumerate(plan.scheduled):
            req = requests[s.request_id]
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
                p.temperature, p.top_k if 0 < p.top_k < self.vocab_size else 0, p.top_p,
                req.seed, end - num_prompt, min_p=p.min_p,
                slot=self.slots.acquire(req) if p.uses_penalty_state else -1,
                repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, reset=s.start_pos == 0,
                num_prompt_tokens=num_prompt, prompt_targets=targets,
                suppress_ids=tuple(req.seq.stop_token_ids) if short else ()))
            num_prompt_tokens += max(0, min(num_prompt, end) - s.start_pos)
        bucket, packed = self.runner.pack_step(plan.scheduled, rows, want_logprobs=want_lp,
                                               src_rows=src_rows)
        allowed, t_mask = None, time.perf_counter()
        if constrained:  # a row short of min_tokens withholds its stop ids where it can
            allowed = self.runner.mask_buffer(bucket)
            self.grammars.fill_masks([(req.grammar, i, req.seq.stop_token_ids if short else ())
                                      for i, req, short in constrained], allowed)
        mask_s = time.perf_counter() - t_mask
        t_dispatch = time.perf_counter()
        out = self.runner.execute(bucket, packed, allowed)
        return InflightStep(plan, choices, rows, out, bucket, want_lp, prompt_lp_rows,
                            num_prompt_tokens, bool(constrained), mask_s, t_dispatch)
