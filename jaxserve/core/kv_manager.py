"""The KV-cache manager the scheduler plans with: device pool, optional host tier, prefix lookup
across both, swapping, and the block copies each step needs. Pure Python, no jax.

The scheduler calls it while planning; ``take_transfers`` hands the step's copies to the engine,
which runs them before the forward pass, offloads first, then loads::

    offloads  device -> host: an evicted cached block (stays findable on the host), or a
              preempted request swapped out
    loads     host -> device: a prefix hit on the host tier, or a swapped-out request resuming

Offloads read device blocks before the step can overwrite them (an evicted block may be
reallocated in the same plan); loads may read a host block this step's offload wrote. Host
blocks a load reads are pinned until ``take_transfers``, so no offload of the plan reuses them.

With ``record_events`` the manager also records what changed in the prefix cache
(``cache_events``: blocks stored, blocks evicted, a reset), per tier, for ``take_events``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.core.block_hash import BlockHasher, ExtraKeys
from jaxserve.core.block_pool import BlockHash, BlockPool
from jaxserve.core.cache_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    CacheEvent,
)
from jaxserve.core.sequence import SeqState

DEVICE, HOST = "device", "host"


@dataclass
class KVStats:
    """Cumulative counters (tokens where the name says so, else blocks or events)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of those, found cached (either tier)
    host_cache_hits: int = 0  # of those, found on the host tier (loaded instead of recomputed)
    num_evicted_blocks: int = 0  # cached device blocks evicted to make room
    num_offloaded_blocks: int = 0  # of those, copied to the host tier
    num_host_evicted_blocks: int = 0  # cached host blocks dropped to make room
    num_swaps: int = 0  # preemptions resolved by swapping to the host tier
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0


@dataclass
class KVManager:
    """Device pool, optional host pool, and this step's pending copies.

    Args:
      num_blocks: device blocks including reserved block 0.
      block_size: tokens per block.
      enable_caching: prefix caching on (both tiers).
      num_host_blocks: host-tier blocks including its reserved block 0; 0: no host tier.
      hash_algo: the block hash (``block_hash.HASH_ALGOS``).
      record_events: record prefix-cache changes in ``events`` for ``take_events``.
    """

    num_blocks: int
    block_size: int
    enable_caching: bool = True
    num_host_blocks: int = 0
    hash_algo: str = "sha256"
    record_events: bool = False
    device: BlockPool = field(init=False)
    host: BlockPool | None = field(init=False)
    hasher: BlockHasher = field(init=False)
    events: list[CacheEvent] | None = field(init=False)  # None: not recording
    stats: KVStats = field(default_factory=KVStats)
    _offloads: list[tuple[int, int]] = field(default_factory=list)
    _loads: list[tuple[int, int]] = field(default_factory=list)
    _pinned: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_host_blocks == 1 or self.num_host_blocks < 0:
            raise ValueError(f"{self.num_host_blocks=} must be 0 (no host tier) or >= 2")
        self.device = BlockPool(self.num_blocks, self.enable_caching)
        self.host = BlockPool(self.num_host_blocks, self.enable_caching) \
            if self.num_host_blocks else None
        self.hasher = BlockHasher(self.hash_algo)
        self.events = [] if self.record_events else None

    # -- hashing and lookup --------------------------------------------------------------------
    def block_hashes(self, seq: SeqState, num_full: int) -> list[BlockHash]:
        """The hashes of ``seq``'s first ``num_full`` full blocks (computed once, kept on seq)."""
        bs, hashes = self.block_size, seq.block_hashes
        for i in range(len(hashes), num_full):
            hashes.append(self.hasher(hashes[i - 1] if i else None,
                                      seq.token_ids[i * bs:(i + 1) * bs], _extra_keys(seq, i)))
        return hashes[:num_full]

    def find_prefix(self, seq: SeqState) -> list[tuple[str, int]]:
        """The longest cached prefix of ``seq``, one ``(DEVICE | HOST, block_id)`` per block.

        At most ``(len(token_ids) - 1) // block_size`` blocks, so the last token is computed and
        yields logits; none when caching is off or ``seq.skip_prefix_cache``. Changes nothing.
        """
        if not self.enable_caching or seq.skip_prefix_cache:
            return []
        hits: list[tuple[str, int]] = []
        for h in self.block_hashes(seq, (len(seq.token_ids) - 1) // self.block_size):
            b = self.device.lookup(h)
            if b is not None:
                hits.append((DEVICE, b))
                continue
            b = self.host.lookup(h) if self.host is not None else None
            if b is None:
                break
            hits.append((HOST, b))
        return hits

    def num_free_needed(self, hits: list[tuple[str, int]], num_blocks_total: int) -> int:
        """Free device blocks an ``admit`` with these arguments takes (cached-free hits count)."""
        dev = [b for tier, b in hits if tier == DEVICE]
        return num_blocks_total - len(dev) + sum(self.device.refcount(b) == 0 for b in dev)

    def admit(self, seq: SeqState, hits: list[tuple[str, int]], num_blocks_total: int) -> None:
        """Give a waiting, not swapped-out request its block table and cached length.

        The caller checks ``num_free_needed`` against the free blocks first.
        """
        # take the hits first, so that allocating the new blocks cannot evict them
        self.device.incref(b for tier, b in hits if tier == DEVICE)
        host_hits = [b for tier, b in hits if tier == HOST]
        if host_hits:
            self.host.incref(host_hits)  # pinned until take_transfers
            self._pinned.extend(host_hits)
        new = self.allocate(num_blocks_total - len(hits) + len(host_hits))
        table, stored = [], []
        for i, (tier, b) in enumerate(hits):
            if tier == DEVICE:
                table.append(b)
                continue
            d = new.pop(0)
            self._loads.append((b, d))
            # its K/V arrives before the step
            if self.device.cache_block(d, seq.block_hashes[i]):
                stored.append(i)
            table.append(d)
        if stored and self.events is not None:
            self._record_stored(seq, stored)
        seq.block_ids = table + new
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        st = self.stats
        if not self.enable_caching or seq.skip_prefix_cache:  # it did not look
            return
        st.prefix_cache_queries += len(seq.token_ids)
        st.prefix_cache_hits += len(hits) * self.block_size
        st.host_cache_hits += len(host_hits) * self.block_size

    # -- allocation and freeing ----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` new device blocks; cached blocks evicted on the way go to the host tier."""
        evicted: list[tuple[int, BlockHash]] = []
        block_ids = self.device.allocate(n, evicted)
        self.stats.num_evicted_blocks += len(evicted)
        if evicted and self.events is not None:
            self.events.append(BlocksRemoved(tuple(h for _, h in evicted), MEDIUM_GPU))
        host = self.host
        for b, h in evicted:
            if host is None or host.lookup(h) is not None or host.num_free_blocks == 0:
                continue
            (hb,) = self._host_allocate(1)
            host.cache_block(hb, h)
            host.free([hb])  # cached-free on the host from now on
            self._offloads.append((b, hb))
            self.stats.num_offloaded_blocks += 1
            if self.events is not None:
                self._record_offloaded(h)
        return block_ids

    def _host_allocate(self, n: int) -> list[int]:
        evicted: list[tuple[int, BlockHash]] = []
        got = self.host.allocate(n, evicted)
        self.stats.num_host_evicted_blocks += len(evicted)
        if evicted and self.events is not None:
            self.events.append(BlocksRemoved(tuple(h for _, h in evicted), MEDIUM_CPU))
        if evicted:  # a host block written earlier in this plan and reused now: one copy only
            gone = {b for b, _ in evicted}
            self._offloads = [(d, h) for d, h in self._offloads if h not in gone]
        return got

    def free_seq(self, seq: SeqState) -> None:
        """Return a request's device and host blocks (device blocks last-first)."""
        self.device.free(reversed(seq.block_ids))
        seq.block_ids = []
        if seq.host_block_ids:
            self.host.free(seq.host_block_ids)
            seq.host_block_ids = []

    def cache_computed_blocks(self, seq: SeqState, num_tokens: int | None = None) -> None:
        """Register the request's full blocks among its first ``num_tokens`` (default: the
        computed ones; async scheduling also passes those of dispatched steps, whose K/V is
        written before any later step reads it) whose tokens are known (a sampled token not
        yet read back is not) in the prefix cache."""
        n = seq.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(n, len(seq.token_ids)) // self.block_size
        if not self.enable_caching or num_full <= seq.num_registered_blocks:
            return
        hashes = self.block_hashes(seq, num_full)
        stored = [i for i in range(seq.num_registered_blocks, num_full)
                  if self.device.cache_block(seq.block_ids[i], hashes[i])]
        seq.num_registered_blocks = num_full
        if stored and self.events is not None:
            self._record_stored(seq, stored)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block in both tiers (blocks of running requests keep their
        hashes); returns how many were dropped."""
        dropped = self.device.reset_prefix_cache() + (
            self.host.reset_prefix_cache() if self.host is not None else 0)
        if self.events is not None:
            self.events.append(CacheCleared())
        return dropped

    # -- events --------------------------------------------------------------------------------
    def _record_stored(self, seq: SeqState, indices: list[int]) -> None:
        """One ``BlocksStored`` per run of consecutive block indices of ``seq`` (ascending)."""
        bs, hashes = self.block_size, seq.block_hashes
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            lo, hi = run[0], run[-1] + 1
            extra = tuple(_extra_keys(seq, i) for i in run)
            self.events.append(BlocksStored(
                tuple(hashes[lo:hi]), hashes[lo - 1] if lo else None,
                tuple(seq.token_ids[lo * bs:hi * bs]), MEDIUM_GPU,
                extra if any(e is not None for e in extra) else None))

    def _record_offloaded(self, h: BlockHash) -> None:
        """A block now cached on the host: its hash only (the manager does not keep its tokens),
        merged into the last event when that stored host blocks too."""
        last = self.events[-1] if self.events else None
        if isinstance(last, BlocksStored) and last.medium == MEDIUM_CPU:
            self.events[-1] = BlocksStored((*last.block_hashes, h), None, (), MEDIUM_CPU)
        else:
            self.events.append(BlocksStored((h,), None, (), MEDIUM_CPU))

    def take_events(self) -> list[CacheEvent]:
        """The prefix-cache changes recorded since the last call, oldest first (empty when not
        recording)."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    # -- swapping ------------------------------------------------------------------------------
    def swap_out(self, seq: SeqState) -> bool:
        """Move a preempted request's blocks to the host tier; False, changing nothing, without
        room or for ``skip_prefix_cache`` (its sampling state restarts at position 0)."""
        n = len(seq.block_ids)
        if self.host is None or n == 0 or n > self.host.num_free_blocks or seq.skip_prefix_cache:
            return False
        seq.host_block_ids = self._host_allocate(n)
        self._offloads.extend(zip(seq.block_ids, seq.host_block_ids, strict=True))
        self.device.free(reversed(seq.block_ids))
        seq.block_ids = []
        self.stats.num_swaps += 1
        self.stats.num_swapped_out_blocks += n
        return True

    def swap_in(self, seq: SeqState, num_blocks_total: int) -> None:
        """Give a swapped-out request ``num_blocks_total`` device blocks, loading its K/V back."""
        new = self.allocate(num_blocks_total)
        self._loads.extend(zip(seq.host_block_ids, new, strict=False))
        self._pinned.extend(seq.host_block_ids)  # their reference moves to the pin list
        self.stats.num_swapped_in_blocks += len(seq.host_block_ids)
        seq.host_block_ids = []
        seq.block_ids = new
        seq.num_registered_blocks = 0  # re-registered (or found registered) by update

    def take_transfers(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """``(offloads, loads)`` planned since the last call; unpins the host blocks read."""
        out = (tuple(self._offloads), tuple(self._loads))
        if self._pinned:
            self.host.free(self._pinned)
        self._offloads, self._loads, self._pinned = [], [], []
        return out


def _extra_keys(seq: SeqState, i: int) -> ExtraKeys:
    """What besides its tokens block ``i`` of ``seq`` is hashed with: the cache salt, on the
    first block only (as vLLM's ``generate_block_hash_extra_keys``)."""
    return (seq.cache_salt,) if i == 0 and seq.cache_salt else None
