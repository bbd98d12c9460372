"""Data-parallel replicas behind one HTTP front end (``jaxserve serve --data-parallel-size M``).

Each replica is a whole engine (its own params copy, KV cache, scheduler and engine thread) on its
own group of ``tensor_parallel_size`` devices; replica ``i`` takes devices
``[i * tp, (i + 1) * tp)``. ``DataParallelEngine`` offers the server the same interface as one
``AsyncEngine`` and sends each new request to the least-loaded replica: fewest unfinished
requests, then lowest KV-cache usage (both read without locks from the replicas' last step, so
the choice is approximate under races, never wrong in outcome). A request stays on its replica
for its whole life. ``/metrics`` shows every replica's series with an ``engine="i"`` label, as
vLLM's data-parallel front end does. With KV-cache events on, replica ``i`` publishes them with
``data_parallel_rank=i`` on the configured port plus ``i``, as vLLM's replicas do.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Sequence

import jax
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.loading.load import served_name
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams


class _LabelledReplicas:
    """A prometheus collector that re-exports each replica's registry with ``engine="i"``."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self.registries = list(registries)

    def collect(self):
        merged: dict[str, Metric] = {}
        for i, reg in enumerate(self.registries):
            for m in reg.collect():
                out = merged.get(m.name)
                if out is None:
                    out = merged[m.name] = Metric(m.name, m.documentation, m.type, m.unit)
                for s in m.samples:
                    out.add_sample(s.name, {**s.labels, "engine": str(i)}, s.value, s.timestamp,
                                   s.exemplar)
        yield from merged.values()


class DataParallelMetrics:
    """``render()`` / ``content_type`` over several replicas' ``EngineMetrics``."""

    def __init__(self, replicas: Sequence) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_LabelledReplicas([m.registry for m in replicas]))

    @property
    def content_type(self) -> str:
        """The Prometheus text exposition content type."""
        return CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        """Every replica's metrics in the text exposition format, labelled by replica."""
        return generate_latest(self.registry)


class DataParallelEngine:
    """Several ``AsyncEngine`` replicas as one engine client for the HTTP server.

    Args:
      replicas: started or unstarted ``AsyncEngine`` objects over the same model (the first
        one's tokenizer, max_model_len and model name are served).
    Raises:
      ValueError: if no replica is given or the replicas serve different models / windows.
    """

    def __init__(self, replicas: Sequence[AsyncEngine]) -> None:
        if not replicas:
            raise ValueError("data_parallel_size must be >= 1 (no replicas given)")
        first = replicas[0]
        for r in replicas[1:]:
            if (r.model_name, r.max_model_len) != (first.model_name, first.max_model_len):
                raise ValueError("data-parallel replicas must serve the same model and "
                                 "max_model_len")
        self.replicas = list(replicas)
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.model_name = first.model_name
        self.metrics = (DataParallelMetrics([r.metrics for r in replicas])
                        if all(r.metrics is not None for r in replicas) else None)
        self.warmup_stats: dict[str, float] = {}
        self.routed = [0] * len(self.replicas)  # requests sent to each replica (for tests, logs)
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}

    @property
    def ready(self) -> bool:
        """True once every replica has compiled its programs."""
        return all(r.ready for r in self.replicas)

    @property
    def alive(self) -> bool:
        """False once any replica's engine thread has died."""
        return all(r.alive for r in self.replicas)

    def start(self, warmup: bool = True, progress: bool = True,
              on_compiled: Callable[[int, int], None] | None = None) -> None:
        """Warm up and start every replica (one after another), then their background
        compiles, if any; ``on_compiled(done, total)`` counts the programs of all replicas,
        and ``warmup_stats`` sums their programs and compile seconds."""
        n = len(self.replicas)
        for i, r in enumerate(self.replicas):
            report = None if on_compiled is None else (
                lambda done, total, i=i: on_compiled(i * total + done, n * total))
            # the background compiles start once every replica is warm: they would slow
            # the later replicas' warm-up
            r.start(warmup=warmup, progress=progress, on_compiled=report, background=False)
            if i == 0:
                self.warmup_stats = dict(r.warmup_stats)
            elif r.warmup_stats:
                for k in ("compile_s", "compile_cpu_s", "num_programs", "pending_programs"):
                    self.warmup_stats[k] = (self.warmup_stats.get(k, 0.0)
                                            + r.warmup_stats.get(k, 0.0))
        for r in self.replicas:
            r.start_background_compile()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every replica's engine thread."""
        for r in self.replicas:
            r.shutdown(timeout_s)

    def num_unfinished(self) -> int:
        """Unfinished requests over all replicas."""
        return sum(r.num_unfinished() for r in self.replicas)

    def num_waiting(self) -> int:
        """Accepted-but-not-running requests over all replicas (the server's queue bound)."""
        return sum(r.num_waiting() for r in self.replicas)

    def _pick(self) -> int:
        def load(i: int) -> tuple[int, float]:
            r = self.replicas[i]
            return r.num_unfinished(), r.engine.kv_cache_usage

        return min(range(len(self.replicas)), key=load)

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str, prompt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Route a request to the least-loaded replica and stream its outputs (see
        ``AsyncEngine.generate`` for the errors raised)."""
        with self._lock:
            base, n = request_id, 0
            while request_id in self._owner:  # the same id on two replicas would collide
                n += 1
                request_id = f"{base}#{n}"
            i = self._pick()
            self._owner[request_id] = i
            self.routed[i] += 1
        try:
            async for out in self.replicas[i].generate(prompt_token_ids, sampling_params,
                                                       request_id, prompt):
                yield out
        finally:
            with self._lock:
                self._owner.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request on the replica that holds it; unknown ids are ignored."""
        with self._lock:
            i = self._owner.get(request_id)
        if i is not None:
            self.replicas[i].abort(request_id)


def build_data_parallel(config: EngineConfig, load: LoadConfig, data_parallel_size: int, *,
                        with_metrics: bool = True,
                        devices: Sequence | None = None) -> DataParallelEngine:
    """Load ``data_parallel_size`` engines, replica ``i`` on devices
    ``[i * tp, (i + 1) * tp)`` of ``devices`` (default: ``jax.devices()``), unstarted.

    Each replica loads the weights itself (load time grows with the replica count).
    Raises:
      ValueError: if ``data_parallel_size < 1`` or there are fewer than ``dp * tp`` devices.
    """
    dp, tp = data_parallel_size, config.tensor_parallel_size
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {dp!r}")
    devs = list(devices if devices is not None else jax.devices())
    if len(devs) < dp * tp:
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} "
                         f"devices; {len(devs)} available ({jax.devices()[0].platform})")
    replicas = []
    for i in range(dp):
        metrics = EngineMetrics(served_name(load)) if with_metrics else None
        eng = LLMEngine(config, load, metrics=metrics,
                        devices=devs[i * tp:(i + 1) * tp], data_parallel_rank=i)
        replicas.append(AsyncEngine(eng))
    return DataParallelEngine(replicas)
