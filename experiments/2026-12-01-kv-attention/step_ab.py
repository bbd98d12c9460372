"""Interleaved A/B of the engine step (``jaxserve bench step``) across source trees and KV settings.

    PYTHONPATH=. .venv/bin/python experiments/2026-12-01-kv-attention/step_ab.py \\
        --config base=/path/to/main:--block-size,16 --config new=.:--block-size,16 \\
        --config new-bs64=.:--block-size,64 --repeats 2 --out results/kv_step_ab.json

Each ``--config NAME=TREE:FLAGS`` runs ``jaxserve bench step`` from source tree TREE (on
PYTHONPATH) with the comma-separated extra FLAGS; the configs run one after the other, round
after round (``--repeats``), so that a drift in the machine's load hits all of them alike. Per
run it records the decode step ms per batch size, the prefill bucket step ms, the load average
before and after (``os.getloadavg``), the CPU-seconds of the child (user + system), and per
step the process CPU time (all threads: XLA's and the host's) beside the wall time: on a
machine shared with other jobs the wall time of a step swings with their load, its CPU time
much less. Prints a table of the per-config medians and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def run_one(tree: str, flags: list[str], common: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    tree = os.path.abspath(tree)  # on PYTHONPATH and the cwd (``-m`` puts the cwd first)
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", out, "bench", "step", *common,
           *flags, "--output-json", out]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0, t0 = os.getloadavg(), time.time()
    proc = subprocess.run(cmd, check=False, env=env, cwd=tree, capture_output=True,
                          text=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return {"result": result, "load_before": load0, "load_after": os.getloadavg(),
            "wall_s": time.time() - t0,
            "cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)}


def child(out: str, argv: list[str]) -> int:
    """Run ``jaxserve <argv>`` with each engine step's process CPU time recorded beside its wall
    time (``step_cpu`` in the JSON at ``out``: bucket tokens, seqs, wall s, CPU s)."""
    from jaxserve.bench import step as step_mod
    from jaxserve.cli import main as cli

    timed, steps = step_mod._timed_step, []

    def timed_step(*a):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        res = timed(*a)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        steps.append((res[0].num_tokens, res[0].num_seqs, time.perf_counter() - t0,
                      (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)))
        return res

    step_mod._timed_step = timed_step
    sys.argv = ["jaxserve", *argv]
    rc = cli.main()
    with open(out) as f:
        result = json.load(f)
    result["step_cpu"] = steps
    with open(out, "w") as f:
        json.dump(result, f)
    return rc or 0


def summarise(run: dict) -> dict:
    """Decode ms per batch, prefill ms per bucket (the best of the batches), from one
    bench-step JSON."""
    dec, pre = {}, {}
    for r in run["rows"]:
        dec[str(r["batch"])] = r["decode"]["median_step_ms"]
        for p in r["prefill"]:
            pre.setdefault(f"{p['bucket_tokens']}x{p['bucket_seqs']}", []).append(
                p["median_step_ms"])
    cpu = {}
    for tokens, seqs, _, cpu_s in run["step_cpu"]:
        cpu.setdefault(f"{tokens}x{seqs}", []).append(1e3 * cpu_s)
    dec_cpu = {b: statistics.median(cpu[f"{b}x{b}"]) for b in dec if f"{b}x{b}" in cpu}
    pre_cpu = {k: statistics.median(cpu[k]) for k in pre if k in cpu}
    return {"decode_ms": dec, "prefill_ms": {k: min(v) for k, v in pre.items()},
            "decode_cpu_ms": dec_cpu, "prefill_cpu_ms": pre_cpu}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2], sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", required=True, help="NAME=TREE:FLAG,FLAG,...")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--num-steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    common = ["--batch-sizes", ns.batch_sizes, "--context", str(ns.context), "--num-steps",
              str(ns.num_steps), "--no-enable-prefix-caching"]
    configs = []
    for spec in ns.config:
        name, rest = spec.split("=", 1)
        tree, _, flags = rest.partition(":")
        configs.append((name, tree, [x for x in flags.split(",") if x]))
    runs = []
    for rep in range(ns.repeats):
        for name, tree, flags in configs:
            r = run_one(tree, flags, common)
            s = summarise(r["result"])
            runs.append({"config": name, "repeat": rep, "tree": os.path.abspath(tree),
                         "flags": flags, **s, "load_before": r["load_before"],
                         "load_after": r["load_after"], "cpu_s": r["cpu_s"],
                         "wall_s": r["wall_s"], "raw": r["result"]})
            fmt = lambda d: " ".join(f"{k}:{v:.0f}" for k, v in d.items())
            print(f"[{rep}] {name:>12s} decode ms {fmt(s['decode_ms'])} (CPU "
                  f"{fmt(s['decode_cpu_ms'])}) prefill ms {fmt(s['prefill_ms'])} (CPU "
                  f"{fmt(s['prefill_cpu_ms'])}) load {r['load_before'][0]:.2f}->"
                  f"{r['load_after'][0]:.2f}, {r['cpu_s']:.0f} CPU-s", flush=True)
    print(f"\nmedians over {ns.repeats} rounds (decode step ms by batch; prefill step ms by "
          f"bucket, best in a run):")
    table = {}
    for name, _, _ in configs:
        mine = [r for r in runs if r["config"] == name]
        med = {key: {b: statistics.median(r[key][b] for r in mine if b in r[key])
                     for b in mine[0][key]}
               for key in ("decode_ms", "decode_cpu_ms", "prefill_ms", "prefill_cpu_ms")}
        table[name] = med
        print(f"  {name:>12s}  decode " + "  ".join(
            f"b{b} {v:6.1f} ms (CPU {med['decode_cpu_ms'].get(b, float('nan')):6.1f})"
            for b, v in med["decode_ms"].items()) + "   prefill " + "  ".join(
            f"{b} {v:6.1f} (CPU {med['prefill_cpu_ms'].get(b, float('nan')):6.1f})"
            for b, v in med["prefill_ms"].items()))
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump({"argv": sys.argv, "medians": table, "runs": runs}, f, indent=1)
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
