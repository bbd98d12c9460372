"""A discrete-event simulation of replicas behind a router, scaled by the HPA.

The data flow, per simulated second: requests arrive (``ramp_trace``: a piecewise-linear rate
with gamma gaps from ``jaxserve.bench.arrivals``, plus Poisson-timed bursts); the router
sends each to the ready, non-draining replica with the fewest requests in flight; a replica
serves at most ``max_num_seqs`` at once (the rest wait, first come first served) by processor
sharing: with ``n`` in service the replica completes ``curve.throughput(n)`` requests/s, each
request getting an equal share, so a closed loop at concurrency ``c`` reproduces the measured
throughput and mean latency at ``c``. Prometheus scrapes every ready (or draining) replica every
``scrape_interval_s``; at every HPA sync (``sync_offset_s + k * sync_period_s``) the controller
(``hpa.HPA``) reads the last scrape's total of the signal and sets the replica count. A new
replica is ready ``time_to_ready_s`` after the sync that asked for it; a removed one (starting
ones first, then the most recently ready) takes no new requests and leaves once its requests
finished. Pods are paid for from creation until they leave (``replica_minutes``).

Per request: TTFT = time waiting for a slot + a draw from a lognormal whose median and
``curve.percentile`` match the curve's TTFT at the concurrency it was admitted at; a request is
over the SLO when its TTFT exceeds the TTFT SLO, or when the curve's tail ITL at its
time-averaged concurrency exceeds the ITL SLO (ITL is a per-token figure; the request ran at a
load that breaks it). Signals: ``running`` (in service), ``waiting`` (queued), ``tokens``
(tokens in flight: the whole prompt and output of a waiting request; the prompt of a running
one until its first token plus the unfinished share of its output).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from jaxserve.autoscaling.curve import Curve
from jaxserve.autoscaling.hpa import HPA, HPASpec
from jaxserve.bench.arrivals import inter_arrival_times

SIGNALS = ("running", "waiting", "tokens")


def ramp_trace(knots: list[tuple[float, float]], rng: np.random.Generator,
               burstiness: float = 1.0, burst_every_s: float | None = None,
               burst_size: int = 0, burst_len_s: float = 1.0) -> np.ndarray:
    """Arrival times (s, sorted ``float64[n]``) of a rate that moves linearly between
    ``knots`` ``[(t_s, requests_per_s), ...]`` (times rising, rates >= 0), gaps gamma
    distributed with shape ``burstiness`` in the rate's own time (1: Poisson), plus bursts:
    a Poisson process of mean gap ``burst_every_s`` whose events each add ``burst_size``
    requests spread uniformly over ``burst_len_s``.

    Raises:
      ValueError: fewer than two knots, times not rising, a negative rate, bad burst values.
    """
    if len(knots) < 2:
        raise ValueError(f"knots needs at least two (t_s, rate) pairs, got {knots}")
    ts = np.array([k[0] for k in knots], np.float64)
    rates = np.array([k[1] for k in knots], np.float64)
    if np.any(np.diff(ts) <= 0) or np.any(rates < 0):
        raise ValueError(f"knots need rising times and rates >= 0, got {knots}")
    if burst_every_s is not None and (not burst_every_s > 0 or burst_size < 1
                                      or not burst_len_s > 0):
        raise ValueError("bursts need burst_every_s > 0, burst_size >= 1, burst_len_s > 0")
    grid = np.arange(ts[0], ts[-1], 0.01)
    cum = np.concatenate([[0.0], np.cumsum(np.interp(grid, ts, rates) * 0.01)])
    grid = np.append(grid, ts[-1])
    total = cum[-1]
    ops: list[np.ndarray] = []
    seen = 0.0
    while seen < total:  # unit-rate arrivals in the rate's own (operational) time
        gaps = inter_arrival_times(max(16, int(total - seen) + 16), 1.0, burstiness, rng)
        ops.append(seen + np.cumsum(gaps))
        seen = float(ops[-1][-1])
    op = np.concatenate(ops) if ops else np.zeros(0)
    times = np.interp(op[op < total], cum, grid)
    if burst_every_s is not None:
        t = ts[0] + rng.exponential(burst_every_s)
        extra = []
        while t < ts[-1]:
            extra.append(t + rng.uniform(0.0, burst_len_s, burst_size))
            t += rng.exponential(burst_every_s)
        if extra:
            times = np.concatenate([times, *extra])
    return np.sort(times)


@dataclass(frozen=True)
class SimConfig:
    """What is simulated besides the arrivals: the per-replica curve, the SLOs (ms, "ttft" /
    "itl"), the scaled signal, the engine's ``max_num_seqs``, the start-up time, the metric
    pipeline's cadence (s), the starting replica count, the seed of the TTFT draws, and the
    mean prompt / output lengths for the tokens signal (default: the curve's).

    Raises:
      ValueError: an unknown signal, SLO name, or non-positive counts / times.
    """

    curve: Curve
    slos_ms: dict[str, float]
    signal: str = "running"
    max_num_seqs: int = 256
    time_to_ready_s: float = 30.0
    scrape_interval_s: float = 15.0
    sync_offset_s: float = 7.5
    initial_replicas: int = 1
    seed: int = 0
    input_len: float | None = None
    output_len: float | None = None

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {SIGNALS}, got {self.signal!r}")
        if bad := set(self.slos_ms) - {"ttft", "itl"}:
            raise ValueError(f"slos_ms keys must be ttft or itl, got {sorted(bad)}")
        if self.max_num_seqs < 1 or self.initial_replicas < 1:
            raise ValueError("max_num_seqs and initial_replicas must be >= 1")
        if self.time_to_ready_s < 0 or not self.scrape_interval_s > 0 or self.sync_offset_s < 0:
            raise ValueError("time_to_ready_s and sync_offset_s must be >= 0, "
                             "scrape_interval_s > 0")
        if self.signal == "tokens" and None in (self.lengths()):
            raise ValueError("signal 'tokens' needs input_len and output_len (the curve has "
                             "none)")

    def lengths(self) -> tuple[float | None, float | None]:
        return (self.input_len if self.input_len is not None else self.curve.mean_input_len,
                self.output_len if self.output_len is not None else self.curve.mean_output_len)


@dataclass
class _Replica:
    created_s: float
    ready_s: float
    draining: bool = False
    gone_s: float | None = None
    last_s: float = 0.0
    vtime: float = 0.0  # service each running request has received since the start (requests)
    area: float = 0.0  # integral of the running count over time
    running: list[tuple[float, int]] = field(default_factory=list)  # heap (finish vtime, id)
    waiting: deque[int] = field(default_factory=deque)

    def in_flight(self) -> int:
        return len(self.running) + len(self.waiting)

    def advance(self, now: float, curve: Curve) -> None:
        n = len(self.running)
        if n:
            self.vtime += (now - self.last_s) * curve.throughput(n) / n
            self.area += (now - self.last_s) * n
        self.last_s = now

    def next_finish(self, curve: Curve) -> float:
        if not self.running:
            return math.inf
        n = len(self.running)
        return self.last_s + (self.running[0][0] - self.vtime) * n / curve.throughput(n)


@dataclass
class SimResult:
    """Per request (arrays of length n): arrival, TTFT (ms), finish time (s), the replica that
    served it (index in creation order), the running count averaged over its time in service,
    over the SLO; per sync: time, replica count asked, ready replicas, the metric total the HPA
    read; and the pods' paid minutes."""

    arrival_s: np.ndarray
    ttft_ms: np.ndarray
    finish_s: np.ndarray
    replica: np.ndarray
    mean_concurrency: np.ndarray
    over_slo: np.ndarray
    sync_s: np.ndarray
    replicas: np.ndarray
    ready: np.ndarray
    metric: np.ndarray
    replica_minutes: float

    def fraction_over_slo(self, start_s: float = -math.inf, end_s: float = math.inf) -> float:
        """Fraction of the requests arriving in ``[start_s, end_s)`` that were over the SLO."""
        sel = (self.arrival_s >= start_s) & (self.arrival_s < end_s)
        return float(self.over_slo[sel].mean()) if sel.any() else 0.0


def simulate(arrivals_s: np.ndarray, cfg: SimConfig, hpa: HPASpec | None = None
             ) -> SimResult:
    """Replay ``arrivals_s`` (s, sorted) through the replicas; with ``hpa`` None the count
    stays at ``cfg.initial_replicas``. Runs until every request has finished."""
    curve = cfg.curve
    rng = np.random.default_rng(cfg.seed)
    z = NormalDist().inv_cdf(curve.percentile / 100.0)
    in_len, out_len = cfg.lengths()
    n_req = len(arrivals_s)
    admit_n = np.zeros(n_req)  # running count when admitted, itself included
    mean_n = np.zeros(n_req)  # the running count averaged over its time in service
    ttft = np.full(n_req, np.nan)
    first_s = np.full(n_req, np.inf)
    finish = np.full(n_req, np.nan)
    start_area = np.zeros(n_req)
    where = np.zeros(n_req, np.int64)  # the replica (index in creation order) that served it
    admit_s = np.zeros(n_req)
    controller = HPA(hpa) if hpa else None
    pods = [_Replica(0.0, 0.0) for _ in range(cfg.initial_replicas)]
    scraped: dict[int, float] = {}
    syncs: list[tuple[float, int, int, float]] = []
    period = hpa.sync_period_s if hpa else math.inf
    next_scrape, next_sync = 0.0, cfg.sync_offset_s if hpa else math.inf
    i = 0

    def admit(k: int, rid: int, now: float) -> None:
        p = pods[k]
        n = len(p.running) + 1
        med, tail = curve.median_ms("ttft", n), curve.tail_ms("ttft", n)
        sigma = math.log(tail / med) / z if tail > med > 0 and z > 0 else 0.0
        ttft[rid] = (now - arrivals_s[rid]) * 1000 + med * math.exp(sigma * rng.standard_normal())
        first_s[rid] = arrivals_s[rid] + ttft[rid] / 1000
        admit_n[rid], admit_s[rid], start_area[rid] = n, now, p.area
        heapq.heappush(p.running, (p.vtime + 1.0, rid))

    def signal(p: _Replica, now: float) -> float:
        if cfg.signal == "running":
            return float(len(p.running))
        if cfg.signal == "waiting":
            return float(len(p.waiting))
        assert in_len is not None and out_len is not None
        toks = len(p.waiting) * (in_len + out_len)
        for tag, rid in p.running:
            toks += out_len * min(1.0, tag - p.vtime) + (in_len if now < first_s[rid] else 0.0)
        return toks

    while True:
        live = [k for k, p in enumerate(pods) if p.gone_s is None]
        t_arr = arrivals_s[i] if i < n_req else math.inf
        t_fin, k_fin = min(((pods[k].next_finish(curve), k) for k in live),
                           default=(math.inf, -1))
        t_ready = min((pods[k].ready_s for k in live if pods[k].ready_s > pods[k].last_s),
                      default=math.inf)
        if i >= n_req and t_fin == math.inf:
            break
        now = min(t_arr, t_fin, next_scrape, next_sync, t_ready)
        for k in live:
            pods[k].advance(now, curve)
        if now == t_fin:
            p = pods[k_fin]
            _, rid = heapq.heappop(p.running)
            finish[rid] = now
            span = now - admit_s[rid]
            mean_n[rid] = (p.area - start_area[rid]) / span if span > 0 else admit_n[rid]
            if p.waiting:
                admit(k_fin, p.waiting.popleft(), now)
            elif p.draining and not p.running:
                p.gone_s = now
        elif now == t_arr:
            ok = [k for k in live if not pods[k].draining and pods[k].ready_s <= now]
            # none ready (every ready one removed while others start): the soonest ready holds it
            k = (min(ok, key=lambda k: (pods[k].in_flight(), k)) if ok else
                 min((k for k in live if not pods[k].draining), key=lambda k: pods[k].ready_s))
            where[i] = k
            if pods[k].ready_s <= now and len(pods[k].running) < cfg.max_num_seqs:
                admit(k, i, now)
            else:
                pods[k].waiting.append(i)
            i += 1
        elif now == next_scrape:
            scraped = {k: signal(pods[k], now) for k in live if pods[k].ready_s <= now}
            next_scrape += cfg.scrape_interval_s
        elif now == next_sync:
            assert controller is not None
            active = [k for k in live if not pods[k].draining]
            want = controller.decide(now, len(active), sum(scraped.values()) if scraped else None)
            if want > len(active):
                pods += [_Replica(now, now + cfg.time_to_ready_s, last_s=now)
                         for _ in range(want - len(active))]
            newest_first = sorted(active, key=lambda k: (pods[k].ready_s <= now,
                                                         -pods[k].ready_s, -k))
            for k in newest_first[:max(0, len(active) - want)]:
                pods[k].draining = True
                if not pods[k].in_flight():
                    pods[k].gone_s = now
            ready = sum(1 for p in pods if p.gone_s is None and not p.draining
                        and p.ready_s <= now)
            syncs.append((now, want, ready, sum(scraped.values()) if scraped else math.nan))
            next_sync += period
        # a replica that became ready serves what it holds (the router sees it from now on)
        for k in live:
            p = pods[k]
            while p.ready_s <= now and p.waiting and len(p.running) < cfg.max_num_seqs:
                admit(k, p.waiting.popleft(), now)

    end = max([finish.max() if n_req else 0.0, *(s[0] for s in syncs[-1:])])
    minutes = sum(((p.gone_s if p.gone_s is not None else end) - p.created_s)
                  for p in pods) / 60.0
    over = ttft > cfg.slos_ms.get("ttft", math.inf)
    if "itl" in cfg.slos_ms:
        over |= np.array([curve.tail_ms("itl", n) > cfg.slos_ms["itl"] for n in mean_n],
                         bool)
    arr = np.array(syncs, np.float64).reshape(-1, 4)
    return SimResult(np.asarray(arrivals_s, np.float64), ttft, finish, where, mean_n, over,
                     arr[:, 0], arr[:, 1].astype(np.int64), arr[:, 2].astype(np.int64),
                     arr[:, 3], minutes)
