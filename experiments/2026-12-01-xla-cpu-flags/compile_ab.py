"""Cold compile of the step programs per XLA_FLAGS setting (no compilation cache).

    python experiments/2026-12-01-xla-cpu-flags/compile_ab.py --rounds 2 --out compile.json

Each run is a fresh process: an ``LLMEngine`` on SmolLM2-135M (default engine flags: the token
buckets 8 ... 512 and the logit_bias writer) with ``compilation_cache_dir=""``, then
``warmup()``; prints its ``compile_s`` (wall) and ``compile_cpu_s`` (process CPU seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SETTINGS = {"xla_default": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
            "jaxserve": ""}
WORKER = """
import json
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
e = LLMEngine(EngineConfig(compilation_cache_dir=""), LoadConfig(None, "auto"))
w = e.warmup(progress=False)
print("RESULT " + json.dumps(w))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    runs = []
    for rnd in range(a.rounds):
        for name, flags in SETTINGS.items():
            env = {**os.environ, "XLA_FLAGS": flags,
                   "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
            with open("/proc/loadavg") as fh:
                load = fh.read().split()[:3]
            out = subprocess.run(["nice", "-n", "19", sys.executable, "-c", WORKER], env=env,
                                 capture_output=True, text=True, check=True).stdout
            w = json.loads(out.split("RESULT ", 1)[1])
            runs.append({"setting": name, "xla_flags": flags, "round": rnd, "load": load, **w})
            print(f"round {rnd} {name:<12} load {load} programs {int(w['num_programs'])} "
                  f"compile {w['compile_s']:.1f} s, {w['compile_cpu_s']:.1f} CPU-s", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"settings": SETTINGS, "runs": runs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
