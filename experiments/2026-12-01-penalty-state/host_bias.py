"""The alternative to the device penalty state that was not chosen: a ``[batch, vocab]`` token
count array built on the host each step (``np.bincount`` of each row's history) and sent to
the device. Prints the median milliseconds per step; compare with the decode step of
``jaxserve bench step --modes greedy,penalties``.

Usage: PYTHONPATH=. python experiments/2026-12-01-penalty-state/host_bias.py [--batch 64]
           [--vocab 49152] [--history 52]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def host_bias_ms(batch: int, vocab: int, history: int, rng: np.random.Generator,
                 reps: int = 20) -> float:
    """Median ms to build ``i32[batch, vocab]`` token counts from ``history`` ids per row with
    numpy and put them on the device."""
    import jax

    hist = rng.integers(0, vocab, (batch, history))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        counts = np.stack([np.bincount(h, minlength=vocab).astype(np.int32) for h in hist])
        jax.device_put(counts).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary")
    p.add_argument("--history", type=int, default=52, help="prompt + output ids per row")
    a = p.parse_args()
    ms = host_bias_ms(a.batch, a.vocab, a.history, np.random.default_rng(0))
    print(f"[{a.batch}, {a.vocab}] counts built on the host and sent: median {ms:.2f} ms per step")


if __name__ == "__main__":
    main()
