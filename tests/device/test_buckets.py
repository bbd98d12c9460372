"""The bucket ladder (jaxserve.device.buckets)."""

from __future__ import annotations

import pytest

from jaxserve.device.buckets import Bucket, make_buckets, pick_bucket, token_buckets


def test_token_buckets_are_powers_of_two_from_8_then_the_budget() -> None:
    assert token_buckets(1024) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert token_buckets(100) == [8, 16, 32, 64, 100]
    assert token_buckets(8) == [8]


def test_single_token_bucket_comes_first() -> None:
    assert token_buckets(64, single_token=True) == [1, 8, 16, 32, 64]
    assert make_buckets(64, 4, single_token=True) == [
        Bucket(1, 1), Bucket(8, 4), Bucket(16, 4), Bucket(32, 4), Bucket(64, 4)]


def test_pick_bucket_takes_the_1_token_bucket_only_for_one_token() -> None:
    buckets = make_buckets(64, 16, single_token=True)
    assert pick_bucket(buckets, 1, 1) == Bucket(1, 1)
    assert pick_bucket(buckets, 2, 2) == Bucket(8, 8)
    assert pick_bucket(buckets, 2, 1) == Bucket(8, 8)
    assert pick_bucket(make_buckets(64, 16), 1, 1) == Bucket(8, 8)
    with pytest.raises(ValueError, match="no bucket holds 65 tokens"):
        pick_bucket(buckets, 65, 3)
