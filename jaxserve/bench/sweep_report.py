"""What ``jaxserve sweep`` makes of its measurements: the SLO verdicts, each configuration's
goodput, the two
recommended ``--config`` files (``interactive``: most goodput; ``offline``: most throughput), the
table and the plots (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

import argparse
import itertools
import math
import os
from typing import Any

import yaml

from jaxserve.bench.metrics import parse_goodput
from jaxserve.extras import require

LIMIT_GAUGES = {"max_num_seqs": "jaxserve:max_num_seqs",
                "max_num_batched_tokens": "jaxserve:max_num_batched_tokens"}
# the SLOs the scheduler plans for, by --goodput name: the served objectives (s) and the engine
# settings (ms) that set them; the itl objective is a request's largest gap (max_itl)
OBJECTIVE_GAUGES = {"ttft": "jaxserve:ttft_slo_seconds", "itl": "jaxserve:itl_slo_seconds"}
OBJECTIVE_SETTINGS = {"ttft": "ttft_slo_ms", "itl": "itl_slo_ms"}
SLO_METRIC = {"itl": "max_itl"}


def slo_key(metric: str, pkey: str) -> str:
    """The step's key a ``--goodput`` SLO is judged on at percentile ``pkey``: ``itl`` is the
    request's largest gap (``p99_max_itl_ms``), as the server's objective and goodput count it;
    the others their own (``p99_ttft_ms``)."""
    return f"p{pkey}_{SLO_METRIC.get(metric, metric)}_ms"


def gains(throughputs: list[float]) -> list[float | None]:
    """Relative gain of each step over the previous one (``None`` for the first; ``inf`` after a
    zero)."""
    out: list[float | None] = [None]
    for a, b in itertools.pairwise(throughputs):
        out.append(b / a - 1 if a > 0 else math.inf)
    return out


def meets_slo(step: dict[str, Any], percentile: float, slos: dict[str, float]) -> bool:
    """Whether a step's ``p<percentile>`` of each SLO metric (ms) is within its target (itl:
    the requests' largest gaps, ``sweep_report.slo_key``)."""
    key = str(int(percentile)) if int(percentile) == percentile else str(percentile)
    return all(step[slo_key(m, key)] <= slo for m, slo in slos.items())


def slo_concurrency(steps: list[dict[str, Any]], percentile: float, slos: dict[str, float]
                    ) -> int | None:
    """The highest concurrency before the first step that breaks an SLO (steps in rising
    concurrency; a later step that happens to pass again after a breach does not count); None
    if the first step already breaks one."""
    best = None
    for s in steps:
        if not meets_slo(s, percentile, slos):
            break
        best = s["concurrency"]
    return best


def best_goodput(steps: list[dict[str, Any]], slo_concurrency: int | None
                 ) -> dict[str, Any] | None:
    """The step with the most ``request_goodput`` (requests/s meeting every SLO, per request)
    among those meeting the SLOs at the sweep's percentile (concurrency <= ``slo_concurrency``),
    the higher output throughput on a tie; None if none met them."""
    ok = [s for s in steps if slo_concurrency is not None and s["concurrency"] <= slo_concurrency]
    return max(ok, key=lambda s: (s["request_goodput"] or 0.0, s["output_throughput"]),
               default=None)


def recommend(configs: list[dict[str, Any]], headroom: float,
              slos: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """The interactive and offline recommendations (module doc) from the per-configuration
    results (each with ``config``, ``steps``, ``slo_concurrency``). Each entry: ``settings``
    (engine keys for the YAML), ``from_config`` (the grid point), ``why`` (a sentence); an entry
    is absent where nothing qualifies (no configuration met the SLOs). The interactive one also
    sets the scheduler's objectives to ``slos``' ttft and itl (ms), where its grid point does
    not set them, so that the server plans for what it was chosen by."""
    out: dict[str, dict[str, Any]] = {}

    def settings(cfg: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
        base = {k: steps[0].get(k) for k in LIMIT_GAUGES if steps and steps[0].get(k)}
        return {**{k: int(v) for k, v in base.items()}, **cfg["config"]}

    goodput = [(c, g) for c in configs if (g := best_goodput(c["steps"], c["slo_concurrency"]))]
    if goodput:
        best, step = max(goodput, key=lambda cg: (cg[1]["request_goodput"] or 0.0,
                                                  cg[1]["output_throughput"]))
        s = settings(best, best["steps"])
        for name, key in OBJECTIVE_SETTINGS.items():
            if name in (slos or {}):
                s.setdefault(key, float(slos[name]))
        c = step["concurrency"]
        target = max(1, math.floor(c * (1 - headroom)))
        s["max_num_seqs"] = min(int(s.get("max_num_seqs", target)), target)
        held = 1 - s["max_num_seqs"] / c
        spare = (f"max_num_seqs {s['max_num_seqs']} holds back {held:.0%} of that for spikes "
                 "(bursts queue instead of slowing every stream)" if held > 0 else
                 f"max_num_seqs {s['max_num_seqs']}: at concurrency {c} no headroom can be "
                 f"held back (the asked {headroom:.0%} rounds to zero sequences), so a spike "
                 "breaches the SLOs")
        out["interactive"] = {"settings": s, "from_config": best["config"], "why": (
            f"most goodput, {step['request_goodput'] or 0.0:.2f} req/s meeting the SLOs at "
            f"concurrency {c} ({step['output_throughput']:.1f} output tok/s; SLOs met up to "
            f"concurrency {best['slo_concurrency']}); " + spare)}
    if configs and any(c["steps"] for c in configs):
        def peak(c: dict[str, Any]) -> dict[str, Any]:
            return max(c["steps"], key=lambda s: s["output_throughput"])

        best = max((c for c in configs if c["steps"]), key=lambda c: peak(c)["output_throughput"])
        s = settings(best, best["steps"])
        top = peak(best)
        s["max_num_seqs"] = max(int(s.get("max_num_seqs", 0)), top["concurrency"])
        out["offline"] = {"settings": s, "from_config": best["config"], "why": (
            f"highest output throughput, {top['output_throughput']:.1f} tok/s at concurrency "
            f"{top['concurrency']}; keep a deep queue: serve with --max-waiting-requests 100000")}
    return out


def write_yaml(path: str, rec: dict[str, Any], serve_args: str | None) -> None:
    """One recommendation as a ``jaxserve serve --config`` file (engine keys only; comments say
    why and how to serve it). ``serve_args``: the swept servers' arguments; None (a server at
    ``--base-url``, whose arguments the sweep does not know) says to give its own."""
    args = "MODEL_AND_FLAGS" if serve_args is None else serve_args.strip()
    cmd = " ".join(x for x in ("jaxserve serve", args, f"--config {os.path.basename(path)}") if x)
    head = [f"# {rec['why']}", f"# serve: {cmd}"]
    if serve_args is None:
        head.append("# MODEL_AND_FLAGS: the model and flags the swept server was started with")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(head) + "\n" + yaml.safe_dump(rec["settings"], sort_keys=True))


def format_table(configs: list[dict[str, Any]], percentile: float, slos: dict[str, float]
                 ) -> str:
    """One row per step: load, throughput and its gain, mean and p99 TTFT and ITL, the largest
    gap, each SLO metric at ``percentile`` (unless a p99 column shows it), goodput, occupancy,
    the SLO verdict."""
    pkey = str(int(percentile)) if int(percentile) == percentile else str(percentile)
    shown = {"p99_ttft_ms", "p99_itl_ms"}
    slo_cols = [k for m in slos if (k := slo_key(m, pkey)) not in shown]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    lines = []
    for c in configs:
        good = ("none" if c.get("goodput") is None else
                f"{c['goodput']:.2f} req/s at concurrency {c['goodput_concurrency']}")
        knee = ("no knee (throughput still rising at the last step)" if c["knee"] is None
                else f"knee at concurrency {c['knee']}")
        meets = ("meets the SLOs at no concurrency" if c["slo_concurrency"] is None
                 else f"meets the SLOs up to concurrency {c['slo_concurrency']}")
        lines.append(f"== {config_label(c['config'])}: {knee}, {meets} (p{pkey}), "
                     f"goodput {good}")
        head = "".join(f"{k[:-3].replace('_', ' '):>15}" for k in slo_cols)
        lines.append(f"{'conc':>5}{'req/s':>8}{'out tok/s':>10}{'gain':>7}{'TTFT mean':>10}"
                     f"{'p99':>8}{'ITL mean':>9}{'p99':>8}{'max gap':>8}{head}{'goodput':>8}"
                     f"{'seqs':>6}{'tokens':>7}{'KV':>6}  SLO")
        for s, g in zip(c["steps"], gains([s["output_throughput"] for s in c["steps"]])):
            gs = "-" if g is None else f"{g:+.0%}"
            extra = "".join(f"{s[k]:>15.1f}" for k in slo_cols)
            lines.append(
                f"{s['concurrency']:>5}{s['request_throughput']:>8.2f}"
                f"{s['output_throughput']:>10.1f}{gs:>7}{s['mean_ttft_ms']:>10.0f}"
                f"{s['p99_ttft_ms']:>8.0f}{s['mean_itl_ms']:>9.1f}{s['p99_itl_ms']:>8.1f}"
                f"{s['largest_itl_ms']:>8.0f}{extra}{s['request_goodput'] or 0:>8.2f}"
                f"{pct(s['seqs_usage']):>6}{pct(s['tokens_usage']):>7}{pct(s['kv_usage']):>6}"
                f"  {'ok' if s['meets_slo'] else 'BREACH'}")
    return "\n".join(lines)


def config_label(cfg: dict[str, Any]) -> str:
    """``max_num_seqs=32 ...`` for a grid point, ``server`` for the --base-url one."""
    return " ".join(f"{k}={v}" for k, v in cfg.items()) or "server"


def plot(configs: list[dict[str, Any]], ns: argparse.Namespace, out_dir: str) -> list[str]:
    """Write throughput.png, latency.png (TTFT and the largest gap per request, p50 and the
    SLO percentile, with the SLO lines) and occupancy.png; returns their paths."""
    # seconds that every jaxserve command would pay; only the plots need it
    matplotlib = require("matplotlib", "bench", "jaxserve sweep's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display backend

    pkey = str(int(ns.percentile)) if int(ns.percentile) == ns.percentile else str(ns.percentile)
    slos = parse_goodput(ns.goodput)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in configs:
        xs = [s["concurrency"] for s in c["steps"]]
        line, = ax.plot(xs, [s["output_throughput"] for s in c["steps"]], "o-",
                        label=config_label(c["config"]))
        if c["knee"] is not None:
            y = next(s["output_throughput"] for s in c["steps"] if s["concurrency"] == c["knee"])
            ax.plot([c["knee"]], [y], "s", ms=12, mfc="none", color=line.get_color())
    ax.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s",
           title="Throughput (square: knee)")
    ax.legend(fontsize=7)
    paths.append(os.path.join(out_dir, "throughput.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    judged = {SLO_METRIC.get(k, k): v for k, v in slos.items()}  # itl: the largest gaps
    for ax, m, name in ((axes[0], "ttft", "TTFT"),
                        (axes[1], "max_itl", "largest gap per request")):
        for c in configs:
            xs = [s["concurrency"] for s in c["steps"]]
            line, = ax.plot(xs, [s[f"median_{m}_ms"] for s in c["steps"]], "o--",
                            label=f"p50 {config_label(c['config'])}")
            ax.plot(xs, [s[f"p{pkey}_{m}_ms"] for s in c["steps"]], "o-",
                    color=line.get_color(), label=f"p{pkey} {config_label(c['config'])}")
        if m in judged:
            ax.axhline(judged[m], color="red", ls=":", label=f"SLO {judged[m]:g} ms")
        ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title=name)
        ax.legend(fontsize=6)
    paths.append(os.path.join(out_dir, "latency.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in configs:
        xs = [s["concurrency"] for s in c["steps"]]
        for key, style in (("seqs_usage", "o-"), ("tokens_usage", "s--"), ("kv_usage", "^:")):
            ys = [s[key] for s in c["steps"]]
            if any(y is not None for y in ys):
                ax.plot(xs, [math.nan if y is None else y for y in ys], style,
                        label=f"{key} {config_label(c['config'])}")
    ax.set(xscale="log", xlabel="concurrency", ylabel="fraction (mean over the step)",
           ylim=(0, 1.05), title="Batch occupancy")
    ax.legend(fontsize=6)
    paths.append(os.path.join(out_dir, "occupancy.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
