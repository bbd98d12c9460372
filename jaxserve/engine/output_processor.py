"""The output side of a step: sampled ids in, ``RequestOutput``s out.

``OutputProcessor.complete(step)`` runs once a dispatched step's ids are on the host. It hands
them to ``Scheduler.update``, the one place where a sequence finishes, with the engine's stop
check (``_stop_check``): for each appended token that is not a stop id it advances the
choice's grammar (a grammar that has ended at EOS stops it) and its incremental detokeniser (a
stop string stops it). Then, per choice that kept a token: its logprobs, the TTFT / ITL
metrics, and one ``RequestOutput`` per request that changed (``request_state``); a finished
choice gives its penalty slot back and leaves the ``RequestTable``, and so does a finished
request.
"""

from __future__ import annotations

import logging
import time

from jaxserve.core.plan import TextStop
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.request_state import (
    Choice,
    RequestGroup,
    RequestTable,
    emit,
    group_output,
    record_logprobs,
    record_prompt_logprobs,
)
from jaxserve.engine.step_inputs import InflightStep
from jaxserve.outputs import RequestOutput
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class OutputProcessor:
    """Applies finished steps to the requests (module docstring).

    Args:
      scheduler: updated with each step's sampled ids (``Scheduler.update``).
      requests: the engine's live requests; finished ones leave it here.
      slots: penalty-state rows, given back by finished choices.
      tokenizer: for logprob texts and EOS ids.
      metrics: an ``EngineMetrics`` or None.
    """

    def __init__(self, scheduler: Scheduler, requests: RequestTable, slots: PenaltySlots,
                 tokenizer: Tokenizer, metrics=None) -> None:
        self.scheduler, self.requests = scheduler, requests
        self.slots, self.tokenizer, self.metrics = slots, tokenizer, metrics

    def complete(self, step: InflightStep) -> tuple[int, list[RequestOutput]]:
        """Read a step whose sampled ids are on the host into the scheduler and the requests;
        returns the number of tokens kept and the outputs. A row whose choice finished or was
        aborted since the step was planned (async scheduling) is dropped."""
        plan, out = step.plan, step.out
        lp_rows = [i for i in step.prompt_lp_rows if self.requests.is_live(step.choices[i])]
        if lp_rows:
            record_prompt_logprobs(self.tokenizer, plan.scheduled, step.choices, step.rows,
                                   lp_rows, out.prompt_logprobs())
        lp = out.logprobs() if step.want_lp else None
        sampled = [int(out.ids[i]) if s.sample else None for i, s in enumerate(plan.scheduled)]
        now = time.monotonic()
        result = self.scheduler.update(plan, sampled, self._stop_check, now)
        if self.metrics is not None:  # the ids are on the host: the step's device work is done
            self.metrics.record_prefill_rate(step.num_prompt_tokens,
                                             step.t_ready - step.t_dispatch)
        touched: dict[str, RequestGroup] = {}
        for sid, tok in result.new_token_ids.items():
            choice = self.requests.choice(sid)
            if choice.logprobs is not None and lp is not None:
                record_logprobs(self.tokenizer, choice, tok, lp, step.row_of[sid])
            if self._process(choice, tok, result.finished.get(sid),
                             result.stop_reasons.get(sid), now):
                touched[choice.group.request_id] = choice.group
        return len(result.new_token_ids), [self._group_output(g, now) for g in touched.values()]

    def _stop_check(self, seq_id: str, token: int) -> TextStop | None:
        """The engine's text rule for ``Scheduler.update`` (module docstring): advance the
        choice's grammar and detokeniser by ``token``; a ``TextStop`` where either ends it."""
        choice = self.requests.choice(seq_id)
        if choice.grammar is not None:
            if not choice.grammar.advance(token):
                log.warning("request %s: the structured-output grammar refused token %d (%s); "
                            "it allows only EOS from here", seq_id, token, choice.grammar.error)
            if choice.grammar.done and token in self.tokenizer.eos_token_ids:
                return TextStop()  # an EOS the request does not stop at (ignore_eos)
        choice.pending_text += choice.detok.add_tokens([token])
        return TextStop(choice.detok.stop_reason) if choice.detok.stopped else None

    def _process(self, choice: Choice, token: int, finish: str | None,
                 stop_reason: str | int | None, now: float) -> bool:
        """Record one choice's new token (detokenised by ``_stop_check`` unless a stop id);
        True if it has a new output."""
        g, m = choice.group, self.metrics
        if g.first_token_time is None:
            g.first_token_time = now
            if m is not None:
                m.record_first_token(now - g.arrival_time,
                                     (g.first_scheduled_time or now) - g.arrival_time)
        elif m is not None and choice.last_token_time is not None:
            m.record_inter_token(now - choice.last_token_time)
        choice.last_token_time = now
        delta, choice.pending_text = choice.pending_text, ""
        if stop_reason == token and token in self.tokenizer.eos_token_ids \
                and token not in choice.params.stop_token_ids:
            stop_reason = None  # EOS is the model's end, not a stop the request asked for
        if finish is not None and not choice.detok.stopped:
            delta += choice.detok.finish()
        if not delta and finish is None:
            return False  # text held back (partial UTF-8 or a possible stop string)
        emit(choice, delta, finish, stop_reason)
        if finish is not None:
            self.requests.finish_choice(choice)
            self.slots.release(choice)
        return True

    def _group_output(self, g: RequestGroup, now: float) -> RequestOutput:
        """The request's output after a step in which some choice changed; a finished request
        is forgotten."""
        out = group_output(g, now)
        if out.finished and self.requests.pop_finished(g):
            self.record_finished(g, g.choices[0].output.finish_reason, now)
        return out

    def record_finished(self, g: RequestGroup, reason: str, now: float) -> None:
        """Count a finished (or, with reason "abort", aborted) request in the metrics."""
        if self.metrics is not None:
            self.metrics.record_finished(
                reason, now - g.arrival_time, num_prompt_tokens=len(g.prompt_token_ids),
                num_generation_tokens=sum(len(c.output_token_ids) for c in g.choices))
