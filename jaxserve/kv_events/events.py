"""vLLM's KV-cache event structs and their msgpack encoding, from the KV manager's records.

The structs carry the names, field order and struct options of vLLM's
``vllm/distributed/kv_events.py`` (``EventBatch``/``KVEventBatch``, ``KVCacheEvent``,
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``): msgspec Structs with
``array_like=True, omit_defaults=True, gc=False``, the events tagged (``tag=True``: an event is
the array ``[class name, field, ...]``, trailing fields at their default left out). A batch is
``[ts, [event, ...], data_parallel_rank]``. Block hashes are vLLM's ``ExternalBlockHash``
(``bytes | int``): by default, as vLLM's ``maybe_convert_block_hash`` with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` unset, the low 64 bits of the big-endian digest as an
int; with that variable "0", the 32-byte digest itself.

The fields are those of the last vLLM releases that sent events as arrays; msgspec writes
every field of an array-like struct, defaults included, so a ``BlockStored`` is always
``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys,
group_idx]``. vLLM PR #42892 (2026) then dropped ``array_like`` from the *events* (msgpack maps
with a ``"type"`` key; the batch stays an array) and added ``kv_cache_spec_*`` fields. The
array form here is what every consumer decodes: older ones only it, llm-d's kv-cache indexer
since v0.9 both.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from jaxserve.core.block_pool import BlockHash
from jaxserve.core.cache_events import BlocksRemoved, BlocksStored, CacheCleared, CacheEvent

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A step's events: ``ts`` (seconds since the epoch), ``events``, the replica's rank."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event structs (encoded as ``[name, fields...]``)."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks became cached: their hashes, the parent of the first, their
    tokens (``block_size`` each), and the medium ("GPU" device, "CPU" host tier)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: cache salt etc.
    group_idx: int | None = None  # the KV cache group (None: the only one)


class BlockRemoved(KVCacheEvent):
    """Cached blocks of ``medium`` were evicted."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset."""


class KVEventBatch(EventBatch):
    """The payload of one published message."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def int_block_hashes() -> bool:
    """Whether hashes go out as 64-bit ints (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
    default on)."""
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").lower() not in ("0", "false")


def external_hash(h: BlockHash, as_int: bool) -> ExternalBlockHash:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits of the big-endian digest, or the
    digest."""
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF if as_int else h


def to_wire(
    records: list[CacheEvent], block_size: int, as_int: bool
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The KV manager's records as vLLM's events (LoRA fields None: jaxserve has no LoRA)."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for r in records:
        if isinstance(r, BlocksStored):
            out.append(
                BlockStored(
                    block_hashes=[external_hash(h, as_int) for h in r.block_hashes],
                    parent_block_hash=(
                        None
                        if r.parent_block_hash is None
                        else external_hash(r.parent_block_hash, as_int)
                    ),
                    token_ids=list(r.token_ids),
                    block_size=block_size,
                    lora_id=None,
                    medium=r.medium,
                    lora_name=None,
                    extra_keys=None if r.extra_keys is None else list(r.extra_keys),
                )
            )
        elif isinstance(r, BlocksRemoved):
            out.append(BlockRemoved([external_hash(h, as_int) for h in r.block_hashes], r.medium))
        elif isinstance(r, CacheCleared):
            out.append(AllBlocksCleared())
        else:
            raise TypeError(f"not a cache event: {r!r}")
    return out
