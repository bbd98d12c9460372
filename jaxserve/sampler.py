"""On-device sampling with per-row parameters (never static arguments).

Inputs per step, ``S`` rows (one per sequence in the bucket):
  logits ``f32[S, vocab]``, temperature ``f32[S]`` (0 = greedy), top_k ``i32[S]`` (<= 0 or >= vocab
  = off), top_p ``f32[S]`` (1 = off), seeds ``u32[S, 2]`` (a 64-bit seed as threefry key data)
  and sample_pos ``i32[S]`` (the index of the token being sampled among the request's outputs).
Each row draws from its own stream ``fold_in(key(seed), sample_pos)``, so a request's tokens
depend only on its seed and position, never on its batch-mates or on being recomputed after a
preemption. Sampling is the Gumbel-max trick (argmax of logits / T + Gumbel noise). Top-k / top-p
filtering (Holtzman et al. 2019, arXiv:1904.09751) sorts each row once and runs only when some
row asks for it (``lax.cond``); the noise runs only when some row is not greedy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
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
    thr = jnp.maximum(kth, pth)
    return jnp.where(scaled >= thr, scaled, _NEG)


def _gumbel_sample(scaled: jax.Array, seeds: jax.Array, sample_pos: jax.Array) -> jax.Array:
    def row(seed, pos):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), pos)
        return jax.random.gumbel(key, (scaled.shape[-1],), jnp.float32)

    noise = jax.vmap(row)(seeds, sample_pos)
    return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    sample_pos: jax.Array,
    vocab_limit: int | None = None,
) -> jax.Array:
    """Sample one token per row; returns ``i32[S]``.

    ``vocab_limit`` (static) masks ids at or above it (a model whose embedding is larger than
    its tokenizer's vocabulary).
    """
    logits = logits.astype(jnp.float32)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, _NEG)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    random_rows = temperature > 0
    vocab = logits.shape[-1]

    def random_path(_):
        t = jnp.where(random_rows, temperature, 1.0)[:, None]
        scaled = logits / t
        need = jnp.any(random_rows & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)))
        scaled = jax.lax.cond(need, _filter_top_k_top_p, lambda s, k, p: s, scaled, top_k,
                              top_p)
        return _gumbel_sample(scaled, seeds, sample_pos)

    drawn = jax.lax.cond(jnp.any(random_rows), random_path, lambda _: greedy, None)
    return jnp.where(random_rows, drawn, greedy)
