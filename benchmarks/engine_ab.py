"""Engines with different settings side by side in one process, steps interleaved.

    python -m benchmarks.engine_ab --config f32:dtype=float32 --config bf16:dtype=bfloat16 \\
        --batches 1,16,64 --context 300 --prefill-lens 256,1024 --rounds 4 --steps 5 \\
        --json results/engine_ab.json

Each ``--config NAME:KEY=VALUE,...`` is one engine: ``EngineConfig`` fields over the shared
``--engine-args`` and the harness defaults (prefix caching off, synchronous steps, no
compilation cache). All engines are built and warmed up first; then
  prefill: per ``--prefill-lens`` length and round, each engine in turn runs one prompt alone,
           timed from ``add_request`` to its first token (its prefill steps);
  decode:  per ``--batches`` size, each engine prefills ``B`` prompts of ``--context`` tokens,
           then round by round each runs ``--steps`` decode steps.
Prints the median wall and process CPU ms per engine (CPU time moves less with a shared
machine's load than wall time). The same prompts go to every engine (numpy seed 0).

A shared, drifting machine makes separate runs incomparable; alternating the engines in one
process is what the decision records rely on (docs/decisions/0030-cpu-dtype-zen4.md). Typical
uses: weight dtypes (``dtype=``), kernels (``attention_backend=``, ``cpu_kernels=``), quantisation, KV-cache dtype,
and the decode step against the cache size (``--config small:num_kv_blocks=256 --config
large:num_kv_blocks=4096``: equal steps show the cache is updated in place, never copied).
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.common import (
    SEED,
    add_config_flag,
    add_model_args,
    build_engine,
    cpu_seconds,
    format_table,
    int_list,
    median,
    parse_configs,
    write_json,
)
from jaxserve import SamplingParams

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine

DECODE_HEADROOM = 8  # tokens a decoding request may still make after the timed steps


def _prompt(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(100, max(101, min(vocab, 40000)), n).tolist()


def time_prefill(engine: LLMEngine, request_id: str, ids: list[int]) -> tuple[float, float]:
    """Wall and CPU ms from ``add_request`` of one prompt to its first (only) token."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * (time.perf_counter() - t0), 1e3 * (cpu_seconds() - c0)


def start_decoding(engine: LLMEngine, prefix: str, prompts: list[list[int]], max_tokens: int) -> None:
    """Add the prompts and step until every one has its first token, then one step more."""
    pending = set()
    for i, ids in enumerate(prompts):
        rid = f"{prefix}-{i}"
        engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                    ignore_eos=True))
        pending.add(rid)
    while pending:
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                pending.discard(out.request_id)
    engine.step()


def run(ns: argparse.Namespace, engines: dict[str, LLMEngine] | None = None) -> dict[str, Any]:
    """Build the engines, run both phases, print the table; returns the result dict.

    ``engines`` (name -> a warmed-up, idle ``LLMEngine``) replaces building them from
    ``ns.config``; the same engine may appear under two names.

    Raises:
      ValueError: two configs with one name, or a bad engine setting.
    """
    configs = parse_configs(ns.config)
    shared = {"max_num_seqs": max([*ns.batches, 1]),
              "max_model_len": max([*ns.prefill_lens, ns.context]) + ns.rounds * ns.steps
              + 2 * DECODE_HEADROOM, **ns.engine_args}
    if engines is None:
        engines = {name: build_engine(ns.model, ns.load_format, {**shared, **kw})
                   for name, kw in configs.items()}
    vocab = next(iter(engines.values())).tokenizer.vocab_size
    rng = np.random.default_rng(SEED)
    rows, result = [], {"configs": configs, "engine_args": shared, "seed": SEED,
                        "prefill": {}, "decode": {}}
    for n in ns.prefill_lens:
        wall: dict[str, list[float]] = {k: [] for k in engines}
        cpu: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(ns.rounds):
            ids = _prompt(rng, vocab, n)
            for name, eng in engines.items():
                w, c = time_prefill(eng, f"{name}-p{n}-{r}", ids)
                wall[name].append(w)
                cpu[name].append(c)
        result["prefill"][n] = {k: {"median_ms": median(wall[k]), "median_cpu_ms": median(cpu[k])}
                                for k in engines}
        rows += [(f"prefill {n}", k, v["median_ms"], v["median_cpu_ms"])
                 for k, v in result["prefill"][n].items()]
    for b in ns.batches:
        prompts = [_prompt(rng, vocab, ns.context) for _ in range(b)]
        for name, eng in engines.items():
            start_decoding(eng, f"{name}-d{b}", prompts, ns.rounds * ns.steps + DECODE_HEADROOM)
        wall = {k: [] for k in engines}
        cpu = {k: [] for k in engines}
        for _ in range(ns.rounds):
            for name, eng in engines.items():
                for _ in range(ns.steps):
                    c0, t0 = cpu_seconds(), time.perf_counter()
                    eng.step()
                    wall[name].append(1e3 * (time.perf_counter() - t0))
                    cpu[name].append(1e3 * (cpu_seconds() - c0))
        for name, eng in engines.items():
            eng.abort_request([f"{name}-d{b}-{i}" for i in range(b)])
            while eng.has_unfinished_requests():
                eng.step()
        result["decode"][b] = {k: {"median_ms": median(wall[k]), "median_cpu_ms": median(cpu[k])}
                               for k in engines}
        rows += [(f"decode b{b} ctx {ns.context}", k, v["median_ms"], v["median_cpu_ms"])
                 for k, v in result["decode"][b].items()]
    print(format_table(["step", "engine", "median ms", "median CPU ms"], rows), flush=True)
    write_json(ns.json, result)
    return result


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_ab",
                                description=__doc__.split("\n")[0])
    add_model_args(p)
    add_config_flag(p)
    p.add_argument("--batches", type=int_list, default=[1, 16, 64],
                   help="decode batch sizes, comma-separated (empty: no decode phase)")
    p.add_argument("--context", type=int, default=300, help="prompt tokens before decoding")
    p.add_argument("--prefill-lens", type=int_list, default=[256],
                   help="lone prompt lengths, comma-separated (empty: no prefill phase)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="decode steps per engine and round")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
