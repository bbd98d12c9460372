"""The attention op alone over a paged KV cache: the native CPU kernel against the jnp path.

    python -m benchmarks.attention_ab --phase decode --seqs 16 --context 300
    python -m benchmarks.attention_ab --phase prefill --seqs 4 --context 256 --cache-dtype bfloat16

``--seqs`` sequences of ``--context`` tokens (decode: one query row each at that context;
prefill: every prompt token a query row, a fresh prompt) over a cache of 16-token pages in
shuffled order, ``--layers`` layers in a ``fori_loop`` (each layer's output feeds the next
query, so nothing is hoisted), SmolLM2-135M's heads by default (9 query, 3 KV, head_dim 64).
Each path is jitted once, then the paths alternate for ``--rounds`` rounds of ``--repeats``
timed calls. The table gives per path the median ms per call (all layers), the range of the
round medians, the rate against this machine's ceiling measured in the same run (decode reads
the KV cache: GB/s of K and V read, against a large array copy's read + write GB/s; prefill
computes: GFLOP/s of q.k and p.v, against a float32 ``[n, n] @ [n, n]`` dot), and the largest
difference from the jnp path relative to the jnp output's largest value. Paths: ``jnp`` (the
pure-jnp op) and ``native`` (the same op with its decode and prefill rows in the C++ kernel;
left out where the kernel is not available). Random inputs come from numpy seed 0.

Records: docs/decisions/0031-vectorised-decode-attention.md,
docs/decisions/0035-prefill-kernels.md.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.common import SEED, format_table, median, write_json

BLOCK_SIZE = 16


def make_inputs(phase: str, seqs: int, context: int, layers: int, q_heads: int, kv_heads: int,
                head_dim: int, cache_dtype: str) -> dict[str, Any]:
    """The op's arguments (jax arrays) for one ``phase`` batch; pages shuffled, block 0 unused."""
    import jax.numpy as jnp

    rng = np.random.default_rng(SEED)
    pages = -(-context // BLOCK_SIZE)
    num_blocks = seqs * pages + 1
    shape = (layers, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    rows = seqs if phase == "decode" else seqs * context
    return {
        "q": jnp.asarray(rng.normal(0, 1, (rows, q_heads, head_dim)), jnp.float32),
        "k": jnp.asarray(rng.normal(0, 1, shape), cache_dtype),
        "v": jnp.asarray(rng.normal(0, 1, shape), cache_dtype),
        "tables": jnp.asarray(rng.permutation(np.arange(1, num_blocks)).reshape(seqs, pages),
                              jnp.int32),
        "seq_lens": jnp.full((seqs,), context, jnp.int32),
        "qsl": jnp.arange(seqs + 1, dtype=jnp.int32) * (1 if phase == "decode" else context),
        "num_seqs": jnp.array([seqs], jnp.int32),
    }


def layer_loop(inputs: dict[str, Any], layers: int, head_dim: int, native: bool) -> Any:
    """A jitted ``q -> out`` running the op over ``layers`` layers, native rows or not."""
    import jax
    import jax.numpy as jnp

    from cpu_kernels.attention import native_attention_fn
    from pallas_kernels import ragged_paged_attention

    a = inputs
    attention = native_attention_fn(prefill=True) if native else ragged_paged_attention

    @jax.jit
    def run(q: jax.Array) -> jax.Array:
        def body(layer: jax.Array, acc: jax.Array) -> jax.Array:
            return acc + attention(
                q + acc * 1e-3, a["k"], a["v"], layer, a["tables"], a["seq_lens"], a["qsl"],
                a["num_seqs"], sm_scale=head_dim ** -0.5)
        return jax.lax.fori_loop(0, layers, body, jnp.zeros_like(q))
    return run


def work_per_call(phase: str, seqs: int, context: int, layers: int, q_heads: int,
                  kv_heads: int, head_dim: int, itemsize: int) -> float:
    """Decode: bytes of K and V one call reads; prefill: FLOPs of q.k and p.v (causal)."""
    if phase == "decode":
        return float(2 * layers * seqs * context * kv_heads * head_dim * itemsize)
    return float(4 * layers * seqs * q_heads * head_dim * context * (context + 1) // 2)


def copy_gb_per_s(num_mib: int, reps: int = 5) -> float:
    """Read + write GB/s of copying a ``num_mib`` MiB float32 array on the default device."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((num_mib * 2**18,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    jax.block_until_ready(f(x))
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(f(x))
    return 2 * x.nbytes * reps / (time.perf_counter() - t0) / 1e9


def matmul_gflop_per_s(n: int, reps: int = 5) -> float:
    """GFLOP/s of a float32 ``[n, n] @ [n, n]`` dot on the default device."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(SEED).normal(0, 1, (n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(f(a))
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def native_available() -> bool:
    """Whether the native CPU attention kernel runs here (a CPU backend and a built kernel)."""
    import jax

    from cpu_kernels import attention as cpu_attention

    return jax.default_backend() == "cpu" and cpu_attention.available()


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """Time the paths, print the table; returns the result dict."""
    import jax

    inputs = make_inputs(ns.phase, ns.seqs, ns.context, ns.layers, ns.q_heads, ns.kv_heads,
                         ns.head_dim, ns.cache_dtype)
    paths = {"jnp": False}
    if native_available():
        paths["native"] = True
    fns = {name: layer_loop(inputs, ns.layers, ns.head_dim, nat) for name, nat in paths.items()}
    outs = {name: np.asarray(jax.block_until_ready(fn(inputs["q"]))) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    round_medians: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ns.rounds):
        for name, fn in fns.items():
            ts = []
            for _ in range(ns.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(inputs["q"]))
                ts.append(1e3 * (time.perf_counter() - t0))
            times[name] += ts
            round_medians[name].append(median(ts))
    work = work_per_call(ns.phase, ns.seqs, ns.context, ns.layers, ns.q_heads, ns.kv_heads,
                         ns.head_dim, inputs["k"].dtype.itemsize)
    if ns.phase == "decode":
        unit, ceiling = "KV GB/s", copy_gb_per_s(ns.ceiling_mib)
    else:
        unit, ceiling = "GFLOP/s", matmul_gflop_per_s(ns.ceiling_n)
    ref = outs["jnp"]
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    result = {"phase": ns.phase, "seqs": ns.seqs, "context": ns.context, "layers": ns.layers,
              "heads": [ns.q_heads, ns.kv_heads, ns.head_dim], "cache_dtype": ns.cache_dtype,
              "seed": SEED, "rate_unit": unit, "ceiling": ceiling, "paths": {}}
    rows = []
    for name in fns:
        rel = float(np.max(np.abs(outs[name] - ref))) / scale
        rate = work / (median(times[name]) / 1e3) / 1e9
        entry = {"median_ms": median(times[name]), "round_min_ms": min(round_medians[name]),
                 "round_max_ms": max(round_medians[name]), "rate": rate,
                 "fraction_of_ceiling": rate / ceiling, "max_rel_diff": rel}
        result["paths"][name] = entry
        rows.append((name, entry["median_ms"],
                     f"{entry['round_min_ms']:.2f}-{entry['round_max_ms']:.2f}", rate,
                     f"{rate / ceiling:.3f}", f"{rel:.1e}"))
    print(f"{ns.phase}: {ns.seqs} x {ns.context} tokens, {ns.layers} layers, "
          f"{ns.cache_dtype} cache; ceiling {ceiling:.1f} {unit.split()[-1]}")
    print(format_table(["path", "median ms", "round medians", unit, "of ceiling",
                        "max rel diff"], rows),
          flush=True)
    write_json(ns.json, result)
    return result


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_ab",
                                description=__doc__.split("\n")[0])
    p.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cache-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=10, help="timed calls per path and round")
    p.add_argument("--ceiling-mib", type=int, default=256,
                   help="decode: MiB of the array copy that measures memory bandwidth")
    p.add_argument("--ceiling-n", type=int, default=2048,
                   help="prefill: n of the float32 [n, n] @ [n, n] dot that measures compute")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
