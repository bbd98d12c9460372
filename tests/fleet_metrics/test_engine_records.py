"""ForwardPassMetrics from a real engine (the tiny dummy model): a 100-request run whose waves
queue behind ``max_num_seqs``, share prompt prefixes (prefix-cache hits), run short of KV blocks
(preemptions: recomputed, and swapped to a small host tier) and mix prompt chunks with decodes.
Every message is read by Dynamo's own ``decode`` (``dynamo/common/forward_pass_metrics.py`` of
the released ai-dynamo 1.6.1 wheel), and each record's numbers equal those a step listener
computes from the same step's plan and waiting queue with plain sums and
``statistics.pvariance`` (and, to 1e-12, Dynamo's ``WelfordAccumulator``)."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import zmq

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.step_report import StepReport
from jaxserve.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT
from tests.fleet_metrics.conftest import free_port, subscriber

NUM_REQUESTS, WAVE = 100, 25
BS = 16
HOST_BLOCKS = 6
BLOCK_BYTES = 2 * 2 * BS * 4 * 16 * 2  # K and V, 2 layers, 4 kv heads of 16 (bfloat16 here)
WORKER_ID = "jaxserve-test-worker"


def expected_record(plan, waiting) -> dict:
    """What Dynamo's vLLM scheduler reports for a step (``_extract_scheduled`` and
    ``_compute_queued``), from our plan and queue, as plain numbers."""
    prefill = [c for c in plan.scheduled if c.num_output_tokens == 0]
    decode = [c for c in plan.scheduled if c.num_output_tokens > 0]
    queued_decode = [s for s in waiting if s.num_preemptions]
    queued_prefill = [s for s in waiting if not s.num_preemptions]

    def pvar(xs: list[int]) -> float:
        return statistics.pvariance(xs) if xs else 0.0

    lengths = [c.num_prompt_tokens for c in prefill]
    decode_kv = [c.start_pos for c in decode]
    q_lengths = [len(s.token_ids) for s in queued_prefill]
    q_kv = [s.num_computed_tokens + s.num_inflight_tokens for s in queued_decode]
    return {
        "scheduled": (len(prefill), sum(len(c.token_ids) for c in prefill), pvar(lengths),
                      sum(c.start_pos for c in prefill), len(decode), sum(decode_kv),
                      pvar(decode_kv)),
        "queued": (len(queued_prefill), sum(q_lengths), pvar(q_lengths), len(queued_decode),
                   sum(q_kv), pvar(q_kv)),
        "welford": (lengths, decode_kv, q_lengths, q_kv),
    }


@pytest.fixture(scope="module")
def run():
    """The 100-request run: the engine's counters, the listener's expectations per completed
    step (in order) and every message the subscriber received."""
    port = free_port()
    cfg = EngineConfig(
        max_model_len=160, num_kv_blocks=40,
        kv_offloading_size=(HOST_BLOCKS + 0.5) * BLOCK_BYTES / 2**30,
        max_num_seqs=8, max_num_batched_tokens=64, itl_slo_ms=0,
        compilation_cache_dir=str(REPO_ROOT / ".jax_cache"),
        forward_pass_metrics_port=port, forward_pass_metrics_worker_id=WORKER_ID)
    eng = LLMEngine(cfg, LoadConfig(model="tiny", load_format="dummy"))
    eng.warmup(progress=False)
    expected: list[dict] = []
    walls: list[float] = []

    def listen(r: StepReport) -> None:
        for done in r.completed:
            expected.append(expected_record(done.plan, eng.scheduler.waiting))
            walls.append(done.measured_s)

    eng.add_step_listener(listen)
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, 500, 32).tolist() for _ in range(3)]  # two full blocks each
    ctx = zmq.Context()
    messages: list[list[bytes]] = []
    try:
        sub = subscriber(ctx, port)
        messages.append(sub.recv_multipart())  # an idle heartbeat: the subscription is live
        sub.setsockopt(zmq.RCVTIMEO, 0)

        def drain() -> None:
            while True:
                try:
                    messages.append(sub.recv_multipart())
                except zmq.Again:
                    return

        finished = 0
        for wave in range(NUM_REQUESTS // WAVE):
            for i in range(WAVE):
                k = wave * WAVE + i
                tail = rng.integers(500, 1000, int(rng.integers(1, 60))).tolist()
                prompt = (prefixes[k % 3] + tail) if k % 2 else tail
                eng.add_request(f"r{k}", prompt, SamplingParams(
                    max_tokens=int(rng.integers(1, 40)), temperature=0.0, ignore_eos=True))
            for _ in range(12):  # the next wave arrives while this one runs
                finished += sum(o.finished for o in eng.step())
                drain()
        while eng.has_unfinished_requests():
            finished += sum(o.finished for o in eng.step())
            drain()
        eng.step()  # the async loop's last read
        stats = {"finished": finished, "preemptions": eng.num_preemptions_total,
                 "published": None}
        eng.close()  # sends what is queued
        sub.setsockopt(zmq.RCVTIMEO, 2_000)
        while True:
            try:
                messages.append(sub.recv_multipart())
            except zmq.Again:
                break
        stats["published"] = len(messages)
    finally:
        ctx.destroy(linger=0)
    return stats, expected, walls, messages


def test_dynamos_decoder_reads_every_record_of_a_100_request_run(run, dynamo) -> None:
    stats, expected, walls, messages = run
    assert stats["finished"] == NUM_REQUESTS and stats["preemptions"] > 0
    decoded = []
    for topic, counter, payload in messages:
        m = dynamo.decode(payload)  # None for a payload or version it cannot read
        assert m is not None and topic == b"" and int.from_bytes(counter, "big") == m.counter_id
        assert (m.version, m.worker_id, m.dp_rank) == (1, WORKER_ID, 0)
        decoded.append(m)
    counters = [m.counter_id for m in decoded]
    assert counters == list(range(counters[0], counters[0] + len(counters)))  # none lost
    records = [m for m in decoded if m.wall_time > 0]
    heartbeats = [m for m in decoded if m.wall_time == 0]
    assert heartbeats and all(
        h.scheduled_requests == dynamo.ScheduledRequestMetrics()
        and h.queued_requests == dynamo.QueuedRequestMetrics() for h in heartbeats)
    assert len(records) == len(expected) == len(walls)  # one per completed step
    for m, want, wall in zip(records, expected, walls, strict=True):
        s, q = m.scheduled_requests, m.queued_requests
        assert m.wall_time == wall  # the engine's measured step time, the step-cost model's
        got_s = (s.num_prefill_requests, s.sum_prefill_tokens, s.var_prefill_length,
                 s.sum_prefill_kv_tokens, s.num_decode_requests, s.sum_decode_kv_tokens,
                 s.var_decode_kv_tokens)
        got_q = (q.num_prefill_requests, q.sum_prefill_tokens, q.var_prefill_length,
                 q.num_decode_requests, q.sum_decode_kv_tokens, q.var_decode_kv_tokens)
        assert got_s == want["scheduled"] and got_q == want["queued"]
        variances = (s.var_prefill_length, s.var_decode_kv_tokens, q.var_prefill_length,
                     q.var_decode_kv_tokens)
        for values, var in zip(want["welford"], variances, strict=True):
            acc = dynamo.WelfordAccumulator()
            for v in values:
                acc.add(v)
            assert var == pytest.approx(acc.variance(), rel=1e-12, abs=1e-12)
    # the run exercised every field: mixed steps, prefix hits, queues of both kinds
    assert any(m.scheduled_requests.num_prefill_requests and
               m.scheduled_requests.num_decode_requests for m in records)
    assert any(m.scheduled_requests.sum_prefill_kv_tokens for m in records)
    assert any(m.scheduled_requests.var_prefill_length > 0 for m in records)
    assert any(m.queued_requests.num_prefill_requests for m in records)
    assert any(m.queued_requests.num_decode_requests for m in records)
    assert any(m.queued_requests.sum_decode_kv_tokens for m in records)  # a swapped one
    assert sum(m.scheduled_requests.num_decode_requests for m in records) > 0
