"""Per-step phase timings: one JSON line per engine step (``--step-trace FILE``), and their
summary per bucket (``jaxserve bench step-trace FILE``).

A line: ``t`` (unix seconds at the step's end), the bucket (``bucket_tokens``,
``bucket_seqs``), what ran (``num_seqs``, ``num_tokens``, ``num_prompt_tokens``) and the
phases in milliseconds, which add up to ``step_ms``:

- ``schedule_ms``: the scheduler's plan and any host-tier block copies;
- ``pack_ms``: per-row sampling inputs and the packed step buffer, and constrained rows' token
  masks (``mask_ms``, a part of it: 0 without structured outputs);
- ``device_ms``: the compiled step program (forward pass and sampling) until the sampled ids
  are on the host;
- ``post_ms``: scheduler update, logprobs, detokenisation, stop checks and the outputs.

With async scheduling (``async`` true on a line) a call packs and dispatches its own step,
then waits for and post-processes the previous one: ``device_ms`` is then only the part of
that step the host did not overlap with its own work (near 0: the host is the bottleneck).
``host_gap_ms`` (absent on a first step) is the time from the previous step's ids reaching the
host to this step's dispatch: the device's idle time between the two when the host waited for
the ids (all host work of the synchronous loop lands in it); 0 when this step was queued
before the ids were read.

``done`` describes the step this call read (the previous one with async scheduling): its
bucket and shape, the terms of the step-cost model (``bucket_tokens``, ``num_decode_rows``,
``num_context_tokens``, ``num_prefill_pairs``), its measured time (``measured_ms``, from the
later of its planning and the previous step's ids on the host to its own) and, with service
objectives, the model's prediction (``predicted_ms``); ``jaxserve bench replay`` fits its
machine to these. The summary gives the median measured / predicted ratio.

The first line of a file (``"kind": "config"``) is the scheduler's settings at start-up
(``SchedulerConfig``: token buckets, limits, objectives, the step-cost prior), so that
``jaxserve bench replay --step-trace FILE`` plans as the server did.

What happens after ``step()`` returns (the server's event loop, SSE encoding) is not in it;
the gap between one line's ``t`` and the next line's start (``t - step_ms``) is.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from jaxserve.core.plan import SchedulerOutput
    from jaxserve.engine.step_inputs import InflightStep

PHASES = ("schedule_ms", "pack_ms", "device_ms", "post_ms")


@dataclass
class StepTimes:
    """One ``LLMEngine.step`` call's clock (``time.perf_counter`` seconds): its start, the plan
    ready, the step dispatched, and the seconds spent waiting for sampled ids."""

    t0: float
    t_sched: float = 0.0
    t_pack: float = 0.0
    wait_s: float = 0.0


class StepTrace:
    """Appends step lines to ``path`` (line-buffered, so a killed server keeps its lines)."""

    def __init__(self, path: str, config: dict[str, Any] | None = None) -> None:
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 (lives with the engine)
        self._last_dispatched: InflightStep | None = None  # for host_gap_ms
        if config is not None:
            self.write({"kind": "config", "t": time.time(), **config})

    def write(self, record: dict[str, Any]) -> None:
        """One step's line (see the module docstring for its fields)."""
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def record(self, times: StepTimes, plan: SchedulerOutput, new: InflightStep | None,
               prev: InflightStep | None) -> None:
        """Write the line of a ``step`` call that dispatched ``new`` (None: nothing to run) and
        completed ``prev`` (the step in flight before it, if any); one of them is not None."""
        t_end = time.perf_counter()
        gap = None  # from the previous step's ids reaching the host to this dispatch
        last = self._last_dispatched
        if new is not None and last is not None and last.t_ready is not None:
            gap = max(0.0, new.t_dispatch - last.t_ready)
        if new is not None:
            self._last_dispatched = new
        b = new.bucket if new is not None else prev.bucket
        self.write({
            "t": time.time(), "bucket_tokens": b.num_tokens, "bucket_seqs": b.num_seqs,
            "num_seqs": len(plan.scheduled), "num_tokens": plan.num_scheduled_tokens,
            "num_prompt_tokens": new.num_prompt_tokens if new else 0,
            "async": new is not None and new.t_ready is None,
            "schedule_ms": 1e3 * (times.t_sched - times.t0),
            "pack_ms": 1e3 * (times.t_pack - times.t_sched),
            "mask_ms": 1e3 * (new.mask_s if new else 0.0), "device_ms": 1e3 * times.wait_s,
            "post_ms": 1e3 * (t_end - times.t_pack - times.wait_s),
            "step_ms": 1e3 * (t_end - times.t0),
            **({} if gap is None else {"host_gap_ms": 1e3 * gap}),
            **self._done(new if new is not None and new.t_ready is not None else prev)})

    @staticmethod
    def _done(done: InflightStep | None) -> dict[str, Any]:
        """The shape, measured time and predicted time of the step this call read."""
        if done is None or done.measured_s is None:
            return {}
        p = done.plan
        record = {"bucket_tokens": done.bucket.num_tokens, "num_decode_rows": p.num_decode_rows,
                  "num_context_tokens": p.num_context_tokens,
                  "num_prefill_pairs": p.num_prefill_pairs, "measured_ms": 1e3 * done.measured_s}
        if done.predicted_s is not None:
            record["predicted_ms"] = 1e3 * done.predicted_s
        return {"done": record}

    def close(self) -> None:
        self._file.close()


def read(path: str) -> list[dict[str, Any]]:
    """The lines of a trace file.

    Raises:
      ValueError: naming the line, for a line that is not a step record.
    """
    return read_with_config(path)[1]


def read_with_config(path: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The scheduler settings of a trace file's last config line (None: none) and its step
    lines.

    Raises:
      ValueError: naming the line, for a line that is not a step or config record.
    """
    out, config = [], None
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
            if isinstance(rec, dict) and rec.get("kind") == "config":
                config = rec
                continue
            if not isinstance(rec, dict) or any(k not in rec for k in PHASES + ("step_ms",)):
                raise ValueError(f"{path}:{i}: not a step record (needs {', '.join(PHASES)}, "
                                 "step_ms)")
            out.append(rec)
    return config, out


def summarize(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per bucket (``"TOKENSxSEQS"``): steps, median step and phase ms, total seconds and its
    share of all step time; plus ``gaps_s``, the time between steps (outside ``step()``), and
    ``host_gap_s`` / ``median_host_gap_ms`` / ``num_async_steps`` from the lines that have them."""
    recs = sorted(records, key=lambda r: r["t"])
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        groups[f"{r['bucket_tokens']}x{r['bucket_seqs']}"].append(r)
    total = sum(r["step_ms"] for r in recs) / 1e3
    buckets = {}
    for name, rs in sorted(groups.items(), key=lambda kv: -sum(r["step_ms"] for r in kv[1])):
        secs = sum(r["step_ms"] for r in rs) / 1e3
        buckets[name] = {
            "steps": len(rs), "total_s": secs, "share": secs / total if total else 0.0,
            "median_step_ms": statistics.median(r["step_ms"] for r in rs),
            **{f"median_{p}": statistics.median(r[p] for r in rs) for p in PHASES},
            "mean_num_seqs": statistics.fmean(r["num_seqs"] for r in rs),
            "tokens": sum(r["num_tokens"] for r in rs),
        }
    gaps = [b["t"] - b["step_ms"] / 1e3 - a["t"] for a, b in itertools.pairwise(recs)]
    span = recs[-1]["t"] - (recs[0]["t"] - recs[0]["step_ms"] / 1e3) if recs else 0.0
    host_gaps = [r["host_gap_ms"] for r in recs if "host_gap_ms" in r]
    return {"num_steps": len(recs), "span_s": span, "step_s": total,
            "gaps_s": sum(g for g in gaps if g > 0),
            "host_gap_s": sum(host_gaps) / 1e3,
            "median_host_gap_ms": statistics.median(host_gaps) if host_gaps else 0.0,
            "num_async_steps": sum(bool(r.get("async")) for r in recs),
            "cost_model": _cost_summary(recs),
            "phase_s": {p: sum(r[p] for r in recs) / 1e3 for p in PHASES}, "buckets": buckets}


def _cost_summary(recs: list[dict[str, Any]]) -> dict[str, float] | None:
    """Median and p90 of measured / predicted step time over the lines that have both, and
    the share of steps measured over 1.5x their prediction (None: no such lines)."""
    done = [r["done"] for r in recs if "done" in r]
    ratios = sorted(d["measured_ms"] / d["predicted_ms"] for d in done
                    if d.get("predicted_ms", 0) > 0)
    if not ratios:
        return None
    return {"num_steps": len(ratios), "median_ratio": statistics.median(ratios),
            "p90_ratio": ratios[int(0.9 * (len(ratios) - 1))],
            "share_over_1_5x": sum(x > 1.5 for x in ratios) / len(ratios)}


def format_summary(s: dict[str, Any]) -> str:
    """The summary as a table."""
    lines = [(f"{s['num_steps']} steps over {s['span_s']:.1f} s: {s['step_s']:.1f} s in steps, "
             f"{s['gaps_s']:.1f} s between them"),
             "phases: " + ", ".join(f"{p[:-3]} {v:.1f} s" for p, v in s["phase_s"].items()),
             (f"host gap (ids on the host -> next dispatch): {s['host_gap_s']:.2f} s, median "
              f"{s['median_host_gap_ms']:.2f} ms; {s['num_async_steps']} async steps"),
             *([] if not s.get("cost_model") else [
                 "cost model (measured / predicted step): median {median_ratio:.2f}, p90 "
                 "{p90_ratio:.2f}, {share_over_1_5x:.0%} of {num_steps} steps over 1.5x"
                 .format(**s["cost_model"])]),
             (f"{'bucket':>10} {'steps':>6} {'seqs':>6} {'share':>6} {'step ms':>8} "
             f"{'sched':>6} {'pack':>6} {'device':>8} {'post':>6}")]
    for name, b in s["buckets"].items():
        lines.append(f"{name:>10} {b['steps']:6d} {b['mean_num_seqs']:6.1f} {b['share']:6.1%} "
                     f"{b['median_step_ms']:8.1f} {b['median_schedule_ms']:6.2f} "
                     f"{b['median_pack_ms']:6.2f} {b['median_device_ms']:8.1f} "
                     f"{b['median_post_ms']:6.2f}")
    return "\n".join(lines)
