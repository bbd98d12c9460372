"""The output side of a step: sampled ids in, ``RequestOutput``s out.

``OutputProcessor.complete(step)`` runs once a dispatched step's ids are on the host:
``scheduler.update`` (token-id stop checks, length limits, block frees), then per choice that
kept a token: its logprobs, its grammar advanced (a grammar that took EOS finishes it),
incremental detokenisation and stop strings (a stop string finishes it), the TTFT / ITL
metrics, and one ``RequestOutput`` per request that changed (``request_state``); a finished
choice gives its penalty slot back and a finished request is forgotten.
"""

from __future__ import annotations

import logging
import time

from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.request_state import (
    Choice,
    RequestGroup,
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
      scheduler: updated with each step's sampled ids; told of finishes it cannot see (stop
        strings, a grammar's EOS).
      requests, groups: the engine's live choices (by sequence id) and requests (by request
        id), shared with it; finished ones are removed here.
      slots: penalty-state rows, given back by finished choices.
      tokenizer: for logprob texts and EOS ids.
      metrics: an ``EngineMetrics`` or None.
    """

    def __init__(self, scheduler: Scheduler, requests: dict[str, Choice],
                 groups: dict[str, RequestGroup], slots: PenaltySlots, tokenizer: Tokenizer,
                 metrics=None) -> None:
        self.scheduler, self.requests, self.groups = scheduler, requests, groups
        self.slots, self.tokenizer, self.metrics = slots, tokenizer, metrics

    def complete(self, step: InflightStep) -> tuple[int, list[RequestOutput]]:
        """Read a step whose sampled ids are on the host into the scheduler and the requests;
        returns the number of tokens kept and the outputs. A row whose choice finished or was
        aborted since the step was planned (async scheduling) is dropped."""
        plan, out = step.plan, step.out
        live = [self.requests.get(s.request_id) is c for s, c in zip(plan.scheduled,
                                                                       step.choices)]
        lp_rows = [i for i in step.prompt_lp_rows if live[i]]
        if lp_rows:
            record_prompt_logprobs(self.tokenizer, plan.scheduled, self.requests, step.rows,
                                   lp_rows, out.prompt_logprobs())
        lp = out.logprobs() if step.want_lp else None
        sampled = [int(out.ids[i]) if s.sample else None for i, s in enumerate(plan.scheduled)]
        result = self.scheduler.update(plan, sampled)
        if self.metrics is not None:  # the ids are on the host: the step's device work is done
            self.metrics.record_prefill_rate(step.num_prompt_tokens,
                                             step.t_ready - step.t_dispatch)
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        for rid, tok in result.new_token_ids.items():
            req = self.requests[rid]
            if req.logprobs is not None and lp is not None:
                record_logprobs(self.tokenizer, req, tok, lp, step.row_of[rid])
            finish = result.finished.get(rid)
            if req.grammar is not None:
                finish = self._advance_grammar(req, tok, finish)
            if self._process(req, tok, finish, now):
                touched[req.group.request_id] = req.group
        return len(result.new_token_ids), [self._group_output(g, now) for g in touched.values()]

    def _advance_grammar(self, req: Choice, token: int, finish: str | None) -> str | None:
        """Feed a sampled token to the choice's grammar; returns its finish reason, "stop"
        once the grammar has taken an EOS the request does not stop at (``ignore_eos``)."""
        if not req.grammar.advance(token):
            log.warning("request %s: the structured-output grammar refused token %d (%s); it "
                        "allows only EOS from here", req.request_id, token, req.grammar.error)
        if finish is None and req.grammar.done and token in self.tokenizer.eos_token_ids:
            self.scheduler.finish([req.request_id])
            return "stop"
        return finish

    def _process(self, req: Choice, token: int, finish: str | None, now: float) -> bool:
        """Advance one choice by a sampled token; True if it has a new output."""
        rid, g, m = req.request_id, req.group, self.metrics
        req.output_token_ids.append(token)
        if g.first_token_time is None:
            g.first_token_time = now
            if m is not None:
                m.record_first_token(now - g.arrival_time,
                                     (g.first_scheduled_time or now) - g.arrival_time)
        elif m is not None and req.last_token_time is not None:
            m.record_inter_token(now - req.last_token_time)
        req.last_token_time = now
        stop_reason: str | int | None = None
        if finish == "stop":
            # a stop token's own text is not part of the output (as vLLM)
            delta = ""
            if token not in self.tokenizer.eos_token_ids or token in req.params.stop_token_ids:
                stop_reason = token
        else:
            delta = req.detok.add_tokens([token])
            if req.detok.stopped:
                finish, stop_reason = "stop", req.detok.stop_reason
                self.scheduler.finish([rid])
        if finish is not None and not req.detok.stopped:
            delta += req.detok.finish()
        if not delta and finish is None:
            return False  # text held back (partial UTF-8 or a possible stop string)
        emit(req, delta, finish, stop_reason)
        if finish is not None:
            req.finished = True
            g.num_finished += 1
            del self.requests[rid]
            self.slots.release(req)
        return True

    def _group_output(self, g: RequestGroup, now: float) -> RequestOutput:
        """The request's output after a step in which some choice changed; a finished request
        is forgotten."""
        out = group_output(g, now)
        if out.finished:
            del self.groups[g.request_id]
            self.record_finished(g, g.choices[0].output.finish_reason, now)
        return out

    def record_finished(self, g: RequestGroup, reason: str, now: float) -> None:
        """Count a finished (or, with reason "abort", aborted) request in the metrics."""
        if self.metrics is not None:
            self.metrics.record_finished(
                reason, now - g.arrival_time, num_prompt_tokens=len(g.prompt_token_ids),
                num_generation_tokens=sum(len(c.output_token_ids) for c in g.choices))
