"""NVIDIA Dynamo's ForwardPassMetrics v1 record: its wire shape and its numbers for one step.

The record (``dynamo/common/forward_pass_metrics.py`` in the ``ai-dynamo`` package, 1.6.1) is a
msgpack map of ``version`` (1), ``worker_id``, ``dp_rank``, ``counter_id`` (the publisher's
message number), ``wall_time`` (seconds) and two maps of seven and six numbers, every field
written. Its planner fits a step-time model to ``wall_time`` against these numbers.

What each number is (Dynamo's vLLM scheduler, ``InstrumentedScheduler._extract_scheduled`` and
``_compute_queued``, applied to jaxserve's plan and waiting queue):

- ``scheduled_requests``, from the completed step's plan. A sequence with no output token yet
  when it was planned (in-flight samples count as outputs: vLLM's ``is_context_phase``) is a
  prefill request: ``sum_prefill_tokens`` adds its chunk's tokens, ``var_prefill_length`` is
  the population variance of those requests' whole prompt lengths, ``sum_prefill_kv_tokens``
  adds the tokens already in the cache before the chunk (prefix-cache hits, earlier chunks).
  Every other sequence is a decode request, its KV tokens the ones before its chunk
  (``sum_decode_kv_tokens``, ``var_decode_kv_tokens``); a preempted sequence that recomputes
  its outputs counts there too, with the tokens it has back in the cache.
- ``queued_requests``, from the waiting queue after the step: a preempted sequence (it had
  been running) is a queued decode request with its cached tokens (0 after a recompute
  preemption, the swapped-out tokens after a swap to the host tier); any other is a queued
  prefill request of its ``len(token_ids)`` tokens.

Variances are population variances, as Dynamo's ``WelfordAccumulator`` computes them (Welford's
one-pass update); here from integer sums and sums of squares, exact until one final division
(cheaper on the step thread, and equal to Welford's to ~1e-15 relative). ``wall_time`` is the engine's measured step time,
the one its own step-cost model is fitted to (``LLMEngine._read``): from the later of the step's
planning and the previous step's sampled ids on the host, to its own ids on the host. Dynamo's
vLLM scheduler measures the same interval between consecutive completions, and from planning
when the engine was idle.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from jaxserve.core.plan import SchedulerOutput
from jaxserve.core.sequence import SeqState

FPM_VERSION = 1


class ScheduledRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    """The requests a step ran (module docstring); Dynamo's field names and order."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class QueuedRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    """The waiting requests after a step (module docstring); Dynamo's field names and order."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class ForwardPassMetrics(msgspec.Struct, frozen=True, gc=False):
    """One step's record, or an idle heartbeat (every number 0); encoded as a msgpack map with
    every field, as Dynamo's struct of the same name."""

    version: int = FPM_VERSION
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    wall_time: float = 0.0  # seconds
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()


def _variance(n: int, total: int, total_sq: int) -> float:
    """Population variance of ``n`` integers from their sum and sum of squares, exact until the
    one final division (0.0 for none)."""
    return (n * total_sq - total * total) / (n * n) if n else 0.0


def scheduled_metrics(plan: SchedulerOutput) -> ScheduledRequestMetrics:
    """The ``scheduled_requests`` of a step that ran ``plan`` (module docstring)."""
    num_prefill = prefill_tokens = prefill_kv = len_sum = len_sq = 0
    num_decode = kv_sum = kv_sq = 0
    for c in plan.scheduled:
        if c.num_output_tokens == 0:
            num_prefill += 1
            prefill_tokens += len(c.token_ids)
            prefill_kv += c.start_pos
            n = c.num_prompt_tokens
            len_sum += n
            len_sq += n * n
        else:
            num_decode += 1
            n = c.start_pos
            kv_sum += n
            kv_sq += n * n
    return ScheduledRequestMetrics(num_prefill, prefill_tokens,
                                   _variance(num_prefill, len_sum, len_sq), prefill_kv,
                                   num_decode, kv_sum, _variance(num_decode, kv_sum, kv_sq))


def queued_metrics(waiting: Iterable[SeqState]) -> QueuedRequestMetrics:
    """The ``queued_requests`` of the waiting sequences (module docstring); reads them only."""
    num_prefill = len_sum = len_sq = num_decode = kv_sum = kv_sq = 0
    for seq in waiting:
        if seq.num_preemptions:
            num_decode += 1
            n = seq.num_computed_tokens + seq.num_inflight_tokens
            kv_sum += n
            kv_sq += n * n
        else:
            num_prefill += 1
            n = len(seq.token_ids)
            len_sum += n
            len_sq += n * n
    return QueuedRequestMetrics(num_prefill, len_sum, _variance(num_prefill, len_sum, len_sq),
                                num_decode, kv_sum, _variance(num_decode, kv_sum, kv_sq))
