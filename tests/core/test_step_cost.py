"""The step-cost model: its fit on synthetic step traces, and the prefill budget it gives."""

from __future__ import annotations

import bisect
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.step_cost import (
    OnlineStepCost,
    StepCostModel,
    StepSample,
    prefill_pairs,
    prefill_token_budget,
)
from jaxserve.device.buckets import token_buckets

MODEL = StepCostModel(fixed_s=0.02, per_token_s=1e-3, per_row_s=5e-4, per_context_token_s=2e-6)


def test_fit_recovers_known_coefficients() -> None:
    rng = random.Random(0)
    samples = []
    for _ in range(200):
        rows = rng.randrange(0, 64)
        n = rng.choice(token_buckets(1024, (1, 4), 64))
        n = max(n, rows)
        ctx = sum(rng.randrange(1, 2048) for _ in range(rows))
        noise = rng.gauss(0, 1e-5)
        samples.append(StepSample(n, rows, ctx, MODEL.predict(n, rows, ctx) + noise))
    got = StepCostModel.fit(samples)
    assert got.fixed_s == pytest.approx(MODEL.fixed_s, abs=1e-5)
    assert got.per_token_s == pytest.approx(MODEL.per_token_s, rel=1e-3)
    assert got.per_row_s == pytest.approx(MODEL.per_row_s, rel=2e-2)
    assert got.per_context_token_s == pytest.approx(MODEL.per_context_token_s, rel=2e-2)
    exact = StepCostModel.fit(StepSample(s.num_tokens, s.num_decode_rows, s.num_context_tokens,
                                         MODEL.predict(s.num_tokens, s.num_decode_rows,
                                                       s.num_context_tokens))
                              for s in samples)
    for name in ("fixed_s", "per_token_s", "per_row_s", "per_context_token_s"):
        assert getattr(exact, name) == pytest.approx(getattr(MODEL, name), rel=1e-6)


def test_fit_refuses_samples_that_do_not_determine_the_model() -> None:
    prefill_only = [StepSample(n, 0, 0, MODEL.predict(n)) for n in (8, 16, 32, 64)]
    with pytest.raises(ValueError, match="term 2"):
        StepCostModel.fit(prefill_only)
    with pytest.raises(ValueError, match="do not determine"):
        StepCostModel.fit([])


def test_prior_is_the_step_overhead_in_prompt_tokens() -> None:
    prior = StepCostModel.prior(32, 0.75e-3)
    assert prior.predict(0) == pytest.approx(0.024)
    assert prior.predict(64, 10, 5000) == pytest.approx(0.072)
    with pytest.raises(ValueError, match="prompt_token_s"):
        StepCostModel.prior(32, 0.0)


BUCKETS = (1, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512)


def test_budget_is_the_largest_bucket_within_the_target_less_the_decodes() -> None:
    model = StepCostModel(fixed_s=0.02, per_token_s=1e-3)
    # 0.02 + 1e-3 * T <= 0.1 for T <= 80: the 64 bucket, of which 3 decode rows
    assert prefill_token_budget(model, 0.1, 3, 300, 512, BUCKETS) == 61
    # without buckets every size is one: 80
    assert prefill_token_budget(model, 0.1, 3, 300, 512) == 77
    # a target below one step's fixed cost: the minimum, 8 tokens, filling the bucket (16)
    assert prefill_token_budget(model, 0.001, 3, 300, 512, BUCKETS) == 13
    # a loose target: the whole budget; a full one: nothing
    assert prefill_token_budget(model, 10.0, 3, 300, 512, BUCKETS) == 509
    assert prefill_token_budget(model, 0.001, 512, 9000, 512, BUCKETS) == 0


@settings(max_examples=300, deadline=None)
@given(
    fixed_ms=st.floats(0, 50), token_us=st.floats(0, 2000), row_us=st.floats(0, 1000),
    target_ms=st.floats(0.1, 500), rows=st.integers(1, 64), ctx_per_row=st.integers(1, 4096),
    max_tokens=st.sampled_from([8, 64, 100, 512, 1024]), bucketed=st.booleans(),
)
def test_budget_keeps_the_padded_step_within_the_target_or_at_the_minimum(
    fixed_ms: float, token_us: float, row_us: float, target_ms: float, rows: int,
    ctx_per_row: int, max_tokens: int, bucketed: bool,
) -> None:
    model = StepCostModel(fixed_ms * 1e-3, token_us * 1e-6, row_us * 1e-6, 1e-7)
    rows = min(rows, max_tokens)
    buckets = tuple(token_buckets(max_tokens, (1, 4), 64)) if bucketed else ()
    got = prefill_token_budget(model, target_ms * 1e-3, rows, rows * ctx_per_row, max_tokens,
                               buckets)
    size = rows + got
    assert 0 <= got and size <= max_tokens
    if buckets:  # the step the device runs: the smallest bucket holding it
        assert size == max_tokens or size in buckets or got == 0
        padded = buckets[bisect.bisect_left(buckets, size)]
        floor = buckets[bisect.bisect_left(buckets, min(rows + 8, max_tokens))]
    else:
        padded, floor = size, min(rows + 8, max_tokens)
    assert (model.predict(padded, rows, rows * ctx_per_row) <= target_ms * 1e-3 + 1e-12
            or padded <= floor)
    assert got >= min(8, max_tokens - rows)  # prompts always progress


# -- fitting toward a prior, online -----------------------------------------------------------


def test_fit_toward_a_prior_keeps_unmeasured_terms_and_follows_measured_ones() -> None:
    """Prefill-only steps determine the fixed and per-token terms, not the decode ones: those
    stay at the prior instead of making the fit singular."""
    prior = StepCostModel(fixed_s=0.03, per_token_s=2e-3, per_row_s=1e-4,
                          per_context_token_s=1e-6)
    prefill_only = [StepSample(n, 0, 0, MODEL.predict(n)) for n in (8, 16, 32, 64, 128) * 20]
    got = StepCostModel.fit(prefill_only, prior=prior)
    assert got.per_row_s == pytest.approx(prior.per_row_s, rel=1e-6)
    assert got.per_context_token_s == pytest.approx(prior.per_context_token_s, rel=1e-6)
    assert got.fixed_s == pytest.approx(MODEL.fixed_s, rel=0.05)
    assert got.per_token_s == pytest.approx(MODEL.per_token_s, rel=0.05)
    empty = StepCostModel.fit([], prior=prior)
    for name in ("fixed_s", "per_token_s", "per_row_s", "per_context_token_s"):
        assert getattr(empty, name) == pytest.approx(getattr(prior, name), rel=1e-9)


def test_fit_toward_a_prior_clips_negative_terms_and_refuses_a_free_token() -> None:
    prior = StepCostModel.prior(32, 0.75e-3)
    falling = [StepSample(n, 0, 0, 0.5 - 1e-3 * n) for n in (8, 64, 128, 256) * 10]
    assert StepCostModel.fit(falling, prior=prior) == prior  # tokens cannot cost < 0
    noisy_rows = [StepSample(64, r, 0, 0.1 - 1e-3 * r) for r in range(1, 40)]
    assert StepCostModel.fit(noisy_rows, prior=prior).per_row_s == 0.0


def test_online_fit_refits_every_k_steps_over_its_window() -> None:
    prior = StepCostModel.prior(32, 0.75e-3)
    online = OnlineStepCost(prior, window=64, refit_every=8, refit_after_s=100.0)
    rng = random.Random(1)
    for i in range(7):
        assert online.observe(StepSample(64, 4, 400, 1.0)) is None
    assert online.model == prior
    assert online.observe(StepSample(64, 4, 400, 0.0)) is None  # not a measurement: ignored
    for _ in range(200):
        n, rows = rng.choice(BUCKETS), rng.randrange(0, 32)
        ctx = rows * rng.randrange(1, 500)
        online.observe(StepSample(max(n, rows), rows, ctx, MODEL.predict(max(n, rows), rows,
                                                                            ctx)))
    assert len(online.samples) == 64  # the window: the seven 1-second steps are gone
    assert online.model.per_token_s == pytest.approx(MODEL.per_token_s, rel=0.1)
    assert online.model.fixed_s == pytest.approx(MODEL.fixed_s, rel=0.1)
    with pytest.raises(ValueError, match="refit_every"):
        OnlineStepCost(prior, refit_every=0)
    # long steps (a long prompt's chunks) bring the fit sooner: after 1 s of them, not 32
    quick = OnlineStepCost(prior, refit_every=32, refit_after_s=1.0)
    assert quick.observe(StepSample(256, 1, 300, 0.6)) is None
    assert quick.observe(StepSample(256, 1, 300, 0.6)) is not None
    assert quick.observe(StepSample(1, 1, 300, 0.04)) is None  # the count starts again


def test_the_online_model_keeps_its_recent_error() -> None:
    """Each observed step's measured / predicted ratio, against the model of its time: the
    quantiles the gap objective's margin is planned with (1.0 until enough steps)."""
    online = OnlineStepCost(MODEL, window=100, refit_every=10**6, refit_after_s=1e9)
    assert online.error_quantile(0.95) == 1.0
    for i in range(100):  # steps 0.8x .. 1.79x their prediction
        predicted = MODEL.predict(64, 4, 400)
        online.observe(StepSample(64, 4, 400, predicted * (0.8 + 0.01 * i)))
    assert online.error_quantile(0.5) == pytest.approx(1.3)
    assert online.error_quantile(0.95) == pytest.approx(1.75)
    assert online.error_quantile(1.0) == pytest.approx(1.79)
    # no step had a prompt chunk: the prefill quantile is that of all steps
    assert online.error_quantile(0.95, prefill=True) == pytest.approx(1.75)


def test_the_prefill_error_is_that_of_the_steps_with_a_prompt_chunk() -> None:
    """Short decode-only steps jitter more, relatively, than the steps a prefill budget plans:
    ``prefill=True`` reads only the steps with prefill pairs, once there are enough of them."""
    online = OnlineStepCost(MODEL, window=200, refit_every=10**6, refit_after_s=1e9)
    decode = MODEL.predict(8, 8, 800)
    mixed = MODEL.predict(256, 4, 800, 20_000)
    for i in range(100):
        online.observe(StepSample(8, 8, 800, decode * (1.0 + 0.01 * i)))  # 1.0x .. 1.99x
        if i < 31:
            online.observe(StepSample(256, 4, 800, mixed * 1.1, num_prefill_pairs=20_000))
    assert online.error_quantile(0.95, prefill=True) == online.error_quantile(0.95)  # 31 < 32
    online.observe(StepSample(256, 4, 800, mixed * 1.1, num_prefill_pairs=20_000))
    assert online.error_quantile(0.95, prefill=True) == pytest.approx(1.1)
    assert online.error_quantile(0.95) > 1.7


def test_a_long_prompts_later_chunks_get_fewer_tokens_and_the_fit_learns_why() -> None:
    """The pairs of a chunk's attention grow with its start: the budget shrinks as a long
    prompt progresses, and a fit on such steps recovers the per-pair cost."""
    truth = StepCostModel(fixed_s=0.02, per_token_s=1e-3, per_prefill_pair_s=2e-8)
    budgets = [prefill_token_budget(truth, 0.15, 1, 100, 512, BUCKETS, prefill_start=start)
               for start in (0, 1000, 3000)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    for start, b in zip((0, 1000, 3000), budgets, strict=True):
        n = b + 1  # the bucket the step fills
        assert truth.predict(n, 1, 100, prefill_pairs(b, start)) <= 0.15 or b <= 8
    samples = [StepSample(n, 0, 0, truth.predict(n, 0, 0, prefill_pairs(n, s)),
                          prefill_pairs(n, s))
               for n in (16, 48, 128, 256) for s in (0, 500, 2000, 3500)]
    got = StepCostModel.fit(samples, prior=StepCostModel.prior(32, 0.75e-3))
    assert got.per_prefill_pair_s == pytest.approx(2e-8, rel=0.05)
    assert StepCostModel.fit([StepSample(n, r, c, truth.predict(n, r, c)) for n, r, c in (
        (8, 1, 50), (16, 2, 30), (64, 3, 400), (128, 9, 100), (32, 30, 9000))]
                             ).per_prefill_pair_s == 0.0  # no chunk past 0: no pair term
    assert prefill_pairs(4, 10) == 4 * 10 + 10  # keys 11, 12, 13, 14


def test_fit_predicts_small_steps_beside_large_ones_and_ignores_stalls() -> None:
    """Decode steps of tens of ms beside prefill steps of seconds, each off by up to 5%, and
    one step in twenty stalled to 5x (a page fault, another process): the fit is in relative
    error and leaves the stalls out, so the decode steps an ITL target is about are predicted
    to within 10%, and the prefill steps too."""
    truth = StepCostModel(fixed_s=0.03, per_token_s=1.4e-3, per_row_s=2e-4,
                          per_context_token_s=5e-6)
    rng = random.Random(2)
    samples = []
    for i in range(400):
        if i % 3:
            rows, n = (r := rng.choice((1, 16, 64))), r
        else:
            rows, n = rng.randrange(0, 60), rng.choice((256, 1024))
        ctx = rows * rng.randrange(100, 400)
        seconds = truth.predict(n, rows, ctx) * rng.uniform(0.95, 1.05)
        samples.append(StepSample(n, rows, ctx, seconds * (5 if i % 20 == 7 else 1)))
    got = StepCostModel.fit(samples, prior=StepCostModel.prior(32, 0.75e-3))
    for n, rows, ctx in ((1, 1, 300), (16, 16, 4000), (64, 64, 16000), (1024, 30, 6000)):
        assert got.predict(n, rows, ctx) == pytest.approx(truth.predict(n, rows, ctx), rel=0.1)


def test_a_long_prompts_late_chunks_are_learned_not_dropped_as_outliers() -> None:
    """Mostly one-row decode steps, and a 3000-token prompt in 255-token chunks beside them
    whose attention makes the last chunk ~3x the first: the fit prices the pairs, so the late
    chunks are predicted, instead of being left out as misses of a model that had not
    learned them (which kept the pair term at 0 on a real trace)."""
    truth = StepCostModel(fixed_s=0.035, per_token_s=1.4e-3, per_row_s=1e-3,
                          per_context_token_s=2e-6, per_prefill_pair_s=1.2e-6)
    rng = random.Random(3)
    samples = []
    for i in range(400):
        ctx = 64 + i
        samples.append(StepSample(1, 1, ctx, truth.predict(1, 1, ctx) * rng.uniform(0.95, 1.05)))
    for start in range(0, 3000, 255):
        pairs = prefill_pairs(255, start)
        samples.append(StepSample(256, 1, 500, truth.predict(256, 1, 500, pairs)
                                  * rng.uniform(0.95, 1.05), pairs))
    prior = StepCostModel.prior(32, 0.75e-3)  # knows nothing of pairs
    got = StepCostModel.fit(samples, prior=prior)
    late = prefill_pairs(255, 2805)
    assert truth.predict(256, 1, 500, late) > 2.5 * truth.predict(256, 1, 500, 0)
    assert got.predict(256, 1, 500, late) == pytest.approx(truth.predict(256, 1, 500, late),
                                                           rel=0.15)
