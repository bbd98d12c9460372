"""Continuous-batching scheduler: host Python over plain data (no jax, no I/O).

One token-count model, no phases (vLLM v1). A sequence is its ``token_ids`` (prompt + output so
far) and ``num_computed_tokens`` (how many of them have their K/V in the cache). Each step it gets
``min(len(token_ids) - num_computed_tokens, token budget left)`` new tokens; prefill, chunked
prefill and decode are the same thing. The engine loop drives one ``Scheduler``::

    scheduler = Scheduler(config)
    scheduler.add(seq)                            # -> waiting (FIFO)
    while scheduler.has_unfinished():
        plan = scheduler.schedule(now)            # which tokens of which sequences; takes blocks
        sampled = run_model(plan)                 # one token per ScheduledSeq with sample=True
        result = scheduler.update(plan, sampled, stop_check, now)  # append, finish, free
    scheduler.abort(ids)                          # at any time: the client went away

``update`` is the one place a sequence finishes (a stop id, the engine's ``stop_check`` for a
stop string or a grammar's end, its length). What the engine measures reaches the scheduler
through its methods (``set_token_buckets``, ``observe_step``, ``calibrate``); how far a step's
prefill grows and in which order is its ``StepPolicy``'s (``core/step_policy.py``). The plan and
the update result are snapshots. A finished, aborted or preempted sequence leaves ``running``
and frees its blocks; a preempted one keeps its tokens, goes to the front of ``waiting``, and
has its K/V swapped to the host tier if that has room, else recomputed later
(``kv_manager.KVManager``).

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
from jaxserve.core.cache_events import CacheEvent
from jaxserve.core.kv_manager import KVManager, KVStats
from jaxserve.core.plan import SchedulerConfig, SchedulerOutput, StopCheck, UpdateResult
from jaxserve.core.sequence import SeqState, cdiv, decodes, last_sample_pending
from jaxserve.core.step_cost import StepCostModel
from jaxserve.core.step_plan import PlanBuilder
from jaxserve.core.step_policy import StepPolicy


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
        self._async = config.async_scheduling
        self.policy = StepPolicy(config)  # told what the engine measures by the methods below

    # -- what the engine tells the scheduler -----------------------------------------------------
    def set_token_buckets(self, buckets: Iterable[int]) -> None:
        """Plan steps for these compiled token buckets (ascending), e.g. once more compiled."""
        self.policy.set_token_buckets(buckets)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """The token buckets steps are planned for (() : none)."""
        return self.policy.token_buckets

    def set_async_scheduling(self, on: bool) -> None:
        """Switch between the async and the synchronous loop (module docstring).

        Raises:
          RuntimeError: while sequences are unfinished.
        """
        if self.has_unfinished():
            raise RuntimeError("set_async_scheduling while sequences are unfinished")
        self._async = bool(on)

    @property
    def async_scheduling(self) -> bool:
        """Whether plans may run one step ahead of ``update``."""
        return self._async

    @property
    def step_cost(self) -> StepCostModel | None:
        """The step-cost model the policy plans with now (None without objectives)."""
        return self.policy.step_cost

    def calibrate(self, model: StepCostModel) -> None:
        """Plan with ``model`` (start-up's timed probe steps) and fit measured steps to it."""
        self.policy.calibrate(model)

    def observe_step(self, plan: SchedulerOutput, num_tokens: int, seconds: float) -> None:
        """One measured step: ``plan`` ran padded to ``num_tokens`` tokens in ``seconds``."""
        self.policy.observe(plan, num_tokens, seconds)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block in both tiers (blocks of running sequences are
        kept); returns how many were dropped (``KVManager.reset_prefix_cache``)."""
        return self.kv.reset_prefix_cache()

    def take_kv_events(self) -> list[CacheEvent]:
        """The prefix-cache changes since the last call, oldest first (``KVManager``)."""
        return self.kv.take_events()

    def predict_step_s(self, plan: SchedulerOutput, num_tokens: int) -> float | None:
        """The model's seconds for ``plan`` padded to ``num_tokens`` (None without one)."""
        return self.policy.predict_s(plan, num_tokens)

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
        cfg, n, rid = self.config, len(seq.token_ids), seq.seq_id
        assert n > 0, f"request {rid!r}: empty prompt"
        assert seq.num_prompt_tokens == n and not seq.num_computed_tokens and \
            not seq.block_ids, f"request {rid!r}: not fresh"
        assert seq.max_tokens >= 1, f"request {rid!r}: {seq.max_tokens=} must be >= 1"
        assert n + seq.max_tokens <= cfg.max_model_len, \
            f"request {rid!r}: prompt length {n} + {seq.max_tokens=} > {cfg.max_model_len=}"
        assert cdiv(n + seq.max_tokens, cfg.block_size) <= self.block_pool.num_usable_blocks, \
            f"request {rid!r} needs more blocks than the pool's usable ones"
        assert not any(s.seq_id == rid for s in (*self.waiting, *self.running)), \
            f"seq_id {rid!r} is already present"
        seq.arrival_index = self._next_arrival_index
        self._next_arrival_index += 1
        self.waiting.append(seq)

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Plan one step: allocate its blocks, admit and preempt sequences; returns the plan.

        Each scheduled sequence gets ``num_new = min(len(token_ids) - num_computed_tokens,
        budget)`` tokens (capped by ``long_prefill_token_threshold`` when > 0) and blocks up to
        the end of its chunk::

            |<------------------------- len(token_ids) ------------------------->|
            |<--- num_computed_tokens --->|<--- num_new --->|<--- later steps -->|
            |   K/V already in the cache  |  computed now   |                    |
            |<--- blocks after: cdiv(num_computed + num_new, block_size) --->|

        The step's prompt tokens (every chunk but the decodes') are capped by the policy's
        ``StepPolicy.prefill_budget`` (the ITL target's; ``core/step_policy.py``).

        1. Running sequences that decode, oldest first; while the pool is short, preempt a
           victim among the running ones not yet planned this step (``preemption_policy``),
           possibly the sequence itself.
        2. Prefill work, in ``StepPolicy.prefill_order``: the running sequences' next prompt
           chunks and the waiting prompts. Waiting ones are admitted while ``max_num_seqs``,
           budget and blocks allow and nothing was preempted; the first that does not fit
           closes admission for the step. A swapped-out one loads its blocks back; any other
           starts after its longest cached prefix of full blocks, so ``start_pos`` may be > 0.

        ``num_computed_tokens`` is advanced by ``update``, not here. With async scheduling a
        sequence's chunk starts after its in-flight tokens, and the full blocks those fill are
        offered to the prefix cache first (module docstring).
        """
        step = PlanBuilder(self.config.max_num_batched_tokens,
                           self.policy.prefill_budget(self.running, now))
        for seq in self.running:  # blocks the dispatched steps fill: as if update had run
            if seq.num_inflight_tokens:
                self.kv.cache_computed_blocks(seq, seq.num_computed_tokens
                                              + seq.num_inflight_tokens)
        for seq in list(self.running):  # 1. the decodes
            if step.budget <= 0:
                break
            if seq.seq_id not in step.preempted and decodes(
                    seq, seq.num_computed_tokens + seq.num_inflight_tokens):
                self._run_chunk(step, seq, step.budget)
        pending = [s for s in self.running if s.seq_id not in step.planned]
        self._plan_prefill(step, pending, now)
        if step.num_prefill_chunks:  # prompts got prefill this step: the others were bypassed
            for seq in (*pending, *self.waiting):
                if seq.seq_id not in step.planned and seq.seq_id not in step.preempted:
                    seq.num_prefill_skips += 1
        num_tokens = self.policy.fit_bucket(step.scheduled, step.max_tokens - step.budget)
        if self._async:  # the plan's tokens are in flight until its update
            by_id = {s.seq_id: s for s in self.running}
            for chunk in step.scheduled:
                seq = by_id[chunk.seq_id]
                seq.num_inflight_tokens += len(chunk.token_ids)
                seq.num_output_placeholders += chunk.sample
        return step.build(num_tokens, *self.kv.take_transfers())

    def _plan_prefill(self, step: PlanBuilder, pending: list[SeqState], now: float) -> None:
        """``schedule``'s step 2: the running sequences ``pending`` a prompt chunk and the
        waiting ones, in the policy's order, while the step's budgets last."""
        pending_ids = {s.seq_id for s in pending}
        admitting = not step.preempted
        for seq in self.policy.prefill_order(pending, self.waiting, now):
            if step.budget <= 0:
                break
            if seq.seq_id in pending_ids:  # running: its next prompt chunk
                if seq.seq_id not in step.preempted:
                    # not after an admission: a swap-out's host copy must not land in the
                    # host blocks a swap-in of this step reads (offloads run first)
                    self._run_chunk(step, seq, step.limit, may_preempt=not step.admitted)
                    admitting = admitting and not step.preempted
            elif admitting:
                num_new = 0 if step.limit <= 0 or len(self.running) >= self.config.max_num_seqs \
                    else self._admit(seq, step.limit)
                if not num_new:
                    admitting = False  # the first that does not fit closes admission
                    continue
                self.waiting.remove(seq)
                self.running.append(seq)
                step.add(seq, num_new)
                step.admitted = True

    def _run_chunk(self, step: PlanBuilder, seq: SeqState, limit: int,
                   may_preempt: bool = True) -> None:
        """Plan a running sequence's next chunk of at most ``limit`` tokens, preempting while
        the pool is short (or, when not ``may_preempt``, leaving it for a later step)."""
        cfg, kv = self.config, self.kv
        start = seq.num_computed_tokens + seq.num_inflight_tokens
        num_new = 0 if last_sample_pending(seq, cfg.max_model_len) \
            else self._chunk(seq, start, limit)
        if num_new <= 0:  # a pending sample ends it (async), or no budget left
            return
        need = cdiv(start + num_new, cfg.block_size) - len(seq.block_ids)
        if need > kv.device.num_free_blocks and not may_preempt:
            return
        while need > kv.device.num_free_blocks:
            victim = self._pick_victim(step.planned)
            self.running.remove(victim)
            self._preempt(victim)
            step.preempted.append(victim.seq_id)
            if victim is seq:
                return
        if need > 0:
            seq.block_ids.extend(kv.allocate(need))
        step.add(seq, num_new)

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

    def update(self, plan: SchedulerOutput, sampled: Sequence[int | None],
               stop_check: StopCheck | None = None, now: float = 0.0) -> UpdateResult:
        """Advance each chunk, append sampled tokens, finish and free: the one place where a
        sequence finishes.

        A sequence that took a token finishes, in this order of precedence: "stop" at one of
        its ``stop_token_ids`` (``stop_reason`` the token; ``stop_check`` is not asked: a stop
        token's text is no part of the output); "stop" where ``stop_check(seq_id, token)``
        returns a ``TextStop`` (a stop string, a grammar's end: its ``stop_reason``); "length"
        at ``max_tokens`` or ``max_model_len``. ``stop_check`` sees every appended token but
        stop ids, in plan order (the engine's detokeniser advances there).

        Sequences no longer present (aborted or finished since ``schedule``) are skipped; in
        the synchronous loop so are those no longer running. With async scheduling a sequence
        preempted since still gets its token (it was sampled before the preemption).

        Args:
          plan: the plan ``schedule`` returned for this step.
          sampled: per ``plan.scheduled`` entry, the token sampled for it (ignored where
            ``sample`` is False).
          stop_check: the engine's text rule (None: none).
          now: when the sampled ids reached the host (the engine's clock, s): each appended
            token's time, for the service objectives (``SeqState.record_token_time``).

        Raises:
          ValueError: ``len(sampled) != len(plan.scheduled)``, or a sampled token is None where
            ``sample`` is True (checked before anything changes).
        """
        if len(sampled) != len(plan.scheduled):
            raise ValueError(f"update: {len(sampled)=} != {len(plan.scheduled)=}")
        for chunk, token in zip(plan.scheduled, sampled, strict=True):
            if chunk.sample and token is None:
                raise ValueError(f"update: sequence {chunk.seq_id!r} has sample=True but no "
                                 "token")
        result = UpdateResult()
        running = {s.seq_id: s for s in self.running}
        known = {**{s.seq_id: s for s in self.waiting}, **running} if self._async else running
        done: list[SeqState] = []
        for chunk, token in zip(plan.scheduled, sampled, strict=True):
            seq = known.get(chunk.seq_id)
            if seq is None or seq.arrival_index != chunk.arrival_index:
                continue
            if self._async:
                if seq.num_inflight_tokens:  # else preempted to recompute: its K/V is gone
                    seq.num_inflight_tokens -= len(chunk.token_ids)
                    seq.num_computed_tokens += len(chunk.token_ids)
                    if seq.seq_id in running:
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
            seq.record_token_time(now)
            result.new_token_ids[seq.seq_id] = token
            if self._finish(seq, token, stop_check, result):
                done.append(seq)
        if done:
            self._remove({s.seq_id for s in done})
        return result

    def _finish(self, seq: SeqState, token: int, stop_check: StopCheck | None,
                result: UpdateResult) -> bool:
        """Whether ``token``, just appended, finishes ``seq`` (``update``'s rules), recorded
        in ``result``."""
        if token in seq.stop_token_ids:
            result.finished[seq.seq_id] = "stop"
            result.stop_reasons[seq.seq_id] = token
            return True
        text = stop_check(seq.seq_id, token) if stop_check is not None else None
        if text is not None:
            result.finished[seq.seq_id] = "stop"
            if text.stop_reason is not None:
                result.stop_reasons[seq.seq_id] = text.stop_reason
            return True
        if seq.num_output_tokens >= seq.max_tokens or \
                len(seq.token_ids) >= self.config.max_model_len:
            result.finished[seq.seq_id] = "length"
            return True
        return False

    def abort(self, seq_ids: Iterable[str]) -> list[str]:
        """Drop aborted sequences (the client went away), free their blocks; return the known
        ids removed."""
        return self._remove(set(seq_ids))

    def _remove(self, seq_ids: set[str]) -> list[str]:
        removed: list[str] = []
        for seq in (*self.running, *self.waiting):
            if seq.seq_id in seq_ids:
                self.kv.free_seq(seq)
                removed.append(seq.seq_id)
        if removed:
            self.running = [s for s in self.running if s.seq_id not in seq_ids]
            self.waiting = deque(s for s in self.waiting if s.seq_id not in seq_ids)
        return removed

    def _chunk(self, seq: SeqState, start: int, budget: int) -> int:
        """How many tokens from ``start`` the sequence gets with ``budget`` left."""
        num_new = min(len(seq.token_ids) + seq.num_output_placeholders - start, budget)
        cap = self.config.long_prefill_token_threshold
        return cap if 0 < cap < num_new else num_new

    def _pick_victim(self, planned: set[str]) -> SeqState:
        """The victim among the running sequences not yet planned this step (one always is:
        the sequence asking for blocks)."""
        free = [(j, s) for j, s in enumerate(self.running) if s.seq_id not in planned]
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
