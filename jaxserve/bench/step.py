"""``jaxserve bench step``: the time of one engine step, per batch size and sampling mode.

    jaxserve bench step --batch-sizes 1,8,32 --context 128 --modes greedy,sampled,penalties \\
        --kv-cache-dtype int8 --output-json results/step.json

One in-process ``LLMEngine`` (loaded and compiled once, any engine flags). For each sampling
mode and batch size, ``batch`` requests of ``--context`` random prompt ids (fixed seed, EOS
ignored) are prefilled, then ``--num-steps`` decode steps (one token per sequence) are timed
after two untimed ones. Each ``engine.step()`` is split, from the engine's step report
(``LLMEngine.add_step_listener``), into:
  device  from the step's dispatch to its sampled ids on the host: the compiled program;
  host    the rest of the step: scheduling, packing the inputs, updating the requests.
  cpu     the process's CPU seconds over the step (every thread: XLA's, the engine's), which a
          busy shared machine disturbs less than the wall time.
The engine runs the synchronous loop here (async scheduling is switched off after start-up), so
that each step reads its own ids and its whole time is its own: ``host`` is the part that async
scheduling overlaps with the device (measure the overlap itself with ``--step-trace``).
Prefill steps are reported per bucket (the padded shape ``tokens x seqs`` the program ran at).
With an ITL target (the default on a CPU; ``--itl-slo-ms``), ``pred ms`` is what the engine's
step-cost model (``jaxserve.core.step_cost``, as refitted up to that step) predicted for each
step, beside the measured step time: the model the scheduler sizes prefill chunks with. It is
calibrated at start-up (``LLMEngine.probe``) and refitted from the engine's own step timings.
Modes: ``greedy`` (temperature 0), ``sampled`` (temperature 1, top_p 0.9), ``top_p`` (temperature
0.7, top_p 0.95), ``top_k`` (temperature 1, top_k 200), ``min_p`` (temperature 1, min_p 0.05),
``logprobs``
(greedy with 5 logprobs), ``penalties`` (greedy, repetition 1.1 and frequency 0.5), ``n4`` (batch
/ 4 requests with n=4), ``json`` (greedy, every row constrained by ``BENCH_SCHEMA``, a JSON schema
no row can complete in the timed steps) and ``json1`` (greedy, one constrained row); for these
the host part also shows ``mask``, the time the host spent computing the rows' token masks.
Compare settings by running it twice (``--quantization int8``,
``--num-kv-blocks 256`` against 4096: equal step times show the cache is updated in place).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import numpy as np

from jaxserve.bench.common import add_model_flags, write_json
from jaxserve.config import MIN_PREFILL_TOKENS, LoadConfig
from jaxserve.config_args import add_engine_args, engine_config_from_args
from jaxserve.device.buckets import MIN_TOKEN_BUCKET, pick_bucket
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.step_report import StepReport
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

MODES: dict[str, tuple[dict[str, Any], int]] = {  # SamplingParams fields, choices per request
    "greedy": ({"temperature": 0.0}, 1),
    "sampled": ({"temperature": 1.0, "top_p": 0.9}, 1),
    "top_p": ({"temperature": 0.7, "top_p": 0.95}, 1),
    "top_k": ({"temperature": 1.0, "top_k": 200}, 1),
    "min_p": ({"temperature": 1.0, "min_p": 0.05}, 1),
    "logprobs": ({"temperature": 0.0, "logprobs": 5}, 1),
    "penalties": ({"temperature": 0.0, "repetition_penalty": 1.1, "frequency_penalty": 0.5}, 1),
    "n4": ({"temperature": 1.0, "n": 4}, 4),
    "json": ({"temperature": 0.0}, 1),
    "json1": ({"temperature": 0.0}, 1),
}
CONSTRAINED_ROWS = {"json": None, "json1": 1}  # mode -> requests constrained (None: all)
BENCH_SCHEMA = {  # at least 64 records: no row completes it within a benchmark's steps
    "type": "object", "required": ["records"], "additionalProperties": False,
    "properties": {"records": {"type": "array", "minItems": 64, "items": {
        "type": "object", "required": ["id", "name", "score"], "additionalProperties": False,
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}}}}}}
NUM_UNTIMED_STEPS = 2


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers"
                                         ) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return out


def _modes(text: str) -> list[str]:
    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in MODES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    return out


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``jaxserve bench step``'s flags: model, batch sizes, modes, and the engine flags."""
    add_model_flags(p)
    a = p.add_argument
    a("--batch-sizes", type=_int_list, default=[1, 8, 32],
      help="comma-separated sequences per decode step (at most --max-num-seqs; that flag "
           "defaults to the largest here)")
    a("--context", type=int, default=64, help="prompt tokens per sequence before the decode steps")
    a("--num-steps", type=int, default=10, help="timed decode steps per batch size and mode")
    a("--modes", type=_modes, default=["greedy"],
      help=f"comma-separated sampling modes: {', '.join(MODES)}")
    a("--output-json", default=None, help="write the results here")
    add_engine_args(p)  # its --seed also seeds the prompts


# bucket, step s, device s, mask s, CPU s, predicted s (None without an ITL target)
Step = tuple[Any, float, float, float, float, float | None]


def _timed_step(engine: LLMEngine, reports: list[StepReport]) -> Step:
    """One engine step (synchronous: it reads its own ids): (its bucket, its seconds, the
    device part of them, the mask part, the process CPU seconds over it, the step-cost model's
    prediction of its seconds), from the engine's step report (``add_step_listener``)."""
    n = len(reports)
    c0, t0 = time.process_time(), time.perf_counter()
    engine.step()
    step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    done = reports[-1].dispatched if len(reports) == n + 1 else None
    if done is None or done.t_ready is None:
        raise RuntimeError("an engine step ran no device program; nothing was scheduled")
    return (done.bucket, step_s, done.t_ready - done.t_dispatch, done.mask_s, cpu_s,
            done.predicted_s)


def _summary(steps: list[Step], num_seqs: int | None = None) -> dict[str, Any]:
    step_ms = [1e3 * s for _, s, *_ in steps]
    device_ms = [1e3 * d for _, _, d, *_ in steps]
    host_ms = [a - b for a, b in zip(step_ms, device_ms)]
    bucket = steps[0][0]
    out = {"bucket_tokens": bucket.num_tokens, "bucket_seqs": bucket.num_seqs,
           "num_steps": len(steps), "median_step_ms": statistics.median(step_ms),
           "min_step_ms": min(step_ms), "max_step_ms": max(step_ms),
           "median_device_ms": statistics.median(device_ms),
           "median_host_ms": statistics.median(host_ms),
           "median_mask_ms": statistics.median(1e3 * k for _, _, _, k, *_ in steps),
           "median_cpu_ms": statistics.median(1e3 * c for *_, c, _ in steps)}
    predicted = [(1e3 * p, ms) for (*_, p), ms in zip(steps, step_ms) if p is not None]
    if predicted:  # the step-cost model's prediction beside the measured steps
        out["median_predicted_ms"] = statistics.median(p for p, _ in predicted)
        out["median_measured_over_predicted"] = statistics.median(m / p for p, m in predicted)
    if num_seqs is not None:  # a decode step: one token per sequence
        out["tokens_per_second"] = num_seqs / (out["median_step_ms"] / 1e3)
    return out


def measure(engine: LLMEngine, reports: list[StepReport], mode: str, batch: int, context: int,
            num_steps: int, rng: np.random.Generator) -> dict[str, Any]:
    """Prefill ``batch`` sequences of ``context`` tokens, then time ``num_steps`` decode steps.

    Returns the decode summary and one summary per prefill bucket (``prefill``).
    """
    kw, n = MODES[mode]
    vocab = engine.tokenizer.vocab_size
    # the first sequences decode while later ones prefill: room to the context window (or the
    # cache), so that no row finishes in the timed steps (the requests are aborted after them)
    room = min(engine.max_model_len, (engine.num_blocks - 1) * engine.config.block_size)
    params = SamplingParams(max_tokens=max(1, room - context),
                            ignore_eos=True,
                            seed=int(rng.integers(1 << 31)), **kw)
    ids = [f"step-{mode}-{batch}-{i}" for i in range(batch // n)]
    num_constrained = CONSTRAINED_ROWS.get(mode, 0)
    if num_constrained is None:
        num_constrained = len(ids)
    constrained = dataclasses.replace(
        params, structured_outputs=StructuredOutputsParams(json=BENCH_SCHEMA))
    for i, rid in enumerate(ids):
        engine.add_request(rid, rng.integers(0, vocab, context).tolist(),
                           constrained if i < num_constrained else params)
    decode_bucket = pick_bucket(engine.runner.buckets, batch, batch)
    prefill: dict[Any, list] = {}
    while engine.scheduler.num_tokens_pending()[0]:  # until every prompt token has run
        step = _timed_step(engine, reports)
        prefill.setdefault(step[0], []).append(step)
    for _ in range(NUM_UNTIMED_STEPS - 1):
        _timed_step(engine, reports)
    decode = [_timed_step(engine, reports) for _ in range(num_steps)]
    if any(b != decode_bucket for b, *_ in decode):
        raise RuntimeError(f"a timed decode step ran at another shape than {decode_bucket} "
                           f"({[b for b, *_ in decode]}); were other requests in the engine, or did rows "
                           f"reach --max-model-len while others prefilled?")
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {"mode": mode, "batch": batch, "num_constrained": num_constrained,
            "decode": _summary(decode, batch),
            "prefill": [_summary(s) for s in prefill.values()]}


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``jaxserve bench step``; returns the exit status.

    Raises:
      ValueError: bad flags (a batch above --max-num-seqs, n4 with a batch not a multiple of 4,
        a context too short or too long).
    """
    if ns.num_steps < 1:
        raise ValueError("--num-steps must be >= 1")
    if ns.context <= MIN_TOKEN_BUCKET:
        raise ValueError(f"--context must be > {MIN_TOKEN_BUCKET}, so that a prefill step "
                         f"never runs at the decode shape")
    if "n4" in ns.modes and any(b % 4 for b in ns.batch_sizes):
        raise ValueError("mode n4 needs batch sizes that are multiples of 4")
    if getattr(ns, "max_num_seqs", None) is None:
        ns.max_num_seqs = max(ns.batch_sizes)
    fit_model_len = getattr(ns, "max_model_len", None) is None
    if fit_model_len:
        ns.max_model_len = ns.context + ns.num_steps + NUM_UNTIMED_STEPS + 16
    cfg = engine_config_from_args(ns)
    if fit_model_len:  # also the tokens the first rows decode while the last ones prefill
        budget = max(1, cfg.max_num_batched_tokens - max(ns.batch_sizes))
        if cfg.itl_slo_ms is None or cfg.itl_slo_ms > 0:  # a gap objective: chunks down to
            budget = min(budget, MIN_PREFILL_TOKENS)  # the minimum a prompt gets per step
        prefill_steps = 2 * -(-max(ns.batch_sizes) * ns.context // budget)
        cfg = dataclasses.replace(cfg, max_model_len=cfg.max_model_len + prefill_steps)
    if max(ns.batch_sizes) > cfg.max_num_seqs:
        raise ValueError(f"--batch-sizes {max(ns.batch_sizes)} exceeds max_num_seqs="
                         f"{cfg.max_num_seqs}")
    engine = LLMEngine(cfg, LoadConfig(ns.model, ns.load_format))
    warm = engine.warmup(progress=False)
    engine.probe()  # as a server's start-up does: calibrates the step-cost model
    engine.set_async_scheduling(False)  # each step reads its own ids: its whole time is its own
    reports: list[StepReport] = []
    engine.add_step_listener(reports.append)
    rng = np.random.default_rng(cfg.seed)
    rows = [measure(engine, reports, mode, b, ns.context, ns.num_steps, rng)
            for mode in ns.modes for b in ns.batch_sizes]
    result = {"model": engine.model_name, "dtype": str(engine.dtype), "context": ns.context, "num_steps": ns.num_steps,
              "seed": cfg.seed, "engine_config": {k: getattr(cfg, k)
                                                  for k in cfg.__dataclass_fields__},
              "num_kv_blocks": engine.num_blocks, "kv_bytes_per_token": engine.kv_layout.bytes_per_token,
              "num_programs": warm["num_programs"], "compile_s": warm["compile_s"],
              "load_s": engine.load_s, "weights": engine.weights_summary(), "rows": rows}
    print(format_table(result), flush=True)
    write_json(ns.output_json, result)
    return 0


def format_table(result: dict[str, Any]) -> str:
    """One row per (mode, batch): the decode step and its host/device split, then prefill."""
    cfg = result["engine_config"]
    lines = [(f"{result['model']}: context {result['context']}, {result['num_steps']} decode "
             f"steps each; {result['weights']}, KV "
             f"{cfg['kv_cache_dtype']} ({result['num_kv_blocks']} blocks of "
             f"{cfg['block_size']}); {int(result['num_programs'])} programs compiled in "
             f"{result['compile_s']:.1f} s"),
             (f"{'mode':<10}{'batch':>6}{'phase':>9}{'bucket':>10}{'steps':>6}{'step ms':>10}"
             f"{'pred ms':>9}{'device ms':>11}{'host ms':>9}{'mask ms':>9}{'cpu ms':>9}"
              f"{'tok/s':>10}")]
    for r in result["rows"]:
        for phase, s in [("decode", r["decode"])] + [("prefill", p) for p in r["prefill"]]:
            tok_s = f"{s['tokens_per_second']:>10.1f}" if phase == "decode" else f"{'':>10}"
            lines.append(f"{r['mode']:<10}{r['batch']:>6}{phase:>9}"
                         f"{str(s['bucket_tokens']) + 'x' + str(s['bucket_seqs']):>10}"
                         f"{s['num_steps']:>6}{s['median_step_ms']:>10.2f}"
                         f"{s.get('median_predicted_ms', float('nan')):>9.2f}"
                         f"{s['median_device_ms']:>11.2f}{s['median_host_ms']:>9.2f}"
                         f"{s['median_mask_ms']:>9.2f}{s['median_cpu_ms']:>9.2f}{tok_s}")
    return "\n".join(lines)
