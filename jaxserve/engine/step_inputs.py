"""From a scheduler plan to a step running on the device, and what the host keeps to read it.

``StepDispatcher.dispatch(plan, prev)`` builds each scheduled row's sampling inputs
(``RowParams``: temperature, top-k/p, seed, penalties, prompt-logprob targets, stop ids held
back under ``min_tokens``) and constrained rows' allowed-token masks from their grammars
(``GrammarCompiler.masks``), then hands all of it to the runner once (``ModelRunner.run``:
packed into the bucket's buffer, the compiled program started). It returns an
``InflightStep``: the plan, the choices the rows ran for and the device's output, read by
``LLMEngine`` when the sampled ids reach the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxserve.core.plan import PLACEHOLDER_TOKEN, SchedulerOutput
from jaxserve.device.buckets import Bucket
from jaxserve.device.runner import ModelRunner, StepOutput
from jaxserve.device.step_buffer import RowParams
from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.request_state import Choice, RequestTable
from jaxserve.engine.structured_output import GrammarCompiler


@dataclass
class InflightStep:
    """A dispatched step: its plan, what the host needs to read its results, and times
    (``time.perf_counter`` seconds)."""

    plan: SchedulerOutput
    choices: list[Choice]  # per scheduled row, the choice it ran for
    rows: list[RowParams]
    out: StepOutput
    want_lp: bool
    prompt_lp_rows: list[int]  # rows whose chunk has prompt-logprob targets
    num_prompt_tokens: int
    constrained: bool  # a row samples under a grammar
    mask_s: float  # seconds spent computing the grammar masks
    t_start: float  # when the engine step that planned it began
    t_ready: float | None = None  # when its sampled ids were on the host
    # the ITL target's step-cost model: its prediction at dispatch, and the step's measured
    # time (``LLMEngine._read``); None without a target
    predicted_s: float | None = None
    measured_s: float | None = None
    row_of: dict[str, int] = field(init=False)  # sequence id -> batch row

    def __post_init__(self) -> None:
        self.row_of = {s.seq_id: i for i, s in enumerate(self.plan.scheduled)}

    @property
    def bucket(self) -> Bucket:
        """The step's shape (the compiled bucket it ran in)."""
        return self.out.bucket

    @property
    def t_dispatch(self) -> float:
        """When its programs were started (``time.perf_counter`` seconds)."""
        return self.out.t_dispatch


class StepDispatcher:
    """Builds a plan's step inputs and starts it on the device (module docstring).

    Args:
      runner: packs and runs the step.
      requests: the engine's live requests (read only).
      slots: penalty-state rows, lent to choices with penalties or ``logit_bias``.
      grammars: computes constrained rows' token masks.
      vocab_size: the tokenizer's vocabulary (``top_k`` at or above it is off).
    """

    def __init__(self, runner: ModelRunner, requests: RequestTable, slots: PenaltySlots,
                 grammars: GrammarCompiler, vocab_size: int) -> None:
        self.runner, self.requests, self.slots = runner, requests, slots
        self.grammars, self.vocab_size = grammars, vocab_size

    def dispatch(self, plan: SchedulerOutput, prev: InflightStep | None, t_start: float
                 ) -> InflightStep:
        """Start ``plan``'s step; ``prev`` is the step still in flight, whose sampled ids stand
        in for the plan's placeholder tokens; ``t_start``: when the engine step began."""
        now = time.monotonic()
        rows, choices, src_rows, prompt_lp_rows = [], [], [], []
        num_prompt_tokens, want_lp = 0, False
        constrained: list[tuple[int, Choice, bool]] = []  # rows sampling under a grammar
        for i, s in enumerate(plan.scheduled):
            req = self.requests.choice(s.seq_id)
            choices.append(req)
            g, p = req.group, req.params
            if g.first_scheduled_time is None:
                g.first_scheduled_time = now
            num_prompt = len(g.prompt_token_ids)
            end = s.start_pos + len(s.token_ids)
            src_rows.append(prev.row_of[s.seq_id]
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
                short = False  # the row's grammar mask carries it (GrammarCompiler.masks)
            rows.append(RowParams(
                p.temperature, p.top_k if 0 < p.top_k < self.vocab_size else 0, p.top_p,
                req.seed, end - num_prompt, min_p=p.min_p,
                slot=self.slots.acquire(req) if p.uses_penalty_state else -1,
                repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, reset=s.start_pos == 0,
                num_prompt_tokens=num_prompt, prompt_targets=targets,
                suppress_ids=tuple(req.seq.stop_token_ids) if short else ()))
            num_prompt_tokens += max(0, min(num_prompt, end) - s.start_pos)
        masks, mask_s = None, 0.0
        if constrained:  # a row short of min_tokens withholds its stop ids where it can
            t_mask = time.perf_counter()
            masks = self.grammars.masks([(req.grammar, i, req.seq.stop_token_ids if short
                                          else ()) for i, req, short in constrained],
                                        constrained[-1][0] + 1)
            mask_s = time.perf_counter() - t_mask
        out = self.runner.run(plan.scheduled, rows, want_logprobs=want_lp, src_rows=src_rows,
                              masks=masks)
        return InflightStep(plan, choices, rows, out, want_lp, prompt_lp_rows,
                            num_prompt_tokens, bool(constrained), mask_s, t_start)
