"""The simulated replica against a real one on the same bursty trace.

    PYTHONPATH=. .venv/bin/python experiments/2026-12-01-autoscaling/validate.py \
        --base-url http://127.0.0.1:PORT --out results/autoscaling --rounds 2

Each round replays the trace of ``make_trace.py`` on the running server (``jaxserve bench
serve --dataset-name trace``: trace A), measures the server's curve at once (``jaxserve sweep
--base-url``, closed loop at 1, 2, 4, 8, 16), replays the trace again (trace B), then replays
the same arrivals through one simulated replica with that curve (``simulate.simulate``, the
server's max_num_seqs, 20 seeds of the TTFT draws) and compares the p50 / p99 TTFT. The model
passes when the real p99 of both replays is within ``--tolerance`` (default 30 %) of the
model's median p99; the two replays bracket the sweep, so their difference shows how much the
machine's speed moved meanwhile (on a shared machine, a lot). ``--reuse`` recomputes the
comparison from the files of an earlier run. Writes ``validate.json`` in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from jaxserve.autoscaling.curve import load_curve
from jaxserve.autoscaling.simulate import SimConfig, simulate

HERE = os.path.dirname(os.path.abspath(__file__))
CLI = [sys.executable, "-m", "jaxserve.cli.main"]


def replay(base_url: str, trace: str, out: str, name: str) -> str:
    subprocess.run([*CLI, "bench", "serve", "--base-url", base_url, "--dataset-name", "trace",
                    "--dataset-path", trace, "--disable-tqdm", "--save-result", "--result-dir",
                    out, "--result-filename", name], check=True, stdout=subprocess.DEVNULL)
    return os.path.join(out, name)


def measure(base_url: str, out: str) -> None:
    """Trace A, the sweep, trace B, all in ``out``."""
    os.makedirs(out, exist_ok=True)
    trace = os.path.join(out, "trace.jsonl")
    subprocess.run([sys.executable, os.path.join(HERE, "make_trace.py"), trace], check=True)
    replay(base_url, trace, out, "trace-a.json")
    subprocess.run([*CLI, "sweep", "--base-url", base_url, "--dataset-name", "random",
                    "--random-input-len", "128", "--random-output-len", "32",
                    "--num-prompts", "8", "--prompts-per-concurrency", "4",
                    "--max-concurrency-limit", "16", "--gain-threshold", "0",
                    "--goodput", "ttft:2000", "tpot:500", "--num-warmups", "2",
                    "--output-dir", os.path.join(out, "sweep")], check=True,
                   stdout=subprocess.DEVNULL)
    replay(base_url, trace, out, "trace-b.json")


def compare(out: str, seeds: int = 20) -> dict[str, float]:
    """Real (both replays) against modelled TTFT percentiles (ms)."""
    sweep_dir = os.path.join(out, "sweep")
    curve, _ = load_curve(sweep_dir)
    with open(os.path.join(sweep_dir, "sweep.json"), encoding="utf-8") as fh:
        mns = int(json.load(fh)["configs"][0]["steps"][0].get("max_num_seqs") or 256)
    with open(os.path.join(out, "trace.jsonl"), encoding="utf-8") as fh:
        times = np.array([json.loads(line)["arrival_time"] for line in fh if line.strip()])
    times -= times[0]
    row: dict[str, float] = {}
    for name in ("a", "b"):
        with open(os.path.join(out, f"trace-{name}.json"), encoding="utf-8") as fh:
            real = np.array(json.load(fh)["ttfts"]) * 1000
        row[f"real_{name}_p50_ms"] = float(np.percentile(real, 50))
        row[f"real_{name}_p99_ms"] = float(np.percentile(real, 99))
    p50s, p99s = [], []
    for seed in range(seeds):
        r = simulate(times, SimConfig(curve, {"ttft": 1e9}, max_num_seqs=mns, seed=seed))
        p50s.append(np.percentile(r.ttft_ms, 50))
        p99s.append(np.percentile(r.ttft_ms, 99))
    row.update(model_p50_ms=float(np.median(p50s)), model_p99_ms=float(np.median(p99s)),
               model_p99_min_ms=float(min(p99s)), model_p99_max_ms=float(max(p99s)),
               c1_throughput_rps=curve.throughput(1.0), c8_throughput_rps=curve.throughput(8.0))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.3)
    ap.add_argument("--reuse", action="store_true",
                    help="compare the rounds already measured in --out (no server needed)")
    ns = ap.parse_args()
    if not ns.reuse and not ns.base_url:
        ap.error("--base-url is needed unless --reuse")
    rows = []
    for k in range(ns.rounds):
        out = os.path.join(ns.out, f"round{k}")
        if not ns.reuse:
            measure(ns.base_url, out)
        row = {"round": k, **compare(out)}
        for name in ("a", "b"):
            row[f"ratio_{name}"] = row[f"real_{name}_p99_ms"] / row["model_p99_ms"]
        row["within"] = all(abs(row[f"ratio_{n}"] - 1) <= ns.tolerance for n in ("a", "b"))
        rows.append(row)
        print(f"round {k}: curve 1 -> {row['c1_throughput_rps']:.2f}, 8 -> "
              f"{row['c8_throughput_rps']:.2f} req/s; real p99 TTFT A {row['real_a_p99_ms']:.0f}"
              f" / B {row['real_b_p99_ms']:.0f} ms (p50 {row['real_a_p50_ms']:.0f} / "
              f"{row['real_b_p50_ms']:.0f}); model p99 {row['model_p99_ms']:.0f} ms "
              f"({row['model_p99_min_ms']:.0f}-{row['model_p99_max_ms']:.0f} over seeds, p50 "
              f"{row['model_p50_ms']:.0f}); real / model {row['ratio_a']:.2f} / "
              f"{row['ratio_b']:.2f}: {'within' if row['within'] else 'outside'} "
              f"{ns.tolerance:.0%}", flush=True)
    with open(os.path.join(ns.out, "validate.json"), "w", encoding="utf-8") as fh:
        json.dump({"tolerance": ns.tolerance, "rounds": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
