"""Serving metrics from per-request timelines, defined exactly as vLLM's ``vllm bench serve``
(``vllm/benchmarks/serve.py: calculate_metrics``) so that figures compare with published ones.

Per successful request (times in s, client side):
  TTFT    time from sending to the first token chunk;
  ITL     the gaps between successive token chunks (a chunk may carry several tokens);
  E2EL    ``latency``: sending to the last chunk with choices;
  TPOT    ``(latency - ttft) / (output_len - 1)``, only for ``output_len > 1``;
  max ITL the request's largest gap, only for requests with a gap (jaxserve only: a stall that
          pooled ITL percentiles hide, since one request's 2 s pause is one gap among
          thousands).
Over the run (``duration`` s, from the first send to the last response, warm-ups excluded):
  request_throughput = completed / duration (req/s); output_throughput = output tokens / duration
  (tok/s); total_token_throughput = (input + output tokens) / duration (tok/s); request_goodput =
  requests meeting every SLO / duration (req/s), an SLO met when ``value <= slo``; a request with
  ``output_len <= 1`` counts TPOT 0 for goodput. An ``itl`` SLO (jaxserve only: vLLM has no ITL
  goodput) is met when the request's largest gap is within it (no gap: met): a user sees the
  worst stall of their stream, which a mean (TPOT) or a pooled percentile does not bound; the
  run's largest gap is ``largest_itl_ms``. ITLs are pooled over all requests before the
  statistics. Means, medians, standard deviations (population) and ``numpy.percentile``
  (linear interpolation) are reported in ms; an empty list counts as ``[0]``, as in vLLM. Failed
  requests count in no statistic and add 0 to ``output_lens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "max_itl", "e2el")
SLO_NAMES = ("ttft", "tpot", "itl", "e2el")
TAIL_METRICS = ("ttft", "itl", "max_itl")  # always in the table, with their p99
_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "max_itl": ("Max ITL", "Largest Gap per Request"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestResult:
    """What one request measured (times in s; ``start_time`` on ``time.perf_counter``)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0


def parse_ms_pairs(pairs: list[str], flag: str, names: tuple[str, ...]
                   ) -> list[tuple[str, float]]:
    """``["ttft:500", ...]`` -> ``[("ttft", 500.0), ...]`` (ms), as the ``flag`` gave them.

    Raises:
      ValueError: naming ``flag``, for a malformed pair, a value that is not a finite number,
        or a name not in ``names``.
    """
    out = []
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or not math.isfinite(ms):
            raise ValueError(f"{flag} takes METRIC:MS pairs, MS a finite number (e.g. ttft:500), "
                             f"got {pair!r}")
        if name not in names:
            raise ValueError(f"{flag} metric must be one of {names}, got {name!r}")
        out.append((name, ms))
    return out


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms).

    Raises:
      ValueError: malformed pair, unknown name (ttft, tpot, itl, e2el), a value <= 0 (no
        request could meet it) or not finite, or a name given twice.
    """
    out: dict[str, float] = {}
    for name, ms in parse_ms_pairs(pairs or [], "--goodput", SLO_NAMES):
        if not ms > 0:
            raise ValueError(f"--goodput {name} must be > 0 ms, got {ms:g}")
        if name in out:
            raise ValueError(f"--goodput {name} given twice ({out[name]:g} and {ms:g} ms)")
        out[name] = ms
    return out


def percentile_key(p: float) -> str:
    """vLLM's key word for a percentile: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def with_tails(percentile_metrics: list[str], percentiles: list[float]
               ) -> tuple[list[str], list[float]]:
    """The selection with ``TAIL_METRICS`` added (in ``METRICS`` order) and 99 added to the
    percentiles (sorted), so every table shows p99 TTFT, p99 ITL and the largest gaps."""
    chosen = set(percentile_metrics) | set(TAIL_METRICS)
    extra = [m for m in percentile_metrics if m not in METRICS]  # left for build_result to refuse
    return [m for m in METRICS if m in chosen] + extra, sorted({*percentiles, 99.0})


def _stats(values: list[float], percentiles: list[float]) -> dict[str, Any]:
    v = values or 0  # vLLM: an empty list counts as [0]
    out: dict[str, Any] = {
        "mean": float(np.mean(v)) * 1000,
        "median": float(np.median(v)) * 1000,
        "std": float(np.std(v)) * 1000,
    }
    out["percentiles"] = [(p, float(np.percentile(v, p)) * 1000) for p in percentiles]
    return out


def calculate_metrics(
    outputs: list[RequestResult],
    duration: float,
    percentiles: list[float],
    goodput: dict[str, float] | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """Summary metrics of a run and the output length of each request (0 if failed).

    Returns:
      ``({"completed", "failed", "total_input", "total_output", "request_throughput",
      "request_goodput", "output_throughput", "total_token_throughput", "ttft", "tpot", "itl",
      "max_itl", "e2el", "largest_itl"}, output_lens)`` where each metric entry holds
      mean/median/std and ``percentiles`` ``[(p, ms)]``, ``largest_itl`` is the run's largest
      gap (ms; 0 without gaps); ``request_goodput`` is None without SLOs.
    """
    output_lens: list[int] = []
    total_input = completed = good = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    itls: list[float] = []
    max_itls: list[float] = []
    all_max_itls: list[float] = []
    e2els: list[float] = []
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens or 1  # vLLM without a tokenizer: a reply of unknown length counts 1
        output_lens.append(n)
        total_input += o.prompt_len
        tpot = 0.0
        if n > 1:
            tpot = (o.latency - o.ttft) / (n - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += o.itl
        if o.itl:
            max_itls.append(max(o.itl))
        all_max_itls.append(max(o.itl, default=0.0))
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "itl": all_max_itls, "e2el": e2els}
        names = list(goodput)
        for values in zip(*(per_metric[k] for k in names)):
            if all(v <= goodput[k] / 1000 for k, v in zip(names, values)):
                good += 1
    total_output = sum(output_lens)
    metrics: dict[str, Any] = {
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input": total_input,
        "total_output": total_output,
        "request_throughput": completed / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "ttft": _stats(ttfts, percentiles),
        "tpot": _stats(tpots, percentiles),
        "itl": _stats(itls, percentiles),
        "max_itl": _stats(max_itls, percentiles),
        "e2el": _stats(e2els, percentiles),
        "largest_itl": max(max_itls, default=0.0) * 1000,
    }
    return metrics, output_lens


def build_result(
    outputs: list[RequestResult],
    duration: float,
    percentiles: list[float],
    percentile_metrics: list[str],
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The result dict with vLLM's JSON keys: the summary, ``{mean,median,std}_<m>_ms`` and
    ``p<P>_<m>_ms`` for each selected metric ``m``, and the per-request lists (``input_lens``,
    ``output_lens``, ``ttfts``, ``itls``, ``latencies``, ``start_times``, ``generated_texts``,
    ``errors``; ``ttfts``/``itls``/``latencies`` in s, ``start_times`` in s after the first
    send), and ``largest_itl_ms`` (jaxserve only)."""
    for m in percentile_metrics:
        if m not in METRICS:
            raise ValueError(f"--percentile-metrics names must be in {METRICS}, got {m!r}")
    metrics, output_lens = calculate_metrics(outputs, duration, percentiles, goodput)
    t0 = min((o.start_time for o in outputs), default=0.0)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "total_input_tokens": metrics["total_input"],
        "total_output_tokens": metrics["total_output"],
        "request_throughput": metrics["request_throughput"],
        "request_goodput": metrics["request_goodput"],
        "output_throughput": metrics["output_throughput"],
        "total_token_throughput": metrics["total_token_throughput"],
        "largest_itl_ms": metrics["largest_itl"],
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time - t0 for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    for m in percentile_metrics:
        s = metrics[m]
        result[f"mean_{m}_ms"] = s["mean"]
        result[f"median_{m}_ms"] = s["median"]
        result[f"std_{m}_ms"] = s["std"]
        for p, value in s["percentiles"]:
            result[f"p{percentile_key(p)}_{m}_ms"] = value
    return result


def format_table(
    result: dict[str, Any],
    percentile_metrics: list[str],
    percentiles: list[float],
    max_concurrency: int | None,
    request_rate: float,
) -> str:
    """The terminal table, laid out as ``vllm bench serve`` prints it."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {format(value, fmt):<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for m in METRICS:
        if m not in percentile_metrics:
            continue
        name, header = _HEADERS[m]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", result[f"mean_{m}_ms"], ".2f")
        row(f"Median {name} (ms):", result[f"median_{m}_ms"], ".2f")
        for p in percentiles:
            w = percentile_key(p)
            row(f"P{w} {name} (ms):", result[f"p{w}_{m}_ms"], ".2f")
        if m == "max_itl":
            row("Largest ITL (ms):", result["largest_itl_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
