"""The order prompts get a step's prefill budget (``SchedulerConfig.prefill_order``), and the
automatic ITL target's budget beside many decodes."""

from __future__ import annotations

import dataclasses

from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import SeqState
from jaxserve.core.step_cost import AUTO_ITL_DECODE_RATIO, StepCostModel
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


def test_automatic_target_lets_prefill_stretch_a_long_decode_step() -> None:
    """With 40 decodes the automatic rule lets a step grow to the 256 bucket (the decodes
    plus a 128-token chunk pad to it: 20 + 256 ms), where a fixed 50 ms target leaves
    prompts only their minimum chunk."""
    cost = StepCostModel(fixed_s=0.02, per_token_s=1e-3)

    def budget(ratio: float) -> int:
        sched = make_scheduler(max_num_seqs=64, max_num_batched_tokens=256, num_blocks=256,
                               max_model_len=64)
        sched = Scheduler(dataclasses.replace(
            sched.config, itl_target_s=0.05, itl_decode_ratio=ratio, step_cost=cost,
            token_buckets=(1, 4, 8, 16, 32, 48, 64, 128, 256)))
        for i in range(40):
            sched.add(make_seq(f"d{i}", 1, max_tokens=8))
        step(sched)  # 40 one-token prompts: all decode from now on
        sched.add(SeqState("p", [5] * 60, 60, 1))
        return sched.policy.prefill_budget(sched.running, len(sched.waiting))

    assert budget(0.0) == 8  # over the fixed target already: the minimum, filling the 48 bucket
    assert budget(AUTO_ITL_DECODE_RATIO) == 256 - 40


def test_automatic_target_scales_with_the_batch_queued_prompts_will_join() -> None:
    """Four streams decoding and 60 prompts queued: the target is that of the 64-row batch
    the queue forms (the streams see its steps once the prompts are in), not of 4 rows."""
    cost = StepCostModel(fixed_s=0.02, per_token_s=1e-3, per_row_s=3e-3)

    def budget(num_queued: int) -> int:
        sched = make_scheduler(max_num_seqs=64, max_num_batched_tokens=512, num_blocks=512,
                               max_model_len=64)
        sched = Scheduler(dataclasses.replace(
            sched.config, itl_target_s=0.05, itl_decode_ratio=AUTO_ITL_DECODE_RATIO,
            step_cost=cost, token_buckets=(1, 4, 8, 16, 32, 64, 128, 256, 512)))
        for i in range(4):
            sched.add(make_seq(f"d{i}", 1, max_tokens=8))
        step(sched)
        for i in range(num_queued):
            sched.add(SeqState(f"p{i}", [5] * 60, 60, 1))
        return sched.policy.prefill_budget(sched.running, len(sched.waiting))

    # 5 rows: a 128-token chunk beside them fills the 256 bucket, 291 ms; 4 decodes + 252
    # prompt tokens are predicted at 288 ms
    assert budget(1) == 256 - 4
    # 64 rows: twice their decode step (2 x 276 ms) lets the step reach the 512 bucket (544 ms)
    assert budget(60) == 512 - 4
    assert budget(200) == 512 - 4  # the batch is capped at max_num_seqs
