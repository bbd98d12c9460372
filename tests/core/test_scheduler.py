"""Scheduler: unit tests on the plan, and hypothesis property tests (invariants, liveness)."""

from __future__ import annotations

import bisect
import collections
import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jaxserve.config import EngineConfig
from jaxserve.core.plan import SchedulerConfig, SchedulerOutput, TextStop, UpdateResult
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import SeqState, cdiv
from jaxserve.core.step_cost import StepCostModel
from jaxserve.core.step_policy import ITL_PLAN_FRACTION
from jaxserve.device.buckets import token_buckets

STOP = 0


def make_scheduler(
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    block_size: int = 4,
    max_model_len: int = 64,
    num_blocks: int = 33,
    long_prefill_token_threshold: int = 0,
    enable_prefix_caching: bool = False,
    num_host_blocks: int = 0,
    preemption_policy: str = "newest",
    prefill_order: str = "fcfs",
    max_prefill_skips: int = 8,
) -> Scheduler:
    """A scheduler; prefix caching is off unless asked for, because make_seq's prompts all
    share their start (the plan tests below are about plans without cache hits), and the
    victim policy is "newest" (the preemption tests below are worked out for it)."""
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, block_size, max_model_len, num_blocks,
                        long_prefill_token_threshold, enable_prefix_caching, num_host_blocks,
                        preemption_policy, prefill_order=prefill_order,
                        max_prefill_skips=max_prefill_skips)
    )


def make_seq(rid: str, prompt_len: int, max_tokens: int = 8, stop: bool = True) -> SeqState:
    prompt = [100 + i for i in range(prompt_len)]
    stops = frozenset({STOP}) if stop else frozenset()
    return SeqState(rid, prompt, prompt_len, max_tokens, stops)


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, UpdateResult]:
    out = sched.schedule()
    res = sched.update(out, [token if s.sample else None for s in out.scheduled])
    return out, res


def by_id(sched: Scheduler, rid: str) -> SeqState:
    return next(s for s in (*sched.running, *sched.waiting) if s.seq_id == rid)


def held(sched: Scheduler) -> int:
    return sched.block_pool.num_usable_blocks - sched.block_pool.num_free_blocks


# ---------------------------------------------------------------- unit tests on the plan


def test_from_engine_config() -> None:
    cfg = SchedulerConfig.from_engine_config(
        EngineConfig(block_size=8, max_num_seqs=3, max_num_batched_tokens=32), 100, 256
    )
    assert cfg == SchedulerConfig(3, 32, 8, 256, 100, 0, True, 0, async_scheduling=True,
                                  prefill_order="shortest-first")
    cfg = SchedulerConfig.from_engine_config(EngineConfig(enable_prefix_caching=False), 9, 64, 5)
    assert (cfg.enable_prefix_caching, cfg.num_host_blocks) == (False, 5)
    with pytest.raises(ValueError, match="preemption_policy"):
        SchedulerConfig(1, 32, 8, 256, 100, preemption_policy="oldest")
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        SchedulerConfig(0, 32, 8, 256, 100)


def test_prefill_then_decode_of_several_requests() -> None:
    sched = make_scheduler()
    for rid, n in (("a", 5), ("b", 3), ("c", 6)):
        sched.add(make_seq(rid, n))
    assert sched.num_unfinished() == 3 and [s.arrival_index for s in sched.waiting] == [0, 1, 2]
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled] == ["a", "b", "c"]
    assert out.num_scheduled_tokens == 14 and out.preempted_ids == () and not out.is_empty
    for s, n in zip(out.scheduled, (5, 3, 6)):
        assert s.start_pos == 0 and s.sample and s.token_ids == tuple(range(100, 100 + n))
        assert len(s.block_ids) == cdiv(n, 4) and 0 not in s.block_ids
    res = sched.update(out, [11, 12, 13])
    assert res.new_token_ids == {"a": 11, "b": 12, "c": 13} and res.finished == {}
    assert by_id(sched, "a").output_token_ids == [11]

    out = sched.schedule()
    assert [(s.seq_id, s.token_ids, s.start_pos, s.sample) for s in out.scheduled] == [
        ("a", (11,), 5, True),
        ("b", (12,), 3, True),
        ("c", (13,), 6, True),
    ]
    assert out.num_scheduled_tokens == 3
    # positions 5, 3, 6: b still fits in one block (cdiv(3 + 1, 4) == 1)
    assert [len(s.block_ids) for s in out.scheduled] == [2, 1, 2]
    res = sched.update(out, [21, 22, 23])
    assert by_id(sched, "b").token_ids == [100, 101, 102, 12, 22]
    assert by_id(sched, "b").num_computed_tokens == 4


def test_chunked_prefill_across_steps() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(make_seq("long", 20))
    expected = [(0, 8, False, 2), (8, 8, False, 4), (16, 4, True, 5)]
    for start, n, sample, nblocks in expected:
        out, res = step(sched, token=9)
        (s,) = out.scheduled
        assert (s.start_pos, len(s.token_ids), s.sample, len(s.block_ids)) == (
            start,
            n,
            sample,
            nblocks,
        )
        assert s.token_ids == tuple(range(100 + start, 100 + start + n))
        assert res.new_token_ids == ({"long": 9} if sample else {})
    out, _ = step(sched)
    (s,) = out.scheduled
    assert (s.token_ids, s.start_pos, s.sample, len(s.block_ids)) == ((9,), 20, True, 6)


def test_long_prefill_token_threshold_leaves_room_to_admit_others() -> None:
    sched = Scheduler(SchedulerConfig(4, 16, 4, 64, 33, long_prefill_token_threshold=6))
    sched.add(make_seq("long", 30))
    out, _ = step(sched)
    assert [(s.seq_id, len(s.token_ids)) for s in out.scheduled] == [("long", 6)]
    sched.add(make_seq("short", 3))
    out, _ = step(sched)
    # without the threshold "long" would take all 16 tokens and "short" would wait
    assert [(s.seq_id, len(s.token_ids), s.sample) for s in out.scheduled] == [
        ("long", 6, False), ("short", 3, True)]


def test_decode_goes_first_and_prefill_chunks_fill_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(make_seq("a", 3))
    step(sched)
    sched.add(make_seq("b", 12))
    out, _ = step(sched)
    assert [(s.seq_id, s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled] == [
        ("a", 3, 1, True),
        ("b", 0, 7, False),
    ]
    out, _ = step(sched)
    assert [(s.seq_id, s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled] == [
        ("a", 4, 1, True),
        ("b", 7, 5, True),
    ]


BUCKETS = (8, 16, 32, 64, 128, 256, 512)


def fitting_scheduler(overhead: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(64, 512, 16, 2048, 200, token_buckets=BUCKETS,
                                     step_overhead_tokens=overhead))


def test_prompt_just_past_a_bucket_is_cut_to_fill_the_bucket_below() -> None:
    sched = fitting_scheduler()
    sched.add(make_seq("a", 300))
    out, res = step(sched)
    assert [(s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled] == [(0, 256, False)]
    assert out.num_scheduled_tokens == 256 and not res.new_token_ids
    assert len(by_id(sched, "a").block_ids) == cdiv(300, 16)  # blocks for the whole chunk
    free = sched.block_pool.num_free_blocks
    out, res = step(sched)
    assert [(s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled] == [(256, 44, True)]
    assert res.new_token_ids == {"a": 7} and sched.block_pool.num_free_blocks == free


def test_no_cut_where_the_two_steps_cost_more_than_the_padding() -> None:
    sched = fitting_scheduler()
    sched.add(make_seq("a", 400))  # 256 + bucket(144)=256 + 32 >= 512: one padded step
    out, _ = step(sched)
    assert [len(s.token_ids) for s in out.scheduled] == [400]
    sched = fitting_scheduler(overhead=300)  # a GPU-like step overhead: padding is cheaper
    sched.add(make_seq("b", 300))
    out, _ = step(sched)
    assert [len(s.token_ids) for s in out.scheduled] == [300]


def test_cut_takes_prompt_tokens_from_the_last_chunks_never_decode_rows() -> None:
    sched = fitting_scheduler()
    for i in range(3):
        sched.add(make_seq(f"d{i}", 10))
    step(sched)
    sched.add(make_seq("p", 100))
    sched.add(make_seq("q", 160))  # 3 decodes + 100 + 160 = 263 -> 256, q gives back 7
    out, _ = step(sched)
    assert [(s.seq_id, len(s.token_ids), s.sample) for s in out.scheduled] == [
        ("d0", 1, True), ("d1", 1, True), ("d2", 1, True), ("p", 100, True), ("q", 153, False)]
    assert out.num_scheduled_tokens == 256
    sched = fitting_scheduler()
    for i in range(64):  # 64 decode rows + a 1-token chunk: nothing can shrink
        sched.add(make_seq(f"e{i}", 1))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == 64


def test_max_num_seqs_limits_admission() -> None:
    sched = make_scheduler(max_num_seqs=2)
    sched.add(make_seq("a", 4, max_tokens=1))
    sched.add(make_seq("b", 4))
    sched.add(make_seq("c", 4))
    out, res = step(sched)
    assert [s.seq_id for s in out.scheduled] == ["a", "b"]
    assert res.finished == {"a": "length"}
    out, _ = step(sched)
    assert [(s.seq_id, s.start_pos) for s in out.scheduled] == [("b", 4), ("c", 0)]


def test_token_budget_chunks_the_last_admitted() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add(make_seq("a", 6))
    sched.add(make_seq("b", 6))
    sched.add(make_seq("c", 6))
    out = sched.schedule()
    assert [(s.seq_id, len(s.token_ids), s.sample) for s in out.scheduled] == [
        ("a", 6, True),
        ("b", 4, False),
    ]
    assert out.num_scheduled_tokens == 10 and [s.seq_id for s in sched.waiting] == ["c"]


def test_head_of_line_blocks_when_the_pool_is_short() -> None:
    sched = make_scheduler(block_size=4, num_blocks=6, max_model_len=24)  # 5 usable blocks
    sched.add(make_seq("a", 12, max_tokens=4))  # 3 blocks
    sched.add(make_seq("b", 12, max_tokens=4))  # needs 3, only 2 left
    sched.add(make_seq("c", 2, max_tokens=4))  # would fit, must not skip b
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled] == ["a"]
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]


def test_preempt_newest_then_it_recomputes_prompt_and_outputs() -> None:
    sched = make_scheduler(max_num_seqs=2, block_size=4, num_blocks=5, max_model_len=16)  # 4 usable
    sched.add(make_seq("a", 4, max_tokens=8))
    sched.add(make_seq("b", 4, max_tokens=8))
    sched.add(make_seq("c", 1, max_tokens=1))  # waits: max_num_seqs=2
    preempted_at = None
    for i in range(7):
        out, _ = step(sched, token=50 + i)
        if out.preempted_ids:
            preempted_at = i
            break
    # both hold 2 blocks after 8 computed tokens; a's position 8 needs a 3rd block
    assert preempted_at == 5 and out.preempted_ids == ("b",)
    assert [s.seq_id for s in out.scheduled] == ["a"]
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]  # b goes to the front
    b = sched.waiting[0]
    assert (b.seq_id, b.num_computed_tokens, b.block_ids, b.num_preemptions) == ("b", 0, [], 1)
    b_tokens = list(b.token_ids)
    assert b_tokens == [100, 101, 102, 103, 50, 51, 52, 53, 54]
    assert sched.num_preemptions_total == 1 and held(sched) == 3
    # prefill: b recomputes its 9 tokens but the last, c's prompt is 1; decode: 2 + 3 + 1 left
    assert sched.num_tokens_pending() == (9, 6)
    # b waits (it needs 2 blocks, 1 is free) until a finishes and frees its blocks at once
    while True:
        out, res = step(sched, token=60)
        if "a" in res.finished:
            break
        assert [s.seq_id for s in out.scheduled] == ["a"]
    assert res.finished == {"a": "length"} and held(sched) == 0
    out, res = step(sched, token=61)
    s = out.scheduled[0]
    assert (s.seq_id, s.start_pos, s.token_ids, s.sample) == ("b", 0, tuple(b_tokens), True)
    assert res.new_token_ids == {"b": 61, "c": 61}
    while sched.has_unfinished():
        _, res = step(sched, token=62)
    assert res.finished == {"b": "length"} and held(sched) == 0
    assert not sched.has_unfinished() and sched.num_preemptions_total == 1


def test_tokens_pending_counts_prefill_left_and_outputs_left() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    assert sched.num_tokens_pending() == (0, 0)
    sched.add(make_seq("a", 12, max_tokens=5))
    sched.add(make_seq("b", 3, max_tokens=2))
    assert sched.num_tokens_pending() == (15, 7)
    step(sched)  # a: 8 of its 12 prompt tokens; b waits for budget
    assert sched.num_tokens_pending() == (4 + 3, 7)
    step(sched)  # a: the last 4 and its first token; b: its 3 and its first token
    assert sched.num_tokens_pending() == (0, 4 + 1)
    step(sched)  # one decode each: b reaches max_tokens and leaves
    assert sched.num_tokens_pending() == (0, 3)


def test_request_being_scheduled_preempts_itself_when_newest() -> None:
    sched = make_scheduler(block_size=4, num_blocks=6, max_model_len=16)  # 5 usable blocks
    sched.add(make_seq("a", 4, max_tokens=8))
    sched.add(make_seq("b", 4, max_tokens=8))
    for _ in range(5):  # prefill (positions 0..3), then decode of positions 4..7
        out, _ = step(sched)
        assert not out.preempted_ids
    # a takes the last free block; b (the newest) then has none and preempts itself
    out, _ = step(sched)
    assert out.preempted_ids == ("b",) and [s.seq_id for s in out.scheduled] == ["a"]
    assert [s.seq_id for s in sched.running] == ["a"]
    assert by_id(sched, "b").num_computed_tokens == 0


def test_stop_token_finishes_and_frees_at_once() -> None:
    sched = make_scheduler()
    sched.add(make_seq("a", 5))
    sched.add(make_seq("b", 5, stop=False))
    out = sched.schedule()
    res = sched.update(out, [STOP, STOP])
    assert res.finished == {"a": "stop"} and res.new_token_ids == {"a": STOP, "b": STOP}
    assert [s.seq_id for s in sched.running] == ["b"] and held(sched) == 2


def test_length_at_max_model_len() -> None:
    sched = make_scheduler(max_model_len=6)
    sched.add(make_seq("a", 4, max_tokens=2))
    _, res = step(sched)
    assert res.finished == {}
    _, res = step(sched)
    assert res.finished == {"a": "length"} and not sched.has_unfinished() and held(sched) == 0


def test_abort_waiting_and_running() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_seq("run", 5))
    sched.add(make_seq("wait", 5))
    step(sched)
    assert held(sched) == 2
    aborted = sched.abort(["wait", "nope"])
    assert aborted == ["wait"] and not sched.waiting
    out = sched.schedule()
    aborted = sched.abort(["run"])
    assert aborted == ["run"] and held(sched) == 0
    res = sched.update(out, [3])  # the aborted request is skipped
    assert res == UpdateResult() and not sched.has_unfinished()


def test_a_text_stop_finishes_in_update_and_frees_blocks() -> None:
    """The engine's stop check (a stop string) finishes a sequence inside ``update``, with its
    reason; a stop id wins over it and is not shown to it; the length limit yields to it."""
    sched = make_scheduler()
    sched.add(make_seq("a", 9))
    sched.add(make_seq("b", 9))
    sched.add(make_seq("c", 9, max_tokens=1))
    seen: list[tuple[str, int]] = []

    def stop_check(seq_id: str, token: int) -> TextStop | None:
        seen.append((seq_id, token))
        return TextStop("the end") if seq_id in ("a", "c") else None

    plan = sched.schedule()
    res = sched.update(plan, [5, 6, 7], stop_check)
    assert seen == [("a", 5), ("b", 6), ("c", 7)]
    assert res.finished == {"a": "stop", "c": "stop"}
    assert res.stop_reasons == {"a": "the end", "c": "the end"}
    assert [s.seq_id for s in sched.running] == ["b"] and held(sched) == 3
    res = sched.update(sched.schedule(), [STOP], stop_check)
    assert seen[-1] == ("c", 7) and res.finished == {"b": "stop"}
    assert res.stop_reasons == {"b": STOP} and held(sched) == 0


def test_add_asserts_what_the_engine_validated() -> None:
    """The engine validates requests once (``validate_request``, tests/engine/test_validation.py);
    the scheduler asserts the same contract."""
    sched = make_scheduler(block_size=4, num_blocks=3, max_model_len=16)  # 2 usable blocks
    with pytest.raises(AssertionError, match="empty prompt"):
        sched.add(make_seq("e", 0))
    with pytest.raises(AssertionError, match="max_model_len"):
        sched.add(make_seq("l", 10, max_tokens=7))
    with pytest.raises(AssertionError, match="usable"):
        sched.add(make_seq("p", 6, max_tokens=3))
    with pytest.raises(AssertionError, match="max_tokens"):
        sched.add(make_seq("z", 2, max_tokens=0))
    sched.add(make_seq("a", 4, max_tokens=4))
    with pytest.raises(AssertionError, match="already present"):
        sched.add(make_seq("a", 4, max_tokens=4))
    assert sched.num_unfinished() == 1


def test_update_checks_sampled_length() -> None:
    sched = make_scheduler()
    sched.add(make_seq("a", 3))
    out = sched.schedule()
    with pytest.raises(ValueError, match="len"):
        sched.update(out, [])
    with pytest.raises(ValueError, match="no token"):
        sched.update(out, [None])
    assert by_id(sched, "a").num_computed_tokens == 0  # nothing changed


# ---------------------------------------------------------------- prefix caching, host tier


def run_to_end(sched: Scheduler, token: int = 7) -> None:
    for _ in range(1000):
        if not sched.has_unfinished():
            return
        step(sched, token)
    raise AssertionError("not finished")


def test_prefix_hit_shares_full_blocks_and_counts_tokens() -> None:
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    sched.add(make_seq("a", 10))
    out, _ = step(sched)
    a_blocks = out.scheduled[0].block_ids
    sched.add(make_seq("b", 11))  # same first 10 tokens
    out = sched.schedule()
    b = out.scheduled[1]
    assert (b.seq_id, b.start_pos, b.token_ids) == ("b", 8, (108, 109, 110))
    assert b.block_ids[:2] == a_blocks[:2] and b.block_ids[2] not in a_blocks
    pool = sched.block_pool
    assert [pool.refcount(x) for x in a_blocks] == [2, 2, 1]
    assert by_id(sched, "b").num_cached_tokens == 8
    st_ = sched.kv_stats
    assert (st_.prefix_cache_queries, st_.prefix_cache_hits) == (10 + 11, 8)


def test_whole_prompt_hit_recomputes_the_last_block() -> None:
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    sched.add(make_seq("a", 8, max_tokens=1))
    run_to_end(sched)
    pool = sched.block_pool
    assert pool.usage == 0.0 and pool.num_cached_blocks == 2  # idle, warm cache
    sched.add(make_seq("b", 8, max_tokens=1))
    out = sched.schedule()
    (b,) = out.scheduled
    assert (b.start_pos, b.token_ids, b.sample) == (4, (104, 105, 106, 107), True)


def test_no_hits_with_caching_off_or_another_salt() -> None:
    for caching, salt in ((False, None), (True, "tenant-2")):
        sched = make_scheduler(block_size=4, enable_prefix_caching=caching)
        sched.add(make_seq("a", 9, max_tokens=1))
        run_to_end(sched)
        seq = make_seq("b", 9, max_tokens=1)
        seq.cache_salt = salt
        sched.add(seq)
        out = sched.schedule()
        assert out.scheduled[0].start_pos == 0
        assert sched.block_pool.num_cached_blocks == (2 if caching else 0)


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    sched = make_scheduler(block_size=4, num_blocks=7, max_model_len=24,
                           enable_prefix_caching=True)  # 6 usable
    old = SeqState("old", [1] * 8, 8, 1)
    new = SeqState("new", [2] * 8, 8, 1)
    sched.add(old)
    run_to_end(sched)
    sched.add(new)
    run_to_end(sched)
    assert sched.block_pool.num_cached_blocks == 4
    # 4 fresh blocks are needed: the 2 empty ones, then old's two (freed first)
    sched.add(SeqState("x", [3] * 13, 13, 1))
    run_to_end(sched)
    assert sched.kv_stats.num_evicted_blocks == 2
    sched.add(SeqState("new2", [2] * 9, 9, 1))
    out = sched.schedule()
    assert out.scheduled[0].start_pos == 8  # "new"'s blocks survived
    run_to_end(sched)
    sched.add(SeqState("old2", [1] * 9, 9, 1))
    out = sched.schedule()
    assert out.scheduled[0].start_pos == 0  # "old"'s were evicted


def test_evicted_blocks_go_to_the_host_tier_and_are_loaded_back() -> None:
    sched = make_scheduler(block_size=4, num_blocks=5, max_model_len=16,
                           enable_prefix_caching=True, num_host_blocks=4)  # 4 device, 3 host blocks
    sched.add(SeqState("a", [1] * 9, 9, 1))
    run_to_end(sched)
    sched.add(SeqState("b", [2] * 13, 13, 1))
    out = sched.schedule()
    # b's 4 blocks evict a's 2 cached ones, which are copied to the host before the step
    assert len(out.offloads) == 2 and not out.loads
    run_to_end(sched)
    sched.add(SeqState("a2", [1] * 9, 9, 1))
    out = sched.schedule()
    (a2,) = out.scheduled
    assert a2.start_pos == 8 and len(out.loads) == 2
    assert [d for _, d in out.loads] == list(a2.block_ids[:2])
    st_ = sched.kv_stats
    assert (st_.num_offloaded_blocks, st_.host_cache_hits, st_.prefix_cache_hits) == (2 + 2, 8, 8)
    run_to_end(sched)
    assert sched.host_pool.num_free_blocks == sched.host_pool.num_usable_blocks


def test_preempted_request_is_swapped_and_resumes_where_it_stopped() -> None:
    sched = make_scheduler(max_num_seqs=2, block_size=4, num_blocks=5, max_model_len=16,
                           num_host_blocks=8)  # 4 usable device blocks
    sched.add(make_seq("a", 4, max_tokens=8))
    sched.add(SeqState("b", [9] * 4, 4, 8, frozenset({STOP})))
    for _ in range(10):
        out, _ = step(sched, token=50)
        if out.preempted_ids:
            break
    assert out.preempted_ids == ("b",) and len(out.offloads) == 2
    b = sched.waiting[0]
    assert (b.num_computed_tokens, b.block_ids, len(b.host_block_ids)) == (8, [], 2)
    assert sched.kv_stats.num_swaps == 1 and sched.num_preemptions_total == 1
    while sched.running:
        out, _ = step(sched, token=60)
    out = sched.schedule()
    (x,) = out.scheduled
    assert (x.seq_id, x.start_pos, x.token_ids) == ("b", 8, (50,))
    assert [h for h, _ in out.loads] and [d for _, d in out.loads] == list(x.block_ids[:2])
    sched.update(out, [61])
    run_to_end(sched)
    assert sched.host_pool.num_free_blocks == sched.host_pool.num_usable_blocks


def test_skip_prefix_cache_computes_everything_and_is_never_swapped() -> None:
    sched = make_scheduler(max_num_seqs=2, block_size=4, num_blocks=5, max_model_len=16,
                           enable_prefix_caching=True, num_host_blocks=8)  # 4 usable, newest first
    sched.add(make_seq("warm", 8, max_tokens=1))
    run_to_end(sched)
    sched.add(SeqState("b", [9] * 4, 4, 8))
    a = make_seq("a", 8, max_tokens=8)
    a.skip_prefix_cache = True
    sched.add(a)
    out = sched.schedule()
    assert out.scheduled[1].start_pos == 0 and sched.kv_stats.prefix_cache_queries == 8 + 4
    sched.update(out, [7, 7])
    for _ in range(10):  # both grow until the newest, a, is preempted
        out, _ = step(sched)
        if out.preempted_ids:
            break
    assert out.preempted_ids == ("a",)  # the host tier had room, yet a was not swapped
    assert (sched.kv_stats.num_swaps, sched.kv_stats.num_swapped_out_blocks) == (0, 0)
    assert by_id(sched, "a").num_computed_tokens == 0 and not by_id(sched, "a").host_block_ids


def test_least_progress_policy_preempts_the_request_with_fewest_computed_tokens() -> None:
    sched = make_scheduler(max_num_seqs=3, block_size=4, num_blocks=7, max_model_len=24,
                           preemption_policy="least_progress")  # 6 usable
    sched.add(make_seq("a", 7, max_tokens=9))  # 2 blocks
    step(sched)
    sched.add(make_seq("b", 3, max_tokens=12))  # 1 block
    sched.add(make_seq("c", 7, max_tokens=9))  # 2 blocks (newest)
    for _ in range(10):
        out, _ = step(sched)
        if out.preempted_ids:
            break
    assert out.preempted_ids == ("b",)  # "newest" would take c
    with_newest = make_scheduler(max_num_seqs=3, block_size=4, num_blocks=7, max_model_len=24)
    with_newest.add(make_seq("a", 7, max_tokens=9))
    step(with_newest)
    with_newest.add(make_seq("b", 3, max_tokens=12))
    with_newest.add(make_seq("c", 7, max_tokens=9))
    for _ in range(10):
        out, _ = step(with_newest)
        if out.preempted_ids:
            break
    assert out.preempted_ids == ("c",)


# ---------------------------------------------------------------- properties


def check_invariants(sched: Scheduler) -> None:
    """Block accounting of both tiers (reference counts = table entries, free + held = usable,
    cached-free blocks hold a hash) and the per-request contracts."""
    cfg, pool, host = sched.config, sched.block_pool, sched.host_pool
    owned = collections.Counter(b for s in sched.running for b in s.block_ids)
    assert 0 not in owned
    for b in range(1, pool.num_blocks):
        assert pool.refcount(b) == owned[b], f"device block {b}"
    assert pool.num_free_blocks + len(owned) == pool.num_usable_blocks
    cached = sum(pool.refcount(b) == 0 and pool.block_hash(b) is not None
                 for b in range(1, pool.num_blocks))
    assert pool.num_cached_blocks == cached
    if not cfg.enable_prefix_caching:
        assert cached == 0 and all(pool.block_hash(b) is None for b in owned)
    if host is not None:
        on_host = collections.Counter(b for s in sched.waiting for b in s.host_block_ids)
        assert 0 not in on_host
        for b in range(1, host.num_blocks):
            assert host.refcount(b) == on_host[b], f"host block {b}"
        assert host.num_free_blocks + len(on_host) == host.num_usable_blocks
        assert host.num_cached_blocks == sum(
            host.refcount(b) == 0 and host.block_hash(b) is not None
            for b in range(1, host.num_blocks))
    assert len(sched.running) <= cfg.max_num_seqs
    for s in sched.running:
        assert len(s.block_ids) == cdiv(s.num_computed_tokens, cfg.block_size)
        assert len(set(s.block_ids)) == len(s.block_ids)
        assert s.num_computed_tokens < len(s.token_ids) and not s.host_block_ids
        for i, b in enumerate(s.block_ids[: s.num_registered_blocks]):
            h = pool.block_hash(b)
            assert h is None or h == s.block_hashes[i]
    for s in sched.waiting:
        assert s.block_ids == []
        assert len(s.host_block_ids) == cdiv(s.num_computed_tokens, cfg.block_size)
    ids = [s.seq_id for s in (*sched.running, *sched.waiting)]
    assert len(ids) == len(set(ids))


def running_prompt_len(sched: Scheduler, rid: str) -> int:
    return next(s.num_prompt_tokens for s in sched.running if s.seq_id == rid)


def check_plan(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert out.num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
    assert 0 <= out.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs
    running = {s.seq_id: s for s in sched.running}
    # batch order: the decodes in running order first, then the prompt chunks (prefill
    # order; a sequence swapped back in may be down to its last token, decode-like)
    order = {s.seq_id: j for j, s in enumerate(sched.running)}
    kinds = [len(x.token_ids) == 1 and x.sample  # a decode: the one token left, past the prompt
             and x.start_pos >= running_prompt_len(sched, x.seq_id) for x in out.scheduled]
    decodes = [order[x.seq_id] for x, k in zip(out.scheduled, kinds, strict=True) if k]
    assert decodes == sorted(decodes)
    assert len({x.seq_id for x in out.scheduled}) == len(out.scheduled)
    for x in out.scheduled:
        seq = running[x.seq_id]
        end = x.start_pos + len(x.token_ids)
        assert len(x.token_ids) >= 1 and x.start_pos == seq.num_computed_tokens
        assert x.token_ids == tuple(seq.token_ids[x.start_pos : end])
        assert x.sample == (end == len(seq.token_ids))
        assert list(x.block_ids) == seq.block_ids
        assert len(x.block_ids) == cdiv(end, cfg.block_size)
    for rid in out.preempted_ids:
        assert rid not in running
    # each victim is pushed to the front: the last one preempted is first
    k = len(out.preempted_ids)
    assert tuple(s.seq_id for s in list(sched.waiting)[:k]) == out.preempted_ids[::-1]
    # copies: one writer per destination in each batch
    assert len({h for _, h in out.offloads}) == len(out.offloads)
    assert len({d for _, d in out.loads}) == len(out.loads)
    if sched.host_pool is None:
        assert not out.offloads and not out.loads


class KVContentModel:
    """What the engine's caches would hold: slot -> the token prefix whose K/V is there.
    ``run(plan)`` applies the plan's copies, checks that every scheduled request's cached
    positions hold its own prefix (what attention reads), then writes the step's tokens."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.device: dict[tuple[int, int], tuple[int, ...]] = {}
        self.host: dict[tuple[int, int], tuple[int, ...]] = {}

    def run(self, sched: Scheduler, out: SchedulerOutput) -> None:
        bs = self.bs
        for d, h in out.offloads:
            for o in range(bs):
                self.host[h, o] = self.device.get((d, o), ())
        for h, d in out.loads:
            for o in range(bs):
                self.device[d, o] = self.host.get((h, o), ())
        seqs = {s.seq_id: s for s in sched.running}
        for x in out.scheduled:
            tokens = seqs[x.seq_id].token_ids
            for p in range(x.start_pos):
                got = self.device.get((x.block_ids[p // bs], p % bs))
                assert got == tuple(tokens[: p + 1]), f"{x.seq_id} reads wrong K/V at {p}"
        for x in out.scheduled:
            tokens = seqs[x.seq_id].token_ids
            for p in range(x.start_pos, x.start_pos + len(x.token_ids)):
                self.device[x.block_ids[p // bs], p % bs] = tuple(tokens[: p + 1])


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals (prompts from a few shared families, so prefixes repeat), steps with
    random tokens (sometimes STOP), aborts, small device pools, with or without prefix caching
    and a host tier, under either preemption policy. A model of the caches' contents checks
    that every request reads its own prefix's K/V."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(2, 12),
        max_num_seqs=st.integers(1, 5),
        max_num_batched_tokens=st.integers(1, 24),
        max_model_len=st.integers(2, 40),
        seed=st.integers(0, 2**16),
        long_prefill=st.sampled_from([0, 0, 1, 3]),
        caching=st.sampled_from([True, True, False]),
        num_host_blocks=st.sampled_from([0, 0, 2, 4, 12]),
        policy=st.sampled_from(["newest", "least_progress"]),
        fit=st.sampled_from([None, 0, 2]),
        order=st.sampled_from(["fcfs", "shortest-first"]),
        max_skips=st.sampled_from([0, 2, 8]),
    )
    def init(
        self,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        seed: int,
        long_prefill: int,
        caching: bool,
        num_host_blocks: int,
        policy: str,
        fit: int | None,
        order: str,
        max_skips: int,
    ) -> None:
        self.sched = make_scheduler(
            max_num_seqs, max_num_batched_tokens, block_size, max_model_len, num_blocks,
            long_prefill, caching, num_host_blocks, policy, order, max_skips,
        )
        if fit is not None:  # plan to the engine's buckets, the step overhead 0 or 2 tokens
            self.sched = Scheduler(dataclasses.replace(
                self.sched.config, token_buckets=tuple(token_buckets(max_num_batched_tokens)),
                step_overhead_tokens=fit))
        self.rng = random.Random(seed)
        self.content = KVContentModel(block_size)
        self.expected: dict[str, list[int]] = {}  # live request -> its token ids
        self.n = 0

    @rule(
        size=st.integers(0, 99),
        out=st.integers(0, 99),
        oversize=st.sampled_from([False] * 9 + [True]),
        stop=st.booleans(),
        family=st.integers(0, 1),
        shared=st.integers(0, 99),
    )
    def add(
        self, size: int, out: int, oversize: bool, stop: bool, family: int, shared: int
    ) -> None:
        """A request of up to the pool's (or context's) capacity, or rarely one beyond it; its
        first ``shared`` percent of tokens come from the family's fixed text (often all of
        them), the rest are random."""
        cfg = self.sched.config
        capacity = min(cfg.max_model_len, (cfg.num_blocks - 1) * cfg.block_size)
        if capacity < 2 and not oversize:
            return
        total = capacity + 1 + size % 5 if oversize else 2 + size * (capacity - 1) // 100
        max_tokens = 1 + out * (total - 1) // 100 if total > 1 else 1
        prompt_len = max(1, total - max_tokens)
        seq = make_seq(f"r{self.n}", prompt_len, max_tokens, stop)
        num_shared = prompt_len if shared >= 50 else shared * prompt_len // 50
        seq.token_ids[:] = [100 * family + 20 + i if i < num_shared else self.rng.randrange(1, 12)
                            for i in range(prompt_len)]
        self.n += 1
        fits = (
            prompt_len + max_tokens <= cfg.max_model_len
            and cdiv(prompt_len + max_tokens, cfg.block_size) <= cfg.num_blocks - 1
        )
        if not fits:
            with pytest.raises(AssertionError):
                self.sched.add(seq)
            return
        self.sched.add(seq)
        self.expected[seq.seq_id] = list(seq.token_ids)

    @rule(abort_between=st.booleans())
    def step(self, abort_between: bool) -> None:
        out = self.sched.schedule()
        check_plan(self.sched, out)
        self.content.run(self.sched, out)
        if self.sched.has_unfinished():
            assert not out.is_empty, "nothing scheduled while requests are pending"
        aborted: set[str] = set()
        if abort_between and out.scheduled:
            victim = self.rng.choice(out.scheduled).seq_id
            ids = self.sched.abort([victim])
            assert ids == [victim]
            aborted.add(victim)
            del self.expected[victim]
        sampled = [self.rng.randrange(0, 12) if s.sample else None for s in out.scheduled]
        res = self.sched.update(out, sampled)
        want = {s.seq_id: t for s, t in zip(out.scheduled, sampled) if s.sample}
        want = {r: t for r, t in want.items() if r not in aborted}
        assert res.new_token_ids == want
        for rid, t in want.items():
            self.expected[rid].append(t)
        live = {s.seq_id: s for s in (*self.sched.running, *self.sched.waiting)}
        for rid, reason in res.finished.items():
            assert rid not in live and reason in ("stop", "length")
            del self.expected[rid]
        assert {r: s.token_ids for r, s in live.items()} == self.expected

    @rule(n=st.integers(2, 8))
    def steps(self, n: int) -> None:
        """Several steps in a row: requests grow past the pool and get preempted."""
        for _ in range(n):
            self.step(abort_between=False)
            check_invariants(self.sched)

    @precondition(lambda self: bool(self.expected))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.expected)))
        ids = self.sched.abort([rid, "unknown"])
        assert ids == [rid]
        del self.expected[rid]

    @invariant()
    def invariants(self) -> None:
        if hasattr(self, "sched"):
            check_invariants(self.sched)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        if self.rng.random() < 0.5:
            ids = [s.seq_id for s in (*self.sched.running, *self.sched.waiting)]
            self.sched.abort(ids)
        else:
            # every live token computed (again, after a preemption) at one token per step
            live = (*self.sched.running, *self.sched.waiting)
            bound = 2 * sum(s.num_prompt_tokens + s.max_tokens for s in live) + 20
            for _ in range(bound):
                if not self.sched.has_unfinished():
                    break
                self.step(abort_between=False)
                check_invariants(self.sched)
        assert not self.sched.has_unfinished()
        for pool in (self.sched.block_pool, self.sched.host_pool):
            if pool is not None:  # nothing leaked in either tier
                assert pool.num_free_blocks == pool.num_usable_blocks
                assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks))


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(4, 16),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 32),
    requests=st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 24), st.integers(1, 16)),
        min_size=1,
        max_size=12,
    ),
    seed=st.integers(0, 2**16),
    caching=st.booleans(),
    num_host_blocks=st.sampled_from([0, 3, 16]),
    policy=st.sampled_from(["newest", "least_progress"]),
    order=st.sampled_from(["fcfs", "shortest-first"]),
)
def test_liveness_every_request_finishes(
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    requests: list[tuple[int, int, int]],
    seed: int,
    caching: bool,
    num_host_blocks: int,
    policy: str,
    order: str,
) -> None:
    """No aborts: staggered arrivals all finish within sum(prompt + max_tokens) steps after the
    last arrival (the request with the most computed tokens is never preempted and gains >= 1
    token a step), in either prefill order."""
    max_model_len = 48
    sched = make_scheduler(max_num_seqs, max_num_batched_tokens, block_size, max_model_len,
                           num_blocks, 0, caching, num_host_blocks, policy, order, 2)
    usable = num_blocks - 1
    arrivals: dict[int, list[SeqState]] = {}
    total = 0
    for i, (at, prompt_len, max_tokens) in enumerate(requests):
        max_tokens = min(max_tokens, usable * block_size - prompt_len, max_model_len - prompt_len)
        if max_tokens < 1:
            continue
        arrivals.setdefault(at, []).append(make_seq(f"r{i}", prompt_len, max_tokens, stop=False))
        total += prompt_len + max_tokens
    rng = random.Random(seed)
    finished: set[str] = set()
    last_arrival = max(arrivals, default=0)
    steps = 0
    while steps <= last_arrival or sched.has_unfinished():
        for seq in arrivals.get(steps, []):
            sched.add(seq)
        out = sched.schedule()
        check_plan(sched, out)
        assert out.is_empty == (not sched.has_unfinished())
        res = sched.update(out, [rng.randrange(1, 50) for _ in out.scheduled])
        check_invariants(sched)
        finished |= res.finished.keys()
        steps += 1
        assert steps <= last_arrival + total + 1, "scheduler made no progress"
    assert finished == {s.seq_id for seqs in arrivals.values() for s in seqs}
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_usable_blocks


# ------------------------------------------- the gap objective's budget (step_policy.py)

COST = StepCostModel(fixed_s=0.02, per_token_s=1e-3, per_row_s=5e-4, per_context_token_s=1e-6)


def itl_scheduler(target_s: float, max_num_batched_tokens: int = 512, buckets: bool = True,
                  **kw: object) -> Scheduler:
    """A scheduler whose steps beside decodes are planned to ``target_s`` (its gap objective
    is ``target_s / ITL_PLAN_FRACTION``; no step measured yet, so no error margin)."""
    return Scheduler(SchedulerConfig(
        64, max_num_batched_tokens, 16, 2048, 400, enable_prefix_caching=False,
        token_buckets=tuple(token_buckets(max_num_batched_tokens)) if buckets else (),
        itl_slo_s=target_s / ITL_PLAN_FRACTION,
        step_cost=StepCostModel(fixed_s=0.02, per_token_s=1e-3), **kw))


def test_itl_target_cuts_prefill_beside_decodes_to_a_bucket() -> None:
    sched = itl_scheduler(0.1)  # 0.02 + 1e-3 * T <= 0.1: T <= 80, the 64 bucket
    sched.add(make_seq("d", 10, max_tokens=50, stop=False))
    step(sched)  # nothing decodes: the whole prompt
    sched.add(make_seq("p", 1000))
    out, _ = step(sched)
    assert [(s.seq_id, len(s.token_ids)) for s in out.scheduled] == [("d", 1), ("p", 63)]
    assert out.num_scheduled_tokens == 64
    out, _ = step(sched)  # the running prompt's next chunk is cut too
    assert [(s.seq_id, len(s.token_ids)) for s in out.scheduled] == [("d", 1), ("p", 63)]
    tight = itl_scheduler(0.001)  # below a step's fixed cost: 8 tokens, filling the 16 bucket
    tight.add(make_seq("d", 10, max_tokens=50, stop=False))
    step(tight)
    tight.add(make_seq("p", 1000))
    out, _ = step(tight)
    assert [len(s.token_ids) for s in out.scheduled] == [1, 15]


def test_itl_target_gives_prefill_the_whole_budget_when_nothing_decodes() -> None:
    for buckets in (True, False):
        sched = itl_scheduler(0.001, buckets=buckets)
        for i in range(3):
            sched.add(make_seq(f"p{i}", 300))
        out, _ = step(sched)
        assert [len(s.token_ids) for s in out.scheduled] == [300, 212]
        assert out.num_scheduled_tokens == 512


def test_itl_target_off_ignores_the_cost_model() -> None:
    """itl_slo_s 0 with a cost model plans as the scheduler without one, on random
    workloads with decodes and prompts interleaved."""
    rng = random.Random(1)
    for trial in range(20):
        scheds = [itl_scheduler(0.0, 256, buckets=trial % 2 == 0)]
        scheds.append(Scheduler(dataclasses.replace(scheds[0].config, step_cost=None)))
        for n in range(60):
            if rng.random() < 0.3:
                size, out_len = rng.randrange(1, 700), rng.randrange(1, 40)
                for s in scheds:
                    s.add(make_seq(f"r{n}", size, out_len, stop=False))
            plans = [s.schedule() for s in scheds]
            assert plans[0] == plans[1]
            for s, p in zip(scheds, plans, strict=True):
                s.update(p, [7 if c.sample else None for c in p.scheduled])


def decode_shape(sched: Scheduler) -> tuple[int, int]:
    """The decode rows of the next step and the context they read (as the scheduler counts)."""
    rows = ctx = 0
    for seq in sched.running:
        num_tokens = len(seq.token_ids) + seq.num_output_placeholders  # async: + in flight
        last_pending = seq.num_output_placeholders and (
            num_tokens - seq.num_prompt_tokens >= seq.max_tokens
            or num_tokens >= sched.config.max_model_len)
        if seq.num_computed_tokens + seq.num_inflight_tokens == num_tokens - 1 and \
                num_tokens > seq.num_prompt_tokens and not last_pending:
            rows, ctx = rows + 1, ctx + num_tokens
    return rows, ctx


@settings(max_examples=150, deadline=None)
@given(
    target_ms=st.floats(1, 300),
    max_num_batched_tokens=st.sampled_from([16, 64, 100, 256]),
    max_num_seqs=st.integers(1, 8),
    requests=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 300), st.integers(1, 24)),
                      min_size=1, max_size=12),
    buckets=st.booleans(),
    async_scheduling=st.booleans(),
)
def test_itl_target_bounds_predicted_steps_and_every_prompt_finishes(
    target_ms: float, max_num_batched_tokens: int, max_num_seqs: int,
    requests: list[tuple[int, int, int]], buckets: bool, async_scheduling: bool,
) -> None:
    """With a fake cost model: a step with decodes is predicted within the target (padded to
    its bucket) unless prefill is at its minimum; steps are compiled sizes; every request
    finishes within one token a step (no prompt starves)."""
    bucket_sizes = tuple(token_buckets(max_num_batched_tokens, (1, 4), 64)) if buckets else ()
    sched = Scheduler(SchedulerConfig(
        max_num_seqs, max_num_batched_tokens, 8, 512, 300, enable_prefix_caching=False,
        token_buckets=bucket_sizes, step_overhead_tokens=8,
        itl_slo_s=target_ms * 1e-3 / ITL_PLAN_FRACTION, step_cost=COST,
        async_scheduling=async_scheduling))
    arrivals: dict[int, list[SeqState]] = {}
    total = 0
    for i, (at, prompt_len, max_tokens) in enumerate(requests):
        arrivals.setdefault(at, []).append(make_seq(f"r{i}", prompt_len, max_tokens, stop=False))
        total += prompt_len + max_tokens
    last_arrival, steps, finished, pending = max(arrivals), 0, set(), []
    while steps <= last_arrival or sched.has_unfinished() or pending:
        for seq in arrivals.get(steps, []):
            sched.add(seq)
        rows, ctx = decode_shape(sched)
        out = sched.schedule()
        n = out.num_scheduled_tokens
        if bucket_sizes and n:
            padded = bucket_sizes[bisect.bisect_left(bucket_sizes, n)]
            floor = bucket_sizes[bisect.bisect_left(bucket_sizes,
                                                    min(rows + 8, max_num_batched_tokens))]
        else:
            padded, floor = n, min(rows + 8, max_num_batched_tokens)
        if rows:
            assert COST.predict(padded, rows, ctx) <= target_ms * 1e-3 or padded <= floor
        pending.append(out)
        while pending and (not async_scheduling or len(pending) == 2
                           or not sched.has_unfinished()):  # async: update one step late
            plan = pending.pop(0)
            res = sched.update(plan, [7 if s.sample else None for s in plan.scheduled])
            finished |= res.finished.keys()
        steps += 1
        assert steps <= last_arrival + total + 2, "scheduler made no progress"
    assert finished == {s.seq_id for seqs in arrivals.values() for s in seqs}


def test_objectives_need_a_cost_model() -> None:
    cfg = SchedulerConfig.from_engine_config(EngineConfig(), 100, 256, step_cost=COST,
                                             ttft_slo_s=2.0, itl_slo_s=0.3)
    assert (cfg.ttft_slo_s, cfg.itl_slo_s, cfg.step_cost) == (2.0, 0.3, COST)
    with pytest.raises(ValueError, match="step_cost"):
        SchedulerConfig.from_engine_config(EngineConfig(), 100, 256, itl_slo_s=0.3)
    with pytest.raises(ValueError, match="ttft_slo_s"):
        SchedulerConfig.from_engine_config(EngineConfig(), 100, 256, step_cost=COST,
                                           ttft_slo_s=-1.0)
    for name in ("itl_slo_ms", "ttft_slo_ms"):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: -1.0})
