"""BlockPool: allocation, reference counts, errors, and a random-ops property test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.block_pool import BlockPool, NoFreeBlocksError, hash_block_tokens


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
    with pytest.raises(ValueError, match="caches nothing"):
        pool.incref([a])
    with pytest.raises(ValueError, match="padding"):
        pool.incref([0])


def test_block_hash_chains_parent_tokens_and_extra_key() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert len(h1) == 32 and h1 == hash_block_tokens(None, (1, 2, 3))
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(hash_block_tokens(None, [9]), [4])
    assert h1 != hash_block_tokens(None, [1, 2, 4])
    assert h1 != hash_block_tokens(None, [1, 2, 3], b"salt")
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])  # 64-bit ids


def test_cached_block_is_found_taken_back_and_evicted_last_freed_last() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    ha, hb = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    assert pool.cache_block(a, ha) and pool.cache_block(b, hb)
    assert not pool.cache_block(a, ha)  # already registered
    (c,) = pool.allocate(1)
    assert not pool.cache_block(c, ha)  # hash taken by a: c stays a plain block
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_block(a, hb)
    pool.free([c, b, a])
    assert (pool.num_free_blocks, pool.num_cached_blocks, pool.usage) == (3, 2, 0.0)
    assert pool.lookup(ha) == a and pool.block_hash(a) == ha
    pool.incref([a])  # a prefix hit takes a back
    assert pool.refcount(a) == 1 and pool.num_cached_blocks == 1 and pool.num_free_blocks == 2
    evicted: list = []
    assert pool.allocate(2, evicted) == [c, b]  # the LRU order; b loses its hash
    assert evicted == [(b, hb)] and pool.lookup(hb) is None and pool.lookup(ha) == a
    pool.free([b, c, a])
    assert pool.reset_prefix_cache() == 1 and pool.num_cached_blocks == 0
    assert pool.lookup(ha) is None


def test_caching_off_registers_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, hash_block_tokens(None, [1]))
    pool.free([a])
    assert pool.num_cached_blocks == 0
    with pytest.raises(ValueError, match="not held"):
        pool.cache_block(a, hash_block_tokens(None, [1]))


def test_too_small_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(1)


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(2, 12),
    ops=st.lists(st.tuples(st.sampled_from("aficl"), st.integers(0, 5)), max_size=50),
)
def test_random_ops_match_a_model(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    """Allocate / free / incref / cache / prefix-hit in random order against a model: held
    blocks' counts, hashes of cached blocks, and free + held = usable after every op."""
    pool = BlockPool(num_blocks)
    refs: dict[int, int] = {}  # the model: held block -> refcount
    hashes: dict[int, bytes] = {}  # block -> hash, held or cached-free
    for op, k in ops:
        h = hash_block_tokens(None, [k])
        if op == "a":
            if k > pool.num_free_blocks:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(k)
            else:
                evicted: list = []
                got = pool.allocate(k, evicted)
                assert len(set(got)) == k and not set(got) & set(refs) and 0 not in got
                assert evicted == [(b, hashes[b]) for b in got if b in hashes]
                for b, _ in evicted:
                    del hashes[b]
                refs.update({b: 1 for b in got})
        elif op == "l":  # prefix hit on hash k
            b = pool.lookup(h)
            assert b == next((x for x, y in hashes.items() if y == h), None)
            if b is not None:
                pool.incref([b])
                refs[b] = refs.get(b, 0) + 1
        elif refs:
            b = sorted(refs)[k % len(refs)]
            if op == "f":
                pool.free([b])
                refs[b] -= 1
                if refs[b] == 0:
                    del refs[b]
            elif op == "i":
                pool.incref([b])
                refs[b] += 1
            else:  # "c"
                fresh = b not in hashes and h not in hashes.values()
                assert pool.cache_block(b, hashes.get(b, h)) == fresh
                if fresh:
                    hashes[b] = h
        assert pool.num_free_blocks + len(refs) == pool.num_usable_blocks
        assert all(pool.refcount(b) == r for b, r in refs.items())
        assert pool.num_cached_blocks == len(set(hashes) - set(refs))
        assert pool.usage == pytest.approx(len(refs) / pool.num_usable_blocks)
    for b, r in refs.items():
        pool.free([b] * r)
    assert pool.num_free_blocks == pool.num_usable_blocks
