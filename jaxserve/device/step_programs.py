"""What the two step programs compute: the bucket's model program and the row count's sampler
program (``ModelRunner`` compiles and runs them; its module docstring gives the data flow).

Both read one packed ``i32`` buffer laid out by ``step_buffer.Layout``; flags in it select the
optional work (``FLAG_PROMPT_LOGPROBS`` in the model program, ``FLAG_LOGPROBS`` and
``FLAG_ALLOWED`` in the sampler) through ``lax.cond``, so a step that asks for none costs none.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.device.penalties import PenaltyState, feed_tokens
from jaxserve.device.sampler import (
    RowInputs,
    logprobs_of,
    sample,
    suppress_tokens,
    zero_logprobs,
)
from jaxserve.device.step_buffer import (
    FLAG_ALLOWED,
    FLAG_LOGPROBS,
    FLAG_PROMPT_LOGPROBS,
    Layout,
)
from jaxserve.sampling_params import MAX_LOGPROBS, MAX_MIN_TOKENS_STOP_IDS
from models.interface import AttentionMetadata, CausalLM
from pallas_kernels import KVCache

LM_HEAD_MIN_ROWS = 2  # rows the LM head is padded to (lm_head)


def gathered(logits: jax.Array, replicated: jax.sharding.Sharding | None) -> jax.Array:
    """Under tensor parallelism (``replicated`` the mesh's replicated sharding), one all-gather
    of the vocabulary-split logits, so what follows (sampling, logprobs) runs without
    collectives; None: ``logits`` as they are."""
    if replicated is None:
        return logits
    return jax.lax.with_sharding_constraint(logits, replicated)


def model_program(model: CausalLM, layout: Layout, vocab_limit: int | None,
                  replicated: jax.sharding.Sharding | None) -> Callable:
    """The bucket's model program: ``(params, kv_cache, pen, packed, prev_ids) ->
    (kv_cache, pen, logits f32[S, vocab] of the sampled rows, prompt logprobs,
    sampler_inputs i32[...])``, the last the packed buffer's sampler tail. ``S`` is the
    layout's sampler row count (rows beyond the bucket's are zero logits); ids at or above
    ``vocab_limit`` are never given logprobs."""
    sl, b = layout.slices, layout.bucket
    limit, k, start = vocab_limit, MAX_LOGPROBS, layout.sampler_start

    def step(params, kv_cache: KVCache, pen: PenaltyState, packed: jax.Array,
             prev_ids: jax.Array):
        f = lambda name: packed[sl[name]]
        md = AttentionMetadata(
            slot_mapping=f("slot_mapping"),
            block_tables=f("block_tables").reshape(b.num_seqs, layout.max_blocks),
            seq_lens=f("seq_lens"), query_start_loc=f("query_start_loc"),
            num_seqs=f("num_seqs"))
        src = f("src_row")  # >= 0: the token is prev_ids[src] (async scheduling)
        token_ids = jnp.where(src >= 0, prev_ids[jnp.maximum(src, 0)], f("token_ids"))
        flags = f("flags")[0]
        num_slots = pen.tokens.shape[0]
        pen = jax.lax.cond(
            jnp.any(f("tok_slot") < num_slots) | jnp.any(f("reset_slot") < num_slots),
            feed_tokens, lambda st, *_: st, pen, f("reset_slot"), f("tok_slot"), token_ids,
            f("tok_is_output"))
        hidden, kv_cache = model.forward(params, token_ids, f("positions"), kv_cache, md)
        logits = gathered(lm_head(model, params, hidden[f("logits_indices")]), replicated)
        if layout.sampler_rows > b.num_seqs:  # the shared sampler's rows (zero logits)
            logits = jnp.pad(logits, ((0, layout.sampler_rows - b.num_seqs), (0, 0)))
        plp = jax.lax.cond(
            (flags & FLAG_PROMPT_LOGPROBS) != 0,
            lambda h, tg: logprobs_of(gathered(lm_head(model, params, h), replicated), tg,
                                      k, limit),
            lambda h, tg: zero_logprobs(b.num_tokens, k), hidden, f("tok_target"))
        return kv_cache, pen, logits, plp, packed[start:]

    return step


def sampler_program(layout: Layout, vocab_limit: int | None, max_rows: int,
                    replicated: jax.sharding.Sharding | None) -> Callable:
    """The sampler program of ``layout``'s sampler row count ``S`` (``Layout.sampler_rows``),
    shared by every bucket with as many: ``(logits f32[S, vocab], pen, sampler_inputs,
    allowed) -> (ids i32[max_rows], logprobs)``. Apart from the model programs so that it
    compiles once per sampler row count (2.5-4.6 s each on the 2-core CPU, against 1.2 s for
    a model program: the platform shares one among buckets, ``BucketSet.sampler_rows``)."""
    sl, num_seqs = layout.sampler_slices, layout.sampler_rows
    limit, k = vocab_limit, MAX_LOGPROBS

    def sample_rows(logits: jax.Array, pen: PenaltyState, inputs: jax.Array,
                    allowed: jax.Array):
        f = lambda name: inputs[sl[name]]
        as_f32 = lambda name: jax.lax.bitcast_convert_type(f(name), jnp.float32)
        flags = f("flags")[0]
        seeds = jax.lax.bitcast_convert_type(
            jnp.stack([f("seed_hi"), f("seed_lo")], axis=-1), jnp.uint32)  # [S, 2]
        rows = RowInputs(as_f32("temperature"), f("top_k"), as_f32("top_p"),
                         as_f32("min_p"), seeds, f("sample_pos"), f("slot"),
                         as_f32("repetition_penalty"), as_f32("presence_penalty"),
                         as_f32("frequency_penalty"))
        suppress = f("suppress_ids").reshape(num_seqs, MAX_MIN_TOKENS_STOP_IDS)
        ids = sample(suppress_tokens(logits, suppress, allowed,
                                     (flags & FLAG_ALLOWED) != 0), rows, pen, limit)
        lp = jax.lax.cond(
            (flags & FLAG_LOGPROBS) != 0,
            lambda lg, ch: logprobs_of(lg, ch, k, limit),
            lambda lg, ch: zero_logprobs(num_seqs, k), logits, ids)
        ids = jnp.zeros(max_rows, jnp.int32).at[:num_seqs].set(ids.astype(jnp.int32))
        if replicated is not None:
            ids = jax.lax.with_sharding_constraint(ids, replicated)
        return ids, lp

    return sample_rows


def lm_head(model: CausalLM, params, hidden: jax.Array) -> jax.Array:
    """``model.compute_logits`` of ``hidden [L, hidden]``, one row padded to
    ``LM_HEAD_MIN_ROWS`` and cut back: XLA:CPU runs a 1-row dot against the transposed
    embedding as a slow reduction (SmolLM2-135M's 1-token step took 65 ms with it, 24 ms padded
    to 8 rows); from 2 rows it goes to YNNPACK. 2 rows against the 8 used before, one decode
    alone (docs/decisions/0025-lm-head-rows.md, four interleaved runs): int4 weights 21.3 /
    18.4 ms a step against 22.8 / 18.7, bfloat16 19.8 / 21.8 against 19.9 / 22.7."""
    rows = hidden.shape[0]
    if rows >= LM_HEAD_MIN_ROWS:
        return model.compute_logits(params, hidden)
    padded = jnp.pad(hidden, ((0, LM_HEAD_MIN_ROWS - rows), (0, 0)))
    return model.compute_logits(params, padded)[:rows]
