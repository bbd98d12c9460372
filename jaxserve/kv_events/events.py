"""vLLM's KV-cache event structs and their msgpack encoding, from the KV manager's records.

Two encodings, chosen by ``--kv-events-config``'s ``event_encoding``:

``"map"`` (the default): vLLM 0.32's ``vllm/distributed/kv_events.py``. The batch
  ``KVEventBatch(ts, events, data_parallel_rank)`` is array-like, ``[ts, [event, ...], rank]``;
  each event is a *tagged map* (msgspec ``tag=True, omit_defaults=True``, no ``array_like``):
  ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...],
  "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
  "kv_cache_spec_kind": "full_attention"}``. Fields at their default are left out, except
  the three that vLLM declares without one (``lora_id``, ``medium``, ``lora_name``). As vLLM's
  KV cache manager, device events carry the KV cache group (``group_idx`` 0: jaxserve has one)
  and its kind (``"full_attention"``: every layer keeps every cached block).
``"array"``: the releases before vLLM PR #42892, whose events are tagged arrays
  ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys,
  group_idx]``, ``["BlockRemoved", hashes, medium, group_idx]``, ``["AllBlocksCleared"]``
  (msgspec writes every field of an array-like struct). For subscribers that read only that
  form (llm-d's kv-cache indexer up to v0.8; its successor in llm-d-router reads both).

Block hashes are vLLM's ``ExternalBlockHash`` (``bytes | int``): by default, as vLLM's
``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` unset, the low 64
bits of the big-endian digest as an int; with that variable "0", the 32-byte digest itself.
``extra_keys`` are published untagged, as vLLM's ``to_event_extra_keys``: ``(cache_salt,)`` on
a salted request's first block.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from jaxserve.core.block_pool import BlockHash
from jaxserve.core.cache_events import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    CacheEvent,
)

ExternalBlockHash = bytes | int
EVENT_ENCODINGS = ("map", "array")
KV_CACHE_GROUP = 0  # jaxserve's one KV cache group
KV_CACHE_SPEC_KIND = "full_attention"  # vLLM's KVCacheSpecKind of that group


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The payload of one published message: ``ts`` (seconds since the epoch), the step's
    events (already encoded structs of one encoding), the replica's rank. vLLM's
    ``EventBatch``/``KVEventBatch``, array-like in every release."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# -- "map": vLLM 0.32 ------------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM 0.32's events: a msgpack map with ``"type"`` the class name."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks became cached in ``medium`` ("GPU" device, "CPU" host tier):
    their hashes, the parent of the first, their tokens (``block_size`` each)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: the cache salt
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks of ``medium`` were evicted."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset."""


# -- "array": the releases before vLLM PR #42892 ----------------------------------------------


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                        tag=True):
    """Base of the older events: ``[class name, field, ...]``."""


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    """``BlockStored`` as a tagged array (fields as ``BlockStored`` up to ``group_idx``)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    """``BlockRemoved`` as a tagged array."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    """``AllBlocksCleared`` as a tagged array."""


def int_block_hashes() -> bool:
    """Whether hashes go out as 64-bit ints (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
    default on)."""
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").lower() not in ("0", "false")


def external_hash(h: BlockHash, as_int: bool) -> ExternalBlockHash:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits of the big-endian digest, or the
    digest."""
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF if as_int else h


class EventEncoder:
    """Turns the KV manager's records into vLLM's events of one encoding, one step at a time.

    It follows which hashes each tier holds, as a subscriber does, and keeps the parent,
    tokens and extra keys of each device block it saw stored; a block offloaded to the host
    tier then goes out self-describing (its tokens and parent, as vLLM 0.32's offloading
    connector sends them), although the KV manager records only its hash. What it keeps is
    dropped once a hash is in neither tier, and on a reset; a host block whose device store it
    never saw goes out with no tokens. Used by the publisher thread only, never the step.

    Args:
      block_size: tokens per block.
      as_int: hashes as 64-bit ints (``int_block_hashes``) rather than digests.
      encoding: one of ``EVENT_ENCODINGS``.
    Raises:
      ValueError: an unknown ``encoding``.
    """

    def __init__(self, block_size: int, as_int: bool, encoding: str = "map") -> None:
        if encoding not in EVENT_ENCODINGS:
            raise ValueError(f"event_encoding must be one of {EVENT_ENCODINGS}, "
                             f"got {encoding!r}")
        self.block_size, self.as_int, self.as_map = block_size, as_int, encoding == "map"
        # hash -> (parent, the block's tokens, its extra keys), for hashes some tier holds
        self._blocks: dict[BlockHash, tuple[BlockHash | None, tuple[int, ...], Any]] = {}
        self._tiers: dict[str, set[BlockHash]] = {}

    def encode(self, records: list[CacheEvent]) -> list[msgspec.Struct]:
        """One step's records as events, in order.

        Raises:
          TypeError: a record that is not a ``CacheEvent``.
        """
        out: list[msgspec.Struct] = []
        gone: set[BlockHash] = set()  # left a tier this step: forgotten after the step if in none
        for r in records:
            if isinstance(r, BlocksStored):
                out.extend(self._stored(r))
            elif isinstance(r, BlocksRemoved):
                self._tiers.setdefault(r.medium, set()).difference_update(r.block_hashes)
                gone.update(r.block_hashes)
                hashes = [external_hash(h, self.as_int) for h in r.block_hashes]
                out.append(BlockRemoved(hashes, r.medium, KV_CACHE_GROUP) if self.as_map
                           else ArrayBlockRemoved(hashes, r.medium))
            elif isinstance(r, CacheCleared):
                self._blocks.clear()
                self._tiers.clear()
                out.append(AllBlocksCleared() if self.as_map else ArrayAllBlocksCleared())
            else:
                raise TypeError(f"not a cache event: {r!r}")
        for h in gone:
            if not any(h in held for held in self._tiers.values()):
                self._blocks.pop(h, None)
        return out

    def _stored(self, r: BlocksStored) -> list[msgspec.Struct]:
        """``r`` as events; an offloaded record as one event per chain of its blocks."""
        bs, blocks = self.block_size, self._blocks
        self._tiers.setdefault(r.medium, set()).update(r.block_hashes)
        if r.token_ids:
            for i, h in enumerate(r.block_hashes):
                blocks[h] = (r.block_hashes[i - 1] if i else r.parent_block_hash,
                             tuple(r.token_ids[i * bs:(i + 1) * bs]),
                             r.extra_keys[i] if r.extra_keys else None)
            return [self._event(r.medium, r.block_hashes, r.parent_block_hash, r.token_ids,
                                r.extra_keys)]
        unknown = [h for h in r.block_hashes if h not in blocks]
        out = [self._event(r.medium, unknown, None, (), None)] if unknown else []
        for chain in _chains([h for h in r.block_hashes if h in blocks], blocks):
            known = [blocks[h] for h in chain]
            extra = tuple(e for _, _, e in known)
            out.append(self._event(r.medium, chain, known[0][0],
                                   tuple(t for _, tokens, _ in known for t in tokens),
                                   extra if any(e is not None for e in extra) else None))
        return out

    def _event(self, medium: str, hashes, parent, tokens, extra) -> msgspec.Struct:
        ext = self.as_int
        fields = {
            "block_hashes": [external_hash(h, ext) for h in hashes],
            "parent_block_hash": None if parent is None else external_hash(parent, ext),
            "token_ids": list(tokens),
            "block_size": self.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "extra_keys": None if extra is None else list(extra),
        }
        if not self.as_map:
            return ArrayBlockStored(**fields)
        return BlockStored(**fields, group_idx=KV_CACHE_GROUP,
                           kv_cache_spec_kind=KV_CACHE_SPEC_KIND if tokens else None)


def _chains(hashes: list[BlockHash], blocks: dict) -> list[list[BlockHash]]:
    """``hashes`` (an offload's blocks, in eviction order: a sequence's last block often first)
    split into parent-to-child chains, each chain after the one holding its parent."""
    inside = set(hashes)
    children: dict[BlockHash, list[BlockHash]] = {}
    roots = []
    for h in hashes:
        parent = blocks[h][0]
        if parent in inside:
            children.setdefault(parent, []).append(h)
        else:
            roots.append(h)
    out: list[list[BlockHash]] = []
    todo = list(reversed(roots))
    while todo:
        chain = [todo.pop()]
        while kids := children.get(chain[-1]):
            todo.extend(reversed(kids[1:]))
            chain.append(kids[0])
        out.append(chain)
    return out
