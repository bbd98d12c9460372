"""The runner's penalty-state rows, lent to the running choices that use penalties or a
logit_bias.

A choice takes a slot when it is first scheduled and gives it back when it finishes, is aborted
or is preempted (it restarts at position 0, where a fresh slot is reset), so holders never
outnumber ``num_penalty_slots`` (``max_num_seqs``). A slot's logit_bias row is written for a
holder with a bias and cleared for the next holder without one.
"""

from __future__ import annotations

from collections.abc import Container

from jaxserve.device.runner import ModelRunner
from jaxserve.engine.request_state import Choice


class PenaltySlots:
    """Slots ``0 .. runner.num_penalty_slots - 1`` and who holds them.

    Args:
      runner: the runner whose penalty state and logit_bias rows the slots index.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self.free = list(range(runner.num_penalty_slots - 1, -1, -1))  # popped from the end
        self.holders: dict[int, Choice] = {}
        self._biased: set[int] = set()  # slots whose bias row is not all zeros

    def acquire(self, choice: Choice) -> int:
        """The slot ``choice`` holds, taking a free one (bias row set) if it holds none."""
        if choice.slot < 0:
            choice.slot = self.free.pop()  # never empty: slots >= running >= holders
            self.holders[choice.slot] = choice
            if choice.params.logit_bias:
                self._runner.set_logit_bias(choice.slot, choice.params.logit_bias)
                self._biased.add(choice.slot)
            elif choice.slot in self._biased:
                self._runner.set_logit_bias(choice.slot, {})
                self._biased.discard(choice.slot)
        return choice.slot

    def release(self, choice: Choice) -> None:
        """Give back ``choice``'s slot, if it holds one."""
        if choice.slot >= 0:
            del self.holders[choice.slot]
            self.free.append(choice.slot)
            choice.slot = -1

    def release_all_but(self, running: Container[str]) -> None:
        """Give back the slots of the holders whose sequence id is not in ``running``."""
        for choice in [c for c in self.holders.values() if c.seq_id not in running]:
            self.release(choice)
