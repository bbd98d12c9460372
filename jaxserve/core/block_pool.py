"""A pool of KV-cache blocks: reference counts, an LRU free list, and a prefix-cache index.

Block ``b`` names rows ``[b * block_size, (b + 1) * block_size)`` of every layer's K and V (of
the device cache or the host tier's). Block 0 is padding and never handed out; each of blocks
``1 .. num_blocks - 1`` is in exactly one state::

    held         refcount >= 1 (one reference per request sharing it)
    cached-free  refcount 0, registered under a hash: valid K/V that ``incref`` can take back
    empty        refcount 0, no hash

The free list (cached-free + empty) is LRU: freed blocks go to the back, ``allocate`` takes from
the front, and a cached block so taken loses its hash (is evicted). Prefix caching and the
chained block hash follow vLLM v1's ``BlockPool``
(https://docs.vllm.ai/en/latest/design/prefix_caching.html). Pure Python, no jax.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

PADDING_BLOCK_ID = 0

BlockHash = bytes  # 32-byte SHA-256 digest


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b""
) -> BlockHash:
    """SHA-256 of one full block, chained so that equal hashes mean equal prefixes and K/V.

    SHA-256, not ``hash``, so no one can provoke a collision that serves another's K/V
    (CVE-2025-25183).

    Args:
      parent: the previous block's hash; None for the first block.
      token_ids: the block's tokens (hashed as little-endian int64).
      extra_key: anything else that changes the K/V, e.g. a cache salt; empty for none.
    """
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(len(extra_key).to_bytes(4, "little"))
    h.update(extra_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class NoFreeBlocksError(ValueError):
    """``allocate(n)`` asked for more blocks than are free; nothing was changed."""


class BlockPool:
    """Reference counts, the LRU free list and the hash index of ``num_blocks`` blocks.

    Args:
      num_blocks: blocks including the reserved block 0 (>= 2).
      enable_caching: False: ``cache_block`` is a no-op and ``lookup`` always misses.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"{num_blocks=} must be >= 2 (block 0 is reserved for padding)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._refcounts: list[int] = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._hash_of: dict[int, BlockHash] = {}  # block -> its hash (held or cached-free)
        self._block_of: dict[BlockHash, int] = {}  # hash -> block
        self._num_cached_free = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: empty plus cached-free."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Cached-free blocks: refcount 0, still holding a prefix's K/V."""
        return self._num_cached_free

    @property
    def num_held_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction in [0, 1] of the usable blocks held (an idle, warm pool reads 0)."""
        return self.num_held_blocks / self.num_usable_blocks

    def refcount(self, block_id: int) -> int:
        """References to ``block_id`` (always 0 for the padding block)."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"{block_id=} out of range [0, {self.num_blocks})")
        return self._refcounts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash ``block_id`` is registered under, or None."""
        return self._hash_of.get(block_id)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block registered under ``block_hash``, or None; take it with ``incref``."""
        return self._block_of.get(block_hash)

    def allocate(self, n: int, evicted: list[tuple[int, BlockHash]] | None = None) -> list[int]:
        """Take ``n`` blocks from the front of the free list, each with refcount 1.

        Args:
          n: how many.
          evicted: if given, gets ``(block_id, hash)`` of each cached block taken (evicted).

        Raises:
          ValueError: ``n < 0``.
          NoFreeBlocksError: fewer than ``n`` blocks free (the pool is left unchanged).
        """
        if n < 0:
            raise ValueError(f"allocate: {n=} must be >= 0")
        if n > len(self._free):
            raise NoFreeBlocksError(f"allocate: {n=} blocks requested, {self.num_free_blocks=}")
        block_ids = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._block_of[h]
                self._num_cached_free -= 1
                if evicted is not None:
                    evicted.append((b, h))
            self._refcounts[b] = 1
            block_ids.append(b)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per occurrence; blocks reaching 0 join the free list in order.

        Free a request's blocks last-first, so its tail (least likely shared) is evicted first.

        Raises:
          ValueError: block 0, an id out of range, or a double free; nothing is changed.
        """
        drops = Counter(block_ids)
        for b, k in drops.items():
            self._check_id(b)
            if self._refcounts[b] < k:
                raise ValueError(
                    f"free: block {b} has refcount {self._refcounts[b]}, cannot drop {k} "
                    "(double free?)"
                )
        for b in drops:  # Counter keeps first-seen order
            self._refcounts[b] -= drops[b]
            if self._refcounts[b] == 0:
                self._free[b] = None
                if b in self._hash_of:
                    self._num_cached_free += 1

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each held or cached-free block (a prefix-cache hit).

        Raises:
          ValueError: block 0, an id out of range, or an empty block; nothing is changed.
        """
        block_ids = list(block_ids)
        for b in block_ids:
            self._check_id(b)
            if self._refcounts[b] == 0 and b not in self._hash_of:
                raise ValueError(f"incref: block {b} is free (refcount 0) and caches nothing; "
                                 "allocate it instead")
        for b in block_ids:
            if self._refcounts[b] == 0:
                del self._free[b]
                self._num_cached_free -= 1
            self._refcounts[b] += 1

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a held, complete block under ``block_hash``; False if caching is off or
        the block or the hash is registered already (the first block keeps it).

        Raises:
          ValueError: a bad block id, a block that is not held, or one already registered
            under a different hash.
        """
        self._check_id(block_id)
        if self._refcounts[block_id] == 0:
            raise ValueError(f"cache_block: block {block_id} is not held")
        old = self._hash_of.get(block_id)
        if old is not None:
            if old != block_hash:
                raise ValueError(f"cache_block: block {block_id} already has another hash")
            return False
        if not self.enable_caching or block_hash in self._block_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block's hash; return how many (held blocks keep theirs)."""
        dropped = 0
        for b in self._free:
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._block_of[h]
                dropped += 1
        self._num_cached_free = 0
        return dropped

    def _check_id(self, block_id: int) -> None:
        if block_id == PADDING_BLOCK_ID:
            raise ValueError(f"{block_id=} is the reserved padding block")
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"{block_id=} out of range [1, {self.num_blocks})")

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self.num_blocks}, num_free_blocks={self.num_free_blocks}, "
                f"num_cached_blocks={self.num_cached_blocks})")
