"""The predicted time of one step, and the prefill budget that keeps a step within a target.

While a sequence decodes, every prompt token planned beside it lengthens the step its next
token waits for. Sarathi-Serve (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM
Inference with Sarathi-Serve", OSDI 2024: stall-free batching) sizes the prefill chunks of a
step so the step stays within a latency target; vLLM's chunked prefill gives prefill what a
fixed token budget leaves after the decodes. Here the budget comes from a linear model of a
step's time::

    seconds = fixed_s + per_token_s * num_tokens + per_row_s * num_decode_rows
              + per_context_token_s * num_context_tokens
              + per_prefill_pair_s * num_prefill_pairs

``num_tokens`` is the step's padded size (the compiled token bucket: the device computes every
padded token, so a prompt token costs through the bucket it fills), ``num_decode_rows`` the
sequences decoding one token, ``num_context_tokens`` the K/V tokens those rows' attention reads
(their context lengths), ``num_prefill_pairs`` the query-key pairs of the prompt chunks'
attention (a chunk of ``c`` tokens from position ``s``: ``c * (s + (c + 1) / 2)``), which
grow with a long prompt's progress: on the project's 2-core AVX2 CPU a 47-token chunk of a
3000-token prompt took 30 ms at its start and 210 ms near its end.

The step policy (``core.step_policy``) calls ``prefill_token_budget`` while streams decode under
a gap objective. The engine starts from the platform's prior (``StepCostModel.prior``) and keeps
the model current with ``OnlineStepCost``: every measured step is a sample (and its measured /
predicted ratio, the model's error), and the model is refitted over a window of
recent steps by least squares pulled toward the prior (ridge regression), so a term the
traffic has not varied yet (no decode rows, one bucket) keeps its prior value instead of
making the fit singular. ``fit_bucket`` weighs a padded step against a second one, in prompt
tokens of compute (the platform's ``step_overhead_tokens``).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from jaxserve.config import MIN_PREFILL_TOKENS

NUM_TERMS = 5  # fixed, per token, per decode row, per context token, per prefill pair
# a typical size of each term's variable (1, tokens, decode rows, context tokens): the ridge
# penalty of a fit toward a prior is measured in these units, so it weighs the terms alike
TERM_SCALES = (1.0, 128.0, 8.0, 2048.0, 128.0 * 2048.0)


class Chunk(Protocol):
    """What ``fit_bucket`` reads of a scheduled chunk (``scheduler.ScheduledSeq``, a frozen
    dataclass it rebuilds with ``dataclasses.replace``)."""

    token_ids: tuple[int, ...]
    sample: bool


@dataclass(frozen=True)
class StepSample:
    """One measured step: its shape and its wall time in seconds."""

    num_tokens: int  # the padded (bucket) token count
    num_decode_rows: int
    num_context_tokens: int
    seconds: float
    num_prefill_pairs: int = 0


def prefill_pairs(num_tokens: int, start_pos: int) -> int:
    """Query-key pairs of a prompt chunk's attention: ``num_tokens`` tokens from ``start_pos``
    (causal: the ``i``-th reads ``start_pos + i + 1`` keys)."""
    return num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class StepCostModel:
    """A step's predicted seconds, linear in its shape (module docstring); coefficients in s."""

    fixed_s: float
    per_token_s: float
    per_row_s: float = 0.0
    per_context_token_s: float = 0.0
    per_prefill_pair_s: float = 0.0

    @classmethod
    def prior(cls, step_overhead_tokens: int, prompt_token_s: float,
              prefill_pair_s: float = 0.0) -> StepCostModel:
        """The model before any step is measured: a step's fixed cost is
        ``step_overhead_tokens`` prompt tokens (``Platform.step_overhead_tokens``) of
        ``prompt_token_s`` seconds each, a prompt chunk's attention ``prefill_pair_s`` a
        query-key pair (``Platform.prefill_pair_s``); rows and context cost nothing extra.

        Raises:
          ValueError: a negative overhead or pair cost, or a per-token cost that is not > 0.
        """
        if step_overhead_tokens < 0 or not prompt_token_s > 0 or not prefill_pair_s >= 0:
            raise ValueError(f"StepCostModel.prior: {step_overhead_tokens=} and "
                             f"{prefill_pair_s=} must be >= 0 and {prompt_token_s=} > 0")
        return cls(fixed_s=step_overhead_tokens * prompt_token_s, per_token_s=prompt_token_s,
                   per_prefill_pair_s=prefill_pair_s)

    def predict(self, num_tokens: int, num_decode_rows: int = 0,
                num_context_tokens: int = 0, num_prefill_pairs: int = 0) -> float:
        """Predicted seconds of a step padded to ``num_tokens`` tokens."""
        return (self.fixed_s + self.per_token_s * num_tokens + self.per_row_s * num_decode_rows
                + self.per_context_token_s * num_context_tokens
                + self.per_prefill_pair_s * num_prefill_pairs)

    @classmethod
    def fit(cls, samples: Iterable[StepSample], prior: StepCostModel | None = None,
            prior_weight: float = 1e-3) -> StepCostModel:
        """Least-squares fit of the coefficients to measured steps, in relative error (each
        step weighs ``1 / seconds``: a 30 ms decode step mispredicted by 20 ms matters as much
        to an ITL target as a 1.5 s prefill step mispredicted by 1 s), with non-negative
        coefficients (a step does not get cheaper with more work: a term whose free fit is
        negative is held at 0 and the rest refitted, the active-set method of Lawson and
        Hanson, "Solving Least Squares Problems", 1974, ch. 23, one term at a time), and once
        more without the steps that took more than ``STALL_RATIO`` times the first fit's
        prediction (a step stalled by something outside the engine: a page fault, another
        process). Normal equations, solved in plain Python: ``core`` imports neither
        jax nor numpy. Without a prior, samples whose prompt chunks all start at 0 leave
        ``per_prefill_pair_s`` at 0 (their pairs vary with their tokens alone); a prior keeps
        it at the prior's value instead.

        With ``prior``, a ridge fit: each coefficient is pulled toward the prior's with
        ``prior_weight`` times the weight the steps give it, plus ``PRIOR_FLOOR`` times the
        count of steps whose variable is its ``TERM_SCALES`` size and whose time is the median
        step's, so measured terms follow the data and unmeasured ones stay at the prior. A fit whose per-token cost is not > 0
        returns the prior.

        Raises:
          ValueError: without a prior, samples that do not determine every coefficient (fewer
            than four distinct shapes, or a term that never varies independently, e.g. no
            decode rows at all).
        """
        rows = [((1.0, float(s.num_tokens), float(s.num_decode_rows),
                  float(s.num_context_tokens), float(s.num_prefill_pairs)), float(s.seconds))
                for s in samples]
        n = NUM_TERMS
        if prior is None and not any(x[4] for x, _ in rows):
            n = NUM_TERMS - 1  # no prompt chunk past position 0: no pair term
        coef = _fit_rows(rows, n, prior, prior_weight)
        if coef is not None:  # once more without the stalled steps
            kept = [(x, y) for x, y in rows if y <= STALL_RATIO * _dot(coef, x)]
            if 0 < len(kept) < len(rows):
                coef = _fit_rows(kept, n, prior, prior_weight)
        if prior is None:
            return cls(*coef)
        fitted = cls(*coef) if coef is not None else prior
        return fitted if fitted.per_token_s > 0 else prior


# a step that took more than this many times the first fit's prediction is a stall, left out of
# the second fit (``StepCostModel.fit``). Not a bound on the relative miss: the steps a model
# misses most are often the ones it has not learned yet (a long prompt's late chunks, whose
# attention the pair term prices: 0.55-1.5 s against one prediction of 0.47 s in a trace where
# a relative bound had dropped them and kept that term at 0)
STALL_RATIO = 4.0
PRIOR_FLOOR = 1e-7  # the ridge's floor (``_fit_rows``)


def _dot(coef: Sequence[float], x: Sequence[float]) -> float:
    return sum(c * v for c, v in zip(coef, x))


def _fit_rows(rows: list[tuple[tuple[float, ...], float]], n: int,
              prior: StepCostModel | None, prior_weight: float) -> list[float] | None:
    """The first ``n`` coefficients (the rest 0) of the weighted, non-negative fit of
    ``StepCostModel.fit``; without a prior, unconstrained (``_solve``'s ValueError when the
    rows do not determine them). None when a prior's fit holds the per-token cost at 0."""
    weighted = [(x, y, 1.0 / y if y > 0 else 0.0) for x, y in rows]
    ata = [[sum(x[i] * x[j] * w * w for x, _, w in weighted) for j in range(n)]
           for i in range(n)]
    atb = [sum(x[i] * y * w * w for x, y, w in weighted) for i in range(n)]
    if prior is None:
        return _solve(ata, atb) + [0.0] * (NUM_TERMS - n)
    p = (prior.fixed_s, prior.per_token_s, prior.per_row_s, prior.per_context_token_s,
         prior.per_prefill_pair_s)
    # the pull: prior_weight of what the data say about the term (its own diagonal: a term
    # the steps measure follows them, one only collinear ones measure is held near the prior),
    # and a floor in the relative units of the data (the term's deviation at its typical size
    # over the median step, per step) that keeps a term no step varies at the prior
    seconds = sorted(y for _, y in rows if y > 0)
    typical = seconds[len(seconds) // 2] if seconds else 1.0
    for i in range(n):
        r = prior_weight * ata[i][i] + PRIOR_FLOOR * max(len(seconds), 1) * (
            TERM_SCALES[i] / typical) ** 2
        ata[i][i] += r
        atb[i] += r * p[i]
    active = list(range(n))
    while True:  # hold the most negative term at 0 and refit the others, until none is < 0
        sub = _solve([[ata[i][j] for j in active] for i in active], [atb[i] for i in active])
        if min(sub) >= 0:
            break
        if active[sub.index(min(sub))] == 1:
            return None  # tokens would cost nothing
        active.pop(sub.index(min(sub)))
    coef = [0.0] * NUM_TERMS
    for i, c in zip(active, sub, strict=True):
        coef[i] = c
    return coef


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``x`` with ``a @ x == b`` (Gaussian elimination, partial pivoting, columns scaled)."""
    n = len(b)
    scale = [max(abs(a[i][i]), 1e-300) ** 0.5 for i in range(n)]  # the terms' units differ
    m = [[a[i][j] / (scale[i] * scale[j]) for j in range(n)] + [b[i] / scale[i]]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-9:
            raise ValueError(f"StepCostModel.fit: the samples do not determine term {col} "
                             "(fixed, per token, per decode row, per context token, per prefill pair)")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [v - f * w for v, w in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] / scale[i] for i in range(n)]


class OnlineStepCost:
    """The step-cost model kept current from measured steps (module docstring).

    ``observe`` adds one step; after every ``refit_every`` samples, or sooner once the steps
    since the last fit took ``refit_after_s`` (a long prompt's chunks: few, long steps whose
    cost the model must learn while the prompt runs), the model is refitted (``fit`` toward
    ``prior``) over the last ``window`` steps. ``model`` is the prior until then.

    Args:
      prior: the model before any step is measured (``StepCostModel.prior``).
      window: how many recent steps a fit uses.
      refit_every: steps between fits (each ~7 ms for 512 steps on a 2-core CPU).
      refit_after_s: measured step seconds after which a fit comes sooner (at most one a
        ``refit_after_s``: ~1% of the step thread at 7 ms a fit).

    Raises:
      ValueError: ``window`` or ``refit_every`` < 1, or ``refit_after_s`` not > 0.
    """

    def __init__(self, prior: StepCostModel, window: int = 512, refit_every: int = 32,
                 refit_after_s: float = 1.0) -> None:
        if window < 1 or refit_every < 1 or not refit_after_s > 0:
            raise ValueError(f"OnlineStepCost: {window=} and {refit_every=} must be >= 1, "
                             f"{refit_after_s=} > 0")
        self.prior = self.model = prior
        self.samples: deque[StepSample] = deque(maxlen=window)
        # measured / predicted seconds of the recent steps, each against the model of its time;
        # and of the recent steps with a prompt chunk (the steps a prefill budget plans)
        self.ratios: deque[float] = deque(maxlen=window)
        self.prefill_ratios: deque[float] = deque(maxlen=window)
        self.refit_every = refit_every
        self.refit_after_s = refit_after_s
        self.num_observed = 0
        self.num_fits = 0  # refits so far
        self._since_fit = (0, 0.0)  # samples and their seconds since the last fit

    def observe(self, sample: StepSample) -> StepCostModel | None:
        """Add one measured step; returns the refitted model when this sample triggered a
        fit, else None. Samples with ``seconds <= 0`` are ignored."""
        if not sample.seconds > 0:
            return None
        predicted = self.model.predict(sample.num_tokens, sample.num_decode_rows,
                                       sample.num_context_tokens, sample.num_prefill_pairs)
        if predicted > 0:
            self.ratios.append(sample.seconds / predicted)
            if sample.num_prefill_pairs > 0:
                self.prefill_ratios.append(sample.seconds / predicted)
        self.samples.append(sample)
        self.num_observed += 1
        n, s = self._since_fit
        n, s = n + 1, s + sample.seconds
        if n < self.refit_every and s < self.refit_after_s:
            self._since_fit = (n, s)
            return None
        self._since_fit = (0, 0.0)
        self.num_fits += 1
        self.model = StepCostModel.fit(self.samples, prior=self.prior)
        return self.model


    def error_quantile(self, q: float, min_samples: int = 32, prefill: bool = False) -> float:
        """The ``q`` quantile of recent steps' measured / predicted seconds (how much longer
        than predicted a step takes, that often or less); 1.0 before ``min_samples`` steps.
        ``prefill``: of the steps with a prompt chunk only, once there are ``min_samples`` of
        them. A decode-only step of a few rows lasts ~20 ms on a 2-core CPU, where a
        millisecond of host jitter is 5%: its ratios spread 1.5-2x wider than those of the
        100-300 ms steps that carry prompt chunks (docs/decisions/0041-slo-scheduling.md)."""
        ratios = self.prefill_ratios if prefill and len(self.prefill_ratios) >= min_samples \
            else self.ratios
        if len(ratios) < min_samples:
            return 1.0
        ordered = sorted(ratios)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prefill_token_budget(model: StepCostModel, target_s: float, num_decode_rows: int,
                         num_context_tokens: int, max_num_tokens: int,
                         token_buckets: Sequence[int] = (),
                         min_prefill_tokens: int = MIN_PREFILL_TOKENS,
                         prefill_start: int = 0) -> int:
    """Prompt tokens a step with ``num_decode_rows`` decodes may add within ``target_s``.

    The step's size is the largest compiled bucket (``token_buckets``, ascending; every size
    up to ``max_num_tokens`` when empty) whose predicted time is within the target, so the
    padded step the device runs is predicted within it too; the prompt tokens are counted as
    one chunk from position ``prefill_start`` (their attention's pairs). Prefill always gets
    at least ``min_prefill_tokens`` (so waiting prompts progress however tight the target),
    rounded up to fill the bucket such a step is padded to anyway; never more than
    ``max_num_tokens`` in all. Returns the step's size minus the decode rows (>= 0).
    """
    def fits(n: int) -> bool:
        pairs = prefill_pairs(max(n - num_decode_rows, 0), prefill_start)
        return model.predict(n, num_decode_rows, num_context_tokens, pairs) <= target_s

    floor = min(num_decode_rows + min_prefill_tokens, max_num_tokens)
    if token_buckets:
        size = next((t for t in reversed(token_buckets) if t <= max_num_tokens and fits(t)), 0)
        floor = token_buckets[min(bisect.bisect_left(token_buckets, floor),
                                  len(token_buckets) - 1)]
    else:  # the largest size that fits (the prediction grows with the size)
        lo, hi = 0, max_num_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        size = lo if fits(lo) else 0
    size = min(max(size, floor), max_num_tokens)
    return max(size - num_decode_rows, 0)


def fit_bucket[C: Chunk](scheduled: list[C], num_tokens: int, buckets: Sequence[int],
                         step_overhead_tokens: int) -> int:
    """Shorten prefill chunks so the step fills a smaller bucket, when that is cheaper.

    A step of ``n`` tokens runs padded to the smallest bucket ``T >= n``. When ``n`` is just
    past the bucket below (``T_prev``), cutting ``n - T_prev`` prompt tokens from the last
    prefill chunks and leaving them to the next step costs ``T_prev + bucket(n - T_prev) +
    step_overhead_tokens`` instead of ``T``; that is done when smaller. E.g. a 300-token
    prompt alone: 256 + 64 + 32 < 512. The cut tokens keep their blocks (allocated for
    the whole chunk), so the next step needs none for them. Changes ``scheduled`` in place;
    returns the new token count.

    Args:
      scheduled: the step's chunks, in batch order.
      num_tokens: their total.
      buckets: the compiled token buckets, ascending.
      step_overhead_tokens: a step's fixed cost in prompt tokens.
    """
    i = bisect.bisect_left(buckets, num_tokens)
    if i == 0 or i == len(buckets):
        return num_tokens
    smaller = buckets[i - 1]
    excess = num_tokens - smaller
    rest = buckets[bisect.bisect_left(buckets, excess)]
    if smaller + rest + step_overhead_tokens >= buckets[i]:
        return num_tokens
    if sum(len(c.token_ids) - 1 for c in scheduled) < excess:  # decode rows cannot shrink
        return num_tokens
    for j in range(len(scheduled) - 1, -1, -1):
        chunk = scheduled[j]
        cut = min(excess, len(chunk.token_ids) - 1)
        if cut > 0:
            scheduled[j] = dataclasses.replace(chunk, token_ids=chunk.token_ids[:-cut],
                                               sample=False)
            excess -= cut
        if excess == 0:
            break
    return smaller
