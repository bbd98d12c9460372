"""On-device sampling with per-row parameters (never static arguments), and raw logprobs.

Inputs per step, ``S`` rows (one per sequence in the bucket), as ``RowInputs``: temperature
``f32[S]`` (0 = greedy), top_k ``i32[S]`` (<= 0 or >= vocab = off), top_p ``f32[S]`` (1 = off),
min_p ``f32[S]`` (0 = off), seeds ``u32[S, 2]`` (a 64-bit seed as threefry key data), sample_pos
``i32[S]`` (the index of the token being sampled among the request's outputs), and for penalties
slot ``i32[S]`` (the row's ``PenaltyState`` slot; ``R`` = none), repetition / presence /
frequency penalties ``f32[S]``.

Order of the logit processing (vLLM's): logit_bias and penalties, then temperature, then the
top-k / top-p / min-p filters, then the draw. Penalties need each request's token history: a
``PenaltyState`` of ``R`` slots stays on the device across steps (donated like the KV cache). A
slot's row is reset when its request starts (or restarts after preemption) at position 0, and
every token the step feeds through the model is counted into its request's row (prompt tokens
set ``PROMPT_SEEN``, output tokens add 1). When a token is sampled the row therefore holds the
whole prompt and every output token before it (the last one is fed in the same step), so
preemption and recompute rebuild it exactly. Requests without penalties or bias hold no slot, and
all of this sits under ``lax.cond``: a step with no such request does not touch the state.

Each row draws from its own stream ``fold_in(key(seed), sample_pos)``, so a request's tokens
depend only on its seed and position, never on its batch-mates or on being recomputed after a
preemption. Sampling is the Gumbel-max trick (argmax of logits / T + Gumbel noise). Top-k / top-p
filtering (Holtzman et al. 2019, arXiv:1904.09751) and min-p (Nguyen et al. 2024,
arXiv:2407.01082) sort each row once and run only when some row asks for them (``lax.cond``); the
noise runs only when some row is not greedy.

Logprobs (``logprobs_of``) are of the raw model distribution, ``log_softmax(logits)`` before any
of the processing above, so they do not depend on the sampling settings.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG = -1e30
PROMPT_SEEN = 1 << 30
"""Bit of a ``PenaltyState.tokens`` entry marking a token that occurs in the prompt; the bits
below it count the token's occurrences in the output."""


class RowInputs(NamedTuple):
    """Per-row sampling inputs (shapes in the module docstring)."""

    temperature: jax.Array  # f32[S]
    top_k: jax.Array  # i32[S]
    top_p: jax.Array  # f32[S]
    min_p: jax.Array  # f32[S]
    seeds: jax.Array  # u32[S, 2]
    sample_pos: jax.Array  # i32[S]
    slot: jax.Array  # i32[S], R = no penalty state
    repetition_penalty: jax.Array  # f32[S]
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]


class PenaltyState(NamedTuple):
    """Device-resident token history and logit_bias of the requests that use them.

    tokens: ``i32[R, V]``: per slot and token id, ``PROMPT_SEEN`` if the id is in the prompt,
      plus the id's count in the output so far.
    bias: ``f32[R, V]``: the slot's logit_bias row (written by ``set_bias_row``).
    """

    tokens: jax.Array
    bias: jax.Array


def new_penalty_state(num_slots: int, vocab: int) -> PenaltyState:
    """Zeroed state of ``num_slots`` slots over a ``vocab``-wide logits row."""
    return PenaltyState(jnp.zeros((num_slots, vocab), jnp.int32),
                        jnp.zeros((num_slots, vocab), jnp.float32))


def set_bias_row(state: PenaltyState, slot: jax.Array, row: jax.Array) -> PenaltyState:
    """Replace one slot's bias row (``slot`` i32 scalar, ``row`` f32[V])."""
    return state._replace(bias=state.bias.at[slot].set(row))


def feed_tokens(state: PenaltyState, reset_slots: jax.Array, tok_slot: jax.Array,
                token_ids: jax.Array, tok_is_output: jax.Array) -> PenaltyState:
    """Reset slots, then count the step's tokens into their slots.

    Args:
      reset_slots: ``i32[S]`` slots whose token rows restart from zero (``R`` = none).
      tok_slot: ``i32[T]`` the slot of each fed token's request (``R`` = none).
      token_ids: ``i32[T]``.
      tok_is_output: ``i32[T]`` 1 for an output token (counted), 0 for a prompt token (marked).
    Out-of-range slots are dropped, so padding and slot-less rows change nothing.
    """
    tokens = state.tokens.at[reset_slots].set(0, mode="drop")
    r = tokens.shape[0]
    cur = tokens.at[tok_slot, token_ids].get(mode="fill", fill_value=0)
    marked = jnp.where(tok_is_output == 0, cur | PROMPT_SEEN, cur)
    prompt_slot = jnp.where(tok_is_output == 0, tok_slot, r)
    tokens = tokens.at[prompt_slot, token_ids].set(marked, mode="drop")
    out_slot = jnp.where(tok_is_output == 1, tok_slot, r)
    tokens = tokens.at[out_slot, token_ids].add(1, mode="drop")
    return state._replace(tokens=tokens)


def apply_penalties(logits: jax.Array, rows: RowInputs, state: PenaltyState) -> jax.Array:
    """Logits ``f32[S, V]`` after each row's repetition / frequency / presence penalties and
    logit_bias, read from its slot of ``state``; rows without a slot pass through.

    repetition (CTRL, arXiv:1909.05858, as vLLM): ``l / p`` where ``l > 0`` else ``l * p``, for
    every token of the prompt or the output; then ``l - frequency * count - presence *
    (count > 0)`` over output counts (OpenAI's formula); then ``+ bias``.
    """
    r = state.tokens.shape[0]
    has = (rows.slot >= 0) & (rows.slot < r)
    idx = jnp.clip(rows.slot, 0, r - 1)
    hist = state.tokens[idx]  # [S, V]
    count = (hist & (PROMPT_SEEN - 1)).astype(jnp.float32)
    seen = hist != 0
    rep = rows.repetition_penalty[:, None]
    out = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    out = out - rows.frequency_penalty[:, None] * count \
        - rows.presence_penalty[:, None] * (count > 0).astype(jnp.float32)
    out = out + state.bias[idx]
    return jnp.where(has[:, None], out, logits)


def _filter(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
            ) -> jax.Array:
    vocab = scaled.shape[-1]
    srt = -jnp.sort(-scaled, axis=-1)  # descending, [S, V]
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)  # [S, 1]
    probs = jax.nn.softmax(srt, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # smallest prefix whose mass reaches top_p: index of the first cum >= top_p
    idx = jnp.sum(cum < top_p[:, None], axis=-1, keepdims=True)
    idx = jnp.minimum(idx, vocab - 1)
    pth = jnp.take_along_axis(srt, idx, axis=-1)
    # p >= min_p * p_max  <=>  logit >= logit_max + log(min_p); log(0) = -inf keeps everything
    mth = srt[:, :1] + jnp.log(min_p)[:, None]
    thr = jnp.maximum(jnp.maximum(kth, pth), mth)
    return jnp.where(scaled >= thr, scaled, _NEG)


def _gumbel_sample(scaled: jax.Array, seeds: jax.Array, sample_pos: jax.Array) -> jax.Array:
    def row(seed, pos):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), pos)
        return jax.random.gumbel(key, (scaled.shape[-1],), jnp.float32)

    noise = jax.vmap(row)(seeds, sample_pos)
    return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)


def mask_vocab(logits: jax.Array, vocab_limit: int | None) -> jax.Array:
    """f32 logits with ids at or above ``vocab_limit`` (static) set to a huge negative value
    (a model whose embedding is larger than its tokenizer's vocabulary)."""
    logits = logits.astype(jnp.float32)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, _NEG)
    return logits


def sample(logits: jax.Array, rows: RowInputs, state: PenaltyState | None = None,
           vocab_limit: int | None = None) -> jax.Array:
    """Sample one token per row; returns ``i32[S]``.

    ``logits`` is ``f[S, V]``; ``state`` (None: no penalties) holds the token history of rows
    whose ``slot`` is in range. ``vocab_limit`` (static) masks ids at or above it.
    """
    logits = mask_vocab(logits, vocab_limit)
    vocab = logits.shape[-1]
    if state is not None:
        r = state.tokens.shape[0]
        any_pen = jnp.any((rows.slot >= 0) & (rows.slot < r))
        logits = jax.lax.cond(any_pen, apply_penalties, lambda lg, rw, st: lg, logits, rows,
                              state)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    random_rows = rows.temperature > 0

    def random_path(_):
        t = jnp.where(random_rows, rows.temperature, 1.0)[:, None]
        scaled = logits / t
        need = jnp.any(random_rows & (((rows.top_k > 0) & (rows.top_k < vocab))
                                      | (rows.top_p < 1.0) | (rows.min_p > 0.0)))
        scaled = jax.lax.cond(need, _filter, lambda s, k, p, m: s, scaled, rows.top_k,
                              rows.top_p, rows.min_p)
        return _gumbel_sample(scaled, rows.seeds, rows.sample_pos)

    drawn = jax.lax.cond(jnp.any(random_rows), random_path, lambda _: greedy, None)
    return jnp.where(random_rows, drawn, greedy)


class Logprobs(NamedTuple):
    """Raw logprobs of ``N`` rows: the ``K`` most likely ids and their logprobs (descending),
    and one chosen id's logprob and rank (1 = most likely; ties share the better rank)."""

    top_ids: jax.Array  # i32[N, K]
    top_logprobs: jax.Array  # f32[N, K]
    chosen_logprob: jax.Array  # f32[N]
    chosen_rank: jax.Array  # i32[N]


def logprobs_of(logits: jax.Array, chosen: jax.Array, k: int,
                vocab_limit: int | None = None) -> Logprobs:
    """``log_softmax`` of raw ``logits`` ``f[N, V]``: top ``k`` (static) and ``chosen``
    (``i32[N]``, clipped into range) per row."""
    lsm = jax.nn.log_softmax(mask_vocab(logits, vocab_limit), axis=-1)
    vals, ids = jax.lax.top_k(lsm, k)
    ch = jnp.clip(chosen, 0, lsm.shape[-1] - 1)
    ch_lp = jnp.take_along_axis(lsm, ch[:, None], axis=-1)  # [N, 1]
    rank = jnp.sum(lsm > ch_lp, axis=-1).astype(jnp.int32) + 1
    return Logprobs(ids.astype(jnp.int32), vals, ch_lp[:, 0], rank)


def zero_logprobs(n: int, k: int) -> Logprobs:
    """The shape of ``logprobs_of``'s result, zero-filled (the untaken branch of a cond)."""
    return Logprobs(jnp.zeros((n, k), jnp.int32), jnp.zeros((n, k), jnp.float32),
                    jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.int32))
