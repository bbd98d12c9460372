"""The ZMQ publisher against a subscriber that decodes with vLLM 0.32's own structs (the
``vllm`` fixture: the released wheel's ``vllm/distributed/kv_events.py``): message framing,
both encodings, sequence numbers, replay over the ROUTER socket, data-parallel endpoints, and
that a stuck publisher never makes ``publish`` wait."""

from __future__ import annotations

import itertools
import threading

import msgspec
import pytest
import zmq

from jaxserve.config import KVEventsConfig
from jaxserve.core.cache_events import BlocksRemoved, BlocksStored, CacheCleared
from jaxserve.kv_events import events as wire
from jaxserve.kv_events.publisher import END_SEQ, ZmqEventPublisher, offset_endpoint

H1, H2 = bytes(range(32)), bytes(range(100, 132))


def low64(h: bytes) -> int:
    return int.from_bytes(h[-8:], "big")


def subscriber(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(endpoint)
    return sub


def wait_subscribed(pub: ZmqEventPublisher, sub: zmq.Socket) -> None:
    """Publish clear events until the subscriber sees one (a SUB misses what is sent before its
    subscription arrives); drain; returns once the stream is live."""
    sub.setsockopt(zmq.RCVTIMEO, 50)
    for _ in range(200):
        pub.publish([CacheCleared()])
        try:
            sub.recv_multipart()
            break
        except zmq.Again:
            continue
    else:
        raise AssertionError("subscriber never connected")
    while True:
        try:
            sub.recv_multipart()
        except zmq.Again:
            break
    sub.setsockopt(zmq.RCVTIMEO, 10_000)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def make(tmp_path, **kw) -> ZmqEventPublisher:
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        **kw,
    )
    return ZmqEventPublisher(cfg, block_size=16)


def test_messages_decode_with_vllms_decoder(tmp_path, ctx, vllm) -> None:
    """vLLM 0.32's subscriber (``Decoder(KVEventBatch)``) reads every event with its fields; the
    raw layout is an array-like batch of tagged maps, as vLLM 0.32 sends."""
    v = vllm.kv_events
    pub = make(tmp_path, topic="kv@pod-0")
    try:
        sub = subscriber(ctx, pub.endpoint, b"kv@pod-0")
        wait_subscribed(pub, sub)
        tokens = tuple(range(32))
        pub.publish(
            [
                BlocksStored((H1, H2), None, tokens, "GPU", ((("salt",)), None)),
                BlocksRemoved((H2,), "GPU"),
                BlocksStored((H2,), None, (), "CPU"),
                CacheCleared(),
            ]
        )
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@pod-0" and len(seq) == 8
        batch = msgspec.msgpack.Decoder(v.KVEventBatch).decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 1.7e9
        assert batch.events == [
            v.BlockStored(
                [low64(H1), low64(H2)], None, list(tokens), 16, None, "GPU", None,
                [("salt",), None], group_idx=0, kv_cache_spec_kind="full_attention",
            ),
            v.BlockRemoved([low64(H2)], "GPU", group_idx=0),
            # the host tier's copy of H2: its tokens and parent, though the record had none
            v.BlockStored([low64(H2)], low64(H1), list(tokens[16:]), 16, None, "CPU", None,
                          group_idx=0, kv_cache_spec_kind="full_attention"),
            v.AllBlocksCleared(),
        ]
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3
        assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [low64(H2)],
                             "medium": "GPU", "group_idx": 0}
    finally:
        pub.shutdown()


def test_the_array_encoding_is_the_older_releases_tagged_arrays(tmp_path, ctx) -> None:
    """``event_encoding: "array"``: events as tagged arrays, every field written (what llm-d's
    kv-cache indexer up to v0.8 reads; tests/kv_events/test_dynamo_indexer.py has a real
    reader of it)."""
    pub = make(tmp_path, event_encoding="array")
    try:
        sub = subscriber(ctx, pub.endpoint)
        wait_subscribed(pub, sub)
        pub.publish([BlocksStored((H1,), None, tuple(range(16)), "GPU"),
                     BlocksRemoved((H1,), "GPU"), CacheCleared()])
        raw = msgspec.msgpack.decode(sub.recv_multipart()[2])
        assert raw[1] == [
            ["BlockStored", [low64(H1)], None, list(range(16)), 16, None, "GPU", None, None,
             None],
            ["BlockRemoved", [low64(H1)], "GPU", None],
            ["AllBlocksCleared"],
        ]
    finally:
        pub.shutdown()


def test_offloaded_blocks_go_out_as_chains_parent_first() -> None:
    """An offload record lists evicted blocks in eviction order (a sequence's last block
    first, blocks of several sequences mixed); the host-tier events are parent-to-child
    chains, each after the one holding its parent, so a router can place every block."""
    enc = wire.EventEncoder(4, as_int=False)
    a = [bytes([i]) * 32 for i in range(1, 4)]  # one sequence's three blocks
    b = bytes([9]) * 32  # another sequence's block, a child of a[0]
    enc.encode([BlocksStored(tuple(a), None, tuple(range(12)), "GPU"),
                BlocksStored((b,), a[0], (7, 7, 7, 7), "GPU")])
    out = enc.encode([BlocksRemoved((a[2], b, a[1], a[0]), "GPU"),
                      BlocksStored((a[2], b, a[1], a[0]), None, (), "CPU")])
    stored = out[1:]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == [
        ([a[0], b], None, [0, 1, 2, 3, 7, 7, 7, 7]),  # a[0]'s first child in the record
        ([a[1], a[2]], a[0], list(range(4, 12))),
    ]
    # blocks in no tier are forgotten: a later host store of them has no tokens
    enc.encode([BlocksRemoved((a[0],), "CPU")])
    (late,) = enc.encode([BlocksStored((a[0],), None, (), "CPU")])
    assert late.token_ids == [] and late.kv_cache_spec_kind is None
    with pytest.raises(ValueError, match="event_encoding"):
        wire.EventEncoder(4, as_int=True, encoding="json")


def test_sequence_numbers_rise_and_replay_fills_a_gap(tmp_path, ctx) -> None:
    pub = make(tmp_path, buffer_steps=4)
    try:
        sub = subscriber(ctx, pub.endpoint)
        wait_subscribed(pub, sub)
        for i in range(6):
            pub.publish([BlocksRemoved((bytes([i]) * 32,), "GPU")])
        got = [sub.recv_multipart() for _ in range(6)]
        seqs = [int.from_bytes(s, "big") for _, s, _ in got]
        assert all(b == a + 1 for a, b in itertools.pairwise(seqs))
        # a subscriber that missed the last three asks for them from the ROUTER socket
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", seqs[3].to_bytes(8, "big")))
        replayed = []
        while True:
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b"" and int.from_bytes(seq, "big", signed=True) == -1
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed == [(s, p) for (_, _, p), s in zip(got, seqs, strict=True) if s >= seqs[3]]
        # only buffer_steps batches are kept: asking from the first gets the last four
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        frames = [dealer.recv_multipart() for _ in range(5)]
        assert [int.from_bytes(f[1], "big") for f in frames[:4]] == seqs[2:]
        assert frames[4][1] == END_SEQ
    finally:
        pub.shutdown()


def test_a_stuck_publisher_never_blocks_publish(tmp_path, ctx, monkeypatch) -> None:
    """The publisher thread is held inside its first send (as if the network stalled) and the
    one subscriber never reads: every ``publish`` still returns at once, the queue takes
    ``max_queue_size`` batches and the rest are dropped and counted."""
    release, entered = threading.Event(), threading.Event()
    real = wire.EventEncoder.encode

    def stalled(*args):
        entered.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(wire.EventEncoder, "encode", stalled)
    pub = make(tmp_path, max_queue_size=3, hwm=1)
    subscriber(ctx, pub.endpoint)  # never reads
    try:
        assert pub.publish([CacheCleared()])
        assert entered.wait(30)  # the thread holds batch 0; the queue is empty
        results = [pub.publish([CacheCleared(), CacheCleared()]) for _ in range(10)]
        assert not release.is_set()  # every call above returned while the thread was stuck
        assert results == [True] * 3 + [False] * 7
        assert pub.num_events_dropped == 14 and pub.num_batches_dropped == 7
    finally:
        release.set()
        pub.shutdown()
    assert pub.num_events_published == 1 + 3 * 2


def test_data_parallel_endpoints_offset_as_vllms() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://10.0.0.1:6000", 1) == "tcp://10.0.0.1:6001"
    assert offset_endpoint("inproc://cache", 3) == "inproc://cache_dp3"
    assert offset_endpoint(None, 3) is None
    with pytest.raises(ValueError, match="no port"):
        offset_endpoint("tcp://*:x", 1)


def test_a_taken_port_fails_at_start(ctx) -> None:
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(ValueError, match="kv_events_config field 'endpoint'"):
        ZmqEventPublisher(
            KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"), 16
        )
    taken.close(linger=0)
