"""Continuous-batching scheduler: host Python over plain data (no jax, no I/O).

One token-count model, no phases (vLLM v1). A sequence is its ``token_ids`` (prompt + output so
far) and ``num_computed_tokens`` (how many of them have their K/V in the cache). Each step it gets
``min(len(token_ids) - num_computed_tokens, token budget left)`` new tokens; prefill, chunked
prefill and decode are the same thing. The engine loop drives one ``Scheduler``::

    scheduler = Scheduler(config)
    scheduler.add(seq)                            # -> waiting (FIFO)
    while scheduler.has_unfinished():
        plan = scheduler.schedule()               # which tokens of which sequences; takes blocks
        sampled = run_model(plan)                 # one token per ScheduledSeq with sample=True
        result = scheduler.update(plan, sampled)  # advance, append, finish, free blocks
        scheduler.finish(stopped)                 # the sequences a stop string ended
    scheduler.abort(ids)                          # at any time: the client went away

The methods change the scheduler in place; the plan and the update result are snapshots. A
finished, aborted or preempted sequence leaves ``running`` and frees its blocks; a preempted one
keeps its tokens, goes to the front of ``waiting``, and has its K/V swapped to the host tier if
that has room, else recomputed later. Block bookkeeping is ``kv_manager.KVManager``'s.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from jaxserve.config import EngineConfig
from jaxserve.core.block_pool import BlockPool
from jaxserve.core.kv_manager import KVManager, KVStats
from jaxserve.core.sequence import SeqState, cdiv

PREEMPTION_POLICIES = ("newest", "least_progress")


@dataclass
class SchedulerConfig:
    """Limits of one step and of the KV cache (see EngineConfig for the meaning of each)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    num_blocks: int  # including the reserved padding block 0
    long_prefill_token_threshold: int = 0  # > 0: most prompt tokens one request gets per step
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0  # host-tier blocks including its reserved block 0; 0: no host tier
    # victim when the pool is short: "newest" (latest admitted) or "least_progress" (fewest
    # computed tokens); default: least work lost (experiments/2026-12-01-preemption-policy)
    preemption_policy: str = "least_progress"
    # the compiled step shapes, ascending (``device.buckets.token_buckets``); () plans without
    # them. With them, a step just past a bucket gives prefill tokens back (``_fit_bucket``).
    token_buckets: tuple[int, ...] = ()
    # the fixed cost of one step (weights read, dispatch, host work) in prompt tokens of compute
    step_overhead_tokens: int = 32

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name}={getattr(self, name)} must be >= 1")
        if self.num_blocks < 2:
            raise ValueError(f"SchedulerConfig.{self.num_blocks=} must be >= 2 (block 0 reserved)")
        if self.preemption_policy not in PREEMPTION_POLICIES:
            raise ValueError(f"SchedulerConfig.{self.preemption_policy=} must be one of "
                             f"{PREEMPTION_POLICIES}")

    @classmethod
    def from_engine_config(
        cls, cfg: EngineConfig, num_blocks: int, max_model_len: int, num_host_blocks: int = 0
    ) -> SchedulerConfig:
        return cls(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            block_size=cfg.block_size,
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            enable_prefix_caching=cfg.enable_prefix_caching,
            num_host_blocks=num_host_blocks,
        )


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    request_id: str
    token_ids: tuple[int, ...]  # at positions start_pos .. start_pos + len - 1
    start_pos: int
    block_ids: tuple[int, ...]  # the whole block table after allocation
    sample: bool  # the chunk reaches the end of the sequence's token_ids


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step; run ``offloads`` then ``loads`` before its forward pass, even
    when ``scheduled`` is empty."""

    scheduled: tuple[ScheduledSeq, ...]  # batch order: running ones, then newly admitted
    num_scheduled_tokens: int
    preempted_ids: tuple[str, ...] = ()  # lost their device blocks this step
    offloads: tuple[tuple[int, int], ...] = ()  # (device block, host block) copies
    loads: tuple[tuple[int, int], ...] = ()  # (host block, device block) copies

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class UpdateResult:
    """What ``Scheduler.update`` changed."""

    new_token_ids: dict[str, int] = field(default_factory=dict)  # sequence -> token appended
    finished: dict[str, str] = field(default_factory=dict)  # sequence -> "stop" | "length"


class Scheduler:
    """The waiting and running sequences and the KV cache they plan with.

    ``waiting`` is FIFO (preempted ones re-enter at the front); ``running`` is oldest first and
    alone holds device blocks (swapped-out waiting ones hold host blocks).

    Args:
      config: the step's limits and the pools' sizes.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                            config.num_host_blocks)
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.num_preemptions_total = 0
        self._next_arrival_index = 0

    @property
    def block_pool(self) -> BlockPool:
        """The device block pool."""
        return self.kv.device

    @property
    def host_pool(self) -> BlockPool | None:
        """The host tier's block pool (None without a host tier)."""
        return self.kv.host

    @property
    def kv_stats(self) -> KVStats:
        return self.kv.stats

    def num_unfinished(self) -> int:
        """Sequences waiting or running."""
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        """True while any sequence is waiting or running."""
        return self.num_unfinished() > 0

    def num_tokens_pending(self) -> tuple[int, int]:
        """Work left in the waiting and running sequences, in tokens: ``(prefill, decode)``.

        prefill: tokens to compute before a sequence samples again, beyond the one token a
          decode step feeds (a fresh prompt's uncomputed part; for a preempted sequence that
          recomputes, its prompt and outputs but the last). Prefix-cache hits not yet looked
          up are counted, so this is an upper bound.
        decode: tokens still to generate, up to each sequence's (clamped) ``max_tokens``.
        """
        prefill = decode = 0
        for seq in (*self.running, *self.waiting):
            num_out = len(seq.token_ids) - seq.num_prompt_tokens
            prefill += max(0, len(seq.token_ids) - seq.num_computed_tokens - (num_out > 0))
            decode += seq.max_tokens - num_out
        return prefill, decode

    def add(self, seq: SeqState) -> None:
        """Queue a fresh sequence (no computed tokens, no blocks) at the back of ``waiting``.

        Raises:
          ValueError: an empty or non-fresh prompt, ``max_tokens < 1``, prompt + max_tokens >
            max_model_len, more blocks than the pool holds, or a ``request_id`` already present.
        """
        cfg, n = self.config, len(seq.token_ids)
        rid = seq.request_id
        if n == 0:
            raise ValueError(f"request {rid!r}: empty prompt (len(token_ids)=0)")
        if seq.num_prompt_tokens != n or seq.num_computed_tokens or seq.block_ids:
            raise ValueError(
                f"request {rid!r}: not fresh ({seq.num_prompt_tokens=}, len(token_ids)={n}, "
                f"{seq.num_computed_tokens=}, {seq.block_ids=})"
            )
        if seq.max_tokens < 1:
            raise ValueError(f"request {rid!r}: {seq.max_tokens=} must be >= 1")
        if n + seq.max_tokens > cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt length {n} + {seq.max_tokens=} > {cfg.max_model_len=}"
            )
        need = cdiv(n + seq.max_tokens, cfg.block_size)
        if need > self.block_pool.num_usable_blocks:
            raise ValueError(
                f"request {rid!r} needs {need} blocks of {cfg.block_size=} but the pool has only "
                f"{self.block_pool.num_usable_blocks} usable (num_blocks={cfg.num_blocks})"
            )
        if any(s.request_id == rid for s in (*self.waiting, *self.running)):
            raise ValueError(f"request_id {rid!r} is already present")
        seq.arrival_index = self._next_arrival_index
        self._next_arrival_index += 1
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Plan one step: allocate its blocks, admit and preempt sequences; returns the plan.

        Each scheduled sequence gets ``num_new = min(len(token_ids) - num_computed_tokens,
        budget)`` tokens (capped by ``long_prefill_token_threshold`` when > 0) and blocks up to
        the end of its chunk::

            |<------------------------- len(token_ids) ------------------------->|
            |<--- num_computed_tokens --->|<--- num_new --->|<--- later steps -->|
            |   K/V already in the cache  |  computed now   |                    |
            |<--- blocks after: cdiv(num_computed + num_new, block_size) --->|

        1. Running sequences, oldest first; while the pool is short, preempt a victim among
           those not yet planned this step (``preemption_policy``), possibly the sequence itself.
        2. Unless step 1 preempted, admit waiting ones FIFO while ``max_num_seqs``, budget and
           blocks allow; a head that does not fit blocks those behind it. A swapped-out head
           loads its blocks back; any other starts after its longest cached prefix of full
           blocks, so ``start_pos`` may be > 0.

        ``num_computed_tokens`` is advanced by ``update``, not here.
        """
        cfg, kv = self.config, self.kv
        pool = kv.device
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[str] = []

        def plan(seq: SeqState, num_new: int) -> None:
            nonlocal budget
            start = seq.num_computed_tokens
            end = start + num_new
            scheduled.append(
                ScheduledSeq(
                    request_id=seq.request_id,
                    token_ids=tuple(seq.token_ids[start:end]),
                    start_pos=start,
                    block_ids=tuple(seq.block_ids),
                    sample=end == len(seq.token_ids),
                )
            )
            budget -= num_new

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk(seq, seq.num_computed_tokens, budget)
            if num_new <= 0:  # defensive: after update a running sequence always has a token left
                i += 1
                continue
            need = cdiv(seq.num_computed_tokens + num_new, cfg.block_size) - len(seq.block_ids)
            while need > pool.num_free_blocks:
                victim = self.running.pop(self._pick_victim(i))
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            if i == len(self.running) or self.running[i] is not seq:  # seq preempted itself
                continue
            if need > 0:
                seq.block_ids.extend(kv.allocate(need))
            plan(seq, num_new)
            i += 1

        while (not preempted and self.waiting and len(self.running) < cfg.max_num_seqs
               and budget > 0):
            seq = self.waiting[0]
            if seq.host_block_ids:  # swapped out: load its blocks back
                num_new = self._chunk(seq, seq.num_computed_tokens, budget)
                total = cdiv(seq.num_computed_tokens + num_new, cfg.block_size)
                if total > pool.num_free_blocks:
                    break
                kv.swap_in(seq, total)
            else:
                hits = kv.find_prefix(seq)
                num_new = self._chunk(seq, len(hits) * cfg.block_size, budget)
                total = cdiv(len(hits) * cfg.block_size + num_new, cfg.block_size)
                if kv.num_free_needed(hits, total) > pool.num_free_blocks:
                    break
                kv.admit(seq, hits, total)
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            self.running.append(seq)
            plan(seq, num_new)

        num_tokens = cfg.max_num_batched_tokens - budget
        if cfg.token_buckets:
            num_tokens = self._fit_bucket(scheduled, num_tokens)
        offloads, loads = kv.take_transfers()
        return SchedulerOutput(
            scheduled=tuple(scheduled),
            num_scheduled_tokens=num_tokens,
            preempted_ids=tuple(preempted),
            offloads=offloads,
            loads=loads,
        )

    def update(self, plan: SchedulerOutput, sampled: Sequence[int | None]) -> UpdateResult:
        """Advance each chunk, append sampled tokens, finish ("stop", "length") and free.

        Sequences no longer running (aborted or finished since ``schedule``) are skipped.

        Args:
          plan: the plan ``schedule`` returned for this step.
          sampled: per ``plan.scheduled`` entry, the token sampled for it (ignored where
            ``sample`` is False).

        Raises:
          ValueError: ``len(sampled) != len(plan.scheduled)``, or a sampled token is None where
            ``sample`` is True (checked before anything changes).
        """
        if len(sampled) != len(plan.scheduled):
            raise ValueError(f"update: {len(sampled)=} != {len(plan.scheduled)=}")
        for chunk, token in zip(plan.scheduled, sampled, strict=True):
            if chunk.sample and token is None:
                raise ValueError(f"update: request {chunk.request_id!r} has sample=True but no "
                                 "token")
        result = UpdateResult()
        running = {s.request_id: s for s in self.running}
        done: list[SeqState] = []
        for chunk, token in zip(plan.scheduled, sampled, strict=True):
            seq = running.get(chunk.request_id)
            if seq is None or seq.num_computed_tokens != chunk.start_pos:
                continue
            seq.num_computed_tokens += len(chunk.token_ids)
            self.kv.cache_computed_blocks(seq)
            if not chunk.sample:
                continue
            assert token is not None
            seq.token_ids.append(token)
            result.new_token_ids[seq.request_id] = token
            if token in seq.stop_token_ids:
                result.finished[seq.request_id] = "stop"
            elif (
                seq.num_output_tokens >= seq.max_tokens
                or len(seq.token_ids) >= self.config.max_model_len
            ):
                result.finished[seq.request_id] = "length"
            else:
                continue
            done.append(seq)
        if done:
            self._remove({s.request_id for s in done})
        return result

    def finish(self, seq_ids: Iterable[str]) -> list[str]:
        """Drop sequences a stop string ended, free their blocks; return the known ids removed."""
        return self._remove(set(seq_ids))

    def abort(self, seq_ids: Iterable[str]) -> list[str]:
        """Drop aborted sequences, free their blocks; return the known ids removed."""
        return self._remove(set(seq_ids))

    def _remove(self, seq_ids: set[str]) -> list[str]:
        removed: list[str] = []
        for seq in (*self.running, *self.waiting):
            if seq.request_id in seq_ids:
                self.kv.free_seq(seq)
                removed.append(seq.request_id)
        if removed:
            self.running = [s for s in self.running if s.request_id not in seq_ids]
            self.waiting = deque(s for s in self.waiting if s.request_id not in seq_ids)
        return removed

    def _fit_bucket(self, scheduled: list[ScheduledSeq], num_tokens: int) -> int:
        """Shorten prefill chunks so the step fills a smaller bucket, when that is cheaper.

        A step of ``n`` tokens runs padded to the smallest bucket ``T >= n``. When ``n`` is just
        past the bucket below (``T_prev``), cutting ``n - T_prev`` prompt tokens from the last
        prefill chunks and leaving them to the next step costs ``T_prev + bucket(n - T_prev) +
        step_overhead_tokens`` instead of ``T``; that is done when smaller. E.g. a 300-token
        prompt alone: 256 + 64 + 32 < 512. The cut tokens keep their blocks (allocated for
        the whole chunk), so the next step needs none for them. Changes ``scheduled`` in place;
        returns the new token count.
        """
        cfg = self.config
        buckets = cfg.token_buckets
        i = bisect.bisect_left(buckets, num_tokens)
        if i == 0 or i == len(buckets):
            return num_tokens
        smaller = buckets[i - 1]
        excess = num_tokens - smaller
        rest = buckets[bisect.bisect_left(buckets, excess)]
        if smaller + rest + cfg.step_overhead_tokens >= buckets[i]:
            return num_tokens
        if sum(len(c.token_ids) - 1 for c in scheduled) < excess:  # decode rows cannot shrink
            return num_tokens
        for j in range(len(scheduled) - 1, -1, -1):
            chunk = scheduled[j]
            cut = min(excess, len(chunk.token_ids) - 1)
            if cut > 0:
                scheduled[j] = dataclasses.replace(chunk, token_ids=chunk.token_ids[:-cut],
                                                   sample=False)
                excess -= cut
            if excess == 0:
                break
        return smaller

    def _chunk(self, seq: SeqState, start: int, budget: int) -> int:
        """How many tokens from ``start`` the sequence gets with ``budget`` left."""
        num_new = min(len(seq.token_ids) - start, budget)
        cap = self.config.long_prefill_token_threshold
        return cap if 0 < cap < num_new else num_new

    def _pick_victim(self, first: int) -> int:
        """Index of the victim among ``running[first:]``, the ones not yet planned this step."""
        if self.config.preemption_policy == "newest":
            return len(self.running) - 1
        return min(range(first, len(self.running)),
                   key=lambda j: (self.running[j].num_computed_tokens, -j))

    def _preempt(self, seq: SeqState) -> None:
        """Swap out (or free, to recompute) the sequence's K/V; requeue it at the front."""
        if not self.kv.swap_out(seq):
            self.kv.free_seq(seq)
            seq.num_computed_tokens = 0
            seq.num_registered_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)
