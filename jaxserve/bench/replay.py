"""``jaxserve bench replay``: a workload through the real scheduler on a modelled machine.

    jaxserve bench replay --step-trace server-steps.jsonl --dataset-name chat-like \\
        --num-prompts 48 --request-rate 0.9 --goodput ttft:2000 itl:300
    jaxserve bench replay --cost-model '{"fixed_s": 0.005, "per_token_s": 2e-5}' \\
        --max-num-seqs 256 --max-num-batched-tokens 8192 --dataset-name chat-like ...

The same requests and arrival times as ``jaxserve bench serve`` with the same flags and seed
(``serve.build_workload``, token-id prompts), fed to a ``core.scheduler.Scheduler`` built with a
server's settings, in simulated time: no jax, no device, seconds for a run that takes minutes
on a server. Each step's time is a step-cost model's prediction (``core.step_cost``) of the
step's padded shape, times a residual drawn from the fitted steps' measured / predicted ratios
(seeded; ``--noise none`` leaves it out), so that the tails a real run shows are there too.

The machine comes from a server's step trace (``jaxserve serve --step-trace-file FILE``: its first
line is the scheduler's settings, and each line the shape and measured time of a step; the model
is refitted to those steps toward the server's prior, ``StepCostModel.fit``), or is declared
(``--cost-model`` coefficients, with the scheduler settings from the engine flags). Engine flags
given on the command line override the trace's settings, so a policy can be tried on a
recorded machine (``--prefill-order``, ``--itl-slo-ms``, ``--max-num-seqs``, ...).

The loop is the engine's async one (``LLMEngine.step``): each call admits the requests that
have arrived, plans the next step (which starts on the device when the one in flight ends),
then waits for the step in flight and applies it (``Scheduler.update`` at the time its ids are
on the host, the token time a client sees, less the network). With ``--no-async-scheduling``
each step is applied before the next is planned. The result is ``jaxserve bench serve``'s
table and JSON (``metrics.build_result``), plus the steps' count and padding.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import itertools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.bench.arrivals import arrival_offsets
from jaxserve.bench.datasets import SampleRequest
from jaxserve.bench.metrics import (
    METRICS,
    RequestResult,
    build_result,
    format_table,
    parse_goodput,
    with_tails,
)
from jaxserve.bench.serve import add_dataset_args, arrival_burstiness, build_workload
from jaxserve.config import DEFAULT_SLOS_MS, EngineConfig
from jaxserve.config_args import add_engine_args, engine_config_from_args
from jaxserve.core.plan import SchedulerConfig, SchedulerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import SeqState
from jaxserve.core.step_cost import StepCostModel, StepSample
from jaxserve.device.buckets import token_buckets
from jaxserve.engine.step_trace import read_with_config

# settings a declared machine takes when neither the trace nor a flag gives them: the CPU's
# small buckets and mid buckets up to max_num_seqs (jaxserve.platform.cpu), 2 GiB of SmolLM2's
# K/V in 16-token blocks, and the CPU's prior (step overhead 32 prompt tokens)
DECLARED_SMALL_BUCKETS = (1, 4)
DECLARED_NUM_BLOCKS = 8192
DECLARED_STEP_OVERHEAD_TOKENS = 32


@dataclass(frozen=True)
class Machine:
    """What the replay runs on.

    Fields:
      step_cost: a step's seconds by shape (the truth of the replay).
      residuals: measured / predicted ratios of the steps ``step_cost`` was fitted to; each
        step's time is multiplied by one drawn at random (empty: none).
      scheduler: the scheduler's settings (token buckets, limits, objectives, the model it
        plans with before it refits it from the replayed steps).
    """

    step_cost: StepCostModel
    residuals: tuple[float, ...]
    scheduler: SchedulerConfig


def machine_from_trace(path: str, overrides: dict[str, Any] | None = None) -> Machine:
    """The machine of a server's step trace (module docstring); ``overrides``: scheduler
    settings to change (``SchedulerConfig`` field names).

    Raises:
      ValueError: a trace without its config line (written by this version's server) or with
        fewer than four measured steps, or a bad override.
    """
    config, steps = read_with_config(path)
    if config is None:
        raise ValueError(f"--step-trace {path}: no config line (a trace of a jaxserve server "
                         "started with --step-trace by this version)")
    done = [s["done"] for s in steps if "done" in s]
    if len(done) < 4:
        raise ValueError(f"--step-trace {path}: {len(done)} measured steps; at least 4 are "
                         "needed to fit the machine")
    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    settings = {k: v for k, v in config.items() if k in fields}
    prior = StepCostModel(**config["step_cost"]) if config.get("step_cost") else \
        StepCostModel.prior(settings.get("step_overhead_tokens", 32), 1e-3)
    samples = [StepSample(d["bucket_tokens"], d["num_decode_rows"], d["num_context_tokens"],
                          d["measured_ms"] / 1e3, d["num_prefill_pairs"]) for d in done]
    model = StepCostModel.fit(samples, prior=prior)
    residuals = tuple(s.seconds / p for s in samples
                      if (p := model.predict(s.num_tokens, s.num_decode_rows,
                                             s.num_context_tokens, s.num_prefill_pairs)) > 0)
    settings.update(token_buckets=tuple(settings.get("token_buckets", ())), step_cost=model,
                    **(overrides or {}))
    return Machine(model, residuals, SchedulerConfig(**settings))


def declared_machine(cost: StepCostModel, engine: EngineConfig, ttft_slo_s: float,
                     itl_slo_s: float, num_blocks: int = DECLARED_NUM_BLOCKS) -> Machine:
    """A machine of declared step costs, with the scheduler settings of ``engine`` (and the
    CPU's bucket rule); no residuals."""
    buckets = token_buckets(engine.max_num_batched_tokens, DECLARED_SMALL_BUCKETS,
                            engine.max_num_seqs)
    cfg = SchedulerConfig.from_engine_config(
        engine, engine.num_kv_blocks or num_blocks, engine.max_model_len or 4096, 0, cost,
        ttft_slo_s, itl_slo_s)
    return Machine(cost, (), dataclasses.replace(
        cfg, token_buckets=tuple(buckets), step_overhead_tokens=DECLARED_STEP_OVERHEAD_TOKENS,
        async_scheduling=engine.async_scheduling))


@dataclass
class _Inflight:
    plan: SchedulerOutput
    num_tokens: int  # the padded step
    start: float
    end: float


def simulate(machine: Machine, requests: list[SampleRequest], offsets: np.ndarray,
             max_concurrency: int | None = None, seed: int = 0
             ) -> tuple[list[RequestResult], dict[str, Any]]:
    """Replay ``requests`` arriving at ``offsets`` (s) on ``machine`` (module docstring).

    Returns:
      one ``RequestResult`` per request (times in s from its send, ``start_time`` its send
      time), and step statistics: ``num_steps``, ``busy_s`` (device time), ``duration_s``,
      ``padding`` (the share of computed tokens that were padding), ``prefill_padding`` (that
      share in steps with a prompt chunk).

    Raises:
      ValueError: a request the scheduler could never hold (longer than ``max_model_len`` or
        the KV cache).
    """
    cfg = machine.scheduler
    sched = Scheduler(cfg)
    rng = np.random.default_rng(seed)
    residuals = np.asarray(machine.residuals, float)
    buckets = cfg.token_buckets
    cap = max_concurrency or len(requests)
    queue = sorted(range(len(requests)), key=lambda i: (offsets[i], i))  # not yet sent
    results = [RequestResult(prompt_len=r.prompt_len) for r in requests]
    times: dict[str, list[float]] = {}  # token times of each sent request
    sent: dict[str, float] = {}
    num_finished = 0
    steps = {"num_steps": 0, "busy_s": 0.0}
    tokens = {"all": [0, 0], "prefill": [0, 0]}  # (scheduled, padded) tokens

    def admit(now: float) -> None:
        while queue and offsets[queue[0]] <= now and len(sent) - num_finished < cap:
            i = queue.pop(0)
            r = requests[i]
            if not isinstance(r.prompt, list):
                raise ValueError("bench replay needs token-id prompts (--endpoint "
                                 "/v1/completions)")
            n = len(r.prompt) + r.expected_output_len
            if n > cfg.max_model_len or -(-n // cfg.block_size) > \
                    sched.block_pool.num_usable_blocks:
                raise ValueError(f"request {i}: {len(r.prompt)} + {r.expected_output_len} "
                                 f"tokens do not fit max_model_len {cfg.max_model_len} or the "
                                 "KV cache")
            rid = f"r{i}"
            sent[rid] = max(now, float(offsets[i]))
            times[rid] = []
            sched.add(SeqState(rid, list(r.prompt), len(r.prompt), r.expected_output_len,
                               arrival_time=sent[rid]))

    def start(plan: SchedulerOutput, at: float) -> _Inflight:
        n = buckets[j] if (j := bisect.bisect_left(buckets, plan.num_scheduled_tokens)) \
            < len(buckets) else plan.num_scheduled_tokens
        s = machine.step_cost.predict(n, plan.num_decode_rows, plan.num_context_tokens,
                                      plan.num_prefill_pairs)
        s *= float(rng.choice(residuals)) if residuals.size else 1.0
        steps["num_steps"] += 1
        steps["busy_s"] += s
        for kind in ("all", "prefill") if plan.num_scheduled_tokens > plan.num_decode_rows \
                else ("all",):
            tokens[kind][0] += plan.num_scheduled_tokens
            tokens[kind][1] += n
        return _Inflight(plan, n, at, at + s)

    t, inflight = 0.0, None
    while queue or sched.has_unfinished() or inflight is not None:
        admit(t)
        plan = sched.schedule(t)
        new = None if plan.is_empty else start(
            plan, t if inflight is None else max(t, inflight.end))
        done = [inflight] if inflight is not None else []
        if new is not None and not sched.async_scheduling:
            done, new = [*done, new], None
        for d in done:  # wait for its ids, then apply them
            t = max(t, d.end)
            sched.observe_step(d.plan, d.num_tokens, d.end - d.start)
            res = sched.update(d.plan, [0 if c.sample else None for c in d.plan.scheduled],
                               now=t)
            for sid in res.new_token_ids:
                times[sid].append(t)
            num_finished += len(res.finished)
        inflight = new
        if plan.is_empty and not done:  # idle: on to the next arrival
            if sched.has_unfinished():
                raise RuntimeError("bench replay: the scheduler planned nothing with "
                                   "sequences waiting and no step in flight")
            if not queue:
                break
            t = max(t, float(offsets[queue[0]]))
    for rid, ts in times.items():
        i = int(rid[1:])
        r = results[i]
        r.start_time = sent[rid]
        if ts:
            r.success = True
            r.output_tokens = len(ts)
            r.ttft = ts[0] - sent[rid]
            r.itl = [b - a for a, b in itertools.pairwise(ts)]
            r.latency = ts[-1] - sent[rid]
    end = max((ts[-1] for ts in times.values() if ts), default=0.0)
    steps.update(duration_s=end - min(sent.values(), default=0.0),
                 padding=1 - tokens["all"][0] / max(tokens["all"][1], 1),
                 prefill_padding=1 - tokens["prefill"][0] / max(tokens["prefill"][1], 1))
    return results, steps


# engine flags a replay of a step trace takes over the trace's settings (EngineConfig field ->
# SchedulerConfig field; the objectives in ms become s)
_OVERRIDES = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
              "max_model_len": "max_model_len", "num_kv_blocks": "num_blocks",
              "long_prefill_token_threshold": "long_prefill_token_threshold",
              "enable_prefix_caching": "enable_prefix_caching", "prefill_order": "prefill_order",
              "async_scheduling": "async_scheduling", "ttft_slo_ms": "ttft_slo_s",
              "itl_slo_ms": "itl_slo_s"}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """``jaxserve bench replay``'s flags: the machine, ``bench serve``'s workload and metric
    flags, and the engine flags (the scheduler's settings)."""
    a = p.add_argument
    a("--step-trace", default=None, metavar="FILE",
      help="a server's step trace (jaxserve serve --step-trace-file): its scheduler settings, and "
           "the steps the machine's cost model is fitted to")
    a("--cost-model", default=None, metavar="JSON",
      help='declared step costs instead, e.g. \'{"fixed_s": 0.03, "per_token_s": 7.5e-4, '
           '"per_row_s": 0, "per_context_token_s": 0, "per_prefill_pair_s": 1e-6}\' '
           "(core/step_cost.py), with the engine flags' scheduler settings")
    a("--noise", choices=("trace", "none"), default="trace",
      help="multiply each step's time by a residual of the fitted steps (trace) or not")
    add_dataset_args(p)
    a("--request-rate", type=float, default=float("inf"),
      help="arrivals per second; inf sends every request at once")
    a("--burstiness", type=float, default=None,
      help="gamma shape of the inter-arrival times (default: the profile's, else 1)")
    a("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    a("--goodput", nargs="+", default=None, metavar="KEY:MS",
      help="SLOs for goodput, e.g. ttft:2000 itl:300 (ms; itl: the request's largest gap)")
    a("--percentile-metrics", default=",".join(METRICS),
      help="comma-separated metrics with statistics (ttft, itl, max_itl always included)")
    a("--metric-percentiles", default="50,90,99",
      help="comma-separated percentiles (99 is always included)")
    a("--output-json", default=None, help="write the result (bench serve's keys) here")
    add_engine_args(p)  # its --seed also seeds the workload, the arrivals and the noise


def build_machine(ns: argparse.Namespace) -> Machine:
    """The machine of ``--step-trace`` (engine flags given override its settings) or of
    ``--cost-model`` (with the engine flags' settings).

    Raises:
      ValueError: neither or both given, a bad cost model, or a bad trace.
    """
    if (ns.step_trace is None) == (ns.cost_model is None):
        raise ValueError("give one of --step-trace FILE and --cost-model JSON")
    given = {k: getattr(ns, k) for k in _OVERRIDES if hasattr(ns, k)}
    engine = engine_config_from_args(ns)  # validates the flags given
    if ns.step_trace is not None:
        over = {_OVERRIDES[k]: v / 1000 if k.endswith("_ms") else v for k, v in given.items()}
        try:
            machine = machine_from_trace(ns.step_trace, over)
        except OSError as e:  # a missing file, a directory, no permission
            raise ValueError(f"--step-trace: {e.strerror or e}: {ns.step_trace}") from None
    else:
        cost = parse_cost_model(ns.cost_model)
        ttft = engine.ttft_slo_ms if engine.ttft_slo_ms is not None else DEFAULT_SLOS_MS["cpu"][0]
        itl = engine.itl_slo_ms if engine.itl_slo_ms is not None else DEFAULT_SLOS_MS["cpu"][1]
        machine = declared_machine(cost, engine, ttft / 1000, itl / 1000)
    return dataclasses.replace(machine, residuals=() if ns.noise == "none" else
                               machine.residuals)


MAX_COST_S = 3600.0  # a coefficient above an hour is a typo, not a machine


def parse_cost_model(text: str) -> StepCostModel:
    """``--cost-model``'s JSON object as a ``StepCostModel``: seconds, each a finite number in
    [0, ``MAX_COST_S``], ``fixed_s`` and ``per_token_s`` required, ``per_token_s`` > 0.

    Raises:
      ValueError: naming ``--cost-model`` and the key at fault (or the JSON error).
    """
    keys = [f.name for f in dataclasses.fields(StepCostModel)]
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--cost-model: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--cost-model: a JSON object of step costs in seconds (keys "
                         f"{', '.join(keys)}), not {type(obj).__name__}")
    unknown = sorted(set(obj) - set(keys))
    if unknown:
        raise ValueError(f"--cost-model: unknown key(s) {', '.join(unknown)}; the keys are "
                         f"{', '.join(keys)}")
    missing = [k for k in ("fixed_s", "per_token_s") if k not in obj]
    if missing:
        raise ValueError(f"--cost-model: {' and '.join(missing)} required")
    for k, v in obj.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or not 0 <= v <= MAX_COST_S:
            raise ValueError(f"--cost-model: {k} must be a number of seconds in "
                             f"[0, {MAX_COST_S:g}], got {v!r}")
    if not obj["per_token_s"] > 0:
        raise ValueError("--cost-model: per_token_s must be > 0 (tokens cost time)")
    return StepCostModel(**{k: float(v) for k, v in obj.items()})


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``jaxserve bench replay``: print ``bench serve``'s table and the steps'
    statistics; ``--output-json`` writes the result. Returns the exit status.

    Raises:
      ValueError: bad flags (see ``build_machine``, ``serve.build_workload``).
    """
    t0 = time.perf_counter()
    if ns.num_prompts is not None and ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    machine = build_machine(ns)
    ns.seed = engine_config_from_args(ns).seed
    burstiness = arrival_burstiness(ns)
    samples, offsets = build_workload(ns, chat=False)
    if offsets is None:
        offsets = arrival_offsets(len(samples), ns.request_rate, burstiness,
                                  np.random.default_rng(ns.seed))
    goodput = parse_goodput(ns.goodput)
    metrics_sel, percentiles = with_tails(
        [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()],
        [float(x) for x in ns.metric_percentiles.split(",") if x.strip()])
    results, steps = simulate(machine, samples, offsets, ns.max_concurrency, ns.seed)
    res = build_result(results, steps["duration_s"], percentiles, metrics_sel, goodput)
    print(format_table(res, metrics_sel, percentiles, ns.max_concurrency, ns.request_rate))
    print(f"{steps['num_steps']} steps, device busy {steps['busy_s']:.1f} of "
          f"{steps['duration_s']:.1f} s; padding {steps['padding']:.1%} of computed tokens, "
          f"{steps['prefill_padding']:.1%} in prefill steps; replayed in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    if ns.output_json:
        cfg = machine.scheduler
        out = {**res, "replay": {**steps, "step_cost": dataclasses.asdict(machine.step_cost),
                                 "num_residuals": len(machine.residuals),
                                 "scheduler": {**{f.name: getattr(cfg, f.name) for f in
                                                  dataclasses.fields(cfg)},
                                               "step_cost": None}},
               "dataset_name": ns.dataset_name, "num_prompts": ns.num_prompts,
               "request_rate": ns.request_rate if not math.isinf(ns.request_rate) else "inf",
               "burstiness": burstiness, "max_concurrency": ns.max_concurrency,
               "goodput_slos_ms": goodput or None, "seed": ns.seed}
        with open(ns.output_json, "w", encoding="utf-8") as fh:
            json.dump(out, fh)
    return 0 if res["completed"] else 1
