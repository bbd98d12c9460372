"""Cold and warm start of ``jaxserve serve``: seconds from launch to /health 200, with the
server's own load and compile figures, once with an empty compilation cache and once warm.

Usage: .venv/bin/python scripts/bench_startup.py [--out results/startup.json] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(cache_dir: str, extra: list[str], timeout_s: float = 600) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", "--port", str(port),
           "--compilation-cache-dir", cache_dir, *extra]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"server exited:\n{log.read()[-3000:]}")
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError("server not ready")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.1)
            ready_s = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(30)
        log.seek(0)
        text = log.read()
    load = re.search(r"loaded .* in ([\d.]+) s", text)
    comp = re.search(r"compiled (\d+) programs in ([\d.]+) s", text)
    return {"ready_s": ready_s, "load_s": float(load.group(1)) if load else -1.0,
            "compile_s": float(comp.group(2)) if comp else -1.0,
            "num_programs": int(comp.group(1)) if comp else -1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/startup.json")
    p.add_argument("extra", nargs="*", help="extra serve flags (after --)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold = start_once(cache, a.extra)
        warm = start_once(cache, a.extra)
    print(f"{'':6}{'ready s':>9}{'load s':>8}{'compile s':>10}{'programs':>9}")
    for name, r in (("cold", cold), ("warm", warm)):
        print(f"{name:6}{r['ready_s']:9.1f}{r['load_s']:8.1f}{r['compile_s']:10.1f}"
              f"{r['num_programs']:9d}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"cold": cold, "warm": warm, "extra_flags": a.extra}, fh, indent=2)


if __name__ == "__main__":
    main()
