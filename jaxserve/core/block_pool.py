"""A pool of KV-cache blocks: reference counts, an LRU free list, and a prefix-cache index.

Block ``b`` names rows ``[b * block_size, (b + 1) * block_size)`` of every layer's K and V cache
(of the device cache, or of the host tier's: the same class keeps both). Block 0 is the padding
block: padded tokens and unused block-table entries point at it, so it is never handed out.
Blocks ``1 .. num_blocks - 1`` are usable, and each is in exactly one of three states::

    held         refcount >= 1: in the block table of at least one request (shared prefix
                 blocks have one reference per request)
    cached-free  refcount 0 and registered under a block hash: its K/V is still valid and a
                 later request with the same prefix can take it back (``incref``) instead of
                 recomputing it
    empty        refcount 0, no hash

so ``num_held_blocks + num_cached_blocks + num_empty_blocks == num_usable_blocks``.
``num_free_blocks`` (cached-free + empty) is what ``allocate`` can hand out.

The free list is LRU: blocks reaching refcount 0 go to its back; ``allocate`` takes from its front
and so reuses the least recently freed block first; a cached block taken from the front loses its
hash (it is *evicted*; the caller can copy it to the host tier first). Prefix caching as in vLLM's
v1 ``BlockPool`` (https://docs.vllm.ai/en/latest/design/prefix_caching.html), whose chained block
hash ``hash_block_tokens`` follows. Pure Python, no jax.
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
    """The hash of one full block: SHA-256 over the parent block's hash (None for the first
    block), the block's token ids (as little-endian int64) and ``extra_key`` (anything else that
    changes the block's K/V, e.g. a per-tenant cache salt; empty for none).

    Chaining makes a block's hash name its whole prefix, so equal hashes mean equal K/V. SHA-256
    (not Python's ``hash``) so that a collision, which would serve one request another's K/V,
    cannot be provoked (vLLM made the same change, CVE-2025-25183).
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
    """Reference counts, the LRU free list and the hash index of ``num_blocks`` blocks
    (block 0 reserved).

    Args:
      num_blocks: blocks including the reserved block 0 (>= 2).
      enable_caching: False makes ``cache_block`` a no-op and ``lookup`` always miss, so freed
        blocks are plain empty blocks (prefix caching off).
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
        """Fraction in [0, 1] of the usable blocks that are held (cached-free blocks excluded,
        so an idle pool with a warm cache reads 0)."""
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
        """The block (held or cached-free) registered under ``block_hash``, or None. Changes
        nothing; take the block with ``incref``."""
        return self._block_of.get(block_hash)

    def allocate(self, n: int, evicted: list[tuple[int, BlockHash]] | None = None) -> list[int]:
        """Take ``n`` free blocks from the front of the LRU list, each with reference count 1.

        A cached-free block taken this way loses its hash; ``(block_id, hash)`` is appended to
        ``evicted`` when a list is given, so the caller can copy its K/V elsewhere before the
        new owner overwrites it.

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
        """Drop one reference to each block (a block may appear k times: k references dropped);
        blocks reaching 0 go to the back of the free list in the order given, cached ones
        keeping their hash (callers free a request's blocks last-first, so that its tail, the
        part least likely to be shared, is evicted first).

        Raises:
          ValueError: a block id out of range, block 0, or a block with fewer references than
            are dropped (double free). All ids are checked before anything changes.
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
        """Add one reference to each block: a held block (sharing it) or a cached-free one
        (taking it back off the free list, a prefix-cache hit).

        Raises:
          ValueError: a block id out of range, block 0, or an empty block (refcount 0 and no
            hash: allocate it instead). All ids are checked before anything changes.
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
        """Register a held block, whose K/V is complete, under ``block_hash``.

        Returns True if registered; False if caching is off, the block is already registered,
        or another block already holds this hash (the first one stays the cached copy and this
        one is freed as a plain block later).

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
        """Forget every cached-free block's hash (they become empty); held blocks keep theirs.
        Returns how many were dropped."""
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
