"""Synthetic replica curves for the autoscaling tests."""

from __future__ import annotations

from jaxserve.autoscaling.curve import Curve, Point


def curve(rows: list[tuple[float, float, float, float]], medians: dict[str, list[float]] | None
          = None, lens: tuple[float | None, float | None] = (None, None)) -> Curve:
    """Rows ``(concurrency, req/s, tail TTFT ms, tail ITL ms)``; medians default to the tails
    (deterministic latencies in the simulation); TPOT equals ITL."""
    pts = []
    for k, (c, x, ttft, itl) in enumerate(rows):
        tail = {"ttft": ttft, "itl": itl, "tpot": itl}
        med = dict(tail, e2el=1000.0 * c / x)
        for m, vals in (medians or {}).items():
            med[m] = vals[k]
        pts.append(Point(c, x, med, tail))
    return Curve(tuple(pts), 99.0, "synthetic", *lens)


def fixed_service(seconds: float, ttft_ms: float = 100.0, n_max: float = 1000.0) -> Curve:
    """Every request takes ``seconds`` in service whatever the load (throughput n / seconds)."""
    return curve([(1.0, 1.0 / seconds, ttft_ms, 10.0), (n_max, n_max / seconds, ttft_ms, 10.0)])


def shared(rate: float, ttft_ms: float = 100.0) -> Curve:
    """A replica completing ``rate`` requests/s at any load, shared equally."""
    return curve([(1.0, rate, ttft_ms, 10.0), (1000.0, rate, ttft_ms, 10.0)])
