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

Async scheduling (``SchedulerConfig.async_scheduling``): the engine plans step N+1 while the
device runs step N, so ``schedule`` may run again before ``update`` has seen the last plan. It
then plans each sequence from where its in-flight steps end: a sequence step N samples for is
assumed to have one more token (a placeholder, ``PLACEHOLDER_TOKEN`` in the plan's
``token_ids``, which the step program takes from step N's sampled ids on the device), and one
whose pending sample is its last (``max_tokens``, ``max_model_len``) is not planned again. The
plans' ``update`` calls must come in order, each at most one ``schedule`` late. ``update``
then appends the real token, runs the stop checks, and drops the sample of a sequence that
finished or was aborted since (the engine never sees it). A sequence preempted while a step
for it is in flight still gets that step's token; it is not admitted again until the token is
known. Without the flag (the synchronous loop), every ``schedule`` is followed by its
``update`` and the placeholders never appear.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.kv_manager import KVManager, KVStats
from jaxserve.core.plan import (
    PLACEHOLDER_TOKEN,
    ScheduledSeq,
    SchedulerConfig,
    SchedulerOutput,
    UpdateResult,
)
from jaxserve.core.sequence import SeqState, cdiv
from jaxserve.core.step_cost import (
    fit_bucket,
    itl_target_s,
    prefill_pairs,
    prefill_token_budget,
)


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
                            config.num_host_blocks, config.prefix_caching_hash_algo,
                            config.record_kv_events)
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.num_preemptions_total = 0
        self._next_arrival_index = 0
        # the step-cost model the ITL target plans with; the engine refits it from measured
        # steps (step_cost.OnlineStepCost)
        self.step_cost = config.step_cost

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
            num_tokens = len(seq.token_ids) + seq.num_output_placeholders
            num_out = num_tokens - seq.num_prompt_tokens
            prefill += max(0, num_tokens - seq.num_computed_tokens - seq.num_inflight_tokens
                           - (num_out > 0))
            decode += seq.max_tokens - num_out
        return prefill, decode

    def add(self, seq: SeqState) -> None:
        """Queue a fresh sequence (no computed tokens, no blocks) at the back of ``waiting``.

        The caller has validated the request (the engine's ``validate_request``: a non-empty
        prompt, ``max_tokens >= 1``, prompt + max_tokens within max_model_len and the pool, a
        new id); these are asserted here, not checked again for users.
        """
        cfg, n, rid = self.config, len(seq.token_ids), seq.request_id
        assert n > 0, f"request {rid!r}: empty prompt"
        assert seq.num_prompt_tokens == n and not seq.num_computed_tokens and \
            not seq.block_ids, f"request {rid!r}: not fresh"
        assert seq.max_tokens >= 1, f"request {rid!r}: {seq.max_tokens=} must be >= 1"
        assert n + seq.max_tokens <= cfg.max_model_len, \
            f"request {rid!r}: prompt length {n} + {seq.max_tokens=} > {cfg.max_model_len=}"
        assert cdiv(n + seq.max_tokens, cfg.block_size) <= self.block_pool.num_usable_blocks, \
            f"request {rid!r} needs more blocks than the pool's usable ones"
        assert not any(s.request_id == rid for s in (*self.waiting, *self.running)), \
            f"request_id {rid!r} is already present"
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

        With an ITL target (``SchedulerConfig.itl_on``) and a sequence decoding, the prompt
        tokens of the step (every chunk but the decodes') are capped by
        ``step_cost.prefill_token_budget`` under ``step_cost.itl_target_s``.

        1. Running sequences that decode, oldest first; while the pool is short, preempt a
           victim among the running ones not yet planned this step (``preemption_policy``),
           possibly the sequence itself.
        2. Prefill work, in ``prefill_order``: the running sequences' next prompt chunks and
           the waiting prompts. "fcfs": running ones oldest first, then waiting ones in queue
           order. "shortest-first" (Shortest-Remaining-Prefill, against head-of-line blocking
           as in sgl-project/sglang#22831): preempted sequences first (they were streaming),
           then prompts bypassed ``max_prefill_skips`` times in arrival order (so a long prompt
           always progresses), then the rest by prompt tokens left. Waiting ones are admitted
           while ``max_num_seqs``, budget and blocks allow and nothing was preempted; the first
           that does not fit closes admission for the step. A swapped-out one loads its blocks
           back; any other starts after its longest cached prefix of full blocks, so
           ``start_pos`` may be > 0.

        ``num_computed_tokens`` is advanced by ``update``, not here. With async scheduling a
        sequence's chunk starts after its in-flight tokens, and the full blocks those fill are
        offered to the prefix cache first (module docstring).
        """
        cfg, kv = self.config, self.kv
        budget = prefill_left = cfg.max_num_batched_tokens  # prefill_left >= budget when off
        if cfg.itl_on:
            prefill_left = self._itl_prefill_budget()
        scheduled: list[ScheduledSeq] = []
        preempted: list[str] = []
        planned: set[str] = set()
        decoding: set[str] = set()  # the planned sequences that decode
        shape = [0, 0, 0]  # decode rows, their context tokens, prefill chunks
        for seq in self.running:  # blocks the dispatched steps fill: as if update had run
            if seq.num_inflight_tokens:
                kv.cache_computed_blocks(seq, seq.num_computed_tokens + seq.num_inflight_tokens)

        def plan(seq: SeqState, num_new: int) -> None:
            nonlocal budget, prefill_left
            start = seq.num_computed_tokens + seq.num_inflight_tokens
            if self._decodes(seq, start):
                shape[0] += 1
                shape[1] += start + 1
                decoding.add(seq.request_id)
            else:
                prefill_left -= num_new
                shape[2] += 1
            end = start + num_new
            known = seq.token_ids[start:end]
            sample = end == len(seq.token_ids) + seq.num_output_placeholders
            scheduled.append(
                ScheduledSeq(
                    request_id=seq.request_id,
                    token_ids=(*known, *[PLACEHOLDER_TOKEN] * (num_new - len(known))),
                    start_pos=start,
                    block_ids=tuple(seq.block_ids),
                    sample=sample,
                    arrival_index=seq.arrival_index,
                )
            )
            planned.add(seq.request_id)
            budget -= num_new

        def run_chunk(seq: SeqState, limit: int, may_preempt: bool = True) -> None:
            """Plan a running sequence's next chunk, preempting while the pool is short (or,
            when not ``may_preempt``, leaving it for a later step)."""
            start = seq.num_computed_tokens + seq.num_inflight_tokens
            num_new = 0 if self._last_sample_pending(seq) else self._chunk(seq, start, limit)
            if num_new <= 0:  # a pending sample ends it (async), or no budget left
                return
            need = cdiv(start + num_new, cfg.block_size) - len(seq.block_ids)
            if need > kv.device.num_free_blocks and not may_preempt:
                return
            while need > kv.device.num_free_blocks:
                victim = self._pick_victim(planned)
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    return
            if need > 0:
                seq.block_ids.extend(kv.allocate(need))
            plan(seq, num_new)

        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.request_id not in preempted and self._decodes(
                    seq, seq.num_computed_tokens + seq.num_inflight_tokens):
                run_chunk(seq, budget)

        pending = [s for s in self.running if s.request_id not in planned]
        pending_ids = {s.request_id for s in pending}
        admitting, admitted = not preempted, False
        for seq in self._prefill_order(pending):
            if budget <= 0:
                break
            limit = min(budget, prefill_left)
            if seq.request_id in pending_ids:  # running: its next prompt chunk
                if seq.request_id not in preempted:
                    # not after an admission: a swap-out's host copy must not land in the
                    # host blocks a swap-in of this step reads (offloads run first)
                    run_chunk(seq, limit, may_preempt=not admitted)
                    admitting = admitting and not preempted
            elif admitting:
                num_new = 0 if limit <= 0 or len(self.running) >= cfg.max_num_seqs \
                    else self._admit(seq, limit)
                if not num_new:
                    admitting = False  # the first that does not fit closes admission
                    continue
                self.waiting.remove(seq)
                self.running.append(seq)
                plan(seq, num_new)
                admitted = True

        if shape[2]:  # prompts got prefill this step: the others were bypassed
            for seq in (*pending, *self.waiting):
                if seq.request_id not in planned and seq.request_id not in preempted:
                    seq.num_prefill_skips += 1
        num_tokens = cfg.max_num_batched_tokens - budget
        if cfg.token_buckets:
            num_tokens = self._fit_bucket(scheduled, num_tokens)
        pairs = sum(prefill_pairs(len(c.token_ids), c.start_pos) for c in scheduled
                    if c.request_id not in decoding)
        if cfg.async_scheduling:  # the plan's tokens are in flight until its update
            by_id = {s.request_id: s for s in self.running}
            for chunk in scheduled:
                seq = by_id[chunk.request_id]
                seq.num_inflight_tokens += len(chunk.token_ids)
                seq.num_output_placeholders += chunk.sample
        offloads, loads = kv.take_transfers()
        return SchedulerOutput(
            scheduled=tuple(scheduled),
            num_scheduled_tokens=num_tokens,
            preempted_ids=tuple(preempted),
            offloads=offloads,
            loads=loads,
            num_decode_rows=shape[0],
            num_context_tokens=shape[1],
            num_prefill_pairs=pairs,
        )

    def _prefill_order(self, pending: list[SeqState]) -> list[SeqState]:
        """The running sequences ``pending`` a prompt chunk and the waiting ones, in the order
        they get the step's prefill budget (``schedule``, step 2)."""
        if self.config.prefill_order == "fcfs":
            return [*pending, *self.waiting]
        max_skips = self.config.max_prefill_skips

        def key(item: tuple[int, SeqState]) -> tuple[int, int, int]:
            pos, seq = item
            if seq.num_preemptions and not seq.block_ids:  # preempted, waiting: queue order
                return (0, pos, 0)
            if seq.num_prefill_skips >= max_skips:
                return (1, seq.arrival_index, 0)
            left = (len(seq.token_ids) + seq.num_output_placeholders - seq.num_computed_tokens
                    - seq.num_inflight_tokens)
            return (2, left, seq.arrival_index)

        return [s for _, s in sorted(enumerate([*pending, *self.waiting]), key=key)]

    def _admit(self, seq: SeqState, limit: int) -> int:
        """Give a waiting sequence blocks for its first chunk of at most ``limit`` tokens
        and return that chunk's size; 0, changing nothing, when it cannot start now."""
        cfg, kv = self.config, self.kv
        if seq.num_inflight_tokens or seq.num_output_placeholders:
            return 0  # preempted with a step in flight: its token comes with update
        if seq.host_block_ids:  # swapped out: load its blocks back
            num_new = self._chunk(seq, seq.num_computed_tokens, limit)
            total = cdiv(seq.num_computed_tokens + num_new, cfg.block_size)
            if total > kv.device.num_free_blocks:
                return 0
            kv.swap_in(seq, total)
        else:
            hits = kv.find_prefix(seq)
            num_new = self._chunk(seq, len(hits) * cfg.block_size, limit)
            total = cdiv(len(hits) * cfg.block_size + num_new, cfg.block_size)
            if kv.num_free_needed(hits, total) > kv.device.num_free_blocks:
                return 0
            kv.admit(seq, hits, total)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
        return num_new

    def update(self, plan: SchedulerOutput, sampled: Sequence[int | None]) -> UpdateResult:
        """Advance each chunk, append sampled tokens, finish ("stop", "length") and free.

        Sequences no longer present (aborted or finished since ``schedule``) are skipped; in
        the synchronous loop so are those no longer running. With async scheduling a sequence
        preempted since still gets its token (it was sampled before the preemption).

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
        known = {**{s.request_id: s for s in self.waiting}, **running} \
            if self.config.async_scheduling else running
        done: list[SeqState] = []
        for chunk, token in zip(plan.scheduled, sampled, strict=True):
            seq = known.get(chunk.request_id)
            if seq is None or seq.arrival_index != chunk.arrival_index:
                continue
            if self.config.async_scheduling:
                if seq.num_inflight_tokens:  # else preempted to recompute: its K/V is gone
                    seq.num_inflight_tokens -= len(chunk.token_ids)
                    seq.num_computed_tokens += len(chunk.token_ids)
                    if seq.request_id in running:
                        self.kv.cache_computed_blocks(seq)
                if not chunk.sample:
                    continue
                seq.num_output_placeholders -= 1
            else:
                if seq.num_computed_tokens != chunk.start_pos:
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
        """``step_cost.fit_bucket`` with this scheduler's buckets and step overhead."""
        return fit_bucket(scheduled, num_tokens, self.config.token_buckets,
                          self.config.step_overhead_tokens)

    def _last_sample_pending(self, seq: SeqState) -> bool:
        """The sequence's in-flight sample is its last (``max_tokens`` or ``max_model_len``):
        nothing is planned after it (async scheduling)."""
        n = seq.num_output_placeholders
        return n > 0 and (seq.num_output_tokens + n >= seq.max_tokens
                          or len(seq.token_ids) + n >= self.config.max_model_len)

    def _decodes(self, seq: SeqState, start: int) -> bool:
        """The sequence has outputs and its chunk from ``start`` is its one next token."""
        num_tokens = len(seq.token_ids) + seq.num_output_placeholders
        return num_tokens - start == 1 and num_tokens > seq.num_prompt_tokens

    def _itl_prefill_budget(self) -> int:
        """Prompt tokens this step may take within the ITL target beside the running
        sequences that decode (all of ``max_num_batched_tokens`` when none does)."""
        cfg, model = self.config, self.step_cost
        rows = context = prefill_start = prompts = 0
        for seq in self.running:
            start = seq.num_computed_tokens + seq.num_inflight_tokens
            if self._decodes(seq, start):
                if not self._last_sample_pending(seq):
                    rows += 1
                    context += start + 1
            else:  # its chunk's attention reads what it has computed: count the furthest
                prefill_start = max(prefill_start, start)
                prompts += 1
        if not rows:
            return cfg.max_num_batched_tokens
        assert model is not None
        # the automatic rule scales with the batch the queued prompts will join: streams see
        # that batch's decode step once they are in, and a queue of prompts is not held to
        # the step of the few that decode already (each assumed at the decodes' mean context)
        batch = min(cfg.max_num_seqs, rows + prompts + len(self.waiting)) \
            if cfg.itl_decode_ratio > 0 else rows
        target = itl_target_s(model, cfg.itl_target_s, cfg.itl_decode_ratio, batch,
                              context * batch // rows, cfg.token_buckets)
        return prefill_token_budget(model, target, rows, context, cfg.max_num_batched_tokens,
                                    cfg.token_buckets, prefill_start=prefill_start)

    def _chunk(self, seq: SeqState, start: int, budget: int) -> int:
        """How many tokens from ``start`` the sequence gets with ``budget`` left."""
        num_new = min(len(seq.token_ids) + seq.num_output_placeholders - start, budget)
        cap = self.config.long_prefill_token_threshold
        return cap if 0 < cap < num_new else num_new

    def _pick_victim(self, planned: set[str]) -> SeqState:
        """The victim among the running sequences not yet planned this step (one always is:
        the sequence asking for blocks)."""
        free = [(j, s) for j, s in enumerate(self.running) if s.request_id not in planned]
        if self.config.preemption_policy == "newest":
            return free[-1][1]
        return min(free, key=lambda js: (js[1].num_computed_tokens, -js[0]))[1]

    def _preempt(self, seq: SeqState) -> None:
        """Swap out (or free, to recompute) the sequence's K/V; requeue it at the front."""
        if not self.kv.swap_out(seq):  # a swapped copy holds the in-flight steps' K/V too
            self.kv.free_seq(seq)
            seq.num_computed_tokens = 0
            seq.num_inflight_tokens = 0
            seq.num_registered_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)
