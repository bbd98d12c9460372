"""A/B of ``sampler.sample`` alone: two (or more) sampler.py files on the same decode logits.

    PYTHONPATH=. python experiments/2026-12-01-sampler-fast/sampler_ab.py \\
        --baseline /path/to/old/sampler.py --rows 64 --rounds 30

The logits are one batch-``--rows`` decode step of the default model (SmolLM2-135M, vocab 49152)
on random prompt ids, as ``jaxserve bench step`` makes them (captured once to ``--logits``).
Each sampling kind runs jitted under every sampler file in turn, round-robin (so load drifts
hit all alike); printed per kind and file: min / p25 / median wall ms and mean CPU ms (all
threads, getrusage), the figure to trust on a loaded machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

KINDS = {"greedy": {}, "temp 1": {"temperature": 1.0},
         "t0.7 p0.95": {"temperature": 0.7, "top_p": 0.95},
         "t1 p0.9": {"temperature": 1.0, "top_p": 0.9},
         "top_k 200": {"temperature": 1.0, "top_k": 200},
         "top_k 50": {"temperature": 1.0, "top_k": 50},
         "min_p 0.05": {"temperature": 1.0, "min_p": 0.05}}


def capture_logits(path: str, rows: int) -> None:
    """One decode step's logits of ``rows`` random-prompt sequences, saved to ``path``."""
    import jaxserve.device.runner as runner_mod
    from jaxserve.config import EngineConfig, LoadConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    saved, orig = [], runner_mod.sample

    def sample(logits, rows_in, state=None, vocab_limit=None):
        jax.debug.callback(lambda lg: saved.append(np.asarray(lg)), logits)
        return orig(logits, rows_in, state, vocab_limit)

    runner_mod.sample = sample
    eng = LLMEngine(EngineConfig(max_num_seqs=rows, max_model_len=128), LoadConfig(None, "auto"))
    runner, execute = eng.runner, eng.runner.execute

    def lazy(bucket, packed, allowed=None):  # compile only the buckets this run uses
        if bucket not in runner.compiled:
            runner.compile_bucket(bucket)
        return execute(bucket, packed, allowed)

    runner.execute = lazy
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    for i in range(rows):
        eng.add_request(f"r{i}", rng.integers(0, eng.tokenizer.vocab_size, 64).tolist(), params)
    while eng.has_unfinished_requests():
        eng.step()
    np.save(path, [s for s in saved if s.shape[0] == rows][-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", action="append", default=[],
                   help="another sampler.py to time beside jaxserve's (repeatable)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--logits", default="/tmp/sampler_ab_logits.npy")
    ns = p.parse_args()
    if not os.path.exists(ns.logits):
        capture_logits(ns.logits, ns.rows)
    files = {f"base{i}": f for i, f in enumerate(ns.baseline)}
    files["jaxserve"] = os.path.join(os.path.dirname(__file__), "../../jaxserve/device/sampler.py")
    mods = {}
    for name, f in files.items():
        spec = importlib.util.spec_from_file_location(f"sampler_{name}", f)
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    x = jnp.asarray(np.load(ns.logits)[: ns.rows])
    n = x.shape[0]

    def rows(mod, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0):
        full = lambda v, dt: jnp.full(n, v, dt)
        return mod.RowInputs(
            full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
            full(min_p, jnp.float32),
            jnp.stack([jnp.zeros(n, jnp.uint32), jnp.arange(n, dtype=jnp.uint32)], 1),
            full(0, jnp.int32), full(1 << 20, jnp.int32), full(1.0, jnp.float32),
            full(0.0, jnp.float32), full(0.0, jnp.float32))

    fns = {}
    for name, mod in mods.items():
        f = jax.jit(mod.sample)
        for kind, kw in KINDS.items():
            r = rows(mod, **kw)
            f(x, r).block_until_ready()
            fns[kind, name] = f, r
    wall = {k: [] for k in fns}
    cpu = dict.fromkeys(fns, 0.0)
    for _ in range(ns.rounds):
        for k, (f, r) in fns.items():
            c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            f(x, r).block_until_ready()
            t1, c1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            wall[k].append(1e3 * (t1 - t0))
            cpu[k] += 1e3 * (c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime) / ns.rounds
    print(f"[{n}, {x.shape[1]}] logits, {ns.rounds} rounds, load average {os.getloadavg()}")
    print(f"{'kind':<12}{'sampler':<10}{'min ms':>8}{'p25 ms':>8}{'med ms':>8}{'cpu ms':>8}")
    for kind in KINDS:
        for name in mods:
            v = sorted(wall[kind, name])
            print(f"{kind:<12}{name:<10}{v[0]:8.2f}{v[len(v) // 4]:8.2f}{v[len(v) // 2]:8.2f}"
                  f"{cpu[kind, name]:8.2f}")


if __name__ == "__main__":
    main()
