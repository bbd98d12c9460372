"""Async scheduling in the scheduler: plans made one step ahead of ``update`` (placeholders)
give every request the same tokens as the synchronous loop, never a token past a stop, a
finish or an abort, and leak no block.

A fake device stands in for the step program: it keeps the K/V cache's contents (which token
each slot holds), resolves placeholder tokens from the previous step's samples as the device
gather does, and samples each token as a hash of the context it reads through the block table,
so a wrong block, position or input token changes the tokens that follow.
"""

from __future__ import annotations

import random
import zlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.core.plan import PLACEHOLDER_TOKEN, SchedulerConfig, SchedulerOutput, TextStop
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import SeqState

STOP = 0  # a stop token id (about one sample in 24)
STRING_STOP = 1  # the engine ends a request on it from outside (as a stop string does)
VOCAB = 24


class FakeDevice:
    """Runs plans in dispatch order, as the device does; returns the sampled tokens."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.device: dict[int, int] = {}  # slot -> token whose K/V is there
        self.host: dict[tuple[int, int], int | None] = {}
        self.last: dict[str, int] = {}  # the previous step's samples, by sequence

    def slot(self, block_ids: tuple[int, ...], pos: int) -> int:
        return block_ids[pos // self.bs] * self.bs + pos % self.bs

    def run(self, plan: SchedulerOutput) -> list[int | None]:
        bs = self.bs
        for d, h in plan.offloads:
            for o in range(bs):
                self.host[h, o] = self.device.get(d * bs + o)
        for h, d in plan.loads:
            for o in range(bs):
                self.device[d * bs + o] = self.host.get((h, o))
        for x in plan.scheduled:
            for j, tok in enumerate(x.token_ids):
                if tok == PLACEHOLDER_TOKEN:
                    assert j == len(x.token_ids) - 1, "only a chunk's last token is unknown"
                    tok = self.last[x.seq_id]
                self.device[self.slot(x.block_ids, x.start_pos + j)] = tok
        sampled: list[int | None] = []
        for x in plan.scheduled:
            if not x.sample:
                sampled.append(None)
                continue
            end = x.start_pos + len(x.token_ids)
            ctx = [self.device.get(self.slot(x.block_ids, p)) for p in range(end)]
            sampled.append(zlib.crc32(repr((x.seq_id, ctx)).encode()) % VOCAB)
        self.last = {x.seq_id: t for x, t in zip(plan.scheduled, sampled, strict=True)
                     if t is not None}
        return sampled


def run(config: SchedulerConfig, requests: list[tuple[int, list[int], int]],
        aborts: dict[int, list[str]]) -> dict[str, list[int]]:
    """Drive a scheduler as the engine does (one step in flight with async scheduling); returns
    each request's tokens as ``update`` handed them out, checking on the way that none comes
    after its request ended and that every block comes back."""
    sched = Scheduler(config)
    dev = FakeDevice(config.block_size)
    got: dict[str, list[int]] = {}
    ended: set[str] = set()
    inflight: tuple[SchedulerOutput, list[int | None]] | None = None
    # the engine's text rule, as a stop string would: STRING_STOP ends a request
    stop_check = lambda seq_id, tok: TextStop("stop-string") if tok == STRING_STOP else None

    def complete(plan: SchedulerOutput, sampled: list[int | None]) -> None:
        res = sched.update(plan, sampled, stop_check)
        for rid, tok in res.new_token_ids.items():
            assert rid not in ended, f"{rid}: a token after its end"
            got[rid].append(tok)
            if rid in res.finished:
                ended.add(rid)
            assert (tok == STRING_STOP) <= (res.finished.get(rid) == "stop")

    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    for i, (at, prompt, max_tokens) in enumerate(requests):
        arrivals.setdefault(at, []).append((f"r{i}", prompt, max_tokens))
    last = max([*arrivals, *aborts], default=0)
    for step in range(2000):
        for rid, prompt, max_tokens in arrivals.get(step, []):
            sched.add(SeqState(rid, list(prompt), len(prompt), max_tokens, frozenset({STOP})))
            got[rid] = []
        for rid in aborts.get(step, []):
            if rid in got:
                sched.abort([rid])
                ended.add(rid)
        if step > last and not sched.has_unfinished():
            break
        plan = sched.schedule()
        sampled = dev.run(plan)  # the copies run even when nothing is scheduled
        new = (plan, sampled) if plan.scheduled else None
        if inflight is not None:
            complete(*inflight)
        inflight = new
        if new is not None and not config.async_scheduling:
            complete(*new)
            inflight = None
    else:
        raise AssertionError("not finished")
    if inflight is not None:  # a step planned before its requests ended gives nothing
        assert not sched.update(*inflight).new_token_ids
    for s in (*sched.running, *sched.waiting):
        raise AssertionError(f"{s.seq_id} left over")
    pool = sched.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    if sched.host_pool is not None:
        assert sched.host_pool.num_free_blocks == sched.host_pool.num_usable_blocks
    for i, (_, _, max_tokens) in enumerate(requests):
        assert len(got[f"r{i}"]) <= max_tokens
    return got


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(6, 24),
    max_num_seqs=st.integers(1, 5),
    max_num_batched_tokens=st.integers(5, 24),
    long_prefill=st.sampled_from([0, 0, 3]),
    caching=st.booleans(),
    num_host_blocks=st.sampled_from([0, 0, 4, 16]),
    policy=st.sampled_from(["newest", "least_progress"]),
    seed=st.integers(0, 2**16),
    num_requests=st.integers(1, 8),
    token_buckets=st.sampled_from([(), (4, 8, 16, 32)]),
)
def test_async_plans_give_the_synchronous_tokens(
    block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
    long_prefill: int, caching: bool, num_host_blocks: int, policy: str, seed: int,
    num_requests: int, token_buckets: tuple[int, ...],
) -> None:
    """Random arrivals (shared prompt prefixes, so the prefix cache hits), small pools (so
    requests are preempted, swapped or recomputed), prefill chunks cut to fit a bucket, stop
    tokens, outside finishes and aborts: both loops give every request that was not aborted
    the same tokens."""
    rng = random.Random(seed)
    max_model_len = 32
    usable = num_blocks - 1
    families = [[rng.randrange(2, VOCAB) for _ in range(12)] for _ in range(2)]
    requests = []
    for _ in range(num_requests):
        prompt = rng.choice(families)[:rng.randint(1, 12)] + [rng.randrange(2, VOCAB)
                                                                for _ in range(rng.randint(0, 4))]
        max_tokens = min(rng.randint(1, 12), usable * block_size - len(prompt),
                         max_model_len - len(prompt))
        if max_tokens >= 1:
            requests.append((rng.randint(0, 6), prompt, max_tokens))
    aborts: dict[int, list[str]] = {}
    for i in range(len(requests)):
        if rng.random() < 0.2:
            aborts.setdefault(rng.randint(0, 12), []).append(f"r{i}")
    aborted = {rid for ids in aborts.values() for rid in ids}
    outs = {}
    for async_scheduling in (False, True):
        cfg = SchedulerConfig(max_num_seqs, max_num_batched_tokens, block_size, max_model_len,
                              num_blocks, long_prefill, caching, num_host_blocks, policy,
                              token_buckets=token_buckets, step_overhead_tokens=1,
                              async_scheduling=async_scheduling)
        outs[async_scheduling] = run(cfg, requests, aborts)
    sync, asyn = outs[False], outs[True]
    for rid in sync:
        if rid in aborted:  # cut at the same step, but the two loops are at different tokens
            n = min(len(sync[rid]), len(asyn[rid]))
            assert sync[rid][:n] == asyn[rid][:n], rid
        else:
            assert sync[rid] == asyn[rid], rid


def _config(**kw) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                           max_model_len=64, num_blocks=33, enable_prefix_caching=False,
                           async_scheduling=True, **kw)


def test_plan_ahead_uses_a_placeholder_and_stops_at_max_tokens() -> None:
    sched = Scheduler(_config())
    sched.add(SeqState("a", [5, 6, 7], 3, 2))
    first = sched.schedule()
    (a,) = first.scheduled
    assert (a.token_ids, a.start_pos, a.sample) == ((5, 6, 7), 0, True)
    second = sched.schedule()  # before update: the decode of the token being sampled
    (a,) = second.scheduled
    assert (a.token_ids, a.start_pos, a.sample) == ((PLACEHOLDER_TOKEN,), 3, True)
    assert sched.schedule().is_empty  # its pending sample is its second and last
    sched.update(first, [9])
    assert sched.running[0].token_ids == [5, 6, 7, 9]
    res = sched.update(second, [10])
    assert res.finished == {"a": "length"} and res.new_token_ids == {"a": 10}
    assert not sched.has_unfinished()


def test_a_stopped_request_drops_the_step_planned_after_its_stop() -> None:
    sched = Scheduler(_config())
    sched.add(SeqState("a", [5, 6, 7], 3, 8, frozenset({STOP})))
    first = sched.schedule()
    second = sched.schedule()
    assert sched.update(first, [STOP]).finished == {"a": "stop"}
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_usable_blocks
    assert sched.update(second, [11]).new_token_ids == {}  # sampled after the stop: dropped


def test_blocks_of_a_dispatched_step_are_found_by_the_next_plan() -> None:
    """A prompt prefilled by the step in flight is a prefix hit for a request the next plan
    admits, as it would be after ``update`` in the synchronous loop."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                                      max_model_len=64, num_blocks=33, async_scheduling=True))
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks
    sched.add(SeqState("a", prompt, 9, 4))
    first = sched.schedule()
    sched.add(SeqState("b", prompt + [5], 10, 4))
    second = sched.schedule()
    b = next(x for x in second.scheduled if x.seq_id == "b")
    assert b.start_pos == 8 and b.block_ids[:2] == first.scheduled[0].block_ids[:2]
