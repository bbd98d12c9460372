"""One replica's latency and throughput against concurrency, read from measurements.

Sources: a ``jaxserve sweep`` result (``sweep.json``, or the ``--output-dir`` holding it; one
configuration of its ``configs``) or a directory of ``jaxserve bench serve`` result files, each
a closed-loop run at its own ``--max-concurrency``. Per concurrency ``c`` the curve keeps the
request throughput (req/s), the median and the chosen percentile of TTFT, ITL and TPOT (ms; the
ITL's percentile is of each request's largest gap, ``p{P}_max_itl_ms``), the median end-to-end
latency (ms) and, where the workload says, the mean prompt and output lengths
(tokens). ``Curve.at(n)`` interpolates linearly between measured concurrencies; below the first
it holds the first point; past the last the replica is saturated: throughput stays at the last
value and every latency grows in proportion to ``n`` (processor sharing at a fixed rate).
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

LATENCIES = ("ttft", "itl", "tpot")


def percentile_key(p: float) -> str:
    """vLLM's key word for a percentile: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


@dataclass(frozen=True)
class Point:
    """The replica at one concurrency (one closed-loop run)."""

    concurrency: float
    request_throughput: float  # req/s
    median_ms: dict[str, float]  # "ttft", "itl", "tpot", "e2el" -> ms
    tail_ms: dict[str, float]  # "ttft", "itl", "tpot" -> ms at Curve.percentile


@dataclass(frozen=True)
class Curve:
    """Measured points in rising concurrency, the percentile of ``tail_ms``, the source, and
    the mean prompt / output lengths (tokens; None where unknown).

    Raises:
      ValueError: no point, concurrencies not strictly rising or below 1, a throughput that is
        not positive.
    """

    points: tuple[Point, ...]
    percentile: float
    source: str
    mean_input_len: float | None = None
    mean_output_len: float | None = None

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError(f"{self.source}: the curve has no point")
        cs = [p.concurrency for p in self.points]
        if cs[0] < 1 or any(b <= a for a, b in itertools.pairwise(cs)):
            raise ValueError(f"{self.source}: concurrencies must rise from >= 1, got {cs}")
        for p in self.points:
            if not p.request_throughput > 0:
                raise ValueError(f"{self.source}: request_throughput at concurrency "
                                 f"{p.concurrency:g} must be > 0, got {p.request_throughput}")

    @property
    def concurrencies(self) -> list[float]:
        return [p.concurrency for p in self.points]

    def _interp(self, n: float, values: list[float], latency: bool) -> float:
        cs = self.concurrencies
        if n > cs[-1]:
            return values[-1] * (n / cs[-1] if latency else 1.0)
        return float(np.interp(n, cs, values))

    def throughput(self, n: float) -> float:
        """Requests/s of the replica with ``n`` requests in service."""
        return self._interp(n, [p.request_throughput for p in self.points], latency=False)

    def median_ms(self, metric: str, n: float) -> float:
        """Median ``metric`` (ttft, itl, tpot, e2el; ms) at concurrency ``n``."""
        return self._interp(n, [p.median_ms[metric] for p in self.points], latency=True)

    def tail_ms(self, metric: str, n: float) -> float:
        """The ``percentile`` of ``metric`` (ttft, itl, tpot; ms) at concurrency ``n``."""
        return self._interp(n, [p.tail_ms[metric] for p in self.points], latency=True)


def slo_concurrency(curve: Curve, slos_ms: dict[str, float]) -> float | None:
    """The largest measured concurrency whose tail latencies all meet ``slos_ms`` (metric ->
    ms; at the target counts as met), before the first point that breaks one (a later point
    that passes again does not count, as ``jaxserve sweep``); None if the first one breaks."""
    best = None
    for p in curve.points:
        if any(p.tail_ms[m] > slo for m, slo in slos_ms.items()):
            break
        best = p.concurrency
    return best


def _number(obj: dict[str, Any], key: str, where: str) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
        raise ValueError(f"{where}: {key!r} must be a number, got {v!r}")
    return float(v)


# The key each tail is read from: ``itl``'s is the percentile of the requests' largest gaps,
# what ``jaxserve sweep``, goodput and the server's --itl-slo-ms judge, not of pooled ITLs.
TAIL_KEYS = {"ttft": "ttft", "itl": "max_itl", "tpot": "tpot"}


def _point(obj: dict[str, Any], concurrency: float, pkey: str, where: str) -> Point:
    median = {m: _number(obj, f"median_{m}_ms", where) for m in (*LATENCIES, "e2el")}
    tail = {m: _number(obj, f"p{pkey}_{TAIL_KEYS[m]}_ms", where) for m in LATENCIES}
    return Point(concurrency, _number(obj, "request_throughput", where), median, tail)


def _from_sweep(path: str, result: dict[str, Any], percentile: float | None,
                config_index: int | None, slos_ms: dict[str, float]) -> tuple[Curve, int]:
    args = result.get("args") or {}
    pct = float(percentile if percentile is not None else args.get("percentile", 99.0))
    pkey = percentile_key(pct)
    configs = result["configs"]
    if not isinstance(configs, list) or not configs:
        raise ValueError(f"{path}: 'configs' must be a non-empty list")
    lens: tuple[float | None, float | None] = (None, None)
    if args.get("dataset_name") == "random":
        lens = (float(args["random_input_len"]), float(args["random_output_len"]))
    curves = []
    for k, c in enumerate(configs):
        steps = [s for s in c.get("steps", []) if s.get("completed")]
        pts = tuple(_point(s, float(s["concurrency"]), pkey, f"{path} config {k} "
                           f"concurrency {s['concurrency']}") for s in steps)
        curves.append(Curve(pts, pct, f"{path} config {k}", *lens))
    if config_index is not None:
        if not 0 <= config_index < len(curves):
            raise ValueError(f"--config-index must be in [0, {len(curves) - 1}], got "
                             f"{config_index}")
        return curves[config_index], config_index

    def score(k: int) -> tuple[float, float]:
        c = slo_concurrency(curves[k], slos_ms)
        return (-1.0, 0.0) if c is None else (c, curves[k].throughput(c))

    best = max(range(len(curves)), key=score)
    return curves[best], best


def _from_bench_dir(path: str, percentile: float | None) -> Curve:
    files = sorted(glob.glob(os.path.join(path, "*.json")))
    if not files:
        raise ValueError(f"{path}: no sweep.json and no bench serve result (*.json) in it")
    pct = 99.0 if percentile is None else float(percentile)
    pkey = percentile_key(pct)
    by_c: dict[float, tuple[str, Point]] = {}
    ins: list[float] = []
    outs: list[float] = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            obj = json.load(fh)
        c = obj.get("max_concurrency")
        if not isinstance(c, int) or c < 1 or obj.get("request_rate") not in ("inf", None):
            raise ValueError(f"{f}: not a closed-loop bench serve result (needs max_concurrency "
                             "and request_rate inf)")
        if c in by_c:
            raise ValueError(f"{f}: concurrency {c} measured twice (also {by_c[c][0]})")
        by_c[c] = (f, _point(obj, float(c), pkey, f))
        ok = [i for i, o in zip(obj.get("input_lens", []), obj.get("output_lens", [])) if o]
        ins += ok
        outs += [o for o in obj.get("output_lens", []) if o]
    points = tuple(by_c[c][1] for c in sorted(by_c))
    return Curve(points, pct, path, float(np.mean(ins)) if ins else None,
                 float(np.mean(outs)) if outs else None)


def load_curve(path: str, percentile: float | None = None, config_index: int | None = None,
               slos_ms: dict[str, float] | None = None) -> tuple[Curve, int | None]:
    """The curve in ``path`` and, for a sweep, the index of the configuration taken (the given
    ``config_index``, else the one meeting ``slos_ms`` at the highest concurrency).

    ``path``: a sweep.json, a directory holding one, or a directory of bench serve results.
    ``percentile``: the tail to read (default: the sweep's ``--percentile``, or 99).
    Raises:
      ValueError: a missing path, a file that is neither, a missing or non-numeric key (named
        with the file and concurrency), or a bad ``config_index``.
    """
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "sweep.json")):
        path = os.path.join(path, "sweep.json")
    if os.path.isdir(path):
        return _from_bench_dir(path, percentile), None
    if not os.path.isfile(path):
        raise ValueError(f"sweep result {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            result = json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg})") from None
    if not isinstance(result, dict) or "configs" not in result:
        raise ValueError(f"{path}: not a jaxserve sweep result (no 'configs'); pass a directory "
                         "for bench serve results")
    return _from_sweep(path, result, percentile, config_index, slos_ms or {})
