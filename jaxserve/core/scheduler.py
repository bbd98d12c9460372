"""Continuous-batching scheduler: pure functions over plain data (no jax, no I/O).

One token-count model, no phases (vLLM v1). A request is its ``token_ids`` (prompt + output so
far) and ``num_computed_tokens`` (how many of them have their K/V in the cache). Each step it gets
``min(len(token_ids) - num_computed_tokens, token budget left)`` new tokens; prefill, chunked
prefill and decode are the same thing. The engine loop drives it::

    state = new_state(config)
    state = add_request(state, seq)               # -> waiting (FIFO)
    while has_unfinished(state):
        state, out = schedule(state)              # plan: which tokens of which requests
        sampled = run_model(out)                  # one token per ScheduledSeq with sample=True
        state, result = update(state, out, sampled)   # advance, append, finish, free blocks

Every function consumes the state it is given (it may be changed in place) and returns the state
to use from then on. Requests leave ``running`` (and their blocks go back to the pool) as soon as
they finish, are aborted, or are preempted; a preempted request keeps its tokens and moves to the
front of ``waiting``. Its K/V is swapped to the host tier when there is one with room (it resumes
where it stopped, after its blocks are loaded back), else dropped and recomputed later
(preemption by recompute; with prefix caching its full blocks are usually still cached).

Block bookkeeping (prefix lookup, eviction to the host tier, swapping, the block copies a step
needs) lives in ``kv_manager.KVManager``; each plan carries the copies the engine runs first.
"""

from __future__ import annotations

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
    # which running request loses its blocks when the pool is short: "newest" (latest admitted)
    # or "least_progress" (fewest computed tokens: the least work lost, the smallest swap).
    # experiments/2026-12-01-preemption-policy measured least_progress recomputing 28-34% fewer
    # tokens without a host tier, swapping 3-15% fewer blocks with one, and finishing in as
    # many or fewer steps, so it is the default.
    preemption_policy: str = "least_progress"

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


@dataclass
class SchedulerState:
    """All scheduler state. ``waiting`` is FIFO (preempted requests re-enter at the front);
    ``running`` is in admission order, oldest first; only running requests hold device blocks
    (swapped-out waiting ones hold host blocks)."""

    config: SchedulerConfig
    kv: KVManager
    waiting: deque[SeqState] = field(default_factory=deque)
    running: list[SeqState] = field(default_factory=list)
    num_preemptions_total: int = 0
    next_arrival_index: int = 0

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


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: ``token_ids`` sit at positions ``start_pos ..
    start_pos + len(token_ids) - 1``; ``block_ids`` is its whole block table after allocation;
    ``sample`` is True on the last chunk (the step that reaches the end of ``token_ids``)."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step; ``scheduled`` is in batch order (running requests in their order,
    then newly admitted ones); ``preempted_ids`` lost their blocks this step. Before the step's
    forward pass the engine copies ``offloads`` (device block, host block) to the host tier, then
    ``loads`` (host block, device block) back (kv_manager.py explains the order); both may be
    non-empty when ``scheduled`` is empty."""

    scheduled: tuple[ScheduledSeq, ...]
    num_scheduled_tokens: int
    preempted_ids: tuple[str, ...] = ()
    offloads: tuple[tuple[int, int], ...] = ()
    loads: tuple[tuple[int, int], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class UpdateResult:
    """What ``update`` changed: the token each request got this step, and the requests that
    finished with their reason ("stop" or "length")."""

    new_token_ids: dict[str, int] = field(default_factory=dict)  # request -> token appended
    finished: dict[str, str] = field(default_factory=dict)  # request -> "stop" | "length"


def new_state(config: SchedulerConfig) -> SchedulerState:
    """An empty scheduler with fresh block pools (``config.num_blocks`` device blocks,
    ``config.num_host_blocks`` host blocks)."""
    kv = KVManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                   config.num_host_blocks)
    return SchedulerState(config=config, kv=kv)


def num_unfinished(state: SchedulerState) -> int:
    """Requests waiting or running."""
    return len(state.waiting) + len(state.running)


def has_unfinished(state: SchedulerState) -> bool:
    """True while any request is waiting or running."""
    return num_unfinished(state) > 0


def add_request(state: SchedulerState, seq: SeqState) -> SchedulerState:
    """Queue a fresh request at the back of ``waiting``; sets ``seq.arrival_index``.
    Consumes ``state``; returns the new state.

    Raises:
      ValueError: the prompt is empty or ``num_prompt_tokens != len(token_ids)``,
        ``max_tokens < 1``, prompt + max_tokens > max_model_len, the request could never fit
        in the block pool alone, or ``request_id`` is already waiting or running.
    """
    cfg, n = state.config, len(seq.token_ids)
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
    if need > state.block_pool.num_usable_blocks:
        raise ValueError(
            f"request {rid!r} needs {need} blocks of {cfg.block_size=} but the pool has only "
            f"{state.block_pool.num_usable_blocks} usable (num_blocks={cfg.num_blocks})"
        )
    if any(s.request_id == rid for s in (*state.waiting, *state.running)):
        raise ValueError(f"request_id {rid!r} is already present")
    seq.arrival_index = state.next_arrival_index
    state.next_arrival_index += 1
    state.waiting.append(seq)
    return state


def schedule(state: SchedulerState) -> tuple[SchedulerState, SchedulerOutput]:
    """Plan one step. Consumes ``state``; returns the new state and the plan.

    Each scheduled request gets ``num_new = min(len(token_ids) - num_computed_tokens, budget)``
    tokens (at most ``long_prefill_token_threshold`` when that is > 0, so that one long prompt
    leaves budget for admitting others), and blocks so that its table covers every position up to the end of the chunk::

        |<-------------------------- len(token_ids) -------------------------->|
        |<--- num_computed_tokens --->|<--- num_new --->|<--- later steps ---->|
        |   K/V already in the cache  |  computed now   |                      |
        |<---- blocks after: cdiv(num_computed + num_new, block_size) ---->|

    1. Running requests, oldest first. When the pool is short, a victim among the requests not
       yet planned this step (``preemption_policy``: the newest, or the one with the fewest
       computed tokens) is preempted and pushed to the front of ``waiting``, repeatedly; its K/V
       is swapped to the host tier if that has room, else dropped (``num_computed_tokens = 0``,
       tokens kept). A request that is itself chosen stops being scheduled this step.
    2. Unless a preemption happened this step (the victim, now at the head of ``waiting``,
       must not be readmitted into the same step), waiting requests are admitted FIFO while
       ``len(running) < max_num_seqs``, budget is left and the pool has the blocks for the chunk
       the head request would get; a head that does not fit blocks the ones behind it. A
       swapped-out head gets its blocks loaded back and continues where it stopped; any other
       head starts after the longest prefix of full blocks found in the prefix cache (device
       blocks shared, host-tier blocks loaded), so ``start_pos`` may be > 0 for a new request.

    A chunk samples a token iff it reaches the end of ``token_ids``. ``num_computed_tokens`` is
    advanced by ``update``, not here. The plan's ``offloads`` and ``loads`` must run before its
    forward pass.
    """
    cfg, kv = state.config, state.kv
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
    while i < len(state.running) and budget > 0:
        seq = state.running[i]
        num_new = _chunk(seq, seq.num_computed_tokens, budget, cfg)
        if num_new <= 0:  # defensive: after update a running request always has a token left
            i += 1
            continue
        need = cdiv(seq.num_computed_tokens + num_new, cfg.block_size) - len(seq.block_ids)
        while need > pool.num_free_blocks:
            victim = state.running.pop(_pick_victim(state, i))
            _preempt(state, victim)
            preempted.append(victim.request_id)
            if victim is seq:
                break
        if i == len(state.running) or state.running[i] is not seq:  # seq preempted itself
            continue
        if need > 0:
            seq.block_ids.extend(kv.allocate(need))
        plan(seq, num_new)
        i += 1

    while not preempted and state.waiting and len(state.running) < cfg.max_num_seqs and budget > 0:
        seq = state.waiting[0]
        if seq.host_block_ids:  # swapped out: load its blocks back
            num_new = _chunk(seq, seq.num_computed_tokens, budget, cfg)
            total = cdiv(seq.num_computed_tokens + num_new, cfg.block_size)
            if total > pool.num_free_blocks:
                break
            kv.swap_in(seq, total)
        else:
            hits = kv.find_prefix(seq)
            num_new = _chunk(seq, len(hits) * cfg.block_size, budget, cfg)
            total = cdiv(len(hits) * cfg.block_size + num_new, cfg.block_size)
            if kv.num_free_needed(hits, total) > pool.num_free_blocks:
                break
            kv.admit(seq, hits, total)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
        state.waiting.popleft()
        state.running.append(seq)
        plan(seq, num_new)

    offloads, loads = kv.take_transfers()
    output = SchedulerOutput(
        scheduled=tuple(scheduled),
        num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
        preempted_ids=tuple(preempted),
        offloads=offloads,
        loads=loads,
    )
    return state, output


def _chunk(seq: SeqState, start: int, budget: int, cfg: SchedulerConfig) -> int:
    num_new = min(len(seq.token_ids) - start, budget)
    cap = cfg.long_prefill_token_threshold
    return cap if 0 < cap < num_new else num_new


def _pick_victim(state: SchedulerState, first: int) -> int:
    """Index in ``running`` of the request to preempt, among ``running[first:]`` (the ones
    not yet planned this step): the newest, or the one with the fewest computed tokens (the
    newest of those on a tie)."""
    if state.config.preemption_policy == "newest":
        return len(state.running) - 1
    return min(range(first, len(state.running)),
               key=lambda j: (state.running[j].num_computed_tokens, -j))


def update(
    state: SchedulerState, output: SchedulerOutput, sampled: Sequence[int | None]
) -> tuple[SchedulerState, UpdateResult]:
    """Apply the results of the step planned by ``output``. Consumes ``state``; returns the new
    state and what changed.

    ``sampled[i]`` is the token sampled for ``output.scheduled[i]`` (ignored where ``sample`` is
    False). Each request's ``num_computed_tokens`` advances by its chunk; a sampled token is
    appended; the request finishes with "stop" if the token is in ``stop_token_ids``, else with
    "length" once ``num_output_tokens >= max_tokens`` or ``len(token_ids) >= max_model_len``.
    Finished requests leave ``running`` at once and their blocks go back to the pool (full
    computed blocks stay findable in the prefix cache until evicted). Requests
    no longer running (aborted or finished since ``schedule``) are skipped.

    Raises:
      ValueError: ``len(sampled) != len(output.scheduled)``, or a sampled token is None where
        ``sample`` is True.
    """
    if len(sampled) != len(output.scheduled):
        raise ValueError(f"update: {len(sampled)=} != {len(output.scheduled)=}")
    for sched, token in zip(output.scheduled, sampled, strict=True):
        if sched.sample and token is None:  # checked before anything changes
            raise ValueError(f"update: request {sched.request_id!r} has sample=True but no token")
    result = UpdateResult()
    running = {s.request_id: s for s in state.running}
    done: list[SeqState] = []
    for sched, token in zip(output.scheduled, sampled, strict=True):
        seq = running.get(sched.request_id)
        if seq is None or seq.num_computed_tokens != sched.start_pos:
            continue
        seq.num_computed_tokens += len(sched.token_ids)
        state.kv.cache_computed_blocks(seq)
        if not sched.sample:
            continue
        assert token is not None
        seq.token_ids.append(token)
        result.new_token_ids[seq.request_id] = token
        if token in seq.stop_token_ids:
            result.finished[seq.request_id] = "stop"
        elif (
            seq.num_output_tokens >= seq.max_tokens
            or len(seq.token_ids) >= state.config.max_model_len
        ):
            result.finished[seq.request_id] = "length"
        else:
            continue
        done.append(seq)
    if done:
        _remove(state, {s.request_id for s in done})
    return state, result


def finish_requests(
    state: SchedulerState, request_ids: Iterable[str], reason: str
) -> SchedulerState:
    """End waiting or running requests for a reason the engine found itself (e.g. a stop
    string); their blocks go back to the pool. Unknown ids are ignored. ``reason`` is for the
    caller's records. Consumes ``state``; returns the new state."""
    del reason
    _remove(state, set(request_ids))
    return state


def abort_requests(
    state: SchedulerState, request_ids: Iterable[str]
) -> tuple[SchedulerState, list[str]]:
    """Remove requests from ``waiting`` or ``running`` and free their blocks; unknown ids are
    ignored. Consumes ``state``; returns the new state and the ids that were removed."""
    return state, _remove(state, set(request_ids))


def _remove(state: SchedulerState, request_ids: set[str]) -> list[str]:
    removed: list[str] = []
    for seq in (*state.running, *state.waiting):
        if seq.request_id in request_ids:
            state.kv.free_seq(seq)
            removed.append(seq.request_id)
    if removed:
        state.running = [s for s in state.running if s.request_id not in request_ids]
        state.waiting = deque(s for s in state.waiting if s.request_id not in request_ids)
    return removed


def _preempt(state: SchedulerState, seq: SeqState) -> None:
    """Swap the request's K/V to the host tier if it has room, else free it (recompute later;
    its full blocks stay in the prefix cache until evicted). Tokens are kept; the request goes
    to the front of ``waiting``."""
    if not state.kv.swap_out(seq):
        state.kv.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
    seq.num_preemptions += 1
    state.num_preemptions_total += 1
    state.waiting.appendleft(seq)
