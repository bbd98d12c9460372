"""The padded shapes the step program is compiled for.

A step's ragged batch (``num_tokens`` tokens from ``num_seqs`` sequences) is padded to a bucket
``(T, S)``: ``T`` the smallest token bucket >= num_tokens (powers of two from 8 up to
``max_num_batched_tokens``, which is always the last bucket, after any ``small`` buckets below
8, with the ``mid`` buckets between them from 24 up to ``mid_up_to``), and
``S = min(T, max_num_seqs)``.
Every sequence contributes at least one token, so ``num_seqs <= num_tokens <= T`` and
``num_seqs <= max_num_seqs``: one ``S`` per ``T`` always fits. That gives one program per token
bucket (8 for the default 1024 tokens; 12 on the CPU, with its small buckets and the mid ones up
to the default 64 sequences) instead of the full (T, S) grid.

Which extra shapes pay for themselves is a platform question (``jaxserve.platform``'s
``buckets``): the CPU compiles small buckets (1 and 4 tokens) and the mid ones; a GPU keeps the
powers of two.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_TOKEN_BUCKET = 8
MIN_MID_BUCKET = 24  # the smallest of the buckets 3 * 2**k (``token_buckets``'s mid_up_to)


@dataclass(frozen=True)
class Bucket:
    """Padded step shape: ``num_tokens`` (T) and ``num_seqs`` (S)."""

    num_tokens: int
    num_seqs: int


def token_buckets(max_num_batched_tokens: int, small: tuple[int, ...] = (),
                  mid_up_to: int = 0, min_tokens: int = 1) -> list[int]:
    """``small`` (ascending, each below 8), then powers of two from 8 below
    ``max_num_batched_tokens``, each ``2**k`` from 16 followed by ``3 * 2**(k - 1)`` while that
    is at most ``mid_up_to`` (so 8, 16, 24, 32, 48, 64, 96, ...), then the maximum itself;
    none of them below ``min_tokens`` but the maximum (``BucketSet.min_tokens``).

    Raises:
      ValueError: a ``small`` bucket not in ``[1, 8)`` or not ascending; ``mid_up_to < 0``.
    """
    if any(not 1 <= t < MIN_TOKEN_BUCKET for t in small) or list(small) != sorted(set(small)):
        raise ValueError(f"small buckets {small} must ascend within [1, {MIN_TOKEN_BUCKET})")
    if mid_up_to < 0:
        raise ValueError(f"mid_up_to={mid_up_to} must be >= 0")
    out, t = list(small), MIN_TOKEN_BUCKET
    while t < max_num_batched_tokens:
        out.append(t)
        mid = t * 3 // 2
        if MIN_MID_BUCKET <= mid <= mid_up_to and mid < max_num_batched_tokens:
            out.append(mid)
        t *= 2
    out.append(max_num_batched_tokens)
    return [t for t in out if t >= min_tokens or t == max_num_batched_tokens]


def make_buckets(max_num_batched_tokens: int, max_num_seqs: int,
                 small: tuple[int, ...] = (), mid_up_to: int = 0,
                 min_tokens: int = 1) -> list[Bucket]:
    """The bucket table, one entry per token bucket (``token_buckets``), ascending."""
    return [Bucket(t, min(t, max_num_seqs))
            for t in token_buckets(max_num_batched_tokens, small, mid_up_to, min_tokens)]


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


def ready_buckets(buckets: list[Bucket]) -> list[Bucket]:
    """What a deferred start-up compiles before it is ready (``BucketSet.defer_compile``): the
    smallest bucket (one sequence decoding), the smallest with the most rows (a full decode
    batch) and the largest (any step), ascending. Until the others are compiled
    (``ModelRunner.compile_pending``) a step pads up to the smallest of these that holds it."""
    most_rows = max(b.num_seqs for b in buckets)
    full = next(b for b in buckets if b.num_seqs == most_rows)
    return sorted({buckets[0], full, buckets[-1]}, key=lambda b: b.num_tokens)
