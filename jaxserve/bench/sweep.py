"""``jaxserve sweep``: find the concurrency, and optionally the engine configuration, that a
workload should be served at.

    jaxserve sweep --serve-args "--max-model-len 2048" --grid max_num_seqs=32,64 \\
        itl_slo_ms=0,50 --dataset-name chat-like --goodput ttft:500 itl:100 --output-dir sw/

The method: for each engine configuration (each point of ``--grid``, the cross product of any
engine settings, e.g. ``max_num_seqs``, ``max_num_batched_tokens``, ``itl_slo_ms``, each on a
freshly started ``jaxserve serve`` subprocess; or the one server at ``--base-url``):
  1. send ``--num-warmups`` unmeasured requests;
  2. run ``jaxserve bench serve`` closed loop at concurrency 1 (the single-request baseline),
     then at ``--concurrency-factor`` times the last, each step with
     ``max(--num-prompts, --prompts-per-concurrency * concurrency)`` requests, until output
     throughput improves by less than ``--gain-threshold`` for ``--patience`` steps in a row or
     the next concurrency passes ``--max-concurrency-limit``;
  3. while each step runs, poll the server's ``/metrics`` (every ``--metrics-interval-s``) and
     average its batch occupancy: sequences over ``max_num_seqs``, scheduled tokens over
     ``max_num_batched_tokens``, KV-cache usage (None against servers without those gauges).
Then, per configuration: the highest concurrency meeting the SLOs (``--goodput`` at
``--percentile``, itl judged on each request's largest gap; default: the objectives the first
server plans for, ``jaxserve:ttft_slo_seconds`` and ``jaxserve:itl_slo_seconds``, on a CPU p99
TTFT <= 2000 ms and largest gap <= 300 ms) before the first breach
(``slo_concurrency``), its goodput (the most requests/s meeting every SLO, per request, among
those steps; ``best_goodput``) and the knee (``knee_concurrency``); over all configurations, two
recommendations written as ``jaxserve serve --config`` files: ``interactive.yaml`` (the
configuration with the most goodput, ``max_num_seqs`` held ``--headroom`` below the concurrency
that reached it, for spikes, and ``ttft_slo_ms`` / ``itl_slo_ms`` set to the SLOs so that the
scheduler plans for them) and ``offline.yaml`` (the configuration with the highest
throughput, ``max_num_seqs`` at least the concurrency that reached it). Output: the table
(throughput, mean and p99 TTFT and ITL, the largest gap, goodput, occupancy) on the terminal,
``sweep.json``, and ``throughput.png``, ``latency.png``, ``occupancy.png`` (matplotlib, Agg
backend) in ``--output-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from jaxserve.bench.client import server_root
from jaxserve.bench.metrics import METRICS, parse_goodput
from jaxserve.bench.serve import ENDPOINTS, add_dataset_args, run_benchmark
from jaxserve.bench.serve import add_cli_args as add_serve_args
from jaxserve.bench.server_process import ServerProcess
from jaxserve.bench.sweep_grid import grid_flags, parse_grid
from jaxserve.bench.sweep_report import (
    LIMIT_GAUGES,
    OBJECTIVE_GAUGES,
    OBJECTIVE_SETTINGS,
    best_goodput,
    format_table,
    gains,
    meets_slo,
    plot,
    recommend,
    slo_concurrency,
    write_yaml,
)
from jaxserve.extras import require

OCCUPANCY_GAUGES = {
    "seqs_usage": "jaxserve:batch_seqs_usage_perc",
    "tokens_usage": "jaxserve:batch_tokens_usage_perc",
    "kv_usage": "jaxserve:kv_cache_usage_perc",
}


# -- the decisions, as pure functions --------------------------------------------------------------


def should_stop(throughputs: list[float], threshold: float, patience: int) -> bool:
    """True once the last ``patience`` steps each gained less than ``threshold``."""
    g = gains(throughputs)[1:]
    return len(g) >= patience and all(x is not None and x < threshold for x in g[-patience:])


def knee_concurrency(concurrencies: list[int], throughputs: list[float], threshold: float
                     ) -> int | None:
    """Where throughput plateaus: the concurrency of the last step that still gained at least
    ``threshold`` over its predecessor (the first step if none did), provided a later step gained
    less (a plateau was seen); None if every step kept gaining (no knee reached).
    """
    g = gains(throughputs)
    last_good = 0
    for i in range(1, len(g)):
        if g[i] is not None and g[i] >= threshold:  # type: ignore[operator]
            last_good = i
    return concurrencies[last_good] if last_good < len(g) - 1 else None


def served_objectives(metrics_text: str, base_url: str) -> list[str]:
    """The ``--goodput`` pairs of the objectives a server plans for, from its ``/metrics`` text
    (``jaxserve:ttft_slo_seconds``, ``jaxserve:itl_slo_seconds``; zero ones left out), e.g.
    ``["ttft:2000", "itl:300"]``.

    Raises:
      ValueError: the server publishes no objective (not jaxserve, or both are 0).
    """
    values = _scrape(metrics_text)
    out = [f"{name}:{values[g] * 1000:g}" for name, g in OBJECTIVE_GAUGES.items()
           if values.get(g, 0) > 0]
    if not out:
        raise ValueError(f"the server at {base_url} publishes no service objectives "
                         f"({', '.join(OBJECTIVE_GAUGES.values())}); give --goodput, e.g. "
                         "--goodput ttft:2000 itl:300")
    return out


# -- running ---------------------------------------------------------------------------------------


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``jaxserve sweep``'s flags."""
    a = p.add_argument
    a("--base-url", default=None,
      help="sweep this running server, by its root URL (no --grid; a trailing /v1 is dropped); "
           "default: start `jaxserve serve` per configuration")
    a("--serve-args", default="",
      help="arguments for each started `jaxserve serve` (model, --max-model-len, ...)")
    a("--grid", nargs="+", default=None, metavar="KEY=V1,V2",
      help="engine settings to cross (any engine flag), e.g. max_num_seqs=32,64 "
           "max_num_batched_tokens=512,2048 itl_slo_ms=0,50")
    a("--endpoint", default="/v1/completions", choices=ENDPOINTS, help="API path")
    add_dataset_args(p, num_prompts=16)
    a("--prompts-per-concurrency", type=int, default=4,
      help="a step sends max(--num-prompts, this * concurrency) requests")
    a("--num-warmups", type=int, default=2, help="unmeasured requests per configuration")
    a("--concurrency-start", type=int, default=1, help="first concurrency (the baseline)")
    a("--concurrency-factor", type=float, default=2.0, help="concurrency multiplier per step")
    a("--max-concurrency-limit", type=int, default=256, help="highest concurrency tried")
    a("--gain-threshold", type=float, default=0.05,
      help="stop when throughput gains less than this fraction ...")
    a("--patience", type=int, default=2, help="... for this many steps in a row")
    a("--percentile", type=float, default=99.0, help="percentile the SLOs apply to")
    a("--goodput", nargs="+", default=None, metavar="KEY:MS",
      help="SLOs (ms), e.g. ttft:2000 itl:300: a step meets them when their --percentile does "
           "(itl: the requests' largest gaps), and its goodput counts the requests meeting them; "
           "default: the objectives the first server plans for (its --ttft-slo-ms and "
           "--itl-slo-ms, from /metrics), which interactive.yaml then sets")
    a("--headroom", type=float, default=0.25,
      help="interactive config: fraction of the concurrency with the most goodput held back "
           "for spikes")
    a("--metrics-interval-s", type=float, default=0.2, help="how often /metrics is polled")
    a("--server-start-timeout-s", type=float, default=900.0,
      help="how long a started server may take to load and compile")
    a("--seed", type=int, default=0, help="seed of the workload")
    a("--output-dir", default="sweep-results", help="where JSON, plots and configs go")


def _check(ns: argparse.Namespace) -> None:
    if ns.base_url and ns.grid:
        raise ValueError("--grid needs freshly started servers; drop --base-url")
    if not 1 <= ns.concurrency_start <= ns.max_concurrency_limit or ns.concurrency_factor <= 1:
        raise ValueError("--concurrency-start must be in [1, --max-concurrency-limit] and "
                         "--concurrency-factor > 1")
    if ns.num_prompts < 1 or ns.prompts_per_concurrency < 0 or ns.num_warmups < 0:
        raise ValueError("--num-prompts must be >= 1, --prompts-per-concurrency and "
                         "--num-warmups >= 0")
    if ns.patience < 1 or not 0 <= ns.gain_threshold < 1:
        raise ValueError("--patience must be >= 1 and --gain-threshold in [0, 1)")
    if not 0 <= ns.headroom < 1:
        raise ValueError("--headroom must be in [0, 1)")
    if not 0 < ns.percentile < 100:
        raise ValueError("--percentile must be in (0, 100)")


def _bench_ns(ns: argparse.Namespace, base_url: str, concurrency: int, num_prompts: int,
              num_warmups: int) -> argparse.Namespace:
    """A ``bench serve`` namespace: its defaults, this sweep's workload flags, one step's load."""
    p = argparse.ArgumentParser()
    add_serve_args(p)
    b = p.parse_args([])
    for k, v in vars(ns).items():
        if hasattr(b, k) and k not in ("num_warmups", "goodput"):
            setattr(b, k, v)
    pct = ns.percentile
    b.metric_percentiles = ",".join(str(x) for x in sorted({50.0, 90.0, 99.0, pct}))
    b.base_url, b.max_concurrency, b.num_prompts = base_url, concurrency, num_prompts
    b.num_warmups, b.goodput, b.disable_tqdm, b.request_rate = num_warmups, ns.goodput, True, \
        math.inf
    return b


def _scrape(text: str) -> dict[str, float]:
    """Each sample with no label but ``model_name`` (one model is served), by name."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if set(s.labels) <= {"model_name"}:
                out[s.name] = s.value
    return out


async def _poll_metrics(base_url: str, interval_s: float, stop: asyncio.Event
                        ) -> list[dict[str, float]]:
    samples: list[dict[str, float]] = []
    httpx = require("httpx", "bench", "jaxserve sweep")
    async with httpx.AsyncClient(timeout=10.0) as client:
        while not stop.is_set():
            try:
                r = await client.get(f"{base_url}/metrics")
                if r.status_code == 200:
                    samples.append(_scrape(r.text))
            except httpx.HTTPError:
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
    return samples


def occupancy(samples: list[dict[str, float]]) -> dict[str, float | None]:
    """Mean of each occupancy gauge over the polled samples (None where no sample had it)."""
    out: dict[str, float | None] = {}
    for key, name in OCCUPANCY_GAUGES.items():
        vals = [s[name] for s in samples if name in s]
        out[key] = sum(vals) / len(vals) if vals else None
    return out


async def _step(ns: argparse.Namespace, base_url: str, c: int, n: int, warm: int
                ) -> tuple[dict[str, Any], list[dict[str, float]]]:
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll_metrics(base_url, ns.metrics_interval_s, stop))
    try:
        result, _ = await run_benchmark(_bench_ns(ns, base_url, c, n, warm))
    finally:
        stop.set()
    return result, await poller


def resolve_goodput(ns: argparse.Namespace, base_url: str) -> None:
    """Set ``ns.goodput`` to the server's objectives (``served_objectives``) if not given, and
    say which SLOs the sweep judges by.

    Raises:
      ValueError: none given and the server publishes none, or it cannot be reached.
    """
    if ns.goodput is None:
        httpx = require("httpx", "bench", "jaxserve sweep")
        try:
            r = httpx.get(f"{base_url}/metrics", timeout=10.0)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot read {base_url}/metrics: {e}") from None
        ns.goodput = served_objectives(r.text if r.status_code == 200 else "", base_url)
        print(f"SLOs: the server's objectives, --goodput {' '.join(ns.goodput)}", flush=True)


def sweep_server(ns: argparse.Namespace, base_url: str) -> list[dict[str, Any]]:
    """Run the concurrency steps against one server; returns one summary dict per step."""
    resolve_goodput(ns, base_url)
    slos = parse_goodput(ns.goodput)
    pkey = str(int(ns.percentile)) if int(ns.percentile) == ns.percentile else str(ns.percentile)
    steps: list[dict[str, Any]] = []
    c = ns.concurrency_start
    warm = ns.num_warmups
    while c <= ns.max_concurrency_limit:
        n = max(ns.num_prompts, ns.prompts_per_concurrency * c)
        print(f"--- concurrency {c}: {n} requests", flush=True)
        result, samples = asyncio.run(_step(ns, base_url, c, n, warm))
        warm = 0
        step = {"concurrency": c, "num_prompts": n, "completed": result["completed"],
                "failed": result["failed"], "duration": result["duration"],
                "request_throughput": result["request_throughput"],
                "output_throughput": result["output_throughput"],
                "total_token_throughput": result["total_token_throughput"],
                "request_goodput": result["request_goodput"]}
        for m in METRICS:
            for k in ("mean", "median", f"p{pkey}", "p99"):
                step[f"{k}_{m}_ms"] = result[f"{k}_{m}_ms"]
        step["largest_itl_ms"] = result["largest_itl_ms"]
        step.update(occupancy(samples))
        step["meets_slo"] = meets_slo(step, ns.percentile, slos)
        steps.append(step)
        if should_stop([s["output_throughput"] for s in steps], ns.gain_threshold, ns.patience):
            break
        c = max(c + 1, int(c * ns.concurrency_factor))
    last = samples[-1] if samples else {}
    for key, name in LIMIT_GAUGES.items():
        for s in steps:
            s[key] = last.get(name)
    return steps


def remove_stale(output_dir: str, rec: dict[str, Any]) -> None:
    """Delete an earlier run's ``interactive.yaml`` / ``offline.yaml`` that this run does not
    recommend, so that no stale configuration is left to be served."""
    for name in ("interactive", "offline"):
        if name not in rec:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(output_dir, f"{name}.yaml"))


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``jaxserve sweep``; returns the exit status (1 if a step failed every
    request).

    Raises:
      ValueError: bad flags, or a server that cannot be started or reached.
      MissingExtraError: httpx or matplotlib (the ``bench`` extra) is not installed.
    """
    _check(ns)
    for module in ("httpx", "matplotlib"):  # before minutes of measuring, not after
        require(module, "bench", "jaxserve sweep")
    parse_goodput(ns.goodput)
    grid = parse_grid(ns.grid)
    varied = sorted({k for cfg in grid for k in cfg} & set(OBJECTIVE_SETTINGS.values()))
    if ns.goodput is None and varied:
        raise ValueError(f"--grid varies {', '.join(varied)}: give --goodput, so that every "
                         "configuration is judged by the same SLOs (e.g. --goodput ttft:2000 "
                         "itl:300)")
    if ns.goodput is not None:
        print(f"SLOs: --goodput {' '.join(ns.goodput)}", flush=True)
    os.makedirs(ns.output_dir, exist_ok=True)
    configs: list[dict[str, Any]] = []
    for k, cfg in enumerate(grid):
        if ns.base_url:
            steps = sweep_server(ns, server_root(ns.base_url))
        else:
            flags = grid_flags(cfg)
            log = os.path.join(ns.output_dir, f"server-{k}.log")
            with ServerProcess(shlex.split(ns.serve_args) + flags, ns.server_start_timeout_s,
                               log) as server:
                steps = sweep_server(ns, server.url)
        thr = [s["output_throughput"] for s in steps]
        c_slo = slo_concurrency(steps, ns.percentile, parse_goodput(ns.goodput))
        best = best_goodput(steps, c_slo)
        configs.append({
            "config": cfg, "steps": steps,
            "knee": knee_concurrency([s["concurrency"] for s in steps], thr, ns.gain_threshold),
            "slo_concurrency": c_slo,
            "goodput": best["request_goodput"] if best else None,
            "goodput_concurrency": best["concurrency"] if best else None,
        })
    rec = recommend(configs, ns.headroom, parse_goodput(ns.goodput))
    remove_stale(ns.output_dir, rec)
    files = {}
    for name, r in rec.items():
        files[name] = os.path.join(ns.output_dir, f"{name}.yaml")
        write_yaml(files[name], r, None if ns.base_url else ns.serve_args)
    plots = plot(configs, ns, ns.output_dir)
    result = {"args": {k: v for k, v in vars(ns).items() if k != "func"},
              "configs": configs, "recommended": rec, "config_files": files, "plots": plots}
    path = os.path.join(ns.output_dir, "sweep.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2, default=str)
    print(format_table(configs, ns.percentile, parse_goodput(ns.goodput)))
    for name, r in rec.items():
        print(f"{name}: {files[name]}: {r['settings']} -- {r['why']}")
    if "interactive" not in rec:
        print("interactive: no configuration met the SLOs even at the first concurrency")
    print(f"Saved {path} and {', '.join(plots)}")
    failed_all = any(s["completed"] == 0 for c in configs for s in c["steps"])
    return 1 if failed_all else 0
