"""Repetition, frequency and presence penalties and logit_bias, from a device-resident state.

Penalties and bias read a ``PenaltyState`` of ``R`` slots (donated like the KV cache). A slot is
reset when its request starts at position 0 (again after preemption), and every token fed
through the model is counted in (prompt: ``PROMPT_SEEN``, output: +1), so when a token is
sampled the row holds the prompt and all earlier outputs. Requests without penalties or bias
hold no slot (``jaxserve.engine.penalty_slots`` lends them).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

PROMPT_SEEN = 1 << 30
"""Bit of a ``PenaltyState.tokens`` entry marking a token that occurs in the prompt; the bits
below it count the token's occurrences in the output."""


class PenaltyRows(Protocol):
    """What ``apply_penalties`` reads of a step's rows (``sampler.RowInputs``)."""

    slot: jax.Array  # i32[S], the row's slot; R = none
    repetition_penalty: jax.Array  # f32[S]
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]


class PenaltyState(NamedTuple):
    """Device-resident token history and logit_bias of the requests that use them."""

    tokens: jax.Array  # i32[R, V]: PROMPT_SEEN if in the prompt, + the count in the output
    bias: jax.Array  # f32[R, V]: the slot's logit_bias row (set_bias_row)


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


def apply_penalties(logits: jax.Array, rows: PenaltyRows, state: PenaltyState) -> jax.Array:
    """Logits ``f32[S, V]`` after each slotted row's penalties and logit_bias.

    Repetition (CTRL, arXiv:1909.05858, as vLLM): ``l / p`` where ``l > 0`` else ``l * p`` over
    prompt and output tokens; then OpenAI's ``l - frequency * count - presence * (count > 0)``
    over output counts; then ``+ bias``.
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
