"""The planned threshold against a naive one (90 % of capacity) on simulated ramps: several
seeds, signals and growth rates, from one sweep.

    PYTHONPATH=. .venv/bin/python experiments/2026-12-01-autoscaling/compare.py SWEEP_DIR \
        --slo ttft:2000 itl:500 --time-to-ready-s 39 --growth-rps 0.01 0.02 \
        --signals running tokens --seeds 5 --plot results/autoscaling/ramp.png

For each growth rate and signal: the plan (``plan.plan``), the ramp of ``report.ramp_scenario``
(4 replicas' worth at the peak), and ``report.compare`` per seed; the table gives the mean over
the seeds and, in brackets, the lowest and highest. The plot is the first seed of the first
growth rate and signal.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from jaxserve.autoscaling.curve import load_curve
from jaxserve.autoscaling.plan import PlanInputs, parse_slos, plan
from jaxserve.autoscaling.report import compare, plot, ramp_scenario


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep")
    ap.add_argument("--slo", nargs="+", required=True)
    ap.add_argument("--time-to-ready-s", type=float, required=True)
    ap.add_argument("--growth-rps", type=float, nargs="+", required=True)
    ap.add_argument("--signals", nargs="+", default=["running", "tokens"])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    slos = parse_slos(ns.slo)
    curve, _ = load_curve(ns.sweep, None, None, slos)
    out = []
    print(f"{'growth':>7} {'signal':8} {'policy':10} {'threshold':>9} {'over SLO, ramp':>22} "
          f"{'replica-min':>20}")
    for g in ns.growth_rps:
        inp = PlanInputs(slos, ns.time_to_ready_s, growth_rps_per_s=g)
        p = plan(curve, inp)
        for signal in ns.signals:
            if p.signals[signal].threshold is None:
                print(f"{g:>7g} {signal:8} no threshold: {p.signals[signal].note}")
                continue
            scenario = ramp_scenario(p, inp)
            by_policy: dict[str, list] = {}
            for seed in range(ns.seeds):
                rows, results, arrivals = compare(curve, p, inp, signal, scenario, seed=seed)
                for r in rows:
                    by_policy.setdefault(r.policy, []).append(r)
                if ns.plot and seed == 0 and not out:
                    plot(ns.plot, results, arrivals, curve, slos, scenario)
            for policy, rs in by_policy.items():
                over = np.array([r.over_slo_ramp for r in rs])
                mins = np.array([r.replica_minutes for r in rs])
                print(f"{g:>7g} {signal:8} {policy:10} {rs[0].threshold:>9.3g} "
                      f"{over.mean():>7.1%} [{over.min():.1%}-{over.max():.1%}] "
                      f"{mins.mean():>8.1f} [{mins.min():.0f}-{mins.max():.0f}]")
                out.append({"growth_rps_per_s": g, "signal": signal, "policy": policy,
                            "threshold": rs[0].threshold, "over_slo_ramp": over.tolist(),
                            "replica_minutes": mins.tolist(),
                            "p99_ttft_ms": [r.p99_ttft_ms for r in rs]})
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
