"""The SLO step policy (``core/step_policy.py``): the gap objective's budget, the first-token
order (Moore-Hodgson, shortest first where it keeps everyone on time, the late ones after,
promotion), and what the scheduler records for them (token times, missed objectives)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.plan import SchedulerConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import SeqState
from jaxserve.core.step_cost import StepCostModel
from jaxserve.core.step_policy import (
    ITL_PLAN_FRACTION,
    LATE_PROMOTION_SLOS,
    LOST_STREAM_GAP_SLOS,
    StepPolicy,
)
from jaxserve.device.buckets import token_buckets

COST = StepCostModel(fixed_s=0.02, per_token_s=1e-3)  # a 100-token step: 0.12 s


def slo_config(ttft_s: float = 2.0, itl_s: float = 0.3, max_tokens: int = 512,
               buckets: tuple[int, ...] = (), **kw: object) -> SchedulerConfig:
    return SchedulerConfig(64, max_tokens, 16, 4096, 2000, enable_prefix_caching=False,
                           token_buckets=buckets, step_cost=COST, ttft_slo_s=ttft_s,
                           itl_slo_s=itl_s, prefill_order="slo", **kw)


def seq(sid: str, prompt_len: int, arrival: float, max_tokens: int = 8) -> SeqState:
    return SeqState(sid, [5] * prompt_len, prompt_len, max_tokens, arrival_time=arrival)


def decoding(sched: Scheduler, n: int, now: float = 0.0) -> None:
    """``n`` one-token prompts, run one step: they all decode from then on."""
    for i in range(n):
        sched.add(seq(f"d{i}", 1, now, max_tokens=100))
    plan = sched.schedule(now)
    sched.update(plan, [7] * len(plan.scheduled), now=now + 0.05)


# ------------------------------------------------------------------------------- the budget


def test_the_budget_plans_the_step_to_the_gap_objective_less_its_margin() -> None:
    """4 streams decode: 0.02 + 1e-3 * T within 0.9 * 0.3 s gives T = 250 (no buckets); a
    stream that missed its first token frees the step to 1.5 * 0.3 s; nothing decoding, all."""
    sched = Scheduler(slo_config())
    assert sched.policy.prefill_budget(sched.running, 0.0) == 512  # nothing decodes
    decoding(sched, 4)
    target = 0.3 * ITL_PLAN_FRACTION
    assert sched.policy.prefill_budget(sched.running, 0.1) == int((target - 0.02) / 1e-3) - 4
    for s in sched.running:  # every stream got its first token 2.5 s after arriving
        s.first_token_time = s.arrival_time + 2.5
    lost = 0.3 * LOST_STREAM_GAP_SLOS
    assert sched.policy.prefill_budget(sched.running, 3.0) == min(
        512, int((lost - 0.02) / 1e-3) - 4)


def test_the_margin_follows_the_measured_error() -> None:
    """Steps measured at twice their prediction halve the step the objective allows."""
    sched = Scheduler(slo_config())
    decoding(sched, 4)
    before = sched.policy.prefill_budget(sched.running, 0.1)
    plan = sched.schedule(0.1)
    for _ in range(64):
        sched.observe_step(plan, 8, 2 * sched.predict_step_s(plan, 8))
    after = sched.policy.prefill_budget(sched.running, 0.2)
    assert after < before
    # the refitted model now predicts this step right: the margin is the error of the steps
    # since, and the budget is what the refitted model allows within 0.9 * 0.3 s
    assert sched.policy.step_cost.per_token_s > COST.per_token_s


def test_without_a_gap_objective_prefill_gets_the_whole_budget() -> None:
    sched = Scheduler(slo_config(itl_s=0.0))
    decoding(sched, 4)
    assert sched.policy.prefill_budget(sched.running, 0.1) == 512


# -------------------------------------------------------------------------------- the order


def order(policy: StepPolicy, seqs: list[SeqState], now: float) -> list[str]:
    for i, s in enumerate(seqs):
        s.arrival_index = i
    return [s.seq_id for s in policy.prefill_order([], seqs, now)]


def test_shortest_first_while_everyone_stays_on_time() -> None:
    """Three prompts, 1000 tokens a second: shortest first keeps all within 2 s."""
    policy = StepPolicy(slo_config())
    policy._rate = 1000.0
    seqs = [seq("a", 900, 0.0), seq("b", 300, 0.1), seq("c", 100, 0.2)]
    assert order(policy, seqs, 0.3) == ["c", "b", "a"]


def test_deadline_order_where_shortest_first_would_make_one_late() -> None:
    """a (1600 tokens, arrived at 0) meets 2 s only if it goes first; shortest first would
    finish it at 2.1 s: the deadline order keeps all three on time (1.7, 1.9, 2.1 s)."""
    policy = StepPolicy(slo_config())
    policy._rate = 1000.0
    seqs = [seq("a", 1600, 0.0), seq("b", 200, 0.1), seq("c", 200, 0.2)]
    assert order(policy, seqs, 0.1) == ["a", "b", "c"]


def test_moore_hodgson_sets_the_longest_aside_when_a_deadline_cannot_be_met() -> None:
    """a (1800) and b (300) and c (300), all arriving at 0, 1000 tokens a second: all three
    cannot finish within 2 s; setting a aside keeps b and c on time; a follows them."""
    policy = StepPolicy(slo_config())
    policy._rate = 1000.0
    seqs = [seq("a", 1800, 0.0), seq("b", 300, 0.0), seq("c", 300, 0.0)]
    assert order(policy, seqs, 0.0) == ["b", "c", "a"]


def test_late_prompts_follow_shortest_first_and_the_overdue_go_first() -> None:
    policy = StepPolicy(slo_config())
    policy._rate = 1000.0
    now = 10.0
    seqs = [seq("old", 500, now - 2.0 * LATE_PROMOTION_SLOS - 0.1),  # overdue: first
            seq("late-long", 800, now - 2.5), seq("late-short", 100, now - 2.1),
            seq("fresh", 700, now)]
    assert order(policy, seqs, now) == ["old", "fresh", "late-short", "late-long"]


def test_preempted_streams_come_first() -> None:
    policy = StepPolicy(slo_config())
    policy._rate = 1000.0
    victim = seq("victim", 400, 0.0)
    victim.num_preemptions = 1
    seqs = [seq("a", 10, 0.5), victim]
    assert order(policy, seqs, 0.5) == ["victim", "a"]


def test_without_a_first_token_objective_slo_is_shortest_first() -> None:
    policy = StepPolicy(slo_config(ttft_s=0.0))
    seqs = [seq("a", 900, 0.0), seq("b", 300, 0.1), seq("c", 100, 0.2)]
    assert order(policy, seqs, 100.0) == ["c", "b", "a"]


# -------------------------------------------------------------- what the scheduler records


def test_update_records_token_times_and_the_objectives_missed() -> None:
    sched = Scheduler(slo_config())
    sched.add(seq("a", 8, 1.0, max_tokens=10))
    plan = sched.schedule(1.0)
    sched.update(plan, [7], now=2.5)  # first token 1.5 s after arrival: on time
    a = sched.running[0]
    assert (a.first_token_time, a.last_token_time, a.max_gap_s) == (2.5, 2.5, 0.0)
    assert not sched.policy.missed(a, 2.5)
    sched.update(sched.schedule(2.5), [7], now=2.9)  # a 0.4 s gap: over 0.3
    assert a.max_gap_s == pytest.approx(0.4) and sched.policy.missed(a, 2.9)
    b = seq("b", 8, 0.0)
    assert not sched.policy.missed(b, 1.9) and sched.policy.missed(b, 2.1)  # still waiting


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.floats(0, 5), st.integers(1, 600), st.integers(1, 30)),
                      min_size=1, max_size=16),
    ttft_s=st.sampled_from([0.2, 1.0, 2.0]),
)
def test_every_prompt_finishes_under_the_slo_policy(
        arrivals: list[tuple[float, int, int]], ttft_s: float) -> None:
    """Prompts arriving over 5 s on a slow modelled machine (the late ones pile up): each
    finishes, and none waits for its first token longer than the promotion bound plus the
    time to prefill every prompt that arrived by then."""
    buckets = tuple(token_buckets(256, (1, 4), 64))
    sched = Scheduler(slo_config(ttft_s, 0.3, 256, buckets))
    pending = sorted((t, i, n, m) for i, (t, n, m) in enumerate(arrivals))
    now = 0.0
    first: dict[str, float] = {}
    total = sum(n + m for _, n, m in arrivals)
    for _ in range(total + 100):
        while pending and pending[0][0] <= now:
            t, i, n, m = pending.pop(0)
            sched.add(seq(f"r{i}", n, t, max_tokens=m))
        if not sched.has_unfinished():
            if not pending:
                break
            now = pending[0][0]
            continue
        plan = sched.schedule(now)
        now += COST.predict(plan.num_scheduled_tokens)
        res = sched.update(plan, [7 if c.sample else None for c in plan.scheduled], now=now)
        for sid in res.new_token_ids:
            first.setdefault(sid, now)
    assert not sched.has_unfinished() and not pending
    work_s = COST.predict(sum(n for _, n, _ in arrivals)) + len(arrivals) * COST.fixed_s
    for i, (t, _, _) in enumerate(arrivals):
        assert first[f"r{i}"] - t <= LATE_PROMOTION_SLOS * ttft_s + work_s + 1.0
