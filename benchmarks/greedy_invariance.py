"""Does a greedy request's output depend on the load it is served under? (issue 46's matrix)

    python -m benchmarks.greedy_invariance --engine-args dtype=bfloat16 --json inv.json

One engine (the serving defaults but for ``--engine-args``: prefix caching and async scheduling
on, unlike the other harnesses). Probe prompts of ``--lens`` tokens (cut from the bundled
Pride and Prejudice text, so their next tokens are not near ties of random ids; the defaults
sit at and around the KV block boundaries 16 and 32) are each run alone first, greedy, with
``--max-tokens`` outputs and EOS ignored: the reference. Then, on the same engine:

  again       each probe alone once more (its prompt's full blocks now a prefix-cache hit)
  batchN      the probes among ``N - len(probes)`` other prompts of 50-400 tokens, all added at
              once (``--batches``; their prompts chunked wherever the step budget falls)
  staggered   24 long-running requests first, the probes added after 6 of their steps
  aborted     the probes beside three 900-token prompts that are aborted after one step, in
              the middle of their chunked prefill

Each scenario reports the probes whose token ids differ from their reference (by length) and
the first differing output position, and how many probes' sampled-token logprobs differ from
the reference in any bit (0 where the engine is batch-invariant; identical tokens with other
logprobs show a load-dependent rounding that has not flipped a token yet). Preemption and the host tier: run it again with
``--engine-args num_kv_blocks=160`` (a pool that forces recompute) or
``kv_offloading_size=0.5``; a scenario's ``preemptions`` says whether any happened.

Across engines: the JSON keeps the reference outputs, and ``--reference PATH`` compares this
run's against another run's (the ``reference`` scenario), e.g. a step budget that splits the
prompts elsewhere (``--engine-args max_num_batched_tokens=64``) or ``--ready-buckets-only``
(every step in the buckets a deferred start-up serves with before its background compile ends,
``jaxserve.device.buckets.ready_buckets``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from benchmarks.common import SEED, format_table, int_list, parse_settings, write_json

SERVING: dict[str, Any] = {"max_model_len": 1024, "compilation_cache_dir": "~/.cache/jaxserve/xla"}


def build_parser() -> argparse.ArgumentParser:
    """The harness's flags (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.greedy_invariance",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="as jaxserve.LLM's model (default model)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--engine-args", type=parse_settings, default={},
                   help=f"EngineConfig fields, KEY=VALUE,... (over {SERVING})")
    p.add_argument("--lens", type=int_list, default=[15, 16, 17, 31, 32, 33, 100, 300],
                   help="probe prompt lengths in tokens")
    p.add_argument("--max-tokens", type=int, default=48, help="greedy outputs per request")
    p.add_argument("--batches", type=int_list, default=[16, 64],
                   help="batch sizes the probes run in (each at least len(--lens))")
    p.add_argument("--ready-buckets-only", action="store_true",
                   help="steps use only the ready buckets, as before a background compile ends")
    p.add_argument("--reference", default=None, metavar="PATH",
                   help="another run's JSON (same --lens and --max-tokens) to compare the "
                        "reference outputs with")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    return p


def _text_ids(engine: Any) -> list[int]:
    from jaxserve.eval.inputs import DEFAULT_CORPUS

    with open(DEFAULT_CORPUS, encoding="utf-8") as fh:
        return engine.tokenizer.encode(fh.read())


Outputs = tuple[list[list[int]], list[list[float]]]
"""Per request, in order: its token ids, and its sampled tokens' logprobs."""


def _run(engine: Any, prompts: list[list[int]], tag: str, params: Any) -> Outputs:
    """Add every prompt, step until idle; the outputs in prompt order."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    return _finish(engine, [f"{tag}-{i}" for i in range(len(prompts))])


def _finish(engine: Any, request_ids: list[str]) -> Outputs:
    """Step until idle; the outputs of ``request_ids`` (added already), in that order."""
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    outs = [done[r] for r in request_ids]
    return ([list(o.token_ids) for o in outs],
            [[lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)] for o in outs])


def _differences(lens: list[int], ref: list[list[int]], got: list[list[int]]
                 ) -> list[dict[str, int]]:
    return [{"len": n, "first_position": next(i for i, (a, b) in enumerate(zip(r, g)) if a != b)
             if len(r) == len(g) and r != g else min(len(r), len(g))}
            for n, r, g in zip(lens, ref, got, strict=True) if r != g]


def run(ns: argparse.Namespace, engine: Any = None) -> dict[str, Any]:
    """Run the matrix (module docstring); print the table, write ``--json``, return the
    result. ``engine``: a built ``LLMEngine`` to use instead of building one (tests).

    Raises:
      ValueError: a batch smaller than the probes, or a probe longer than the text.
    """
    from jaxserve import LLM

    if any(b < len(ns.lens) for b in ns.batches):
        raise ValueError(f"--batches {ns.batches}: each must be >= {len(ns.lens)} probes")
    other = None
    if ns.reference is not None:
        with open(ns.reference, encoding="utf-8") as fh:
            other = json.load(fh)
        if other.get("lens") != ns.lens or other.get("max_tokens") != ns.max_tokens:
            raise ValueError(f"--reference {ns.reference}: its lens and max_tokens differ")
    if engine is None:
        engine = LLM(ns.model, load_format=ns.load_format,
                     **{**SERVING, **ns.engine_args}).engine
    engine.use_ready_buckets_only(ns.ready_buckets_only)
    try:
        return _matrix(ns, engine, other)
    finally:
        engine.use_ready_buckets_only(False)


def _matrix(ns: argparse.Namespace, engine: Any, other: dict | None) -> dict[str, Any]:
    from jaxserve import SamplingParams

    ids, rng = _text_ids(engine), np.random.default_rng(SEED)
    if max(ns.lens) >= len(ids) or max(ns.lens) >= engine.max_model_len - ns.max_tokens:
        raise ValueError(f"--lens up to {max(ns.lens)} do not fit the text or max_model_len")

    def cut(n: int) -> list[int]:
        start = int(rng.integers(0, len(ids) - n))
        return ids[start:start + n]

    top = min(400, engine.max_model_len - 4 * ns.max_tokens - 1)  # room for the staggered

    def others(k: int) -> list[list[int]]:
        return [cut(int(rng.integers(min(50, top // 2), top))) for _ in range(k)]

    greedy = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    probes = [cut(n) for n in ns.lens]

    def each_alone(tag: str) -> Outputs:
        runs = [_run(engine, [p], f"{tag}{i}", greedy) for i, p in enumerate(probes)]
        return [r[0][0] for r in runs], [r[1][0] for r in runs]

    ref, ref_lp = each_alone("alone")
    scenarios: dict[str, dict[str, Any]] = {}

    def record(name: str, got: Outputs, preempted_before: int) -> None:
        ids, lps = got[0][:len(probes)], got[1][:len(probes)]
        scenarios[name] = {"differ": _differences(ns.lens, ref, ids),
                           "logprobs_differ": [n for n, a, b in zip(ns.lens, ref_lp, lps)
                                               if a != b],
                           "preemptions": engine.num_preemptions_total
                           - preempted_before}

    before = engine.num_preemptions_total
    record("again", each_alone("again"), before)
    for size in ns.batches:
        before = engine.num_preemptions_total
        got = _run(engine, probes + others(size - len(probes)), f"batch{size}", greedy)
        record(f"batch{size}", got, before)
    before = engine.num_preemptions_total
    long_running = SamplingParams(max_tokens=4 * ns.max_tokens, temperature=0.0,
                                  ignore_eos=True)
    for i, p in enumerate(others(24)):
        engine.add_request(f"busy-{i}", p, long_running)
    for _ in range(6):
        engine.step()
    record("staggered", _run(engine, probes, "staggered", greedy), before)
    before = engine.num_preemptions_total
    long_prompts = [cut(min(900, engine.max_model_len - ns.max_tokens - 1)) for _ in range(3)]
    for i, p in enumerate(long_prompts):
        engine.add_request(f"doomed-{i}", p, greedy)
    for i, p in enumerate(probes):
        engine.add_request(f"aborted-{i}", p, greedy)
    engine.step()
    engine.abort_request([f"doomed-{i}" for i in range(len(long_prompts))])
    record("aborted", _finish(engine, [f"aborted-{i}" for i in range(len(probes))]), before)
    if other is not None:
        other_lp = other.get("reference_logprobs") or [None] * len(ns.lens)
        scenarios["reference"] = {"differ": _differences(ns.lens, other["reference"], ref),
                                  "logprobs_differ": [n for n, a, b in zip(ns.lens, other_lp,
                                                                           ref_lp) if a != b],
                                  "preemptions": 0}
    result = {"dtype": str(engine.dtype), "lens": ns.lens, "max_tokens": ns.max_tokens,
              "engine_args": ns.engine_args, "ready_buckets_only": ns.ready_buckets_only,
              "batch_invariant": engine.platform.batch_invariant(engine.config),
              "reference": ref, "reference_logprobs": ref_lp, "scenarios": scenarios}
    print(format_table(["scenario", "probes differing", "lens (first differing output)",
                        "logprobs differing", "preemptions"],
                       [(name, len(s["differ"]), " ".join(
                           f"{d['len']}({d['first_position']})" for d in s["differ"]) or "-",
                         len(s["logprobs_differ"]), s["preemptions"])
                        for name, s in scenarios.items()]), flush=True)
    write_json(ns.json, result)
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv``, run, exit status 0."""
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
