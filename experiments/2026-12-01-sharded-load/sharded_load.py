"""Per-shard load time and host memory: tensor-parallel loading that reads each device's slice
(``jaxserve.loading.sharded``) against reading the whole checkpoint, then sharding it.

Writes SmolLM2-135M-shaped dummy weights (float32, seed 0) once as an orbax checkpoint
(``models.checkpoint.save_checkpoint``) and as an HF safetensors directory (``LlamaForCausalLM``
names, ``[out, in]`` linear weights), then loads each one in a fresh process on 8 simulated CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) at each ``--tp`` size, two ways:

  sharded          orbax restore into NamedSharding targets / HF ``get_slice`` per device
  full-then-shard  ``load_checkpoint`` / ``load_hf_params`` onto one device, then ``shard_params``

Per process: the ``LoadReport`` (per device: bytes read, bytes placed, seconds), the load's wall
time, bytes tensorstore read from files (orbax), and host memory: peak RSS of the process
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``; Linux carries it across ``exec``, so every
process here, the checkpoint writer included, is started by a parent that never imports jax)
and its growth over the RSS before the load, plus the peaks of its two parts sampled every 2 ms
from ``/proc/self/status``: anonymous memory (``RssAnon``: buffers, copies) and file-backed pages
(``RssFile``: the memory-mapped safetensors pages a read touched; clean page cache that the
kernel can drop, and that counts in ``ru_maxrss``). On the CPU backend device buffers live in
host memory too, so the placed weights (513 MiB) are part of every figure; what differs is the
full host copy and the one-device copy of the load-then-shard path. Prints one per-device table
per run, a summary table, and writes JSON.

Usage: .venv/bin/python experiments/2026-12-01-sharded-load/sharded_load.py [--tp 1 3] [--out results/...json]
           [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Self

MIB = 2**20


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Peaks of ``RssAnon`` and ``RssFile`` (bytes) sampled on a thread every ``period_s``."""

    def __init__(self, period_s: float = 0.002) -> None:
        import threading

        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)

    def sample(self) -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as fh:
            for line in fh:
                key = line.split(":")[0]
                if key in self.peak:
                    out[key] = int(line.split()[1]) * 1024
        return out

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            for k, v in self.sample().items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(period_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for k, v in self.sample().items():
            self.peak[k] = max(self.peak[k], v)


def child(fmt: str, path: str, tp: int, method: str) -> dict:
    """One load in this (fresh) process; returns the figures as a dict."""
    import resource

    import jax
    import jax.numpy as jnp

    from jaxserve import sharding
    from jaxserve.loading import sharded as sharded_load
    from models import checkpoint, hf

    dtype = jnp.dtype(jnp.float32)
    mesh = sharding.make_mesh(tp)
    sampler = RssSampler()
    rss_before = current_rss_bytes()
    before = sampler.sample()
    with sampler:
        t0 = time.perf_counter()
        if method == "sharded":
            if fmt == "orbax":
                cfg, params, report = sharded_load.load_orbax_sharded(path, dtype, mesh)
            else:
                cfg, params, report = sharded_load.load_hf_sharded(path, dtype, mesh,
                                                                   progress=False)
        else:
            if fmt == "orbax":
                cfg, full = checkpoint.load_checkpoint(path, dtype)
            else:
                cfg, full = hf.load_hf_params(path, dtype, progress=False)
            params, report = sharded_load.shard_loaded(full, cfg, mesh, t0, fmt)
            del full
        jax.block_until_ready(params)
        storage = sharded_load.tensorstore_bytes_read() if fmt == "orbax" else None
        load_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"format": fmt, "tp": tp, "method": method, "load_s": load_s,
            "peak_rss_mib": peak / MIB, "rss_before_load_mib": rss_before / MIB,
            "peak_rss_growth_mib": (peak - rss_before) / MIB,
            "peak_anon_growth_mib": (sampler.peak["RssAnon"] - before["RssAnon"]) / MIB,
            "peak_file_growth_mib": (sampler.peak["RssFile"] - before["RssFile"]) / MIB,
            "storage_bytes_read": storage,
            "report": report.as_dict(), "table": report.table()}


def write_checkpoints(workdir: str) -> tuple[str, str, float]:
    """SmolLM2-shaped dummy weights as an orbax checkpoint and an HF directory; returns the two
    paths and the params' size in MiB."""
    import jax
    import numpy as np
    from safetensors.numpy import save_file

    from models import checkpoint
    from models.config import builtin_config
    from models.hf import LAYER_TENSORS  # our layer path -> (HF name, transposed)
    from models.llama import LlamaForCausalLM
    from models.loader import dummy_params

    cfg = builtin_config("smollm2-135m")
    params = dummy_params(LlamaForCausalLM(cfg), 0)
    size_mib = sum(x.nbytes for x in jax.tree_util.tree_leaves(params)) / MIB
    orbax_dir = os.path.join(workdir, "smollm2-orbax")
    checkpoint.save_checkpoint(orbax_dir, cfg, params)

    hf_dir = os.path.join(workdir, "smollm2-hf")
    os.makedirs(hf_dir)
    tensors = {"model.embed_tokens.weight": np.asarray(params["embed"]),
               "model.norm.weight": np.asarray(params["final_norm"]["weight"])}
    for path, (name, transpose) in LAYER_TENSORS.items():
        leaf = params["layers"]
        for key in path:
            leaf = leaf[key]
        stacked = np.asarray(leaf)
        for i in range(cfg.num_layers):
            x = stacked[i].T if transpose else stacked[i]
            tensors[f"model.layers.{i}.{name}"] = np.ascontiguousarray(x)
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
              "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
              "max_position_embeddings": cfg.max_position_embeddings}
    with open(os.path.join(hf_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    return orbax_dir, hf_dir, size_mib


def run_child(*args: str) -> dict:
    """Run this script with ``args`` in a fresh process; its last stdout line as JSON."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], check=True,
                         capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 3], help="TP sizes (of 8 devices)")
    ap.add_argument("--out", default="results/bench_sharded_load.json")
    ap.add_argument("--workdir", default=None,
                    help="where the checkpoints are written (default: a temporary directory)")
    ap.add_argument("--child", nargs=4, metavar=("FORMAT", "PATH", "TP", "METHOD"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--write-checkpoints", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fmt, path, tp, method = args.child
        print(json.dumps(child(fmt, path, int(tp), method)))
        return
    if args.write_checkpoints:
        print(json.dumps(write_checkpoints(args.write_checkpoints)))
        return

    runs = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        t0 = time.perf_counter()
        orbax_dir, hf_dir, size_mib = run_child("--write-checkpoints", tmp)
        print(f"wrote SmolLM2-shaped float32 checkpoints ({size_mib:.0f} MiB of params) in "
              f"{time.perf_counter() - t0:.1f} s")
        for fmt, path in (("orbax", orbax_dir), ("hf", hf_dir)):
            for tp in args.tp:
                for method in ("full-then-shard", "sharded"):
                    r = run_child("--child", fmt, path, str(tp), method)
                    runs.append(r)
                    print(f"\n{fmt} TP={tp} {method} ({r['report']['timing']} seconds):")
                    print(r.pop("table"))

    print("\nsummary (MiB; growth: over the RSS before the load; anon/file: peaks of RssAnon "
          "and RssFile growth)")
    head = (f"{'format':<6} {'tp':>2} {'method':<16} {'load s':>7} {'read/dev':>9} "
            f"{'max dev s':>9} {'storage':>8} {'peak RSS':>9} {'growth':>7} {'anon':>6} "
            f"{'file':>6}")
    print(head)
    for r in runs:
        devs = r["report"]["devices"]
        read = [d["bytes_read"] for d in devs]
        per_dev = "-" if None in read else f"{max(read) / MIB:.1f}"
        storage = "-" if r["storage_bytes_read"] is None else f"{r['storage_bytes_read'] / MIB:.1f}"
        print(f"{r['format']:<6} {r['tp']:>2} {r['method']:<16} {r['load_s']:>7.2f} "
              f"{per_dev:>9} {max(d['seconds'] for d in devs):>9.3f} {storage:>8} "
              f"{r['peak_rss_mib']:>9.0f} {r['peak_rss_growth_mib']:>7.0f} "
              f"{r['peak_anon_growth_mib']:>6.0f} {r['peak_file_growth_mib']:>6.0f}")
    result = {"model": "SmolLM2-135M shape, dummy weights, float32", "params_mib": size_mib,
              "devices": "8 simulated CPU devices", "runs": runs,
              "python": platform.python_version(), "machine": platform.machine(),
              "cpu_count": os.cpu_count(), "loadavg": os.getloadavg()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
