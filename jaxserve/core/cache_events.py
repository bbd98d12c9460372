"""What changed in the prefix cache, as the KV manager records it for KV-cache events.

``KVManager`` appends these to its ``events`` list (only when built with
``record_events=True``: with events off nothing is built) and the engine takes them once per
step (``KVManager.take_events``), as vLLM's scheduler takes its KV cache manager's. The
``jaxserve.kv_events`` package turns them into vLLM's wire events (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) off the step thread. Hashes stay the raw 32-byte
digests here; the wire form is chosen by the publisher. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.block_hash import ExtraKeys
from jaxserve.core.block_pool import BlockHash

MEDIUM_GPU = "GPU"  # the device pool (vLLM's name for it, on any accelerator)
MEDIUM_CPU = "CPU"  # the host tier


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive full blocks of one sequence became cached in ``medium``.

    ``token_ids`` are the blocks' tokens, ``block_size`` per block, in order; empty for blocks
    offloaded to the host tier (the manager keeps only their hashes there, as vLLM's
    offloading connector reports them). ``parent_block_hash`` is the hash of the block before
    the first one (None: the first block of a sequence, or unknown). ``extra_keys``: None, or
    one entry per block (None or that block's extra keys).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    medium: str
    extra_keys: tuple[ExtraKeys, ...] | None = None


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Cached blocks of ``medium`` were evicted (their hashes no longer find them)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """The prefix cache was reset: every cached-free block in every tier was forgotten."""


CacheEvent = BlocksStored | BlocksRemoved | CacheCleared
