"""The planned threshold against a naive one (90 % of capacity) on a ramp, simulated.

The ramp (``ramp_scenario``): one replica's worth at half its SLO-limited throughput for
``warm_s``, then the rate grows at the planned growth until ``peak_replicas`` replicas are
needed at the target load, holds for ``hold_s``, falls back in a minute and stays low for
``cool_s`` (long enough for the 300 s scale-down window to act); Poisson bursts of c_slo / 2
requests every 30 s on average ride on top. Each policy replays the same arrivals
(``simulate.simulate``); the table gives the fraction of requests over the SLO among those
arriving during the ramp and the hold, over the whole trace, the p99 TTFT, and the
replica-minutes paid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from jaxserve.autoscaling.curve import Curve
from jaxserve.autoscaling.hpa import HPASpec
from jaxserve.autoscaling.plan import Plan, PlanInputs, naive_threshold
from jaxserve.autoscaling.simulate import SimConfig, SimResult, ramp_trace, simulate
from jaxserve.extras import require

PLOT_FEATURE = "jaxserve plan-autoscaling --sim-plot"


@dataclass(frozen=True)
class Scenario:
    """The ramp's knots ``[(t_s, requests_per_s)]``, the window (s) whose requests count as
    "during the ramp", and the bursts."""

    knots: list[tuple[float, float]]
    ramp_start_s: float
    ramp_end_s: float
    burst_every_s: float
    burst_size: int


def ramp_scenario(p: Plan, inp: PlanInputs, peak_replicas: int = 4, warm_s: float = 120.0,
                  hold_s: float = 120.0, cool_s: float = 420.0) -> Scenario:
    """The ramp of the module doc for this plan.

    Raises:
      ValueError: ``peak_replicas`` < 2.
    """
    if peak_replicas < 2:
        raise ValueError(f"peak_replicas must be >= 2, got {peak_replicas}")
    base = 0.5 * p.throughput_rps * inp.min_replicas
    peak = peak_replicas * p.throughput_rps * (1 - inp.headroom)
    growth = (inp.growth_rps_per_s if inp.growth_rps_per_s is not None
              else inp.growth_concurrency_per_s / p.time_in_system_s)  # type: ignore[operator]
    t1 = warm_s + max(peak - base, 0.0) / growth
    t2 = t1 + hold_s
    knots = [(0.0, base), (warm_s, base), (t1, peak), (t2, peak), (t2 + 60.0, base),
             (t2 + 60.0 + cool_s, base)]
    return Scenario(knots, warm_s, t2, 30.0, max(1, int(p.c_slo // 2)))


@dataclass(frozen=True)
class Row:
    """One policy's outcome."""

    policy: str
    threshold: float
    over_slo_ramp: float
    over_slo_all: float
    p99_ttft_ms: float
    replica_minutes: float
    max_replicas: int


def compare(curve: Curve, p: Plan, inp: PlanInputs, signal: str, scenario: Scenario,
            max_replicas: int = 10, seed: int = 0) -> tuple[list[Row], dict[str, SimResult],
                                                            np.ndarray]:
    """Simulate the planned and the naive threshold of ``signal`` on the scenario's arrivals.

    Returns:
      (the rows, each policy's ``SimResult``, the arrival times).
    Raises:
      ValueError: the signal has no planned threshold.
    """
    sp = p.signals[signal]
    if sp.threshold is None:
        raise ValueError(f"signal {signal!r} has no planned threshold ({sp.note})")
    arrivals = ramp_trace(scenario.knots, np.random.default_rng(seed), 1.0,
                          scenario.burst_every_s, scenario.burst_size, 1.0)
    scrape = inp.metric_delay_s if inp.metric_delay_s > 0 else 1.0
    slos = {k: v for k, v in inp.slos_ms.items() if k in ("ttft", "itl")}
    cfg = SimConfig(curve, slos, signal, p.max_num_seqs, inp.time_to_ready_s, scrape,
                    scrape / 2, inp.min_replicas, seed)
    rows, results = [], {}
    for name, th in (("planned", sp.threshold), ("naive 90%", naive_threshold(sp.capacity))):
        spec = HPASpec(th, inp.min_replicas, max_replicas, inp.tolerance,
                       inp.sync_period_s if inp.sync_period_s > 0 else 1.0)
        r = simulate(arrivals, cfg, spec)
        results[name] = r
        ok = np.isfinite(r.ttft_ms)
        rows.append(Row(name, float(th),
                        r.fraction_over_slo(scenario.ramp_start_s, scenario.ramp_end_s),
                        r.fraction_over_slo(), float(np.percentile(r.ttft_ms[ok], 99)),
                        float(r.replica_minutes),
                        int(r.replicas.max()) if len(r.replicas) else inp.min_replicas))
    return rows, results, arrivals


def format_rows(rows: list[Row], signal: str) -> str:
    """The comparison table."""
    lines = [(f"{'policy (' + signal + ')':22}{'threshold':>10}{'over SLO, ramp':>16}"
              f"{'over SLO, all':>15}{'p99 TTFT ms':>13}{'replica-min':>13}{'max pods':>9}")]
    for r in rows:
        lines.append(f"{r.policy:22}{r.threshold:>10.3g}{r.over_slo_ramp:>16.1%}"
                     f"{r.over_slo_all:>15.1%}{r.p99_ttft_ms:>13.0f}{r.replica_minutes:>13.1f}"
                     f"{r.max_replicas:>9d}")
    return "\n".join(lines)


def plot(path: str, results: dict[str, SimResult], arrivals: np.ndarray, curve: Curve,
         slos_ms: dict[str, float], scenario: Scenario) -> str:
    """Replicas and arrival rate over time (top), TTFT per request (bottom), one colour per
    policy, written as a PNG at ``path``; returns ``path``.

    Raises:
      MissingExtraError: matplotlib (the ``autoscaling`` extra) is not installed.
    """
    matplotlib = require("matplotlib", "autoscaling", PLOT_FEATURE)  # only the plot needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg")

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    edges = np.arange(0.0, arrivals[-1] + 10.0, 10.0)
    counts, _ = np.histogram(arrivals, edges)
    rate = top.twinx()
    rate.step(edges[:-1], counts / 10.0, where="post", color="0.6", lw=1)
    rate.set_ylabel("arrivals, req/s (grey)")
    for (name, r), color in zip(results.items(), ("tab:blue", "tab:red")):
        top.step(r.sync_s, r.replicas, where="post", color=color, label=f"{name}: asked")
        top.step(r.sync_s, r.ready, where="post", color=color, ls=":", label=f"{name}: ready")
        bottom.plot(r.arrival_s, r.ttft_ms, ".", ms=2, color=color, alpha=0.5, label=name)
    top.set(ylabel="replicas")
    top.legend(fontsize=7, loc="upper left")
    if "ttft" in slos_ms:
        bottom.axhline(slos_ms["ttft"], color="k", ls="--", lw=1, label="TTFT SLO")
    for ax in (top, bottom):
        ax.axvspan(scenario.ramp_start_s, scenario.ramp_end_s, color="0.93", zorder=0)
    bottom.set(yscale="log", xlabel="time (s); shaded: ramp and hold",
               ylabel=f"TTFT ms (p{curve.percentile:g}-fitted draws)")
    bottom.legend(fontsize=7, loc="upper left", markerscale=4)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

