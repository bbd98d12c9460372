"""What probes and scrapers read: ``/health`` (liveness), ``/ready`` (the start-up stage,
``lifecycle.ReadyStatus``) and ``/metrics`` (Prometheus text), answered from process start
(before an engine is attached) to exit, whatever the gate refuses."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.metrics import MODEL_LABEL, PREFIX, vllm_compat
from jaxserve.server.gate import Gate
from jaxserve.server.gate import error_response as _error
from jaxserve.server.jobs import EngineClient
from jaxserve.server.lifecycle import Lifecycle


class _TimeToReady(Collector):
    """``jaxserve:time_to_ready_seconds``: seconds from start-up to ready
    (``Lifecycle.ready_s``), exported from the moment the server is ready; what a new replica
    costs before it serves."""

    def __init__(self, lifecycle: Lifecycle, served_model_name: str) -> None:
        self.lifecycle = lifecycle
        self.model_name = served_model_name

    def collect(self) -> Iterator[Metric]:
        ready_s = self.lifecycle.ready_s
        if ready_s is None:
            return
        g = GaugeMetricFamily(PREFIX + "time_to_ready_seconds",
                              "Seconds from start-up (the port bound) to ready.",
                              labels=(MODEL_LABEL,))
        g.add_metric((self.model_name,), ready_s)
        yield g


class Probes:
    """``/health``, ``/ready`` and ``/metrics``: what probes and scrapers read, answered from
    process start (before an engine is attached) to exit.

    ``/metrics`` is the server's own series (``jaxserve:draining``, from ready on
    ``jaxserve:time_to_ready_seconds``, prometheus-client's ``process_*``) followed, once an
    engine is attached, by the engine's (and with ``metrics_compat="vllm"`` their ``vllm:``
    copies, ``jaxserve.engine.metrics.vllm_compat``).
    """

    def __init__(self, gate: Gate, served_model_name: str, compat: str | None) -> None:
        self.gate = gate
        self.lifecycle: Lifecycle = gate.lifecycle
        self.engine: EngineClient | None = None
        self.compat = compat
        self._compat: CollectorRegistry | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        Gauge(PREFIX + "draining", "1 from the moment a SIGTERM starts the drain, else 0.",
              (MODEL_LABEL,), registry=self.registry).labels(served_model_name).set_function(
            lambda: float(gate.draining))
        self.registry.register(_TimeToReady(self.lifecycle, served_model_name))

    def attach(self, engine: EngineClient) -> None:
        m = engine.metrics
        if self.compat == "vllm" and m is not None:
            self._compat = vllm_compat(m.registry)
        self.engine = engine

    async def health(self, request: Request) -> Response:
        if self.engine is not None and not self.engine.alive:
            return _error(500, "the engine thread has died (its error is in the log)",
                          "server_error")
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        st = self.lifecycle.status()
        return Response(msgspec.json.encode(st), status_code=200 if st.stage == "ready" else 503,
                        media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        parts = [generate_latest(self.registry)]
        m = None if self.engine is None else self.engine.metrics
        if m is not None:
            parts.append(m.render())
            if self._compat is not None:
                parts.append(generate_latest(self._compat))
        return Response(b"".join(parts), headers={"Content-Type": CONTENT_TYPE_LATEST})
