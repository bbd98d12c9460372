"""Maintained measuring harnesses on jaxserve's public API (``docs/decisions/`` cites them).

Each module is a command, ``python -m benchmarks.NAME --help``, run from the repository root:
fixed seeds, one printed table, and ``--json PATH`` for the full result. Results are not
committed. What ``jaxserve bench step|throughput|serve|startup|prefix-cache`` and ``jaxserve
sweep`` already measure is not repeated here.

- ``engine_ab``: engines with different settings in one process, prefill and decode steps
  interleaved round by round (the A/B that a drifting shared machine needs).
- ``op_profile``: where a prefill or decode step's device time goes, per XLA op
  (``jax.profiler``).
- ``attention_ab``: the attention op alone over a paged cache, the native CPU kernel against
  the jnp path, decode or prefill rows.
"""
