"""Where a prefill or decode step's device time goes, per XLA op (``jax.profiler``).

    python -m benchmarks.op_profile --phase decode --batch 16 --context 300 --steps 10
    python -m benchmarks.op_profile --phase prefill --batch 4 --context 256

Builds one engine (``--engine-args``, prefix caching off, synchronous steps). ``decode``:
``--batch`` prompts of ``--context`` random tokens are prefilled, a few decode steps run
untraced, then ``--steps`` decode steps are traced. ``prefill``: the ``--batch`` prompts
themselves are traced, from ``add_request`` until each has its first token (with the default
token budget, 4 x 256 tokens are one 1024-token step). The op events of the trace are summed by
name and divided by the traced steps; the table lists the ``--top`` largest.

Op events are summed over XLA's threads (a multi-threaded dot counts once per thread), a
``while`` event spans its body's ops, and tracing inflates small ops: read shares, not
milliseconds (docs/decisions/0034-native-prefill-attention.md).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.common import SEED, add_model_args, build_engine, format_table, write_json
from benchmarks.engine_ab import start_decoding
from jaxserve import SamplingParams

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine

OP_PREFIXES = ("fusion", "ynn", "dot", "copy", "gather", "scatter", "while", "reduce",
               "convert", "custom-call", "wrapped", "dynamic", "broadcast", "multiply", "add",
               "subtract", "select")
UNTRACED_DECODE_STEPS = 3


def op_times(trace_dir: str, num_steps: int) -> tuple[dict[str, float], dict[str, int]]:
    """Per op name: ms per step and events per step, from the ``*.trace.json.gz`` under
    ``trace_dir``.

    Raises:
      FileNotFoundError: the profiler wrote no trace there.
    """
    paths = sorted(Path(trace_dir).rglob("*.trace.json.gz"))
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1]) as fh:
        trace = json.load(fh)
    ms: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        name, args = ev.get("name", ""), ev.get("args", {})
        if "hlo_op" in args or "long_name" in args or name.startswith(OP_PREFIXES):
            ms[name] += ev["dur"] / 1e3 / num_steps
            count[name] += 1
    return dict(ms), {k: v // num_steps for k, v in count.items()}


def _traced(work: Callable[[], int]) -> tuple[int, float, str]:
    """Run ``work()`` (returns its step count) under ``jax.profiler``: (steps, wall ms, dir)."""
    import jax

    trace_dir = tempfile.mkdtemp(prefix="op_profile-")
    jax.profiler.start_trace(trace_dir)
    t0 = time.perf_counter()
    try:
        steps = work()
    finally:
        wall = 1e3 * (time.perf_counter() - t0)
        jax.profiler.stop_trace()
    return steps, wall, trace_dir


def run(ns: argparse.Namespace, engine: LLMEngine | None = None) -> dict[str, Any]:
    """Profile the steps, print the table; returns the result dict.

    ``engine``: a warmed-up, idle ``LLMEngine`` to use instead of building one.
    """
    if engine is None:
        engine = build_engine(ns.model, ns.load_format, {
            "max_num_seqs": max(ns.batch, 1), "max_model_len": ns.context + ns.steps + 32,
            **ns.engine_args})
    rng = np.random.default_rng(SEED)
    vocab = max(101, min(engine.tokenizer.vocab_size, 40000))
    prompts = [rng.integers(100, vocab, ns.context).tolist() for _ in range(ns.batch)]
    ids = [f"profile-{i}" for i in range(ns.batch)]
    if ns.phase == "decode":
        start_decoding(engine, "profile", prompts, ns.steps + UNTRACED_DECODE_STEPS + 8)
        for _ in range(UNTRACED_DECODE_STEPS):
            engine.step()

        def work() -> int:
            for _ in range(ns.steps):
                engine.step()
            return ns.steps
    else:
        def work() -> int:
            pending, steps = set(ids), 0
            for rid, p in zip(ids, prompts, strict=True):
                engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=1))
            while pending:
                steps += 1
                for out in engine.step():
                    if out.outputs and out.outputs[0].token_ids:
                        pending.discard(out.request_id)
            return steps
    steps, wall, trace_dir = _traced(work)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    ms, count = op_times(trace_dir, steps)
    total = sum(ms.values())
    top = sorted(ms.items(), key=lambda kv: -kv[1])[:ns.top]
    print(f"{ns.phase}, batch {ns.batch}, context {ns.context}: {steps} traced steps, "
          f"{wall / steps:.1f} ms a traced step, {total:.1f} ms of op events a step")
    print(format_table(["op", "ms/step", "share %", "events/step"],
                       [(name, t, 100 * t / total if total else 0.0, count[name])
                        for name, t in top]), flush=True)
    result = {"phase": ns.phase, "batch": ns.batch, "context": ns.context, "seed": SEED,
              "traced_steps": steps, "wall_ms_per_step": wall / steps,
              "op_ms_per_step": total, "ops": [{"name": n, "ms_per_step": t,
                                                "events_per_step": count[n]} for n, t in top]}
    write_json(ns.json, result)
    return result


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.op_profile",
                                description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    p.add_argument("--batch", type=int, default=16, help="sequences (prompts) in the steps")
    p.add_argument("--context", type=int, default=300, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="decode steps traced")
    p.add_argument("--top", type=int, default=30, help="ops listed")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
