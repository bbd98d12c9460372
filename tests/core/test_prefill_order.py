"""The order prompts get a step's prefill budget (``SchedulerConfig.prefill_order``): fcfs and
shortest-first (the SLO order: tests/core/test_step_policy.py)."""

from __future__ import annotations

from jaxserve.core.scheduler import Scheduler
from tests.core.test_scheduler import by_id, make_scheduler, make_seq, step


def chunk_sizes(sched: Scheduler) -> dict[str, int]:
    out, _ = step(sched)
    return {s.seq_id: len(s.token_ids) for s in out.scheduled}


def long_then_short(order: str) -> Scheduler:
    """A 100-token prompt already chunking at 16 tokens a step, then a 10-token prompt."""
    sched = make_scheduler(max_num_batched_tokens=16, num_blocks=64, max_model_len=128,
                           prefill_order=order)
    sched.add(make_seq("long", 100))
    assert chunk_sizes(sched) == {"long": 16}
    sched.add(make_seq("short", 10))
    return sched


def test_shortest_first_prefills_a_short_prompt_before_a_long_one_already_chunking() -> None:
    sched = long_then_short("shortest-first")
    assert chunk_sizes(sched) == {"short": 10, "long": 6}  # the short one samples this step
    assert by_id(sched, "short").num_output_tokens == 1
    fcfs = long_then_short("fcfs")
    assert chunk_sizes(fcfs) == {"long": 16}  # behind the long prompt's chunks
    assert by_id(fcfs, "short").num_output_tokens == 0


def test_a_bypassed_prompt_goes_by_arrival_after_max_prefill_skips() -> None:
    """Short prompts arriving every step take the whole budget from a long one; after
    ``max_prefill_skips`` steps without prefill the long one goes first, so it progresses."""
    for max_skips in (0, 3):
        sched = make_scheduler(max_num_seqs=64, max_num_batched_tokens=8, num_blocks=256,
                               max_model_len=128, prefill_order="shortest-first",
                               max_prefill_skips=max_skips)
        sched.add(make_seq("long", 64, max_tokens=1))
        sched.add(make_seq("s0", 8, max_tokens=1))
        progress = []
        for i in range(1, 8):
            sched.add(make_seq(f"s{i}", 8, max_tokens=1))  # always one short one waiting
            progress.append(chunk_sizes(sched).get("long", 0))
        # never more than max_skips steps in a row without a chunk for the long prompt
        assert progress[max_skips] == 8 and not any(progress[:max_skips])
        assert by_id(sched, "long").num_prefill_skips >= max_skips


def test_preempted_sequences_come_back_before_shorter_prompts() -> None:
    """A preempted (recomputing) sequence was streaming: it is readmitted before a fresh
    prompt, however short."""
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                           num_blocks=8, max_model_len=32, prefill_order="shortest-first")
    sched.add(make_seq("a", 12, max_tokens=16, stop=False))
    sched.add(make_seq("b", 12, max_tokens=16, stop=False))
    for _ in range(6):  # 7 usable blocks: the two outgrow them, "b" (newest) is preempted
        step(sched)
    victim = by_id(sched, "b")
    assert victim.num_preemptions >= 1 and victim in sched.waiting
    sched.add(make_seq("tiny", 2, max_tokens=1))
    order = sched.policy.prefill_order([], sched.waiting)
    assert order[0] is victim
