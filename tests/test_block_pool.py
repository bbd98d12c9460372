"""BlockPool: allocation, reference counts, errors, and a random-ops property test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.block_pool import BlockPool, NoFreeBlocksError


def test_fresh_pool() -> None:
    pool = BlockPool(8)
    assert pool.num_usable_blocks == 7
    assert pool.num_free_blocks == 7
    assert pool.usage == 0.0
    assert all(pool.refcount(b) == 0 for b in range(8))


def test_allocate_never_hands_out_block_0_and_exhausts() -> None:
    pool = BlockPool(5)
    got = pool.allocate(4)
    assert sorted(got) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    assert all(pool.refcount(b) == 1 for b in got)
    assert pool.allocate(0) == []


def test_allocate_too_many_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="num_free_blocks"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert isinstance(NoFreeBlocksError("x"), ValueError)
    with pytest.raises(ValueError, match="n=-1"):
        pool.allocate(-1)


def test_free_returns_blocks_fifo() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)
    pool.free(a)
    assert pool.num_free_blocks == 5
    assert pool.usage == 0.0
    # the two never-used blocks come first, then the freed ones in the order freed
    assert pool.allocate(5) == [4, 5, *a]


def test_double_free_and_bad_ids_raise_without_change() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b, a])
    assert pool.refcount(b) == 1  # checked before anything changed
    with pytest.raises(ValueError, match="double free"):
        pool.free([b, b])
    with pytest.raises(ValueError, match="padding"):
        pool.free([0])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])
    assert pool.num_free_blocks == 2


def test_incref_shares_a_block() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.incref([a])
    assert pool.refcount(a) == 2
    pool.free([a])
    assert pool.refcount(a) == 1 and pool.num_free_blocks == 2
    pool.free([a])
    assert pool.refcount(a) == 0 and pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="refcount 0"):
        pool.incref([a])
    with pytest.raises(ValueError, match="padding"):
        pool.incref([0])


def test_too_small_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(1)


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(2, 12),
    ops=st.lists(st.tuples(st.sampled_from("afi"), st.integers(0, 5)), max_size=40),
)
def test_random_ops_match_a_model(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(num_blocks)
    refs: dict[int, int] = {}  # the model: held block -> refcount
    for op, k in ops:
        if op == "a":
            if k > pool.num_free_blocks:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(k)
            else:
                got = pool.allocate(k)
                assert len(set(got)) == k and not set(got) & set(refs) and 0 not in got
                refs.update({b: 1 for b in got})
        elif refs:
            b = sorted(refs)[k % len(refs)]
            if op == "f":
                pool.free([b])
                refs[b] -= 1
                if refs[b] == 0:
                    del refs[b]
            else:
                pool.incref([b])
                refs[b] += 1
        assert pool.num_free_blocks + len(refs) == pool.num_usable_blocks
        assert all(pool.refcount(b) == r for b, r in refs.items())
        assert pool.usage == pytest.approx(len(refs) / pool.num_usable_blocks)
    for b, r in refs.items():
        pool.free([b] * r)
    assert pool.num_free_blocks == pool.num_usable_blocks
