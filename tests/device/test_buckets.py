"""The bucket ladder (jaxserve.device.buckets)."""

from __future__ import annotations

import pytest

from jaxserve.device.buckets import (
    CPU_SMALL_BUCKETS,
    Bucket,
    make_buckets,
    pick_bucket,
    token_buckets,
)


def test_token_buckets_are_powers_of_two_from_8_then_the_budget() -> None:
    assert token_buckets(1024) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert token_buckets(100) == [8, 16, 32, 64, 100]
    assert token_buckets(8) == [8]


def test_small_buckets_come_first() -> None:
    assert token_buckets(64, small=CPU_SMALL_BUCKETS) == [1, 4, 8, 16, 32, 64]
    assert make_buckets(64, 4, small=(1, 4)) == [
        Bucket(1, 1), Bucket(4, 4), Bucket(8, 4), Bucket(16, 4), Bucket(32, 4), Bucket(64, 4)]
    for bad in ((0,), (8,), (4, 1), (1, 1)):
        with pytest.raises(ValueError, match="small buckets"):
            token_buckets(64, small=bad)


def test_pick_bucket_takes_the_smallest_that_holds_the_step() -> None:
    buckets = make_buckets(64, 16, small=CPU_SMALL_BUCKETS)
    assert pick_bucket(buckets, 1, 1) == Bucket(1, 1)
    assert pick_bucket(buckets, 2, 2) == Bucket(4, 4)
    assert pick_bucket(buckets, 4, 1) == Bucket(4, 4)
    assert pick_bucket(buckets, 5, 5) == Bucket(8, 8)
    assert pick_bucket(make_buckets(64, 16), 1, 1) == Bucket(8, 8)
    with pytest.raises(ValueError, match="no bucket holds 65 tokens"):
        pick_bucket(buckets, 65, 3)
