"""The ZMQ publisher of ForwardPassMetrics records, on its own thread, never blocking the step.

Wire protocol (the one Dynamo's own relay subscribes to: ``_FpmPublisherThread`` in
``dynamo/vllm/instrumented_scheduler.py`` of ``ai-dynamo`` 1.6.1, whose ``FpmEventRelay``
connects to ``tcp://127.0.0.1:{DYN_FORWARDPASS_METRIC_PORT + dp_rank}``):

- a PUB socket bound at ``tcp://*:{port + data_parallel_rank}`` sends each record as the
  multipart message ``(b"", counter_id as 8 bytes big-endian, payload)``, ``payload`` the
  msgpack ``ForwardPassMetrics`` (``forward_pass.py``) stamped with the same ``counter_id``
  (0, 1, 2, ... per publisher, heartbeats included);
- while no step completes for ``heartbeat_s`` (1 s), an idle heartbeat goes out each
  ``heartbeat_s``: a record whose numbers are all 0 (``wall_time`` 0.0).

The engine thread calls ``record(steps, waiting)`` after each engine step with the steps it
completed: it counts each plan's requests and the queue's once (``forward_pass``) and makes one
``put_nowait`` per record on a queue of at most ``max_queue_size`` records; a full queue drops the record and counts it
(``num_dropped``). The thread stamps, encodes and sends (a PUB socket drops a message for a
subscriber past its high-water mark rather than block, and the send does not wait).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable

import msgspec

from jaxserve.core.plan import SchedulerOutput
from jaxserve.core.sequence import SeqState
from jaxserve.fleet_metrics.forward_pass import (
    ForwardPassMetrics,
    queued_metrics,
    scheduled_metrics,
)

log = logging.getLogger(__name__)
MAX_PORT = 65535


class ForwardPassPublisher:
    """Publishes one ForwardPassMetrics record per completed step (module docstring).

    The socket is bound here, on the caller's thread, so a taken port fails start-up; from then
    on only the publisher thread touches it.

    Args:
      port: the base port (Dynamo's ``DYN_FORWARDPASS_METRIC_PORT``); the socket binds
        ``port + data_parallel_rank`` on every interface.
      worker_id: stamped on every record (Dynamo's ``DYN_FPM_WORKER_ID``: the worker's id in
        its runtime).
      data_parallel_rank: the replica's rank, stamped as ``dp_rank``.
      heartbeat_s: idle seconds before a heartbeat, and between heartbeats.
      max_queue_size: records queued for the thread; more are dropped.
    Raises:
      ValueError: the port is out of range or cannot be bound (naming the setting).
    """

    def __init__(self, port: int, worker_id: str = "", data_parallel_rank: int = 0,
                 heartbeat_s: float = 1.0, max_queue_size: int = 10_000) -> None:
        import zmq  # only a publisher needs pyzmq

        self.port = port + data_parallel_rank
        if not 0 < self.port <= MAX_PORT:
            raise ValueError(f"forward_pass_metrics_port {port} + data-parallel rank "
                             f"{data_parallel_rank} is not a port in [1, {MAX_PORT}]")
        self.worker_id, self.dp_rank, self.heartbeat_s = worker_id, data_parallel_rank, heartbeat_s
        self.endpoint = f"tcp://*:{self.port}"
        self.num_published = 0  # messages sent, heartbeats included (the publisher thread)
        self.num_dropped = 0  # records dropped with a full queue (the engine thread)
        self._queue: queue.Queue[ForwardPassMetrics | None] = queue.Queue(max_queue_size)
        self._zmq_again = zmq.Again
        self._pub = zmq.Context.instance().socket(zmq.PUB)
        try:
            self._pub.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            raise ValueError(f"forward_pass_metrics_port: cannot bind {self.endpoint}: {exc}"
                             ) from None
        self._noblock = zmq.NOBLOCK
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="fpm-publisher", daemon=True)
        self._thread.start()
        log.info("forward-pass metrics (Dynamo's ForwardPassMetrics v1): publishing on %s, "
                 "worker_id %r, dp_rank %d", self.endpoint, worker_id, data_parallel_rank)

    def record(self, steps: Iterable[tuple[SchedulerOutput, float]], waiting: Iterable[SeqState]
               ) -> int:
        """Queue one record per completed step ``(plan, wall_time_s)``, in order, with
        ``waiting`` the scheduler's waiting queue now (read only, counted once), never waiting.
        Returns how many were queued: a record that finds the queue full is dropped and counted,
        and none is queued once the publisher is shut down."""
        if self._stopped:
            return 0
        queued, num_queued = None, 0
        for plan, wall_time_s in steps:
            if queued is None:
                queued = queued_metrics(waiting)
            metrics = ForwardPassMetrics(worker_id=self.worker_id, dp_rank=self.dp_rank,
                                         wall_time=wall_time_s,
                                         scheduled_requests=scheduled_metrics(plan),
                                         queued_requests=queued)
            try:
                self._queue.put_nowait(metrics)
            except queue.Full:
                self.num_dropped += 1
                continue
            num_queued += 1
        return num_queued

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to ``timeout_s``), stop the thread, close the socket."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._queue.put(None, timeout=timeout_s)  # after the records queued before it
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._pub.close(linger=0)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        heartbeat = ForwardPassMetrics(worker_id=self.worker_id, dp_rank=self.dp_rank)
        counter = 0
        last_sent = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self.heartbeat_s)
            except queue.Empty:
                if time.monotonic() - last_sent < self.heartbeat_s:
                    continue
                item = heartbeat
            if item is None:
                return
            try:
                payload = encode(msgspec.structs.replace(item, counter_id=counter))
                self._pub.send_multipart((b"", counter.to_bytes(8, "big"), payload),
                                         flags=self._noblock)
            except self._zmq_again:  # not sent, but numbered: a subscriber sees the gap
                counter += 1
                continue
            except Exception:
                log.exception("forward-pass metrics: a record could not be sent")
                continue
            counter += 1
            self.num_published += 1
            last_sent = time.monotonic()

