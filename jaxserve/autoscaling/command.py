"""``jaxserve plan-autoscaling``: KEDA / HPA thresholds from a sweep.

    jaxserve plan-autoscaling sweep/ --slo ttft:2000 itl:500 --startup-json startup.json \\
        --growth-rps 0.01 --model-name SmolLM2-135M-Instruct --output plan.yaml \\
        --simulate --sim-plot plan.png

Reads the curve (``curve.py``), computes the plan (``plan.py``), prints it, and writes the
snippet (YAML, or JSON for a ``.json`` ``--output``) whose ``thresholds.<signal>.threshold``
goes into the ScaledObject's trigger ``threshold`` or the HPA's ``target.averageValue``, and
whose ``behavior`` is the HPA's (KEDA: ``advanced.horizontalPodAutoscalerConfig.behavior``).
With ``--simulate`` it also replays a ramp through simulated replicas under the HPA with the
planned threshold and with a naive one (``report.py``) and prints the table (and a plot with
``--sim-plot``). Exit status 1 when no signal has a threshold early enough.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from typing import Any

import yaml

from jaxserve.autoscaling.curve import load_curve
from jaxserve.autoscaling.plan import PlanInputs, format_plan, parse_slos, plan, snippet
from jaxserve.autoscaling.report import PLOT_FEATURE, compare, format_rows, ramp_scenario
from jaxserve.autoscaling.report import plot as plot_report
from jaxserve.autoscaling.simulate import SIGNALS
from jaxserve.extras import require


def _number(kind: type, low: float, low_ok: bool) -> Any:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {kind.__name__}, got {text!r}") from None
        if not (v >= low if low_ok else v > low) or math.isinf(v):
            raise argparse.ArgumentTypeError(f"must be {'>=' if low_ok else '>'} {low:g} and "
                                             f"finite, got {text!r}")
        return v
    return parse


POSITIVE, NON_NEGATIVE = _number(float, 0, False), _number(float, 0, True)
COUNT = _number(int, 1, True)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``jaxserve plan-autoscaling``'s flags."""
    a = p.add_argument
    a("sweep", help="a sweep.json (or the --output-dir of 'jaxserve sweep'), or a directory "
                    "of closed-loop 'jaxserve bench serve' results, one per --max-concurrency")
    a("--slo", nargs="+", required=True, metavar="METRIC:MS",
      help="tail-latency SLOs (ms) at --percentile: ttft, itl (each request's largest gap, as "
           "`jaxserve sweep` judges it), tpot, e.g. ttft:500 itl:50")
    t = p.add_mutually_exclusive_group(required=True)
    t.add_argument("--time-to-ready-s", type=NON_NEGATIVE,
                   help="seconds from the scale-up decision to the new replica ready "
                        "(bench startup's ready_s plus pod scheduling and image pull)")
    t.add_argument("--startup-json", help="a 'jaxserve bench startup --output-json' file: "
                                          "its median ready_s (see --startup-kind)")
    a("--startup-kind", choices=("cold", "warm"), default="warm",
      help="which start of --startup-json a new replica pays (warm: the compilation cache is "
           "on the replica's volume)")
    a("--extra-start-s", type=NON_NEGATIVE, default=0.0,
      help="seconds added to --startup-json's figure: pod scheduling, image pull")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--growth-rps", type=POSITIVE,
                   help="traffic growth of the whole deployment, requests/s per second")
    g.add_argument("--growth-concurrency", type=POSITIVE,
                   help="traffic growth as requests in flight per second")
    a("--metric-delay-s", type=NON_NEGATIVE, default=15.0,
      help="age of the metric the autoscaler reads: the Prometheus scrape interval (plus any "
           "rate() window or adapter cache)")
    a("--sync-period-s", type=NON_NEGATIVE, default=15.0,
      help="the HPA's sync period (kube-controller-manager "
           "--horizontal-pod-autoscaler-sync-period)")
    a("--headroom", type=float, default=0.25,
      help="share of the SLO-limited capacity held back in steady state: target = capacity * "
           "(1 - headroom)")
    a("--tolerance", type=NON_NEGATIVE, default=0.1, help="the HPA's tolerance")
    a("--min-replicas", type=COUNT, default=1, help="the deployment's minReplicas")
    a("--max-num-seqs", type=COUNT, default=None,
      help="the replicas' --max-num-seqs (default: the SLO-limited concurrency, so requests "
           "queue, and the waiting signal rises, from that load on)")
    a("--tokens-per-request", type=POSITIVE, default=None,
      help="tokens in flight one request holds on average (default: from the sweep's lengths)")
    a("--percentile", type=float, default=None,
      help="the tail the SLOs apply to (default: the sweep's --percentile, else 99)")
    a("--config-index", type=int, default=None,
      help="the sweep configuration to plan for (default: the one meeting the SLO at the "
           "highest concurrency)")
    a("--model-name", default="default",
      help="the served model name, for the model_name label of the queries")
    a("--output", default=None,
      help="write the thresholds here (.json for JSON, else YAML); default: print the YAML")
    a("--simulate", action="store_true",
      help="also simulate a ramp under the HPA: the planned against a naive (90%%) threshold")
    a("--sim-signal", choices=SIGNALS, default=None,
      help="the signal simulated (default: the recommended one)")
    a("--sim-peak-replicas", type=COUNT, default=4,
      help="the ramp grows until this many replicas are needed at the target load")
    a("--sim-max-replicas", type=COUNT, default=10, help="the HPA's maxReplicas in the simulation")
    a("--sim-plot", default=None, help="write the simulation's plot (PNG) here")
    a("--seed", type=int, default=0, help="seed of the simulated arrivals and latencies")


def _time_to_ready(ns: argparse.Namespace) -> float:
    if ns.time_to_ready_s is not None:
        return ns.time_to_ready_s
    try:
        with open(ns.startup_json, encoding="utf-8") as fh:
            result = json.load(fh)
        ready = float(result[ns.startup_kind]["median_ready_s"])
    except OSError as e:
        raise ValueError(f"--startup-json {ns.startup_json!r}: {e.strerror}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ValueError(f"--startup-json {ns.startup_json!r}: not a bench startup result "
                         f"(no {ns.startup_kind}.median_ready_s)") from None
    return ready + ns.extra_start_s


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``jaxserve plan-autoscaling``; returns the exit status (1 when no
    signal has a threshold early enough).

    Raises:
      ValueError: bad flags or inputs, naming them.
      MissingExtraError: --sim-plot without matplotlib (the ``autoscaling`` extra).
    """
    slos = parse_slos(ns.slo)
    if ns.percentile is not None and not 0 < ns.percentile < 100:
        raise ValueError(f"--percentile must be in (0, 100), got {ns.percentile}")
    if ns.sim_plot and not ns.simulate:
        raise ValueError("--sim-plot needs --simulate")
    if ns.sim_plot:  # before the simulation, not after it
        require("matplotlib", "autoscaling", PLOT_FEATURE)
    inp = PlanInputs(slos, _time_to_ready(ns), ns.growth_rps, ns.growth_concurrency,
                     ns.metric_delay_s, ns.sync_period_s, ns.headroom, ns.tolerance,
                     ns.min_replicas, ns.max_num_seqs, ns.tokens_per_request)
    curve, _ = load_curve(ns.sweep, ns.percentile, ns.config_index, slos)
    p = plan(curve, inp)
    print(format_plan(p, inp, curve))
    out = snippet(p, inp, ns.model_name, curve.source)
    out["inputs"] = {k: v for k, v in asdict(inp).items() if v is not None}
    if ns.simulate:
        signal = ns.sim_signal or out["recommended_signal"]
        if signal is None:
            raise ValueError("--simulate: no signal has a threshold to simulate")
        scenario = ramp_scenario(p, inp, max(2, ns.sim_peak_replicas))
        rows, results, arrivals = compare(curve, p, inp, signal, scenario,
                                          ns.sim_max_replicas, ns.seed)
        print(f"simulated ramp: {len(arrivals)} requests over {arrivals[-1]:.0f} s, ramp and "
              f"hold {scenario.ramp_start_s:.0f}-{scenario.ramp_end_s:.0f} s")
        print(format_rows(rows, signal))
        out["simulation"] = {"signal": signal, "knots": scenario.knots,
                             "rows": [asdict(r) for r in rows]}
        if ns.sim_plot:
            print(f"Saved {plot_report(ns.sim_plot, results, arrivals, curve, slos, scenario)}")
    text = (json.dumps(out, indent=2) if (ns.output or "").endswith(".json")
            else yaml.safe_dump(out, sort_keys=False))
    if ns.output:
        os.makedirs(os.path.dirname(os.path.abspath(ns.output)), exist_ok=True)
        with open(ns.output, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"Saved {ns.output}")
    else:
        sys.stdout.write(text)
    return 0 if out["recommended_signal"] else 1
