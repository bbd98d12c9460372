"""The Kubernetes HorizontalPodAutoscaler's decision, as the controller computes it.

Follows ``pkg/controller/podautoscaler`` (``replica_calculator.go``,
``horizontal.go: normalizeDesiredReplicasWithBehaviors``) for a metric with an ``AverageValue``
target, the form both KEDA's Prometheus scaler and an External metric of prometheus-adapter
produce. At every sync (``sync_period_s``, the controller's ``--horizontal-pod-autoscaler-sync-
period``, 15 s by default):

  1. ratio = total / (target * replicas); within ``tolerance`` of 1 the recommendation is the
     current count, else ``ceil(total / target)`` (``total`` is the metric summed over the
     pods, so this is ``ceil(replicas * average / target)``);
  2. stabilisation: the recommendation becomes at least the lowest and at most the highest of
     the recommendations of the last ``scale_up`` / ``scale_down`` window seconds (the current
     one included), starting from the current count;
  3. rate limits: each policy allows, from the count at the start of its period (the current
     count less what the period's scale events added, plus what they removed), ``+value`` pods
     or ``+value %`` (rounded up; down: ``-value`` pods or ``-value %``, rounded down);
     ``select_policy`` Max takes the policy allowing the largest change, Min the smallest;
     then ``min_replicas`` / ``max_replicas`` bound the result;
  4. a change is recorded as a scale event (time, pods added or removed) for step 3.

Defaults are the Kubernetes defaults for scale-up (window 0 s; max of 100 % and 4 pods per
15 s) and a slower scale-down than Kubernetes' (window 300 s as Kubernetes, then 1 pod per 60 s).
Times are seconds on any clock the caller keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Policy:
    """One scaling policy: ``kind`` "Pods" or "Percent", ``value`` > 0, per ``period_s`` > 0."""

    kind: str
    value: int
    period_s: float

    def __post_init__(self) -> None:
        if self.kind not in ("Pods", "Percent"):
            raise ValueError(f"Policy.kind must be 'Pods' or 'Percent', got {self.kind!r}")
        if self.value <= 0 or self.period_s <= 0:
            raise ValueError(f"Policy value and period_s must be > 0, got {self.value}, "
                             f"{self.period_s}")


@dataclass(frozen=True)
class Rules:
    """One direction's behaviour: stabilisation window (s), policies, ``select_policy``
    ("Max", "Min" or "Disabled")."""

    window_s: float
    policies: tuple[Policy, ...]
    select_policy: str = "Max"

    def __post_init__(self) -> None:
        if self.window_s < 0:
            raise ValueError(f"Rules.window_s must be >= 0, got {self.window_s}")
        if self.select_policy not in ("Max", "Min", "Disabled"):
            raise ValueError(f"Rules.select_policy must be Max, Min or Disabled, got "
                             f"{self.select_policy!r}")
        if not self.policies and self.select_policy != "Disabled":
            raise ValueError("Rules.policies must not be empty")


SCALE_UP = Rules(0.0, (Policy("Percent", 100, 15.0), Policy("Pods", 4, 15.0)))
SCALE_DOWN = Rules(300.0, (Policy("Pods", 1, 60.0),))


@dataclass(frozen=True)
class HPASpec:
    """The autoscaler: per-replica ``target`` (average value of the metric, > 0), replica
    bounds, ``tolerance``, sync period (s) and the two directions' rules.

    Raises:
      ValueError: a non-positive target or sync period, bounds out of order, a negative
        tolerance.
    """

    target: float
    min_replicas: int = 1
    max_replicas: int = 10
    tolerance: float = 0.1
    sync_period_s: float = 15.0
    scale_up: Rules = SCALE_UP
    scale_down: Rules = SCALE_DOWN

    def __post_init__(self) -> None:
        if not self.target > 0:
            raise ValueError(f"HPASpec.target must be > 0, got {self.target}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"HPASpec needs 1 <= min_replicas <= max_replicas, got "
                             f"{self.min_replicas}, {self.max_replicas}")
        if self.tolerance < 0 or not self.sync_period_s > 0:
            raise ValueError(f"HPASpec.tolerance must be >= 0 and sync_period_s > 0, got "
                             f"{self.tolerance}, {self.sync_period_s}")


def _changed_in(events: list[tuple[float, int]], now: float, period_s: float) -> int:
    return sum(n for t, n in events if t > now - period_s)


@dataclass
class HPA:
    """The controller's state for one scale target: past recommendations and scale events."""

    spec: HPASpec
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    up_events: list[tuple[float, int]] = field(default_factory=list)
    down_events: list[tuple[float, int]] = field(default_factory=list)

    def raw_recommendation(self, replicas: int, total: float) -> int:
        """Step 1: the count the metric asks for (``total``: the metric summed over pods)."""
        ratio = total / (self.spec.target * replicas)
        if abs(1.0 - ratio) <= self.spec.tolerance:
            return replicas
        return math.ceil(total / self.spec.target)

    def _stabilize(self, now: float, replicas: int, desired: int) -> int:
        up, down = desired, desired
        for t, r in self.recommendations:
            if t > now - self.spec.scale_up.window_s:
                up = min(up, r)
            if t > now - self.spec.scale_down.window_s:
                down = max(down, r)
        keep = max(self.spec.scale_up.window_s, self.spec.scale_down.window_s)
        self.recommendations = [(t, r) for t, r in self.recommendations if t > now - keep]
        self.recommendations.append((now, desired))
        return min(max(replicas, up), down)

    def _limit(self, rules: Rules, now: float, replicas: int, up: bool) -> int:
        if rules.select_policy == "Disabled":
            return replicas
        proposals = []
        for p in rules.policies:
            start = (replicas - _changed_in(self.up_events, now, p.period_s)
                     + _changed_in(self.down_events, now, p.period_s))
            if p.kind == "Pods":
                proposals.append(start + p.value if up else start - p.value)
            elif up:
                proposals.append(math.ceil(start * (1 + p.value / 100)))
            else:
                proposals.append(int(start * (1 - p.value / 100)))
        wide = max if up else min  # the policy allowing the largest change
        return (wide if rules.select_policy == "Max" else (min if up else max))(proposals)

    def decide(self, now: float, replicas: int, total: float | None) -> int:
        """The replica count after the sync at ``now`` (s), from ``replicas`` pods and the
        metric ``total`` over them (None: no metric, nothing changes). Records the change."""
        if total is None:
            return replicas
        desired = self._stabilize(now, replicas, self.raw_recommendation(replicas, total))
        s = self.spec
        if desired > replicas:
            cap = min(s.max_replicas, max(replicas, self._limit(s.scale_up, now, replicas, True)))
            desired = min(desired, cap)
        elif desired < replicas:
            floor = max(s.min_replicas,
                        min(replicas, self._limit(s.scale_down, now, replicas, False)))
            desired = max(desired, floor)
        if desired > replicas:
            self.up_events.append((now, desired - replicas))
        elif desired < replicas:
            self.down_events.append((now, replicas - desired))
        return desired
