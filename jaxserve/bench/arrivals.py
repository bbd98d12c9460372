"""Request arrival times for ``jaxserve bench serve`` (vLLM's ``get_request`` rule).

Open loop at ``request_rate`` (requests/s): inter-arrival gaps are gamma distributed with shape
``burstiness`` and scale ``1 / (request_rate * burstiness)``, so the mean gap is always
``1 / request_rate`` and the coefficient of variation is ``1 / sqrt(burstiness)``: burstiness 1 is
a Poisson process (exponential gaps), < 1 burstier, > 1 more regular, ``inf`` evenly spaced.
``request_rate = inf`` sends every request at time 0 (a closed burst; with ``--max-concurrency``
this is a closed loop at that concurrency).

As in vLLM, the cumulative offsets are rescaled so that the last request arrives at exactly
``n / request_rate`` s; this removes the 1-2% run-to-run spread of the total send time.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import numpy as np


def inter_arrival_times(
    n: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """``n`` gaps (s) between successive arrivals, before any rescaling.

    Raises:
      ValueError: non-positive rate or burstiness.
    """
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / request_rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def arrival_offsets(
    n: int,
    request_rate: float,
    burstiness: float,
    rng: np.random.Generator,
    normalize: bool = True,
) -> np.ndarray:
    """Send times (s after the start) of ``n`` requests: cumulative gaps, the first one included;
    with ``normalize`` rescaled so the last is ``n / request_rate``."""
    offsets = np.cumsum(inter_arrival_times(n, request_rate, burstiness, rng))
    if normalize and n and offsets[-1] > 0:
        offsets *= (n / request_rate) / offsets[-1]
    return offsets


async def paced(offsets: np.ndarray) -> AsyncIterator[int]:
    """Yield request indices ``0..n-1``, each no earlier than its offset (s) after the first
    ``anext``; a late loop does not sleep (requests are never dropped, only delayed)."""
    start = time.perf_counter()
    for i, t in enumerate(offsets.tolist()):
        wait = start + t - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield i
