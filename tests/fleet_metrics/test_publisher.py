"""The ForwardPassMetrics record and its publisher against Dynamo's own module (the ``dynamo``
fixture: ``dynamo/common/forward_pass_metrics.py`` of the released ai-dynamo 1.6.1 wheel):
the bytes we send are the bytes Dynamo's ``encode`` makes of the same record, Dynamo's
``decode`` reads them, the framing and counters are those its relay reads, an idle publisher
sends heartbeats, and ``record`` never waits."""

from __future__ import annotations

import random
import statistics
import threading
import types

import msgspec
import pytest
import zmq

from jaxserve.core.plan import ScheduledSeq, SchedulerOutput
from jaxserve.core.sequence import SeqState
from jaxserve.fleet_metrics import forward_pass as fp
from jaxserve.fleet_metrics import publisher
from jaxserve.fleet_metrics.publisher import ForwardPassPublisher
from tests.fleet_metrics.conftest import free_port, subscriber


def chunk(seq_id: str, start: int, num_new: int, prompt: int, outputs: int) -> ScheduledSeq:
    return ScheduledSeq(seq_id, (7,) * num_new, start, (1,), True, num_prompt_tokens=prompt,
                        num_output_tokens=outputs)


def plan_of(*chunks: ScheduledSeq) -> SchedulerOutput:
    return SchedulerOutput(chunks, sum(len(c.token_ids) for c in chunks))


def waiting_seq(prompt: int, outputs: int = 0, computed: int = 0, preemptions: int = 0
                ) -> SeqState:
    return SeqState("w", [5] * (prompt + outputs), prompt, 8, num_computed_tokens=computed,
                    num_preemptions=preemptions)


def as_dynamo(dynamo, m: fp.ForwardPassMetrics):
    """The same record built with Dynamo's structs."""
    d = msgspec.structs.asdict(m)
    return dynamo.ForwardPassMetrics(
        **{**d, "scheduled_requests": dynamo.ScheduledRequestMetrics(
            **msgspec.structs.asdict(m.scheduled_requests)),
           "queued_requests": dynamo.QueuedRequestMetrics(
               **msgspec.structs.asdict(m.queued_requests))})


def test_the_numbers_follow_dynamos_rules(dynamo) -> None:
    # a fresh prompt with a 16-token prefix hit, a prompt's second chunk, two decodes, and a
    # preempted sequence recomputing (it has outputs: a decode request, as vLLM's scheduler
    # classes it)
    plan = plan_of(chunk("a", 16, 20, 36, 0), chunk("b", 32, 8, 100, 0),
                   chunk("c", 40, 1, 30, 10), chunk("d", 77, 1, 70, 7), chunk("e", 0, 24, 20, 5))
    s = fp.scheduled_metrics(plan)
    assert (s.num_prefill_requests, s.sum_prefill_tokens, s.sum_prefill_kv_tokens) == (2, 28, 48)
    assert s.var_prefill_length == statistics.pvariance([36, 100])
    assert (s.num_decode_requests, s.sum_decode_kv_tokens) == (3, 117)
    assert s.var_decode_kv_tokens == statistics.pvariance([40, 77, 0])  # exact
    acc = dynamo.WelfordAccumulator()
    for v in (40, 77, 0):
        acc.add(v)
    assert s.var_decode_kv_tokens == pytest.approx(acc.variance(), rel=1e-13)  # Dynamo's

    q = fp.queued_metrics([waiting_seq(12), waiting_seq(30, outputs=4, computed=0, preemptions=1),
                           waiting_seq(50), waiting_seq(20, outputs=9, computed=29,
                                                        preemptions=2)])
    assert (q.num_prefill_requests, q.sum_prefill_tokens) == (2, 62)
    assert q.var_prefill_length == statistics.pvariance([12, 50])
    assert (q.num_decode_requests, q.sum_decode_kv_tokens) == (2, 29)
    assert q.var_decode_kv_tokens == statistics.pvariance([0, 29])
    assert fp.scheduled_metrics(plan_of()) == fp.ScheduledRequestMetrics()
    assert fp.queued_metrics([]) == fp.QueuedRequestMetrics()


def test_our_bytes_are_dynamos_bytes(dynamo) -> None:
    rng = random.Random(0)
    encode = msgspec.msgpack.Encoder().encode
    for i in range(50):
        m = fp.ForwardPassMetrics(
            worker_id=f"w{i}", dp_rank=rng.randrange(4), counter_id=rng.randrange(1 << 40),
            wall_time=rng.random(),
            scheduled_requests=fp.ScheduledRequestMetrics(
                *(rng.randrange(1000) for _ in range(2)), rng.random() * 1e4,
                *(rng.randrange(1 << 20) for _ in range(3)), rng.random() * 1e6),
            queued_requests=fp.QueuedRequestMetrics(
                *(rng.randrange(1000) for _ in range(2)), rng.random() * 1e4,
                *(rng.randrange(1 << 20) for _ in range(2)), rng.random() * 1e6))
        payload = encode(m)
        assert payload == dynamo.encode(as_dynamo(dynamo, m))
        assert dynamo.decode(payload) == as_dynamo(dynamo, m)
    assert encode(fp.ForwardPassMetrics()) == dynamo.encode(dynamo.ForwardPassMetrics())


def test_publisher_frames_counters_heartbeats(ctx, dynamo) -> None:
    port = free_port()
    pub = ForwardPassPublisher(port - 1, "worker-7", data_parallel_rank=1, heartbeat_s=0.05)
    try:
        assert pub.endpoint == f"tcp://*:{port}"
        sub = subscriber(ctx, port)
        frames = sub.recv_multipart()  # an idle publisher sends heartbeats
        topic, counter, payload = frames
        hb = dynamo.decode(payload)
        assert topic == b"" and hb is not None
        assert int.from_bytes(counter, "big") == hb.counter_id
        assert (hb.worker_id, hb.dp_rank, hb.wall_time) == ("worker-7", 1, 0.0)
        assert hb.scheduled_requests == dynamo.ScheduledRequestMetrics()
        assert hb.queued_requests == dynamo.QueuedRequestMetrics()
        plan = plan_of(chunk("a", 0, 12, 12, 0), chunk("b", 20, 1, 15, 5))
        assert pub.record([(plan, 0.0125)], [waiting_seq(9)]) == 1
        while True:
            _, counter, payload = sub.recv_multipart()
            m = dynamo.decode(payload)
            assert int.from_bytes(counter, "big") == m.counter_id
            if m.wall_time:
                break
        assert m.counter_id > hb.counter_id and m.wall_time == 0.0125
        assert (m.worker_id, m.dp_rank, m.version) == ("worker-7", 1, 1)
        s, q = m.scheduled_requests, m.queued_requests
        assert (s.num_prefill_requests, s.sum_prefill_tokens, s.num_decode_requests,
                s.sum_decode_kv_tokens) == (1, 12, 1, 20)
        assert (q.num_prefill_requests, q.sum_prefill_tokens) == (1, 9)
    finally:
        pub.shutdown()
    assert pub.record([(plan, 0.01)], []) == 0


def test_a_stuck_publisher_never_blocks_record(monkeypatch) -> None:
    """The publisher thread is held inside its first record (as if the network stalled): every
    ``record`` still returns at once, the queue takes ``max_queue_size`` records and the rest
    are dropped and counted."""
    release, entered = threading.Event(), threading.Event()

    def stalled(struct, **changes):
        entered.set()
        release.wait(30)
        return msgspec.structs.replace(struct, **changes)

    monkeypatch.setattr(publisher, "msgspec", types.SimpleNamespace(
        msgpack=msgspec.msgpack, structs=types.SimpleNamespace(replace=stalled)))
    pub = ForwardPassPublisher(free_port(), heartbeat_s=60.0, max_queue_size=3)
    plan = plan_of(chunk("a", 0, 4, 4, 0))
    try:
        assert pub.record([(plan, 0.01)], []) == 1
        assert entered.wait(30)  # the thread holds record 0; the queue is empty
        results = [pub.record([(plan, 0.01)], []) for _ in range(6)]
        results.append(pub.record([(plan, 0.01)] * 4, []))
        assert not release.is_set()  # every call above returned while the thread was stuck
        assert results == [1] * 3 + [0] * 4 and pub.num_dropped == 7
    finally:
        release.set()
        pub.shutdown()


def test_bad_ports_name_the_setting() -> None:
    with pytest.raises(ValueError, match="forward_pass_metrics_port"):
        ForwardPassPublisher(65535, data_parallel_rank=1)
    port = free_port()
    first = ForwardPassPublisher(port, heartbeat_s=60.0)
    try:
        with pytest.raises(ValueError, match=f"forward_pass_metrics_port: cannot bind "
                                             f"tcp://\\*:{port}"):
            ForwardPassPublisher(port)
    finally:
        first.shutdown()


def test_shutdown_sends_what_is_queued(ctx, dynamo) -> None:
    port = free_port()
    pub = ForwardPassPublisher(port, heartbeat_s=0.02)
    sub = subscriber(ctx, port)
    sub.recv_multipart()  # subscribed: a heartbeat came through
    for i in range(0, 20, 2):
        assert pub.record([(plan_of(chunk("a", j, 1, 1, 1 + j)), 0.001 * (j + 1))
                           for j in (i, i + 1)], [waiting_seq(3)]) == 2
    pub.shutdown()
    walls = []
    sub.setsockopt(zmq.RCVTIMEO, 1000)
    while len(walls) < 20:
        m = dynamo.decode(sub.recv_multipart()[2])
        if m.wall_time:
            walls.append(m.wall_time)
    assert walls == [0.001 * (i + 1) for i in range(20)]
