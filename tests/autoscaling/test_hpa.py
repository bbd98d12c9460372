"""The HPA decision (jaxserve/autoscaling/hpa.py) against decisions computed by hand from
the Kubernetes algorithm: tolerance, scale-up policies, the scale-down window and rate."""

from __future__ import annotations

import pytest

from jaxserve.autoscaling.hpa import HPA, HPASpec, Policy, Rules


def test_raw_recommendation_and_tolerance() -> None:
    hpa = HPA(HPASpec(target=5.0))
    assert hpa.raw_recommendation(2, 10.9) == 2  # ratio 1.09: within the 0.1 tolerance
    assert hpa.raw_recommendation(2, 9.0) == 2  # ratio 0.9: within
    assert hpa.raw_recommendation(2, 11.1) == 3  # ceil(11.1 / 5)
    assert hpa.raw_recommendation(2, 30.0) == 6
    assert hpa.raw_recommendation(4, 8.0) == 2  # ratio 0.4
    assert hpa.raw_recommendation(4, 0.0) == 0  # bounded later by min_replicas


def test_scale_up_is_limited_by_the_widest_policy_per_period() -> None:
    # defaults: max(+100 %, +4 pods) per 15 s; the metric asks for 20 replicas throughout
    hpa = HPA(HPASpec(target=5.0, max_replicas=20))
    assert hpa.decide(0.0, 1, 100.0) == 5  # max(ceil(1 * 2) = 2, 1 + 4 = 5)
    assert hpa.decide(15.0, 5, 100.0) == 10  # the event at 0 is outside (15 - 15, 15]: max(10, 9)
    assert hpa.decide(30.0, 10, 200.0) == 20  # max(20, 14), capped at max_replicas 20
    assert hpa.up_events == [(0.0, 4), (15.0, 5), (30.0, 10)]


def test_a_period_counts_its_own_scale_events() -> None:
    hpa = HPA(HPASpec(target=1.0, scale_up=Rules(0.0, (Policy("Pods", 1, 60.0),))))
    assert hpa.decide(0.0, 1, 10.0) == 2
    assert hpa.decide(15.0, 2, 10.0) == 2  # the period started at 2 - 1 = 1 pod: +1 is used up
    assert hpa.decide(45.0, 2, 10.0) == 2
    assert hpa.decide(60.0, 2, 10.0) == 3  # the event at 0 left the period (60 - 60, 60]


def test_scale_down_waits_for_the_window_then_one_pod_a_minute() -> None:
    hpa = HPA(HPASpec(target=1.0))
    assert hpa.decide(0.0, 4, 4.0) == 4  # ratio 1: recommendation 4
    for t in range(15, 300, 15):  # the metric fell to 0 (recommendation 1), the window holds 4
        assert hpa.decide(float(t), 4, 0.0) == 4, t
    assert hpa.decide(300.0, 4, 0.0) == 3  # the 4 at 0 left the window (300 - 300, 300]; 1 pod/60 s
    assert hpa.decide(315.0, 3, 0.0) == 3  # the period started at 3 + 1 = 4: 4 - 1 = 3
    assert hpa.decide(345.0, 3, 0.0) == 3
    assert hpa.decide(360.0, 3, 0.0) == 2  # the event at 300 left (360 - 60, 360]
    assert hpa.down_events == [(300.0, 1), (360.0, 1)]


def test_scale_up_window_takes_the_lowest_recent_recommendation() -> None:
    hpa = HPA(HPASpec(target=1.0, scale_up=Rules(30.0, (Policy("Pods", 10, 15.0),))))
    assert hpa.decide(0.0, 2, 2.0) == 2
    assert hpa.decide(15.0, 2, 8.0) == 2  # recommendations 2 and 8 in the window: the lowest, 2
    assert hpa.decide(30.0, 2, 8.0) == 8  # the 2 at 0 is outside (30 - 30, 30]


def test_percent_down_policy_min_select_and_disabled() -> None:
    down = Rules(0.0, (Policy("Percent", 50, 60.0), Policy("Pods", 1, 60.0)), "Min")
    hpa = HPA(HPASpec(target=1.0, scale_down=down))
    assert hpa.decide(0.0, 9, 1.0) == 8  # Min: the smaller change, max(int(9 * 0.5), 9 - 1)
    hpa = HPA(HPASpec(target=1.0, scale_down=Rules(0.0, (Policy("Percent", 50, 60.0),))))
    assert hpa.decide(0.0, 9, 1.0) == 4  # int(9 * 0.5) = 4 (rounded down)
    hpa = HPA(HPASpec(target=1.0, scale_up=Rules(0.0, (), "Disabled")))
    assert hpa.decide(0.0, 2, 50.0) == 2
    assert HPA(HPASpec(target=1.0)).decide(0.0, 3, None) == 3  # no metric: no change


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"target": 0.0}, "target must be > 0"),
    ({"target": 1.0, "min_replicas": 3, "max_replicas": 2}, "min_replicas <= max_replicas"),
    ({"target": 1.0, "tolerance": -0.1}, "tolerance"),
])
def test_bad_specs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HPASpec(**kwargs)
    with pytest.raises(ValueError, match="Policy.kind"):
        Policy("Replicas", 1, 15.0)
    with pytest.raises(ValueError, match="select_policy"):
        Rules(0.0, (Policy("Pods", 1, 15.0),), "Largest")
