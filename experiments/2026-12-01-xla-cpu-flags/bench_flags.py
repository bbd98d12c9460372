"""A/B of XLA:CPU flag settings on the served step: ``jaxserve bench step`` per setting.

    python experiments/2026-12-01-xla-cpu-flags/bench_flags.py --rounds 3 \\
        --configs default,fastmath --out results/step_flags.json

Each round runs every setting once (interleaved), each in a fresh process with its own
``XLA_FLAGS`` (jaxserve adds its ``CPU_XLA_FLAGS`` to a setting that does not name them, so the
settings other than ``jaxserve`` name the scheduler flag; ``xla`` is XLA's defaults), decode at
batch 1, 16 and 64 after a 64-token prompt each (the batch-16 and batch-64 prompts run as
512-token prefill steps). A private compilation cache (``--cache-dir``) makes each setting's
first round a cold compile (``compile_s``) and later rounds warm. Prints, per setting and row,
the median over rounds of the per-step medians: wall ms and process CPU ms, and writes
everything (with ``uptime`` load averages per run) as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

XLA_SCHED = "--xla_cpu_enable_concurrency_optimized_scheduler=true"  # XLA's default
CONFIGS = {
    "jaxserve": "",  # what jaxserve sets (jaxserve.CPU_XLA_FLAGS)
    "default": XLA_SCHED,  # XLA's defaults (the name the figures of the README use)
    "fastmath": "--xla_cpu_enable_fast_math=true",
    "ynn_more": "--xla_cpu_experimental_ynn_fusion_type=individual_dot,dot,eltwise",
    "ynn_dot": "--xla_cpu_experimental_ynn_fusion_type=+dot",
    "eigen": "--xla_cpu_experimental_ynn_fusion_type=",
    "onednn": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_onednn=true",
    "xnn_dot": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_xnn_fusion_type=dot",
    "vec512": "--xla_cpu_prefer_vector_width=512",
    "no_conc_sched": "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    "no_mt_eigen": "--xla_cpu_multi_thread_eigen=false",
}
CONFIGS.update({k: f"{XLA_SCHED} {v}" for k, v in CONFIGS.items()
                if k not in ("jaxserve", "default", "no_conc_sched")})
SCHED_OFF = CONFIGS["no_conc_sched"]
CONFIGS.update({  # on top of jaxserve's default
    "off+vec512": f"{SCHED_OFF} --xla_cpu_prefer_vector_width=512",
    "off+fastmath": f"{SCHED_OFF} --xla_cpu_enable_fast_math=true",
})
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def load() -> list[str]:
    with open("/proc/loadavg") as fh:
        return fh.read().split(" ")[:3]


def one(name: str, flags: str, cache: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    env = {**os.environ, "XLA_FLAGS": flags,
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = ["nice", "-n", str(args.nice), sys.executable, "-m", "jaxserve.cli", "bench", "step",
           "--batch-sizes", args.batch_sizes, "--context", "64", "--num-steps",
           str(args.num_steps), "--compilation-cache-dir", cache, "--output-json", path]
    before, t0 = load(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        return {"config": name, "xla_flags": flags, "error": proc.stderr[-2000:]}
    with open(path) as fh:
        res = json.load(fh)
    os.unlink(path)
    rows = {}
    for r in res["rows"]:
        rows[f"decode b{r['batch']}"] = r["decode"]
        for p in r["prefill"]:
            if p["bucket_tokens"] == 512:
                rows.setdefault("prefill 512", p)
    return {"config": name, "xla_flags": flags, "load_before": before, "load_after": load(),
            "wall_s": time.perf_counter() - t0, "compile_s": res["compile_s"], "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="default,no_conc_sched",
                   help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-steps", type=int, default=8)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--nice", type=int, default=19)
    p.add_argument("--cache-dir", default=None, help="compilation cache (default: a new temp dir)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    names = args.configs.split(",")
    cache = args.cache_dir or tempfile.mkdtemp(prefix="xla-flags-cache-")
    runs = []
    for rnd in range(args.rounds):
        for name in names:
            r = one(name, CONFIGS[name], cache, args)
            r["round"] = rnd
            runs.append(r)
            short = {k: round(v["median_step_ms"], 1) for k, v in r.get("rows", {}).items()}
            print(f"round {rnd} {name:<14} load {r.get('load_before')} compile "
                  f"{r.get('compile_s', float('nan')):.1f}s {short or r.get('error')}", flush=True)
    summary = {}
    for name in names:
        ok = [r for r in runs if r["config"] == name and "rows" in r]
        if not ok:
            continue
        s = summary[name] = {"cold_compile_s": ok[0]["compile_s"]}
        for row in ok[0]["rows"]:
            vals = [r["rows"][row] for r in ok if row in r["rows"]]
            s[row] = {"step_ms": statistics.median(v["median_step_ms"] for v in vals),
                      "cpu_ms": statistics.median(v["median_cpu_ms"] for v in vals),
                      "min_step_ms": min(v["min_step_ms"] for v in vals)}
    rows = list(next(iter(summary.values())).keys())[1:] if summary else []
    print(f"{'config':<14}{'cold compile s':>15}" + "".join(f"{r:>24}" for r in rows))
    for name, s in summary.items():
        print(f"{name:<14}{s['cold_compile_s']:>15.1f}" + "".join(
            f"{s[r]['step_ms']:>11.1f} ms {s[r]['cpu_ms']:>6.1f} cpu" for r in rows if r in s))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"configs": {n: CONFIGS[n] for n in names}, "runs": runs,
                       "summary": summary}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
