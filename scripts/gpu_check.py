"""The one prepared check for a GPU machine (jax + CUDA plugin, flax, numpy; no network).

Steps, each a row of the table printed last (JSON with ``--json PATH``), in this order so that the
rows that matter most run first when the time budget is short:
  1. copy bandwidth of the device (``-x`` over a 4 GiB bf16 array: 2 bytes moved per byte);
  2. the Mosaic GPU kernel (``ragged_paged_attention_mosaic``; Hopper and newer) against the
     float64 numpy reference on the device (bf16 at SmolLM2's and Llama's head layouts, an fp8
     cache; mixed prefill/decode batch, NaN in unused pages);
  3. decode attention at Llama-3.1-8B shapes (32 q / 8 kv heads, head_dim 128, bf16) at batch
     64 x context 4k and 256 x 16k, the Mosaic GPU and the Triton kernel: time and fraction of
     the KV-read floor at the measured bandwidth (goal: >= 0.8 at b64 x 4k);
  4. a 512-token prefill chunk at context 4k: time and fraction of the device's dense bf16
     tensor-core peak (``jaxserve.platform.gpu.DEVICE_FIGURES``; goal: >= 0.5), the Mosaic GPU
     kernel with P in registers and through shared memory, and the Triton kernel;
  5. the Mosaic GPU kernel on an fp8 cache at b64 x 4k; engine decode steps of the dummy
     ``llama-3.1-8b`` in bf16 through it (weights made on the device, batch 64, context 4k,
     ``ModelRunner``): step time against the weight + KV read floor;
  6. the Triton kernel's rows as before: correctness (f32, bf16, fp8, int8), decode at batch
     8/64/256 x context 512/4k/16k against XLA (the pure-jnp op), ``write_kv`` (XLA scatter,
     also quantising to 8 bits), and engine steps through it, the jnp op and an fp8 cache.
A deadline (``--budget-s``, default 270 s) skips the remaining rows rather than overrun 5 minutes.

``--dry-run`` runs every step at tiny shapes on the CPU with the kernels in interpret mode (and the
``tiny`` model): it checks the script itself, not the GPU.
Usage: bash scripts/gpu_check.sh [--dry-run] [--json PATH] [--budget-s S] [--only PREFIX ...]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.platform.gpu import device_figures
from pallas_kernels import (
    allocate_kv_cache,
    ragged_paged_attention,
    ragged_paged_attention_mosaic,
    ragged_paged_attention_pallas,
    ref_ragged_paged_attention,
    write_kv,
)
from pallas_kernels.kv_cache import KV_QUANT_DTYPES, QUANT_MAX, quantize_kv
from pallas_kernels.testing import make_case

H200_BF16_TFLOPS = 989.0  # dense bf16 tensor-core peak of an H100/H200 SXM (default peak)
KERNELS = {"pallas": ragged_paged_attention_pallas, "mosaic": ragged_paged_attention_mosaic}
DRY_SKIP = ("skipped (dry run: tests/kernels/test_mosaic_attention.py serves the engine through "
            "the kernel in interpret mode)")


class Report:
    def __init__(self, budget_s: float, only: tuple[str, ...] = ()) -> None:
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.only = only  # name prefixes of the checks to run; () runs them all
        self.bandwidth_gbps = 1.0  # set by the bandwidth check; floors use it
        self.peak_tflops = H200_BF16_TFLOPS  # the device's, where its kind is known
        self.bench_iters = 3  # timed calls at least (1 in a dry run: interpret mode is slow)

    def add(self, name: str, status: str = "ok", **values) -> None:
        row = {"check": name, "status": status, **values}
        self.rows.append(row)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {name}: {status} "
              + " ".join(f"{k}={v}" for k, v in values.items()), flush=True)

    def time_left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def run(self, name: str, fn, *args, need_s: float = 10.0, **kw) -> None:
        """Run one check; a failure becomes a FAIL row (with the error), not a crash."""
        if self.only and not name.startswith(self.only):
            self.add(name, "skipped (--only)")
            return
        if self.time_left() < need_s:
            self.add(name, "skipped (time budget)")
            return
        try:
            fn(self, *args, **kw)
        except Exception as e:  # noqa: BLE001 - the table must still print
            self.add(name, "FAIL", error=f"{type(e).__name__}: {str(e)[:300]}")
        gc.collect()


def bench_s(fn, *args, min_iters: int = 3, max_iters: int = 50, min_total_s: float = 0.2) -> float:
    """Median wall time of ``fn(*args)`` (compiled, synchronised), after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters
                                      or time.perf_counter() - start < min_total_s):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


# -- 1. bandwidth ----------------------------------------------------------------------------------
def check_bandwidth(rep: Report, nbytes: int) -> float:
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: -a)
    t = bench_s(f, x)
    gbps = 2 * nbytes / t / 1e9
    rep.add("copy bandwidth", bytes=nbytes, ms=round(t * 1e3, 3), GBps=round(gbps, 1))
    rep.bandwidth_gbps = gbps
    return gbps


# -- 2. correctness on the device ------------------------------------------------------------------
def check_correctness(rep: Report, interpret: bool, group: int, head_dim: int,
                      kernel: str = "pallas", splits_list: tuple[int, ...] = (1, 4)) -> None:
    """The kernel against the float64 reference: float32 and bfloat16 for the Triton kernel,
    bfloat16 for the Mosaic GPU one (a 16-bit cache), 1 and 4 splits."""
    rng = np.random.default_rng(0)
    q_lens = [1, 13, 1, 5, 1, 16, 1]
    ctx = [16, 13, 100, 17, 3, 32, 513 if not interpret else 40]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx, block_size=16, num_seqs_pad=8,
                                         tokens_pad=64, kv_heads=2, group=group,
                                         head_dim=head_dim)
    total = int(qsl[-1])
    dtypes = (("float32", 1e-3), ("bfloat16", 2e-2)) if kernel == "pallas" else (
        ("bfloat16", 2e-2),)
    for dtype, tol in dtypes:
        for splits in splits_list:
            qd, kd, vd = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
                          for x in (q, k, v))
            got = KERNELS[kernel](
                jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                jnp.int32(1), jnp.asarray(bt), jnp.asarray(sl), jnp.asarray(qsl),
                jnp.asarray(ns), sm_scale=head_dim ** -0.5, num_kv_splits=splits,
                interpret=interpret)
            got = np.asarray(got.astype(jnp.float32), np.float64)
            want = ref_ragged_paged_attention(qd, kd, vd, 1, bt, sl, qsl, ns,
                                              sm_scale=head_dim ** -0.5)
            err = float(np.max(np.abs(got[:total] - want[:total])
                               / (tol + np.abs(want[:total]))) * tol)
            ok = (np.all(np.isfinite(got)) and np.allclose(got[:total], want[:total], rtol=tol,
                                                           atol=tol)
                  and np.all(got[total:] == 0))
            name = f"correct {dtype} g{group} d{head_dim} splits{splits}"
            rep.add(name if kernel == "pallas" else f"{kernel} {name}",
                    "ok" if ok else "FAIL", max_scaled_err=f"{err:.2e}", tol=tol)


# -- 7. 8-bit KV cache ----------------------------------------------------------------------------
def quantize_case(k: np.ndarray, v: np.ndarray, kv_dtype: str):
    """Quantise a float64 case's pages with per-(layer, head) absmax scales (NaN pages stay
    NaN in fp8). Returns ``(k_q, v_q, k_scale, v_scale)``: device arrays and ``f32[L, kv]``."""
    dt = KV_QUANT_DTYPES[kv_dtype]
    out = []
    for x in (k, v):
        amax = np.nanmax(np.abs(x), axis=(1, 2, 4)).astype(np.float32)  # [L, kv]
        scale = np.maximum(amax / QUANT_MAX[dt], 1e-6).astype(np.float32)
        xq = jax.vmap(lambda a, s: quantize_kv(a, s, dt))(jnp.asarray(x, jnp.float32),
                                                           jnp.asarray(scale))
        out.append((xq, scale))
    (kq, ks), (vq, vs) = out
    return kq, vq, ks, vs


def check_correctness_quant(rep: Report, interpret: bool, group: int, head_dim: int,
                            kv_dtype: str, kernel: str = "pallas",
                            splits_list: tuple[int, ...] = (1, 4)) -> None:
    rng = np.random.default_rng(1)
    q_lens = [1, 13, 1, 5, 1, 16, 1]
    ctx = [16, 13, 100, 17, 3, 32, 513 if not interpret else 40]
    q, k, v, bt, sl, qsl, ns = make_case(rng, q_lens, ctx, block_size=16, num_seqs_pad=8,
                                         tokens_pad=64, kv_heads=2, group=group,
                                         head_dim=head_dim)
    kq, vq, ks, vs = quantize_case(k, v, kv_dtype)
    total = int(qsl[-1])
    dtypes = (("float32", 1e-3), ("bfloat16", 2e-2)) if kernel == "pallas" else (
        ("bfloat16", 2e-2),)  # the Mosaic GPU kernel's dots are bfloat16 for any q
    for dtype, tol in dtypes:
        for splits in splits_list:
            qd = np.asarray(jnp.asarray(q, dtype).astype(jnp.float32), np.float64)
            got = KERNELS[kernel](
                jnp.asarray(q, dtype), kq, vq, jnp.int32(1), jnp.asarray(bt), jnp.asarray(sl),
                jnp.asarray(qsl), jnp.asarray(ns), sm_scale=head_dim ** -0.5,
                k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs), num_kv_splits=splits,
                interpret=interpret)
            got = np.asarray(got.astype(jnp.float32), np.float64)
            want = ref_ragged_paged_attention(qd, np.asarray(kq), np.asarray(vq), 1, bt, sl, qsl,
                                              ns, sm_scale=head_dim ** -0.5, k_scale=ks,
                                              v_scale=vs)
            err = float(np.max(np.abs(got[:total] - want[:total])
                               / (tol + np.abs(want[:total]))) * tol)
            ok = (np.all(np.isfinite(got)) and np.allclose(got[:total], want[:total], rtol=tol,
                                                           atol=tol)
                  and np.all(got[total:] == 0))
            name = f"correct kv-{kv_dtype} q-{dtype} g{group} d{head_dim} splits{splits}"
            rep.add(name if kernel == "pallas" else f"{kernel} {name}",
                    "ok" if ok else "FAIL", max_scaled_err=f"{err:.2e}", tol=tol)


# -- 3./4. attention timings -------------------------------------------------------------------------
def attention_inputs(batch: int, q_len: int, context: int, *, nq: int, nkv: int, d: int,
                     block_size: int = 16, dtype=jnp.bfloat16, kv_dtype: str | None = None):
    """One-layer cache holding ``batch`` sequences of ``context`` tokens, each with ``q_len`` new
    tokens (decode: 1), contiguous blocks per sequence; values random on the device.
    ``kv_dtype`` "fp8" / "int8": the cache is quantised with scale 4 / QUANT_MAX (values
    beyond 4 sigma saturate), and the scales are returned as ``{"k_scale", "v_scale"}``
    (else ``{}``) after the usual arguments."""
    bps = -(-context // block_size)
    num_blocks = 1 + batch * bps
    key = jax.random.PRNGKey(0)
    shape = (1, num_blocks, block_size, nkv, d)
    extra = {}
    if kv_dtype is None:
        mk = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype))
    else:
        qdt = KV_QUANT_DTYPES[kv_dtype]
        scale = jnp.full((1, nkv), 4.0 / QUANT_MAX[qdt], jnp.float32)
        mk = jax.jit(lambda k: quantize_kv(jax.random.normal(k, shape, jnp.float32), scale[0],
                                           qdt))
        extra = {"k_scale": scale, "v_scale": scale}
    k_cache, v_cache = mk(key), mk(jax.random.fold_in(key, 1))
    q = jax.random.normal(jax.random.fold_in(key, 2), (batch * q_len, nq, d), dtype)
    bt = (1 + np.arange(batch * bps, dtype=np.int32)).reshape(batch, bps)
    sl = np.full(batch, context, np.int32)
    qsl = (np.arange(batch + 1) * q_len).astype(np.int32)
    args = (q, k_cache, v_cache, jnp.int32(0), jnp.asarray(bt), jnp.asarray(sl),
            jnp.asarray(qsl), jnp.asarray([batch], jnp.int32))
    return args if kv_dtype is None else (*args, extra)


def check_decode(rep: Report, batch: int, context: int, interpret: bool, nq: int, nkv: int,
                 d: int, with_reference: bool, kv_dtype: str | None = None,
                 kernel: str = "pallas") -> None:
    args = attention_inputs(batch, 1, context, nq=nq, nkv=nkv, d=d, kv_dtype=kv_dtype)
    scales = {}
    if kv_dtype is not None:
        *args, scales = args
    kv_bytes = 2 * batch * context * nkv * d * (2 if kv_dtype is None else 1)
    fn = jax.jit(functools.partial(KERNELS[kernel], sm_scale=d ** -0.5, interpret=interpret,
                                   **scales))
    t = bench_s(fn, *args, min_iters=rep.bench_iters)
    floor = kv_bytes / (rep.bandwidth_gbps * 1e9)
    row = {"ms": round(t * 1e3, 4), "floor_ms": round(floor * 1e3, 4),
               "frac_of_bw": round(floor / t, 3)}
    if with_reference:
        ref = jax.jit(functools.partial(ragged_paged_attention, sm_scale=d ** -0.5, **scales))
        tr = bench_s(ref, *args)
        row.update(xla_ms=round(tr * 1e3, 4), speedup=round(tr / t, 2))
    kv = "" if kv_dtype is None else f" kv-{kv_dtype}"
    rep.add(f"decode {kernel}{kv} b{batch} ctx{context}", **row)


def check_prefill(rep: Report, q_len: int, context: int, interpret: bool, nq: int, nkv: int,
                  d: int, with_reference: bool, kernel: str = "pallas", **knobs) -> None:
    args = attention_inputs(1, q_len, context, nq=nq, nkv=nkv, d=d)
    # causal chunk at the end of the context: keys seen per query ~ context - q_len / 2
    flops = 4 * q_len * (context - q_len / 2) * nq * d
    fn = jax.jit(functools.partial(KERNELS[kernel], sm_scale=d ** -0.5, interpret=interpret,
                                   **knobs))
    t = bench_s(fn, *args, min_iters=rep.bench_iters)
    row = {"ms": round(t * 1e3, 4), "TFLOPs": round(flops / t / 1e12, 2),
           "frac_of_peak": round(flops / t / 1e12 / rep.peak_tflops, 3),
           "peak_TFLOPs": rep.peak_tflops}
    if with_reference:
        ref = jax.jit(functools.partial(ragged_paged_attention, sm_scale=d ** -0.5))
        tr = bench_s(ref, *args)
        row.update(xla_ms=round(tr * 1e3, 4), speedup=round(tr / t, 2))
    extra = "".join(f" {k}={v}" for k, v in knobs.items())
    rep.add(f"prefill {kernel}{extra} q{q_len} ctx{context}", **row)


def check_write_kv(rep: Report, num_tokens: int, num_blocks: int, nkv: int, d: int,
                   kv_dtype: str | None = None) -> None:
    scales, dt = {}, jnp.bfloat16
    if kv_dtype is not None:  # the 8-bit cache: quantise on write (must stay an in-place scatter)
        dt = KV_QUANT_DTYPES[kv_dtype]
        scales = {"k_scale": np.full((32, nkv), 0.05, np.float32),
                  "v_scale": np.full((32, nkv), 0.05, np.float32)}
    cache = allocate_kv_cache(32, num_blocks, 16, nkv, d, dt, **scales)
    rng = np.random.default_rng(0)
    slots = jnp.asarray(rng.choice(np.arange(16, num_blocks * 16), num_tokens, replace=False)
                        .astype(np.int32))
    kn = jnp.ones((num_tokens, nkv, d), jnp.bfloat16)
    f = jax.jit(functools.partial(write_kv, k_scale=cache.k_scale, v_scale=cache.v_scale),
                donate_argnums=(0, 1))
    k, v = cache.k, cache.v
    k, v = f(k, v, jnp.int32(3), kn, kn, slots)  # compile + warm
    jax.block_until_ready(k)
    times = []
    for i in range(20):
        t = time.perf_counter()
        k, v = f(k, v, jnp.int32(i % 32), kn, kn, slots)
        jax.block_until_ready(k)
        times.append(time.perf_counter() - t)
    kv = "" if kv_dtype is None else f" kv-{kv_dtype}"
    rep.add(f"write_kv{kv} T{num_tokens} (XLA scatter)",
            us=round(float(np.median(times)) * 1e6, 1))


# -- 6. engine steps ------------------------------------------------------------------------------
def check_engine(rep: Report, model_name: str, batch: int, context: int, backend: str,
                 dtype, steps: int, kv_dtype: str | None = None) -> None:
    from jaxserve.config import EngineConfig
    from jaxserve.device.buckets import make_buckets
    from jaxserve.device.runner import ModelRunner
    from jaxserve.device.step_buffer import Chunk, RowParams
    from jaxserve.platform import current_platform
    from jaxserve.platform.base import attention_fn
    from models.config import builtin_config
    from models.llama import LlamaForCausalLM
    from models.loader import dummy_params

    cfg = builtin_config(model_name)
    block_size = 16
    bps = -(-context // block_size)
    attention = attention_fn(current_platform().attention_backend(
        EngineConfig(attention_backend=backend)))
    model = LlamaForCausalLM(cfg, dtype, attention_fn=attention)
    t0 = time.perf_counter()
    # the params' shapes come from a trace with a 1-token page, which the Mosaic GPU kernel
    # refuses: the jnp op's model traces them (the engine's loader does the same)
    params = dummy_params(LlamaForCausalLM(cfg, dtype), 0)
    jax.block_until_ready(params)
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    scales = {}
    kv_dt = dtype
    if kv_dtype is not None:  # fixed scales: this row measures time, not accuracy
        kv_dt = KV_QUANT_DTYPES[kv_dtype]
        scales = {"k_scale": np.full((cfg.num_layers, cfg.num_kv_heads), 0.05, np.float32),
                  "v_scale": np.full((cfg.num_layers, cfg.num_kv_heads), 0.05, np.float32)}
    kv = allocate_kv_cache(cfg.num_layers, 1 + batch * bps, block_size, cfg.num_kv_heads,
                           cfg.head_dim, kv_dt, **scales)
    runner = ModelRunner(model, params, kv, max_num_batched_tokens=max(8, batch),
                         max_num_seqs=batch, max_blocks_per_seq=bps,
                         vocab_limit=None)
    bucket = next(b for b in make_buckets(max(8, batch), batch) if b.num_tokens >= batch)
    # compile only the bucket this check runs (warmup would compile every bucket)
    runner.compile_bucket(bucket)
    setup_s = time.perf_counter() - t0
    rows = [RowParams(0.0, 0, 1.0, i, 0) for i in range(batch)]
    blocks = [list(range(1 + i * bps, 1 + (i + 1) * bps)) for i in range(batch)]
    times = []
    for i in range(steps + 2):
        b, packed = runner.pack_step([Chunk((100 + i,), context - 1, blk) for blk in blocks], rows)
        t = time.perf_counter()
        runner.execute(b, packed).ids  # noqa: B018 (execute returns at dispatch; wait)
        times.append(time.perf_counter() - t)
    t = float(np.median(times[2:]))
    kv_bytes = (2 * batch * context * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                * jnp.dtype(kv_dt).itemsize)
    floor = (param_bytes + kv_bytes) / (rep.bandwidth_gbps * 1e9)
    kv_name = "" if kv_dtype is None else f" kv-{kv_dtype}"
    rep.add(f"engine {model_name} {backend}{kv_name} b{batch} ctx{context}",
            ms=round(t * 1e3, 3),
            floor_ms=round(floor * 1e3, 3), frac_of_floor=round(floor / t, 3),
            setup_s=round(setup_s, 1))
    del runner, params, kv


# -- main -----------------------------------------------------------------------------------------
def print_table(rows: list[dict]) -> None:
    """check | status | ms | xla_ms | floor_ms | fraction (of bandwidth / floor / peak) | rest."""
    fixed = ["check", "status", "ms", "xla_ms", "floor_ms"]
    fracs = ("frac_of_bw", "frac_of_floor", "frac_of_peak")
    header = fixed + ["fraction", "detail"]
    cells = []
    for r in rows:
        frac = next((f"{r[k]} ({k[8:]})" for k in fracs if k in r), "")
        rest = " ".join(f"{k}={v}" for k, v in r.items() if k not in fixed and k not in fracs)
        cells.append([str(r.get(k, "")) for k in fixed] + [frac, rest])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print("\n" + line + "\n" + "-" * len(line))
    for c in cells:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU, kernel in interpret mode")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for all rows (default 270; 500 in a dry run: interpret mode)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--only", action="append", default=[], metavar="PREFIX",
                   help="run only the checks whose names start with PREFIX (repeatable); the "
                        "others are rows marked skipped")
    a = p.parse_args()
    dry = a.dry_run
    rep = Report(a.budget_s or (500.0 if dry else 270.0), tuple(a.only))
    devices = jax.devices()
    rep.add("device", platform=devices[0].platform, kind=devices[0].device_kind.replace(" ", "_"),
            jax=jax.__version__)
    if not dry and devices[0].platform != "gpu":
        print("no GPU found; use --dry-run on the CPU", file=sys.stderr)
        return 2
    nq, nkv, d = (4, 2, 16) if dry else (32, 8, 128)
    figures = device_figures(devices[0].device_kind)
    if figures is not None and not dry:
        rep.peak_tflops = figures.bf16_flops / 1e12
    rep.bench_iters = 1 if dry else 3
    model, batch, ctx, dt = ("tiny", 4, 64, jnp.float32) if dry else \
        ("llama-3.1-8b", 64, 4096, jnp.bfloat16)

    rep.run("copy bandwidth", check_bandwidth, (16 << 20) if dry else (4 << 30), need_s=5)
    # the Mosaic GPU kernel first: its correctness, then both kernels at the points
    # (a dry run interprets a call in seconds: one split count each, two sequences a batch)
    for group, head_dim in ([(2, 16)] if dry else [(3, 64), (4, 128)]):
        rep.run(f"mosaic correct g{group} d{head_dim}", check_correctness, dry, group,
                head_dim, "mosaic", (4,) if dry else (1, 4), need_s=5)
    rep.run("mosaic correct kv-fp8", check_correctness_quant, dry, 2 if dry else 4,
            32 if dry else 128, "fp8", "mosaic", (1,) if dry else (1, 4), need_s=5)
    for b, c in ([(2, 64)] if dry else [(64, 4096), (256, 16384)]):
        for kernel in ("mosaic", "pallas"):
            rep.run(f"decode {kernel} b{b} ctx{c}", check_decode, b, c, dry, nq, nkv, d, False,
                    None, kernel, need_s=8)
    q_len, p_ctx = (16, 64) if dry else (512, 4096)
    for kernel, knobs in (("mosaic", {}), ("mosaic", {"p_in_smem": True}), ("pallas", {})):
        rep.run(f"prefill {kernel}" + "".join(f" {k}={v}" for k, v in knobs.items()),
                check_prefill, q_len, p_ctx, dry, nq, nkv, d, False, kernel, **knobs, need_s=8)
    b, c = (2, 64) if dry else (64, 4096)
    rep.run(f"decode mosaic kv-fp8 b{b} ctx{c}", check_decode, b, c, dry, nq, nkv,
            max(d, 32), False, "fp8", "mosaic", need_s=8)  # 8-bit pages: head_dim >= 32
    if dry:  # ~40 interpreted CTAs a step: minutes; the kernel's engine test covers it
        rep.add("engine mosaic", DRY_SKIP)
    else:  # bfloat16 (a 16-bit cache)
        rep.run("engine mosaic", check_engine, model, batch, ctx, "mosaic", jnp.bfloat16, 10,
                need_s=90)

    # the Triton kernel's rows, as time allows
    for group, head_dim in ([(3, 16)] if dry else [(3, 64), (4, 128), (1, 256)]):
        rep.run(f"correct g{group} d{head_dim}", check_correctness, dry, group, head_dim, need_s=5)
    grid = [(8, 64)] if dry else [(b, c) for b in (8, 64, 256) for c in (512, 4096, 16384)
                                  if (b, c) not in ((64, 4096), (256, 16384))]
    for batch_, ctx_ in grid:
        with_ref = not dry and batch_ * ctx_ <= 64 * 16384
        rep.run(f"decode pallas b{batch_} ctx{ctx_} vs XLA", check_decode, batch_, ctx_, dry, nq,
                nkv, d, with_ref, need_s=8)
    for kv_dtype in ("fp8", "int8"):  # the 8-bit cache: correctness, decode at b64 ctx4k, write
        rep.run(f"write_kv kv-{kv_dtype} T64", check_write_kv, 8 if dry else 64,
                64 if dry else 16384, nkv, d, kv_dtype, need_s=5)
        rep.run(f"correct kv-{kv_dtype}", check_correctness_quant, dry, 3 if dry else 4,
                16 if dry else 128, kv_dtype, need_s=5)
        b, c = (8, 64) if dry else (64, 4096)
        rep.run(f"decode pallas kv-{kv_dtype} b{b} ctx{c}", check_decode, b, c, dry, nq, nkv, d,
                not dry, kv_dtype, need_s=8)
    for num_tokens in ((8,) if dry else (64, 512)):
        rep.run(f"write_kv T{num_tokens}", check_write_kv, num_tokens, 64 if dry else 16384,
                nkv, d, need_s=5)
    rep.run("engine pallas", check_engine, model, batch, ctx,
            "pallas-interpret" if dry else "pallas", dt, 3 if dry else 10, need_s=90)
    rep.run("engine reference", check_engine, model, batch, ctx, "reference", dt,
            3 if dry else 10, need_s=90)
    rep.run("engine pallas kv-fp8", check_engine, model, batch, ctx,
            "pallas-interpret" if dry else "pallas", dt, 3 if dry else 10, "fp8", need_s=60)

    rep.add("total", s=round(time.perf_counter() - rep.t0, 1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rep.rows, fh, indent=1)
    print_table(rep.rows)
    return 1 if any(r["status"] == "FAIL" for r in rep.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
