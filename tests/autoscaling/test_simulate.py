"""The simulation (jaxserve/autoscaling/simulate.py) on tiny traces whose service times,
scrapes and HPA decisions are computed by hand, and the ramp traces."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.autoscaling.hpa import HPASpec
from jaxserve.autoscaling.simulate import SimConfig, ramp_trace, simulate
from tests.autoscaling.curves import curve, fixed_service, shared


def test_processor_sharing_and_the_slot_queue() -> None:
    # one replica completing 1 request/s, shared: arrivals at 0 and 0.5. The first is alone
    # for 0.5 s (0.5 left), then both get 0.5/s: the first ends at 1.5, the second, with 0.5
    # left, alone again, at 2.0
    r = simulate(np.array([0.0, 0.5]), SimConfig(shared(1.0), {"ttft": 1000.0}))
    assert r.finish_s == pytest.approx([1.5, 2.0])
    assert r.ttft_ms == pytest.approx([100.0, 100.0])  # the curve's (deterministic) TTFT
    # max_num_seqs 1: the second waits for the first (done at 1.0): TTFT 500 ms + 100 ms
    r = simulate(np.array([0.0, 0.5]), SimConfig(shared(1.0), {"ttft": 550.0}, max_num_seqs=1))
    assert r.finish_s == pytest.approx([1.0, 2.0])
    assert r.ttft_ms == pytest.approx([100.0, 600.0])
    assert r.over_slo.tolist() == [False, True]
    assert r.replica_minutes == pytest.approx(2.0 / 60)


def test_itl_breach_counts_the_load_a_request_ran_at() -> None:
    # tail ITL 10 ms alone, 50 ms at 3; two requests side by side average concurrency 2: 30 ms
    c = curve([(1.0, 1.0, 100.0, 10.0), (3.0, 3.0, 100.0, 50.0)])
    r = simulate(np.array([0.0, 0.0]), SimConfig(c, {"itl": 29.0}))
    assert r.finish_s == pytest.approx([1.0, 1.0])
    assert r.over_slo.all()
    assert not simulate(np.array([0.0, 0.0]), SimConfig(c, {"itl": 30.5})).over_slo.any()


def test_hpa_decisions_on_a_tiny_trace() -> None:
    """Each request is served in 1 s. Scrapes at 0, 15, 30, 45; syncs at 7.5, 22.5, 37.5, ...
    Six requests at 14.5-14.55 are running at the scrape at 15; the sync at 22.5 reads 6 on 1
    replica, target 2: ceil(6 / 2) = 3 (scale-up limit max(2, 1 + 4) = 5), ready at 32.5. The
    scrape at 30 reads 0: the recommendation 0 is held at 3 by the 300 s down window. Three
    requests at 40 go one to each replica (fewest in flight)."""
    arrivals = np.array([14.5 + 0.01 * k for k in range(6)] + [40.0, 40.0, 40.0])
    cfg = SimConfig(fixed_service(1.0), {"ttft": 1000.0}, time_to_ready_s=10.0)
    r = simulate(arrivals, cfg, HPASpec(target=2.0))
    assert r.sync_s.tolist() == [7.5, 22.5, 37.5]
    assert r.metric.tolist() == [0.0, 6.0, 0.0]
    assert r.replicas.tolist() == [1, 3, 3]
    assert r.ready.tolist() == [1, 1, 3]
    assert r.replica.tolist() == [0] * 6 + [0, 1, 2]
    assert r.finish_s[-3:] == pytest.approx([41.0, 41.0, 41.0])
    # pod 0 from 0 to the last finish (41 s), pods 1 and 2 from 22.5 s
    assert r.replica_minutes == pytest.approx((41.0 + 2 * 18.5) / 60)


def test_scale_down_drains_the_newest_pod() -> None:
    """Two replicas at the start; nothing running at the scrapes: every recommendation is
    ceil(0 / 1) = 0, bounded to min_replicas 1; the down window is 0 s here, so the first sync
    (7.5 s) removes one pod, the most recently ready, pod 1, which still serves a request
    from 7.0 to 8.0 and leaves when it ends."""
    from jaxserve.autoscaling.hpa import SCALE_DOWN, Rules

    down = Rules(0.0, SCALE_DOWN.policies)
    cfg = SimConfig(fixed_service(1.0), {"ttft": 1000.0}, initial_replicas=2)
    r = simulate(np.array([6.9, 7.0, 9.0]), cfg, HPASpec(target=1.0, scale_down=down))
    assert r.replica.tolist() == [0, 1, 0]
    assert r.replicas.tolist() == [1]
    assert r.replica_minutes == pytest.approx((10.0 + 8.0) / 60)  # pod 0 to 10.0, pod 1 to 8.0


def test_tokens_signal() -> None:
    """One request (prompt 100, output 10 tokens, served in 10 s, first token after 100 ms)
    arrives at 14.0: at the scrape at 15 a tenth of its output is done and its prompt too:
    9 tokens; a second one arriving at 14.95 is before its first token (15.05):
    100 + 10 * (1 - 0.05 / 10). The sync at 22.5 reads that scrape."""
    c = fixed_service(10.0, ttft_ms=100.0)
    cfg = SimConfig(c, {"ttft": 1000.0}, signal="tokens", input_len=100.0, output_len=10.0)
    r = simulate(np.array([14.0]), cfg, HPASpec(target=1000.0))
    assert r.sync_s.tolist() == [7.5, 22.5] and r.metric[-1] == pytest.approx(9.0)
    r = simulate(np.array([14.0, 14.95]), cfg, HPASpec(target=1000.0))
    assert r.metric[-1] == pytest.approx(9.0 + 100.0 + 9.95)
    with pytest.raises(ValueError, match="signal 'tokens' needs input_len"):
        SimConfig(c, {"ttft": 1.0}, signal="tokens")


def test_ramp_trace_counts_and_bursts() -> None:
    rng = np.random.default_rng(0)
    t = ramp_trace([(0.0, 0.0), (100.0, 10.0)], rng)  # 500 expected, Poisson sd ~22
    assert abs(len(t) - 500) < 90 and np.all(np.diff(t) >= 0) and t[-1] < 100.0
    assert np.mean(t) > 55.0  # a rising rate puts most arrivals late (mean 66.7 s)
    bursty = ramp_trace([(0.0, 1.0), (600.0, 1.0)], np.random.default_rng(1),
                        burst_every_s=60.0, burst_size=20, burst_len_s=0.5)
    plain = ramp_trace([(0.0, 1.0), (600.0, 1.0)], np.random.default_rng(1))
    assert len(bursty) > len(plain) + 60  # ~10 bursts of 20 on top of ~600
    assert np.any(np.diff(bursty) < 0.01)  # bursts pack 20 arrivals in half a second
    with pytest.raises(ValueError, match="rising times"):
        ramp_trace([(0.0, 1.0), (0.0, 2.0)], rng)
    with pytest.raises(ValueError, match="bursts need"):
        ramp_trace([(0.0, 1.0), (1.0, 1.0)], rng, burst_every_s=1.0, burst_size=0)


def test_lognormal_ttft_matches_the_curve_median_and_tail() -> None:
    c = curve([(1.0, 1000.0, 400.0, 10.0), (2000.0, 2e6, 400.0, 10.0)],
              medians={"ttft": [100.0, 100.0]})
    r = simulate(np.linspace(0.0, 10.0, 6000), SimConfig(c, {"ttft": 1e9}, max_num_seqs=10**6))
    assert np.median(r.ttft_ms) == pytest.approx(100.0, rel=0.03)
    assert np.percentile(r.ttft_ms, 99) == pytest.approx(400.0, rel=0.12)
