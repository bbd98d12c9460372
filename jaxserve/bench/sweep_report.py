"""What ``jaxserve sweep`` makes of its measurements: the two recommended ``--config`` files
(``interactive``, ``offline``) and the plots (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import yaml

from jaxserve.bench.metrics import parse_goodput
from jaxserve.extras import require

LIMIT_GAUGES = {"max_num_seqs": "jaxserve:max_num_seqs",
                "max_num_batched_tokens": "jaxserve:max_num_batched_tokens"}


def recommend(configs: list[dict[str, Any]], headroom: float) -> dict[str, dict[str, Any]]:
    """The interactive and offline recommendations (module doc) from the per-configuration
    results (each with ``config``, ``steps``, ``slo_concurrency``). Each entry: ``settings``
    (engine keys for the YAML), ``from_config`` (the grid point), ``why`` (a sentence); an entry
    is absent where nothing qualifies (no configuration met the SLOs)."""
    out: dict[str, dict[str, Any]] = {}

    def settings(cfg: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
        base = {k: steps[0].get(k) for k in LIMIT_GAUGES if steps and steps[0].get(k)}
        return {**{k: int(v) for k, v in base.items()}, **cfg["config"]}

    ok = [c for c in configs if c["slo_concurrency"]]
    if ok:
        def at_slo(c: dict[str, Any]) -> float:
            return next(s["output_throughput"] for s in c["steps"]
                        if s["concurrency"] == c["slo_concurrency"])

        best = max(ok, key=lambda c: (c["slo_concurrency"], at_slo(c)))
        s = settings(best, best["steps"])
        c_slo = best["slo_concurrency"]
        target = max(1, math.floor(c_slo * (1 - headroom)))
        s["max_num_seqs"] = min(int(s.get("max_num_seqs", target)), target)
        held = 1 - s["max_num_seqs"] / c_slo
        spare = (f"max_num_seqs {s['max_num_seqs']} holds back {held:.0%} of that for spikes "
                 "(bursts queue instead of slowing every stream)" if held > 0 else
                 f"max_num_seqs {s['max_num_seqs']}: at concurrency {c_slo} no headroom can be "
                 f"held back (the asked {headroom:.0%} rounds to zero sequences), so a spike "
                 "breaches the SLOs")
        out["interactive"] = {"settings": s, "from_config": best["config"], "why": (
            f"meets the SLOs up to concurrency {c_slo} ({at_slo(best):.1f} output tok/s there); "
            + spare)}
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


def write_yaml(path: str, rec: dict[str, Any], serve_args: str) -> None:
    """One recommendation as a ``jaxserve serve --config`` file (engine keys only; comments say
    why and how to serve it)."""
    head = [f"# {rec['why']}",
            f"# serve: jaxserve serve {serve_args} --config {os.path.basename(path)}".replace(
                "  ", " ")]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(head) + "\n" + yaml.safe_dump(rec["settings"], sort_keys=True))


def config_label(cfg: dict[str, Any]) -> str:
    """``max_num_seqs=32 ...`` for a grid point, ``server`` for the --base-url one."""
    return " ".join(f"{k}={v}" for k, v in cfg.items()) or "server"


def plot(configs: list[dict[str, Any]], ns: argparse.Namespace, out_dir: str) -> list[str]:
    """Write throughput.png, latency.png and occupancy.png; returns their paths."""
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
    for ax, m, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for c in configs:
            xs = [s["concurrency"] for s in c["steps"]]
            line, = ax.plot(xs, [s[f"median_{m}_ms"] for s in c["steps"]], "o--",
                            label=f"p50 {config_label(c['config'])}")
            ax.plot(xs, [s[f"p{pkey}_{m}_ms"] for s in c["steps"]], "o-",
                    color=line.get_color(), label=f"p{pkey} {config_label(c['config'])}")
        if m in slos:
            ax.axhline(slos[m], color="red", ls=":", label=f"SLO {slos[m]:g} ms")
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
