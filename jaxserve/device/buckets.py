"""The padded shapes the step program is compiled for.

A step's ragged batch (``num_tokens`` tokens from ``num_seqs`` sequences) is padded to a bucket
``(T, S)``: ``T`` the smallest token bucket >= num_tokens (powers of two from 8 up to
``max_num_batched_tokens``, which is always the last bucket, after any ``small`` buckets below
8), and ``S = min(T, max_num_seqs)``.
Every sequence contributes at least one token, so ``num_seqs <= num_tokens <= T`` and
``num_seqs <= max_num_seqs``: one ``S`` per ``T`` always fits. That gives one program per token
bucket (8 for the default 1024 tokens, 10 with the CPU's small buckets) instead of the full
(T, S) grid.

On the CPU the engine adds ``CPU_SMALL_BUCKETS``, 1 and 4 tokens, for one to four requests
decoding. XLA:CPU runs a 1-row weight matmul as a matrix-vector product, and a step's
attention gathers every slot's pages (padding slots' too). SmolLM2-135M, bfloat16 weights,
context 300 (``jaxserve bench step``): one decode 24 ms in the 1-token bucket against 32 ms in
the 8-token one; four decodes 30-32 ms in the 4-token bucket against 36 ms. Each costs one
model and one sampler program more to compile; a 2-token bucket was no faster for two
decodes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_TOKEN_BUCKET = 8
CPU_SMALL_BUCKETS = (1, 4)  # token buckets below 8 that the engine compiles on the CPU


@dataclass(frozen=True)
class Bucket:
    """Padded step shape: ``num_tokens`` (T) and ``num_seqs`` (S)."""

    num_tokens: int
    num_seqs: int


def token_buckets(max_num_batched_tokens: int, small: tuple[int, ...] = ()) -> list[int]:
    """``small`` (ascending, each below 8), then powers of two from 8 below
    ``max_num_batched_tokens``, then that maximum itself.

    Raises:
      ValueError: a ``small`` bucket not in ``[1, 8)`` or not ascending.
    """
    if any(not 1 <= t < MIN_TOKEN_BUCKET for t in small) or list(small) != sorted(set(small)):
        raise ValueError(f"small buckets {small} must ascend within [1, {MIN_TOKEN_BUCKET})")
    out, t = list(small), MIN_TOKEN_BUCKET
    while t < max_num_batched_tokens:
        out.append(t)
        t *= 2
    out.append(max_num_batched_tokens)
    return out


def make_buckets(max_num_batched_tokens: int, max_num_seqs: int,
                 small: tuple[int, ...] = ()) -> list[Bucket]:
    """The bucket table, one entry per token bucket (``token_buckets``), ascending."""
    return [Bucket(t, min(t, max_num_seqs))
            for t in token_buckets(max_num_batched_tokens, small)]


def pick_bucket(buckets: list[Bucket], num_tokens: int, num_seqs: int) -> Bucket:
    """The smallest bucket holding ``num_tokens`` tokens of ``num_seqs`` sequences.

    Raises:
      ValueError: if no bucket is large enough (the scheduler exceeded its budget).
    """
    i = bisect.bisect_left([b.num_tokens for b in buckets], num_tokens)
    if i == len(buckets) or num_seqs > buckets[i].num_seqs:
        raise ValueError(
            f"no bucket holds {num_tokens} tokens of {num_seqs} sequences; largest is "
            f"{buckets[-1]}")
    return buckets[i]
