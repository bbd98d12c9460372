"""The autoscaling thresholds from measurements (the arithmetic of ``jaxserve plan-autoscaling``).

Inputs: one replica's curve (``curve.load_curve``), the SLO (tail TTFT and/or ITL, ms), the
time a new replica takes to become ready (s; ``jaxserve bench startup``'s ``ready_s`` plus what
the cluster adds: scheduling, image pull), the traffic growth (requests/s per second, or
requests in flight per second, for the whole deployment) and the metric pipeline's delays.

The arithmetic, per scaled signal (running requests, waiting requests, tokens in flight):

  c_slo      the largest measured concurrency whose tail latencies meet the SLO;
  capacity   the signal's value per replica at the SLO limit: running min(c_slo, max_num_seqs);
             waiting, with running capped at max_num_seqs = M, the queue whose wait still meets
             the TTFT SLO, (ttft_slo - ttft_tail(M)) * throughput(M); tokens: the running
             figures (capacity, trigger, target) each turned into tokens, n requests in flight
             holding n * (output / 2 + prompt * TTFT / E2E) tokens, the medians at n (the prompt
             counts until its first token, the output counts down; the prompt's share of a
             request's life, and so the tokens per request, rise with the load);
  growth     per replica and second, at the smallest deployment (``min_replicas``): requests in
             flight grow at the concurrency growth, or the request-rate growth times the time a
             request spends in the system at c_slo (Little's law: c_slo / throughput(c_slo));
  lag        time_to_ready + metric_delay + sync_period: the longest from the moment the signal
             crosses the trigger to the moment a new replica serves;
  trigger    capacity - growth * lag: the signal may reach at most this before scale-up starts,
             or the new replica arrives after the SLO broke;
  target     capacity * (1 - headroom): the steady-state load a replica is run at;
  threshold  the per-replica average the autoscaler is given: min(target, trigger / (1 +
             tolerance)), since the HPA acts only once the average passes threshold * (1 +
             tolerance). It is KEDA's ``threshold`` (Prometheus trigger, AverageValue) and the
             HPA's ``target.averageValue``.

A trigger <= 0 means no threshold is early enough at that growth: the plan then gives the
smallest ``minReplicas`` that makes one exist (more replicas share the growth).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxserve.autoscaling.curve import Curve, slo_concurrency
from jaxserve.bench.metrics import parse_ms_pairs

SLO_METRICS = ("ttft", "itl", "tpot")
QUERIES = {  # PromQL of the total over the deployment; KEDA / the HPA divide by the pod count
    "running": 'sum(jaxserve:num_requests_running{model_name="%s"})',
    "waiting": 'sum(jaxserve:num_requests_waiting{model_name="%s"})',
    "tokens": 'sum(jaxserve:num_tokens_in_flight{model_name="%s"})',
}
SCALE_UP_BEHAVIOR = {"stabilizationWindowSeconds": 0, "selectPolicy": "Max", "policies": [
    {"type": "Percent", "value": 100, "periodSeconds": 15},
    {"type": "Pods", "value": 4, "periodSeconds": 15}]}
SCALE_DOWN_BEHAVIOR = {"stabilizationWindowSeconds": 300, "selectPolicy": "Max", "policies": [
    {"type": "Pods", "value": 1, "periodSeconds": 60}]}


def parse_slos(pairs: list[str]) -> dict[str, float]:
    """``["ttft:500", "itl:50"]`` -> ``{"ttft": 500.0, "itl": 50.0}`` (ms).

    Raises:
      ValueError: a malformed pair, an unknown metric (ttft, itl, tpot), a value <= 0, a
        repeated metric, or no pair.
    """
    out: dict[str, float] = {}
    for name, ms in parse_ms_pairs(pairs, "--slo", SLO_METRICS):
        if not ms > 0:
            raise ValueError(f"--slo {name} must be > 0 ms, got {ms:g}")
        if name in out:
            raise ValueError(f"--slo {name} given twice")
        out[name] = ms
    if not out:
        raise ValueError("--slo needs at least one METRIC:MS pair")
    return out


@dataclass(frozen=True)
class PlanInputs:
    """Everything but the curve (units in the names; growth: exactly one of the two, > 0).

    Raises:
      ValueError: naming the field: both or neither growth, negative times, headroom outside
        [0, 1), tolerance < 0, min_replicas < 1, max_num_seqs < 1, tokens_per_request <= 0.
    """

    slos_ms: dict[str, float]
    time_to_ready_s: float
    growth_rps_per_s: float | None = None
    growth_concurrency_per_s: float | None = None
    metric_delay_s: float = 15.0
    sync_period_s: float = 15.0
    headroom: float = 0.25
    tolerance: float = 0.1
    min_replicas: int = 1
    max_num_seqs: int | None = None
    tokens_per_request: float | None = None

    def __post_init__(self) -> None:
        if (self.growth_rps_per_s is None) == (self.growth_concurrency_per_s is None):
            raise ValueError("give exactly one of growth_rps_per_s and "
                             "growth_concurrency_per_s")
        for name in ("growth_rps_per_s", "growth_concurrency_per_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        for name in ("time_to_ready_s", "metric_delay_s", "sync_period_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")
        if not self.tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance}")
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.tokens_per_request is not None and not self.tokens_per_request > 0:
            raise ValueError(f"tokens_per_request must be > 0, got {self.tokens_per_request}")
        parse_slos([f"{k}:{v}" for k, v in self.slos_ms.items()])

    @property
    def lag_s(self) -> float:
        """From the signal crossing the trigger to a new replica serving (s)."""
        return self.time_to_ready_s + self.metric_delay_s + self.sync_period_s


@dataclass(frozen=True)
class SignalPlan:
    """One signal's figures (per replica, in the signal's unit); ``threshold`` None when no
    threshold is early enough (see ``min_replicas_needed``) or the signal does not apply
    (``note`` says why)."""

    signal: str
    capacity: float
    growth_per_s: float
    early_trigger: float
    target: float
    threshold: float | None
    binding: str  # "headroom", "early trigger", or "none"
    min_replicas_needed: int | None
    note: str


@dataclass(frozen=True)
class Plan:
    """The SLO-limited concurrency, its throughput (req/s), the time in system there (s), the
    lag (s), the per-replica in-flight growth (requests/s), the replicas' ``max_num_seqs`` the
    plan assumes, and one ``SignalPlan`` per signal."""

    c_slo: float
    throughput_rps: float
    time_in_system_s: float
    lag_s: float
    concurrency_growth_per_s: float
    max_num_seqs: int
    signals: dict[str, SignalPlan]


def tokens_per_request(curve: Curve, c: float) -> float | None:
    """Tokens in flight one request holds on average at concurrency ``c`` (module doc), None
    without the curve's lengths."""
    if curve.mean_input_len is None or curve.mean_output_len is None:
        return None
    prompt_share = min(1.0, curve.median_ms("ttft", c) / curve.median_ms("e2el", c))
    return curve.mean_output_len / 2 + curve.mean_input_len * prompt_share


def _signal(name: str, capacity: float, growth: float, inp: PlanInputs, note: str,
            to_signal: Callable[[float], float] | None = None) -> SignalPlan:
    """The figures of one signal from its capacity and growth in requests (in flight or
    waiting); ``to_signal`` maps a number of requests in flight onto the signal's unit (tokens
    in flight; default: the identity)."""
    f = to_signal or (lambda n: n)
    trigger = capacity - growth * inp.lag_s
    target = capacity * (1 - inp.headroom)
    slope = f(capacity) / capacity if capacity > 0 else 1.0
    if trigger <= 0:
        # per-replica growth falls as 1/N: the least N with capacity - growth * min / N * lag > 0
        need = math.floor(growth * inp.min_replicas * inp.lag_s / capacity) + 1 \
            if capacity > 0 else None
        why = (f"the signal would have to trigger at {trigger * slope:.3g} <= 0: at this "
               f"growth a new replica ({inp.lag_s:g} s away) arrives after the SLO breaks")
        return SignalPlan(name, f(capacity), growth * slope, trigger * slope, f(target), None,
                          "none", need, f"{why}; {note}" if note else why)
    early = f(trigger) / (1 + inp.tolerance)
    threshold = min(f(target), early)
    return SignalPlan(name, f(capacity), growth * slope, f(trigger), f(target),
                      math.floor(threshold * 100) / 100,
                      "headroom" if f(target) <= early else "early trigger", None, note)


def plan(curve: Curve, inp: PlanInputs) -> Plan:
    """The thresholds (module doc).

    Raises:
      ValueError: no measured concurrency meets the SLO, or the SLO names a latency the curve
        lacks.
    """
    c = slo_concurrency(curve, inp.slos_ms)
    first = curve.points[0]
    if c is None:
        got = ", ".join(f"{m} {first.tail_ms[m]:.0f} ms" for m in inp.slos_ms)
        raise ValueError(f"no measured concurrency meets the SLO: at concurrency "
                         f"{first.concurrency:g} the p{curve.percentile:g} is {got}; "
                         "loosen --slo or measure a faster configuration")
    x = curve.throughput(c)
    w = c / x
    g_c = (inp.growth_concurrency_per_s if inp.growth_concurrency_per_s is not None
           else inp.growth_rps_per_s * w) / inp.min_replicas  # type: ignore[operator]
    m = inp.max_num_seqs if inp.max_num_seqs is not None else int(c)
    signals = {"running": _signal(
        "running", float(min(c, m)), g_c, inp,
        "" if m >= c else f"max_num_seqs {m} < c_slo {c:g}: running saturates at {m}")}
    if "ttft" not in inp.slos_ms:
        signals["waiting"] = SignalPlan("waiting", math.inf, g_c, math.inf, math.inf, None,
                                        "none", None, "no TTFT SLO: waiting does not bound it")
    elif m > c:
        signals["waiting"] = SignalPlan(
            "waiting", 0.0, g_c, -g_c * inp.lag_s, 0.0, None, "none", None,
            f"requests start waiting only past max_num_seqs {m} > c_slo {c:g}, after the SLO "
            "broke: serve with --max-num-seqs <= c_slo to scale on waiting")
    else:
        queue = max(0.0, (inp.slos_ms["ttft"] - curve.tail_ms("ttft", m)) / 1000.0
                    * curve.throughput(m))
        signals["waiting"] = _signal("waiting", queue, g_c, inp,
                                     f"with --max-num-seqs {m}; a queue builds only once "
                                     f"{m} run")
    fixed = inp.tokens_per_request
    tpr = fixed or tokens_per_request(curve, c)
    if tpr is None:
        signals["tokens"] = SignalPlan("tokens", math.nan, math.nan, math.nan, math.nan, None,
                                       "none", None, "prompt / output lengths unknown: give "
                                       "--tokens-per-request")
    else:
        def tokens(n: float) -> float:  # the prompt's share of a request's life rises with n
            return n * (fixed or tokens_per_request(curve, max(n, 1.0)))  # type: ignore[operator]

        signals["tokens"] = _signal("tokens", c, g_c, inp,
                                    f"{tpr:.1f} tokens per request in flight at c_slo", tokens)
    return Plan(c, x, w, inp.lag_s, g_c, m, signals)


def naive_threshold(capacity: float, fraction: float = 0.9) -> float:
    """The threshold most set by hand: a fixed share of capacity, no regard for the lag."""
    return capacity * fraction


def snippet(p: Plan, inp: PlanInputs, model_name: str, source: str) -> dict[str, Any]:
    """The thresholds to paste into the KEDA ScaledObject / HPA manifests (docs/benchmarks.md
    #from-a-sweep-to-autoscaling-thresholds), as a plain dict for YAML or JSON."""
    usable = [s for s in ("tokens", "running", "waiting") if p.signals[s].threshold is not None]
    need = [s.min_replicas_needed for s in p.signals.values() if s.min_replicas_needed]
    out: dict[str, Any] = {
        "source": source,
        "slo_ms": inp.slos_ms,
        "c_slo": p.c_slo,
        "max_num_seqs": p.max_num_seqs,
        "lag_s": p.lag_s,
        "recommended_signal": usable[0] if usable else None,
        # no threshold early enough: the fewest replicas that share the growth so one is
        "minReplicas": inp.min_replicas if usable or not need else min(need),
        "thresholds": {},
        "behavior": {"scaleUp": SCALE_UP_BEHAVIOR, "scaleDown": SCALE_DOWN_BEHAVIOR},
    }
    for name, s in p.signals.items():
        out["thresholds"][name] = {
            "query": QUERIES[name] % model_name,
            "threshold": None if s.threshold is None else f"{s.threshold:g}",
            "capacity": _num(s.capacity), "early_trigger": _num(s.early_trigger),
            "target": _num(s.target), "binding": s.binding,
            **({"min_replicas_needed": s.min_replicas_needed} if s.min_replicas_needed else {}),
            **({"note": s.note} if s.note else {}),
        }
    return out


def _num(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else round(x, 3)


def format_plan(p: Plan, inp: PlanInputs, curve: Curve) -> str:
    """The plan as terminal text: the inputs that matter, then one row per signal."""
    slo = ", ".join(f"p{curve.percentile:g} {k} <= {v:g} ms" for k, v in inp.slos_ms.items())
    lines = [
        (f"SLO {slo}: met up to concurrency {p.c_slo:g} ({p.throughput_rps:.2f} req/s, "
         f"{p.time_in_system_s:.2f} s in the system per request)"),
        (f"lag = time to ready {inp.time_to_ready_s:g} s + metric delay "
         f"{inp.metric_delay_s:g} s + sync {inp.sync_period_s:g} s = {p.lag_s:g} s; "
         f"in-flight growth {p.concurrency_growth_per_s:.3g} requests/s per replica "
         f"(at {inp.min_replicas} replica(s))"),
        (f"{'signal':8}{'capacity':>10}{'growth/s':>10}{'trigger':>10}{'target':>9}"
         f"{'threshold':>11}  binding")]
    for s in p.signals.values():
        th = "-" if s.threshold is None else f"{s.threshold:g}"
        lines.append(f"{s.signal:8}{s.capacity:>10.3g}{s.growth_per_s:>10.3g}"
                     f"{s.early_trigger:>10.3g}{s.target:>9.3g}{th:>11}  {s.binding}"
                     + (f"; {s.note}" if s.note else ""))
    return "\n".join(lines)
