"""The pool of KV-cache blocks: a free list plus a reference count per block.

Block ``b`` names rows ``[b * block_size, (b + 1) * block_size)`` of every layer's K and V cache.
Block 0 is the padding block: padded tokens and unused block-table entries point at it, so it is
never handed out. Blocks ``1 .. num_blocks - 1`` are usable.

A block is *held* while its reference count is >= 1 and *free* (on the free list) at 0. Today a
block has one owner; the counts are there for prefix caching, where several requests share the
blocks of a common prefix (``incref``) and each ``free`` drops one reference.

The free list is FIFO: freed blocks go to the back and ``allocate`` takes from the front, so the
least recently freed block is reused first (the order an LRU prefix cache evicts in).
Pure Python, no jax.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

PADDING_BLOCK_ID = 0


class NoFreeBlocksError(ValueError):
    """``allocate(n)`` asked for more blocks than are free; nothing was changed."""


class BlockPool:
    """Free list and reference counts of ``num_blocks`` KV-cache blocks (block 0 reserved)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"{num_blocks=} must be >= 2 (block 0 is reserved for padding)")
        self.num_blocks = num_blocks
        self._refcounts: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction in [0, 1] of the usable blocks that are held."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def refcount(self, block_id: int) -> int:
        """References to ``block_id`` (always 0 for the padding block)."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"{block_id=} out of range [0, {self.num_blocks})")
        return self._refcounts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1.

        Raises:
          ValueError: ``n < 0``.
          NoFreeBlocksError: fewer than ``n`` blocks free (the pool is left unchanged).
        """
        if n < 0:
            raise ValueError(f"allocate: {n=} must be >= 0")
        if n > len(self._free):
            raise NoFreeBlocksError(f"allocate: {n=} blocks requested, {self.num_free_blocks=}")
        block_ids = [self._free.popleft() for _ in range(n)]
        for b in block_ids:
            self._refcounts[b] = 1
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block (a block may appear k times: k references dropped);
        blocks reaching 0 go to the back of the free list, in the order given.

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
                self._free.append(b)

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each (already held) block, e.g. to share a cached prefix.

        Raises:
          ValueError: a block id out of range, block 0, or a free block (refcount 0).
        """
        block_ids = list(block_ids)
        for b in block_ids:
            self._check_id(b)
            if self._refcounts[b] == 0:
                raise ValueError(f"incref: block {b} is free (refcount 0); allocate it first")
        for b in block_ids:
            self._refcounts[b] += 1

    def _check_id(self, block_id: int) -> None:
        if block_id == PADDING_BLOCK_ID:
            raise ValueError(f"{block_id=} is the reserved padding block")
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"{block_id=} out of range [1, {self.num_blocks})")

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, num_free_blocks={self.num_free_blocks})"
