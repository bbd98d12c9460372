"""Start-up calibration of the step-cost model: timed probe steps on the padding block."""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.core.step_cost import StepCostModel, StepSample
from jaxserve.device.runner import ModelRunner


def calibrate(runner: ModelRunner, prior: StepCostModel, max_model_len: int,
              sizes: Sequence[int] = (1, 128), repeats: int = 2) -> StepCostModel:
    """Time a prompt step of each of ``sizes`` tokens ``repeats`` times on the padding block
    (``ModelRunner.probe``) and fit the step-cost model to the fastest of each, toward
    ``prior`` (``StepCostModel.fit``).

    Each size is clamped to what the runner can probe (its largest bucket, below
    ``max_model_len``), then lowered to the largest usable bucket at most that size, so that no
    probe pads up while programs still compile after ready (``StepPacker.usable``: 128 becomes
    64 then, on the CPU's ready buckets).
    """
    most = min(max(b.num_tokens for b in runner.buckets), max_model_len - 1)
    usable = [b.num_tokens for b in runner.usable_buckets]
    sizes = {max([t for t in usable if t <= n], default=n)
             for n in (max(1, min(n, most)) for n in sizes)}
    samples = []
    for n in sorted(sizes):
        seconds, padded = min(runner.probe(n) for _ in range(repeats))
        samples.append(StepSample(padded, 0, 0, seconds))
    return StepCostModel.fit(samples, prior=prior)
