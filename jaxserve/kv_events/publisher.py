"""The ZMQ publisher of KV-cache events, on its own thread, never blocking the engine step.

Wire protocol (vLLM's ``ZmqEventPublisher`` in ``vllm/distributed/kv_events.py``):

- a PUB socket at ``endpoint`` sends each batch as the multipart message
  ``(topic, seq, payload)``: ``topic`` the config's topic in UTF-8, ``seq`` the batch's
  sequence number (0, 1, 2, ... per publisher) as 8 bytes big-endian, ``payload`` the msgpack
  ``KVEventBatch`` (``events.py``: vLLM 0.32's tagged-map events, or with ``event_encoding``
  "array" the tagged arrays of earlier releases);
- a ROUTER socket at ``replay_endpoint`` (optional) answers a request
  ``(identity, b"", start_seq as 8 bytes big-endian)`` with ``(identity, b"", seq, payload)``
  for every batch still buffered (the last ``buffer_steps``) with ``seq >= start_seq``, then
  the end marker ``(identity, b"", (-1).to_bytes(8, "big", signed=True), b"")``; a DEALER
  client sends ``(b"", start_seq)`` and receives ``(b"", seq, payload)`` frames.

The engine thread calls ``publish(records)`` after a step: one ``put_nowait`` on a queue of at
most ``max_queue_size`` batches. When it is full the batch is dropped and counted
(``num_events_dropped``), so a slow or stuck publisher never slows a step. The thread turns
records into vLLM's structs, encodes them, sends them (a PUB socket drops for a subscriber past
its ``hwm`` rather than block) and serves replay requests. ``pyzmq`` is imported here, when the
engine starts a publisher, and nowhere else.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import msgspec

from jaxserve.config import KVEventsConfig
from jaxserve.core.cache_events import CacheEvent
from jaxserve.kv_events.events import EventEncoder, KVEventBatch, int_block_hashes

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05  # the thread's wait for a batch between replay polls


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """``endpoint`` of replica ``data_parallel_rank`` (vLLM's ``offset_endpoint_port``): a tcp
    port plus the rank, an inproc name with ``_dp{rank}``; rank 0 and ipc paths unchanged.

    Raises:
      ValueError: a tcp endpoint without a numeric port, for a rank above 0.
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(
                f"kv_events_config endpoint {endpoint!r} has no port to offset "
                f"for data-parallel rank {data_parallel_rank}"
            )
        return f"{base}:{int(port) + data_parallel_rank}"
    return endpoint


class ZmqEventPublisher:
    """Publishes the KV manager's records as vLLM's KV events over ZMQ (module docstring).

    Sockets are bound (or connected) here, on the caller's thread, so a taken port fails
    start-up; from then on only the publisher thread touches them.

    Args:
      config: the events settings (``publisher`` "zmq").
      block_size: tokens per block, sent in every ``BlockStored``.
      data_parallel_rank: the replica's rank: stamped on every batch, added to the ports.
    Raises:
      ValueError: an endpoint cannot be bound or connected (naming the config field).
    """

    def __init__(
        self, config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0
    ) -> None:
        import zmq  # only a publisher needs pyzmq

        self.config, self.block_size, self.data_parallel_rank = (
            config,
            block_size,
            data_parallel_rank,
        )
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._queue: queue.Queue[tuple[float, list[CacheEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self._topic = config.topic.encode()
        self._as_int = int_block_hashes()
        self.num_events_published = 0  # events sent (counted by the publisher thread)
        self.num_events_dropped = 0  # events dropped with a full queue (the engine thread)
        self.num_batches_dropped = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        field, e = "endpoint", self.endpoint
        try:
            self._pub.set_hwm(config.hwm)
            if "*" in e or "::" in e or e.startswith(("ipc://", "inproc://")):
                self._pub.bind(e)
            else:
                self._pub.connect(e)
            if self.replay_endpoint is not None:
                field, e = "replay_endpoint", self.replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(e)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config field {field!r}: cannot use {e!r}: {exc}"
                             ) from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        log.info(
            "KV-cache events: publishing on %s%s",
            self.endpoint,
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
        )

    def publish(self, records: list[CacheEvent]) -> bool:
        """Queue one step's records as one batch, never waiting; False if the queue was full
        (the batch is dropped and counted) or the publisher is shut down."""
        if not records or self._stop.is_set():
            return False
        try:
            self._queue.put_nowait((time.time(), records))
        except queue.Full:
            self.num_events_dropped += len(records)
            self.num_batches_dropped += 1
            return False
        return True

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to ``timeout_s``), stop the thread, close the sockets."""
        if self._stop.is_set():
            return
        try:
            self._queue.put(None, timeout=timeout_s)  # after the batches queued before it
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._stop.set()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        events = EventEncoder(self.block_size, self._as_int, self.config.event_encoding)
        seq = 0
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a bad request must not stop publishing
                    log.exception("KV events: replay request failed")
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, records = item
            try:
                batch = KVEventBatch(ts, events.encode(records), self.data_parallel_rank)
                payload = encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:
                log.exception("KV events: a batch could not be sent")
                continue
            self._buffer.append((seq, payload))
            self.num_events_published += len(batch.events)
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: ignoring a replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


class NullEventPublisher:
    """vLLM's "null" publisher: records are taken each step and dropped, nothing is sent."""

    num_events_published = 0
    num_events_dropped = 0

    def publish(self, records: list[CacheEvent]) -> bool:
        """Drop ``records``; always False."""
        return False

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Nothing to stop."""


def start_publisher(
    config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0,
    hash_algo: str = "sha256_cbor",
) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher ``config.publisher`` names, started; warns when ``hash_algo`` (the
    engine's ``prefix_caching_hash_algo``) gives block hashes no router can recompute.

    Raises:
      ValueError: an endpoint cannot be bound or connected (``ZmqEventPublisher``).
    """
    if hash_algo != "sha256_cbor":
        log.warning("KV-cache events are on with --prefix-caching-hash-algo %s, whose block "
                    "hashes a router cannot recompute; llm-d and Dynamo need sha256_cbor "
                    "(docs/kv-events.md)", hash_algo)
    if config.publisher == "zmq":
        return ZmqEventPublisher(config, block_size, data_parallel_rank)
    return NullEventPublisher()
