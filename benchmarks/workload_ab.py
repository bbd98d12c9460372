"""Engines with different settings on one request workload, interleaved: per-step p50 and p99.

    python -m benchmarks.workload_ab --model tiny --load-format dummy \\
        --config off: --config fpm:forward_pass_metrics_port=20380 --config off2: \\
        --requests 100 --rounds 6 --json results/workload_ab.json

Each ``--config NAME:KEY=VALUE,...`` is one engine: ``EngineConfig`` fields over the shared
``--engine-args`` and the harness defaults (``benchmarks.common.ENGINE_DEFAULTS``, but async
scheduling on, as served). All engines are built and warmed up first. Then, round by round,
each engine in turn (the order reversed every other round, so a drift of the machine falls on
both sides) serves the same workload alone: ``--requests`` requests of ``--prompt-lens`` prompt
tokens and ``--output-lens`` output tokens (uniform, numpy seed 0), ``--wave`` of them added
every ``--wave-steps`` engine steps, stepped until all finish. Every ``engine.step()`` call is
timed (wall, and the process's CPU seconds over it: every thread's, a publisher thread's
included). Prints per engine the p50 and p99 step time over all rounds, and the spread of the
per-round p50s and p99s: a setting whose effect is smaller than the spread between rounds of
one engine (or between two engines of the same settings, e.g. ``off`` and ``off2``) is within
the machine's noise. Meant for settings that add work to each step, such as
``forward_pass_metrics_port`` or ``kv_events_config``.
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
    parse_configs,
    write_json,
)
from jaxserve import SamplingParams

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine


def workload(ns: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """``(prompt ids, max_tokens)`` per request, drawn once (numpy seed ``SEED``)."""
    rng = np.random.default_rng(SEED)
    lo, hi = ns.prompt_lens
    olo, ohi = ns.output_lens
    return [(rng.integers(100, max(101, min(vocab, 40000)), int(rng.integers(lo, hi + 1))
                          ).tolist(), int(rng.integers(olo, ohi + 1)))
            for _ in range(ns.requests)]


def serve(engine: LLMEngine, name: str, requests: list[tuple[list[int], int]], wave: int,
          wave_steps: int) -> tuple[list[float], list[float]]:
    """Run the workload on ``engine``; the wall and CPU ms of each ``step()`` call."""
    wall: list[float] = []
    cpu: list[float] = []
    pending = list(enumerate(requests))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % wave_steps == 0:
            for i, (ids, max_tokens) in pending[:wave]:
                engine.add_request(f"{name}-{i}", ids, SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            pending = pending[wave:]
        c0, t0 = cpu_seconds(), time.perf_counter()
        engine.step()
        wall.append(1e3 * (time.perf_counter() - t0))
        cpu.append(1e3 * (cpu_seconds() - c0))
        steps += 1
    engine.step()  # the async loop's last read
    return wall, cpu


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (numpy's linear rule), NaN for no values."""
    return float(np.percentile(values, q)) if values else float("nan")


def run(ns: argparse.Namespace, engines: dict[str, LLMEngine] | None = None) -> dict[str, Any]:
    """Build the engines, run the rounds, print the table; returns the result dict.

    ``engines`` (name -> a warmed-up, idle ``LLMEngine``) replaces building them from
    ``ns.config``.

    Raises:
      ValueError: two configs with one name, or a bad engine setting.
    """
    configs = parse_configs(ns.config)
    shared = {"async_scheduling": True, "max_model_len": ns.prompt_lens[1] + ns.output_lens[1],
              **ns.engine_args}
    if engines is None:
        engines = {name: build_engine(ns.model, ns.load_format, {**shared, **kw})
                   for name, kw in configs.items()}
    requests = workload(ns, next(iter(engines.values())).tokenizer.vocab_size)
    wall: dict[str, list[list[float]]] = {k: [] for k in engines}
    cpu: dict[str, list[list[float]]] = {k: [] for k in engines}
    order = list(engines)
    for r in range(ns.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            w, c = serve(engines[name], f"{name}-{r}", requests, ns.wave, ns.wave_steps)
            wall[name].append(w)
            cpu[name].append(c)
    result: dict[str, Any] = {"configs": configs, "engine_args": shared, "seed": SEED,
                              "requests": ns.requests, "rounds": ns.rounds, "engines": {}}
    rows = []
    for name in engines:
        pooled = [x for rnd in wall[name] for x in rnd]
        pooled_cpu = [x for rnd in cpu[name] for x in rnd]
        p50s = [percentile(rnd, 50) for rnd in wall[name]]
        p99s = [percentile(rnd, 99) for rnd in wall[name]]
        e = {"num_steps": len(pooled), "p50_ms": percentile(pooled, 50),
             "p99_ms": percentile(pooled, 99), "cpu_p50_ms": percentile(pooled_cpu, 50),
             "cpu_p99_ms": percentile(pooled_cpu, 99), "round_p50_ms": p50s,
             "round_p99_ms": p99s}
        result["engines"][name] = e
        rows.append((name, e["num_steps"], e["p50_ms"], f"{min(p50s):.2f}-{max(p50s):.2f}",
                     e["p99_ms"], f"{min(p99s):.1f}-{max(p99s):.1f}", e["cpu_p50_ms"],
                     e["cpu_p99_ms"]))
    print(format_table(["engine", "steps", "p50 ms", "round p50s", "p99 ms", "round p99s",
                        "CPU p50", "CPU p99"], rows), flush=True)
    write_json(ns.json, result)
    return result


def _range(text: str) -> tuple[int, int]:
    lo, hi = int_list(text)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r} must be LO,HI with 1 <= LO <= HI")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.workload_ab",
                                description=__doc__.split("\n")[0])
    add_model_args(p)
    add_config_flag(p)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--prompt-lens", type=_range, default=(8, 96), metavar="LO,HI")
    p.add_argument("--output-lens", type=_range, default=(4, 48), metavar="LO,HI")
    p.add_argument("--wave", type=int, default=25, help="requests added at once")
    p.add_argument("--wave-steps", type=int, default=10, help="engine steps between waves")
    p.add_argument("--rounds", type=int, default=6)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
