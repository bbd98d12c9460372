"""The padded shapes the step program is compiled for.

A step's ragged batch (``num_tokens`` tokens from ``num_seqs`` sequences) is padded to a bucket
``(T, S)``: ``T`` the smallest token bucket >= num_tokens (powers of two from 8 up to
``max_num_batched_tokens``, which is always the last bucket, and on the CPU a 1-token bucket
first), and ``S = min(T, max_num_seqs)``.
Every sequence contributes at least one token, so ``num_seqs <= num_tokens <= T`` and
``num_seqs <= max_num_seqs``: one ``S`` per ``T`` always fits. That gives one program per token
bucket (8 for the default 1024 tokens, 9 with the 1-token bucket) instead of the full (T, S)
grid.

The 1-token bucket is for one request decoding alone. On XLA:CPU its step took 24 ms against
32 ms padded to 8 rows (SmolLM2-135M, bfloat16 weights, context 300): a 1-row weight matmul
runs as a matrix-vector product, and attention gathers one sequence's pages instead of eight
(7 of them padding). It costs one model and one sampler program more to compile.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_TOKEN_BUCKET = 8


@dataclass(frozen=True)
class Bucket:
    """Padded step shape: ``num_tokens`` (T) and ``num_seqs`` (S)."""

    num_tokens: int
    num_seqs: int


def token_buckets(max_num_batched_tokens: int, single_token: bool = False) -> list[int]:
    """Powers of two from 8 below ``max_num_batched_tokens``, then that maximum itself; with
    ``single_token``, 1 before them."""
    out, t = [1] if single_token else [], MIN_TOKEN_BUCKET
    while t < max_num_batched_tokens:
        out.append(t)
        t *= 2
    out.append(max_num_batched_tokens)
    return out


def make_buckets(max_num_batched_tokens: int, max_num_seqs: int, single_token: bool = False
                 ) -> list[Bucket]:
    """The bucket table, one entry per token bucket (``token_buckets``), ascending."""
    return [Bucket(t, min(t, max_num_seqs))
            for t in token_buckets(max_num_batched_tokens, single_token)]


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
