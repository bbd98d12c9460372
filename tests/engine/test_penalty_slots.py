"""Penalty-state slots (``jaxserve.engine.penalty_slots``) over a fake runner: one slot per
holder, reused after release, the logit_bias row written for a biased holder and cleared for the
next unbiased one, and preempted holders released."""

from __future__ import annotations

from types import SimpleNamespace

from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.sampling_params import SamplingParams


class FakeRunner:
    num_penalty_slots = 2

    def __init__(self) -> None:
        self.bias_writes: list[tuple[int, dict]] = []

    def set_logit_bias(self, slot: int, bias: dict) -> None:
        self.bias_writes.append((slot, bias))


def _choice(rid: str, **kw):
    return SimpleNamespace(seq_id=rid, slot=-1, params=SamplingParams(**kw))


def test_slots_are_lent_and_bias_rows_kept_clean() -> None:
    runner = FakeRunner()
    slots = PenaltySlots(runner)
    a, b = _choice("a", logit_bias={3: 1.0}), _choice("b", presence_penalty=0.5)
    assert slots.acquire(a) == 0 and slots.acquire(a) == 0  # held: the same slot
    assert slots.acquire(b) == 1 and runner.bias_writes == [(0, {3: 1.0})]
    slots.release(a)
    assert a.slot == -1 and slots.free == [0] and set(slots.holders) == {1}
    c = _choice("c", frequency_penalty=0.5)
    assert slots.acquire(c) == 0 and runner.bias_writes[-1] == (0, {})  # a's bias cleared
    slots.release_all_but({"c"})
    assert b.slot == -1 and slots.holders == {0: c}
    slots.release(b)  # holds none: nothing happens
    assert sorted(slots.free) == [1]
