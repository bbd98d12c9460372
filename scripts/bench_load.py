"""Load time of SmolLM2-135M per weights format: GGUF (Q4_1, dequantised), the orbax checkpoint
``jaxserve convert`` writes (stored in the serving dtype), and dummy (random) weights.

Each figure is the wall time of ``jaxserve.loading.load.load_model`` (config, params on the device,
tokenizer) in a fresh Python process after its imports, until every param is ready; the median
of ``--repeats`` processes is reported. The orbax checkpoint is converted once first (its
conversion time is printed, not counted). Prints a table and writes JSON.

Usage: .venv/bin/python scripts/bench_load.py [--dtype float32] [--repeats 3]
           [--out results/bench_load.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, sys, time
import jax, jax.numpy as jnp
from jaxserve.config import LoadConfig
from jaxserve.loading.load import load_model
model, fmt, dtype = sys.argv[1:4]
t0 = time.perf_counter()
loaded = load_model(LoadConfig(model, fmt), jnp.dtype(dtype), seed=0)
params, name = loaded.params, loaded.name
jax.block_until_ready(params)
t1 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "num_params": sum(x.size for x in jax.tree.leaves(params)),
                  "name": name}))
"""


def load_once(model: str, fmt: str, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, fmt, dtype], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", help="serving (and stored orbax) dtype")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/bench_load.json")
    ap.add_argument("--workdir", default=None, help="where the orbax checkpoint is written "
                    "(default: a temporary directory)")
    args = ap.parse_args()

    from jaxserve.cli.convert import convert
    from jaxserve.loading.model_files import default_gguf_path

    gguf = default_gguf_path()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        ckpt = os.path.join(tmp, "smollm2-orbax")
        t0 = time.perf_counter()
        convert(gguf, ckpt, args.dtype)
        convert_s = time.perf_counter() - t0
        cases = [("gguf", gguf, "auto"), ("orbax", ckpt, "auto"), ("dummy", "smollm2-135m",
                                                                      "dummy")]
        results = {}
        for name, model, fmt in cases:
            runs = [load_once(model, fmt, args.dtype) for _ in range(args.repeats)]
            times = [r["load_s"] for r in runs]
            results[name] = {"median_load_s": statistics.median(times), "load_s": times,
                             "num_params": runs[0]["num_params"]}
    report = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "repeats": args.repeats,
              "convert_s": convert_s, "results": results, "python": platform.python_version(),
              "machine": platform.machine(), "cpu_count": os.cpu_count()}
    print(f"SmolLM2-135M load time ({args.dtype}, median of {args.repeats} fresh processes; "
          f"orbax conversion took {convert_s:.1f} s)")
    print(f"{'format':<8}{'median s':>10}   runs")
    for name, r in results.items():
        print(f"{name:<8}{r['median_load_s']:>10.2f}   "
              + " ".join(f"{t:.2f}" for t in r["load_s"]))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
