"""What the allowed-token mask costs the device: the sampling tail of a step (``suppress_tokens``
then greedy ``sample``) over ``f32[32, 49152]`` logits, without a mask (as before structured
outputs), with the device-resident all-ones mask read unconditionally (the first design), with
it skipped under ``lax.cond`` on the step's flag (every unconstrained step now), and with a host
mask sent and read (a step with a constrained row). Interleaved, 600 rounds, medians and
minima.

    PYTHONPATH=. python experiments/2026-12-01-grammar-engine/mask_cost.py
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.device.sampler import RowInputs, sample, suppress_tokens

S, V, ROUNDS = 32, 49152, 600


def main() -> None:
    rng = np.random.default_rng(0)
    logits = jax.device_put(rng.standard_normal((S, V)).astype(np.float32))
    ids = jax.device_put(np.full((S, 32), -1, np.int32))
    rows = RowInputs(jnp.zeros(S), jnp.zeros(S, jnp.int32), jnp.ones(S), jnp.zeros(S),
                     jnp.zeros((S, 2), jnp.uint32), jnp.zeros(S, jnp.int32),
                     jnp.full(S, S, jnp.int32), jnp.ones(S), jnp.zeros(S), jnp.zeros(S))
    words = -(-V // 32)
    ones = jax.device_put(np.full((S, words), -1, np.int32))
    host = np.full((S, words), -1, np.int32)
    host[0, : words // 2] = 0  # one constrained row
    without = jax.jit(lambda lg, i: sample(suppress_tokens(lg, i), rows))
    always = jax.jit(lambda lg, i, m: sample(suppress_tokens(lg, i, m), rows))
    flagged = jax.jit(lambda lg, i, m, f: sample(suppress_tokens(lg, i, m, f), rows))
    off, on = jax.device_put(np.bool_(False)), jax.device_put(np.bool_(True))
    runs = {"no mask (before)": lambda: without(logits, ids),
            "all-ones, always read": lambda: always(logits, ids, ones),
            "all-ones, flag off (unconstrained step)": lambda: flagged(logits, ids, ones, off),
            "host mask, flag on (constrained step)": lambda: flagged(logits, ids, host, on)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for f in runs.values():
        f().block_until_ready()
    for _ in range(ROUNDS):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f().block_until_ready()
            times[k].append(time.perf_counter() - t0)
    for k, ts in times.items():
        print(f"{k:<42}{1e6 * statistics.median(ts):>10.1f} us median"
              f"{1e6 * min(ts):>10.1f} us min")


if __name__ == "__main__":
    main()
