"""The bucket ladder (jaxserve.device.buckets)."""

from __future__ import annotations

import pytest

from jaxserve.device.buckets import (
    Bucket,
    make_buckets,
    pick_bucket,
    token_buckets,
)
from jaxserve.platform.cpu import SMALL_BUCKETS


def test_token_buckets_are_powers_of_two_from_8_then_the_budget() -> None:
    assert token_buckets(1024) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert token_buckets(100) == [8, 16, 32, 64, 100]
    assert token_buckets(8) == [8]


def test_small_buckets_come_first() -> None:
    assert token_buckets(64, small=SMALL_BUCKETS) == [1, 4, 8, 16, 32, 64]
    assert make_buckets(64, 4, small=(1, 4)) == [
        Bucket(1, 1), Bucket(4, 4), Bucket(8, 4), Bucket(16, 4), Bucket(32, 4), Bucket(64, 4)]
    for bad in ((0,), (8,), (4, 1), (1, 1)):
        with pytest.raises(ValueError, match="small buckets"):
            token_buckets(64, small=bad)


def test_pick_bucket_takes_the_smallest_that_holds_the_step() -> None:
    buckets = make_buckets(64, 16, small=SMALL_BUCKETS)
    assert pick_bucket(buckets, 1, 1) == Bucket(1, 1)
    assert pick_bucket(buckets, 2, 2) == Bucket(4, 4)
    assert pick_bucket(buckets, 4, 1) == Bucket(4, 4)
    assert pick_bucket(buckets, 5, 5) == Bucket(8, 8)
    assert pick_bucket(make_buckets(64, 16), 1, 1) == Bucket(8, 8)
    with pytest.raises(ValueError, match="no bucket holds 65 tokens"):
        pick_bucket(buckets, 65, 3)


def test_mid_buckets_sit_between_the_powers_of_two_from_24_up_to_their_limit() -> None:
    assert token_buckets(1024, small=SMALL_BUCKETS, mid_up_to=64) == [
        1, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512, 1024]
    assert token_buckets(1024, mid_up_to=47) == [8, 16, 24, 32, 64, 128, 256, 512, 1024]
    assert token_buckets(1024, mid_up_to=23) == token_buckets(1024)
    # never at or past the budget, which is the last bucket whatever it is
    assert token_buckets(100, mid_up_to=1000) == [8, 16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(96, mid_up_to=1000) == [8, 16, 24, 32, 48, 64, 96]
    assert token_buckets(16, mid_up_to=64) == [8, 16]
    assert make_buckets(64, 16, mid_up_to=64)[:5] == [
        Bucket(8, 8), Bucket(16, 16), Bucket(24, 16), Bucket(32, 16), Bucket(48, 16)]
    with pytest.raises(ValueError, match="mid_up_to"):
        token_buckets(64, mid_up_to=-1)
    # a step of 33 decodes pads to 48, not 64
    assert pick_bucket(make_buckets(1024, 64, SMALL_BUCKETS, 64), 33, 33) == Bucket(48, 48)


def test_min_tokens_drops_the_buckets_below_it_but_the_largest() -> None:
    """Batch invariance's floor (``BucketSet.min_tokens``): no bucket below it, so every step's
    matmuls run at one row class; the budget stays the last bucket even below the floor."""
    full = token_buckets(1024, small=SMALL_BUCKETS, mid_up_to=64)
    assert token_buckets(1024, small=SMALL_BUCKETS, mid_up_to=64, min_tokens=2) == full[1:]
    assert token_buckets(1024, small=SMALL_BUCKETS, mid_up_to=64, min_tokens=64) == [
        64, 128, 256, 512, 1024]
    assert token_buckets(32, small=SMALL_BUCKETS, mid_up_to=64, min_tokens=64) == [32]
    assert make_buckets(1024, 64, SMALL_BUCKETS, 64, min_tokens=64)[0] == Bucket(64, 64)
