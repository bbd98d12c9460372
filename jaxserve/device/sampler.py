"""On-device sampling with per-row parameters (arrays, never static arguments), and raw logprobs.

Per step, ``S`` rows (``RowInputs``) of ``f[S, V]`` logits go through vLLM's order: logit_bias
and penalties, temperature, then top-k (``top_k_threshold``), top-p (arXiv:1904.09751) and min-p
(arXiv:2407.01082) in ``draw_filtered``: no sort; top-k and min-p are cuts, top-p a rejection
loop on draws that inverts the kept tokens' CDF at one uniform per round (only when some row is
not greedy). Row ``i``'s round ``r`` draws at ``fold_in(fold_in(key(seed), sample_pos), r)``, so
its tokens depend only on its seed and position, not on batch-mates or on recompute after
preemption.

Penalties and bias read a device-resident ``PenaltyState`` of ``R`` slots
(``jaxserve.device.penalties``); a step without any row holding a slot skips it (``lax.cond``).

``logprobs_of`` gives the raw ``log_softmax(logits)``, independent of the sampling settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.device.penalties import PenaltyState, apply_penalties

_NEG = -1e30
_TOP_K_WIDTHS = (256,)
"""Candidate widths of ``_kth_in_blocks`` tried in turn, the narrowest holding the step's
largest top_k; a larger top_k bisects the whole row. At [64, 49152] on a 2-core CPU, width 256
took 4.7 ms, against 12.4 ms for ``lax.top_k`` at 256 and 24 ms for the whole-row bisection.
Each width adds ~0.4 s to a sampler program's compile (64 and 1024 as well: 3.0 and 10.5 ms,
+1.1 s), so one width serves top_k up to 256."""
_TOP_K_BLOCK = 16
"""Ids per block of ``_kth_in_blocks``."""
_MAX_BLOCK = 256
"""Ids per block of ``_row_max``."""
_DRAW_BLOCK = 256
_FEW_ROWS = 8
"""Top-p rejection rounds after the first gather the rows still drawing when at most this many
are left, so that such a round reads a few rows instead of the batch."""


class RowInputs(NamedTuple):
    """Per-row sampling inputs, one row per sequence in the bucket."""

    temperature: jax.Array  # f32[S], 0 = greedy
    top_k: jax.Array  # i32[S], <= 0 or >= vocab = off
    top_p: jax.Array  # f32[S], 1 = off
    min_p: jax.Array  # f32[S], 0 = off
    seeds: jax.Array  # u32[S, 2], a 64-bit seed as threefry key data
    sample_pos: jax.Array  # i32[S], index of the sampled token among the request's outputs
    slot: jax.Array  # i32[S], the row's PenaltyState slot; R = none
    repetition_penalty: jax.Array  # f32[S]
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]


def suppress_tokens(logits: jax.Array, token_ids: jax.Array, allowed: jax.Array | None = None,
                    use_allowed: jax.Array | None = None) -> jax.Array:
    """f32 ``logits`` ``[S, V]`` with tokens masked (never sampled): ``token_ids`` ``i32[S, K]``
    of each row (the EOS and stop ids of rows short of ``min_tokens``; ids outside ``[0, V)``,
    -1 for padding, mask nothing; repeats are harmless) and, with ``allowed``
    (``i32[S, ceil(V / 32)]``, token ``t`` is bit ``t & 31`` of word ``t >> 5``), every token
    whose bit is clear: a constrained row's grammar mask; other rows send all bits set.
    ``use_allowed`` (bool scalar; None: True) says whether ``allowed`` is read at all.

    The ids become a ``u32[S, ceil(V / 32)]`` bitmask, merged with ``allowed`` word by word
    (under ``lax.cond`` on ``use_allowed``: a step without a constrained row does not touch
    it), then one elementwise select, which XLA fuses with the logits' next use; there is no
    ``lax.cond`` over the logits, whose pass-through branch would copy the ``[S, V]`` logits in
    every step without a masked row.
    """
    logits = logits.astype(jnp.float32)
    s, v = logits.shape
    num_words = -(-v // 32)
    ids = jnp.sort(token_ids, axis=-1)
    repeat = jnp.concatenate([jnp.zeros((s, 1), bool), ids[:, 1:] == ids[:, :-1]], axis=-1)
    word = jnp.where((ids >= 0) & (ids < v) & ~repeat, ids >> 5, num_words)  # else: dropped
    bit = jnp.left_shift(jnp.uint32(1), (ids & 31).astype(jnp.uint32))
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], ids.shape)
    bits = jnp.zeros((s, num_words), jnp.uint32).at[rows, word].add(bit, mode="drop")
    if allowed is not None:
        merge = lambda b: b | ~jax.lax.bitcast_convert_type(allowed, jnp.uint32)
        bits = merge(bits) if use_allowed is None else jax.lax.cond(
            use_allowed, merge, lambda b: b, bits)
    col = jnp.arange(v)
    masked = (bits[:, col >> 5] >> (col & 31).astype(jnp.uint32)) & 1
    return jnp.where(masked != 0, _NEG, logits)


def _row_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's maximum (f32[S, 1]) and the first index of it (i32[S]) in ``f32[S, V]``: the
    same as ``jnp.argmax`` for rows without NaN. One pass over the row (maxima of blocks of
    ``_MAX_BLOCK`` ids), then the first block holding the maximum, then the first id in that
    block: 0.3 ms at [64, 49152] on a 2-core CPU, against 2.8 ms for a masked minimum of the
    ids over the whole row and 7.6 ms for ``jnp.argmax``."""
    s, v = x.shape
    nb = -(-v // _MAX_BLOCK)
    xb = jnp.pad(x, ((0, 0), (0, nb * _MAX_BLOCK - v)), constant_values=-jnp.inf) \
        .reshape(s, nb, _MAX_BLOCK)
    bmax = jnp.max(xb, axis=-1)
    m = jnp.max(bmax, axis=-1, keepdims=True)
    b = jnp.min(jnp.where(bmax == m, jnp.arange(nb, dtype=jnp.int32), nb - 1), axis=-1)
    blk = jnp.take_along_axis(xb, b[:, None, None], axis=1)[:, 0]  # [S, BLOCK]
    i = jnp.min(jnp.where(blk == m, jnp.arange(_MAX_BLOCK, dtype=jnp.int32), _MAX_BLOCK - 1),
                axis=-1)
    return m, jnp.minimum(b * _MAX_BLOCK + i, v - 1)


def _key(x: jax.Array) -> jax.Array:
    """f32 -> u32 with the same order (for finite and infinite values; -0 sorts before +0)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _unkey(k: jax.Array) -> jax.Array:
    b = jnp.where((k >> 31) == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def _largest_threshold(tail: Callable[[jax.Array], jax.Array], target: jax.Array,
                       lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Per row, the largest ``v`` with ``tail(v) >= target``, found by bisection on the bits.

    ``tail(v[S]) -> [S]`` must not increase with ``v`` and change only at the row's values
    (a sum over its elements ``>= v``), so the answer is one of the row's values: exactly
    the value a descending sort would give at the same cut. ``lo``/``hi`` (f32[S]) bracket it,
    with ``tail(lo) >= target``. At most 32 passes over the row, fewer when the bracket is narrow.
    """
    def body(c):
        lo, hi = c
        mid = lo + (hi - lo + 1) // 2  # the upper middle, so lo == hi is a fixed point
        ok = tail(_unkey(mid)) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo_k, _ = jax.lax.while_loop(lambda c: jnp.any(c[0] < c[1]), body, (_key(lo), _key(hi)))
    return _unkey(lo_k)


def _kth_in_blocks(x: jax.Array, k: jax.Array, width: int) -> jax.Array:
    """The ``k``-th largest value (f32[S]) of each row of ``f32[S, V]``, for ``k`` (i32[S]) in
    ``[1, width]``, read from ``width`` blocks of ``_TOP_K_BLOCK`` ids (needs ``width`` blocks
    in a row).

    ``lb`` is the ``k``-th largest block maximum. Every value above ``lb`` lies in a block whose
    maximum is above it (fewer than ``k`` blocks), and at least ``k`` blocks have a maximum
    ``>= lb``; so the blocks above ``lb`` plus those equal to it in id order, ``width`` in all
    (padded with an empty block), hold every value above ``lb`` and at least ``k`` values
    ``>= lb``: their ``k``-th largest is the row's. Two bisections on the bits
    (``_largest_threshold``), over the ``V / 16`` block maxima and over the ``16 * width``
    candidates, and one pass over the row.
    """
    s, v = x.shape
    blk = _TOP_K_BLOCK
    nb = -(-v // blk)
    xb = jnp.pad(x, ((0, 0), (0, (nb + 1) * blk - v)), constant_values=-jnp.inf) \
        .reshape(s, nb + 1, blk)  # block nb: padding only, the filler
    bmax = jnp.max(xb[:, :nb], axis=-1)  # [S, NB]
    top = jnp.max(bmax, axis=-1)

    def count(vals):
        return lambda t: jnp.sum((vals >= t[:, None]).astype(jnp.int32), axis=-1)

    lb = _largest_threshold(count(bmax), k, jnp.min(bmax, axis=-1), top)
    # the j-th chosen block (j < width): the first index where the running count of
    # [above lb..., equal to lb...] reaches j + 1
    order = jnp.concatenate([bmax > lb[:, None], bmax == lb[:, None]], axis=-1)
    running = jnp.cumsum(order.astype(jnp.int32), axis=-1)  # [S, 2 NB]
    want = jnp.arange(1, width + 1, dtype=jnp.int32)
    pos = jax.vmap(lambda r: jnp.searchsorted(r, want, side="left"))(running)  # [S, width]
    chosen = jnp.where(pos < 2 * nb, pos % nb, nb)
    cand = jnp.take_along_axis(xb, chosen[:, :, None], axis=1).reshape(s, width * blk)
    return _largest_threshold(count(cand), k, lb, top)


def top_k_threshold(scaled: jax.Array, top_k: jax.Array) -> jax.Array:
    """The k-th largest value ``f32[S]`` of each row of ``f32[S, V]``, ``-inf`` where top-k is
    off (``top_k <= 0`` or ``>= V``): the row keeps the tokens whose logit is ``>=`` it (ties
    at the k-th value kept), exactly as a descending sort would cut it. A step whose largest
    ``top_k`` is at most 256 (``_TOP_K_WIDTHS``, where the vocabulary has that many blocks)
    reads that many blocks of the row (``_kth_in_blocks``), a larger one bisects
    on the whole row's bits (``_largest_threshold``); nothing runs when no row asks
    (``lax.cond``)."""
    s, vocab = scaled.shape
    k_on = (top_k > 0) & (top_k < vocab)
    k = jnp.where(k_on, top_k, 1)
    k_max = jnp.max(jnp.where(k_on, k, 0))

    def kth_bisect(_):
        def count(v):
            return jnp.sum((scaled >= v[:, None]).astype(jnp.int32), axis=-1)
        return _largest_threshold(count, k, jnp.min(scaled, axis=-1), jnp.max(scaled, axis=-1))

    def narrowest(width, wider):  # `width` blocks if they hold every row's k, else wider
        return lambda _: jax.lax.cond(
            k_max <= width, lambda _: _kth_in_blocks(scaled, k, width), wider, None)

    kth = kth_bisect
    for width in sorted(w for w in _TOP_K_WIDTHS if w * _TOP_K_BLOCK <= vocab)[::-1]:
        kth = narrowest(width, kth)
    kth = jax.lax.cond(k_max == 0, lambda _: jnp.full((s,), -jnp.inf, jnp.float32), kth, None)
    return jnp.where(k_on, kth, -jnp.inf)


def _draw(e: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row with chance proportional to the weights ``e`` (f32[S, V], >= 0, some
    positive), by inverting their CDF at ``u`` (f32[S] in [0, 1)): ``i32[S]``, and the rows'
    total weight (f32[S]).

    Two levels (sums of blocks of ``_DRAW_BLOCK`` ids, then the ids in the chosen block) keep
    the float32 cumulative sums short, so a token's chance is its probability to within about
    ``2**-24`` of the row's mass. Never returns an id of weight 0.
    """
    s, vocab = e.shape
    nb = -(-vocab // _DRAW_BLOCK)
    e = jnp.pad(e, ((0, 0), (0, nb * _DRAW_BLOCK - vocab))).reshape(s, nb, _DRAW_BLOCK)
    block = jnp.sum(e, axis=-1)  # [S, NB]
    cum = jnp.cumsum(block, axis=-1)
    t = u * cum[:, -1]

    def pick(cum, weight, t):  # first index with cum > t, kept on an index of positive weight
        n = cum.shape[-1]
        i = jnp.sum((cum <= t[:, None]).astype(jnp.int32), axis=-1)
        last = jnp.max(jnp.where(weight > 0, jnp.arange(n, dtype=jnp.int32), 0), axis=-1)
        return jnp.minimum(i, last)

    b = pick(cum, block, t)
    before = jnp.where(b > 0, jnp.take_along_axis(cum, jnp.maximum(b - 1, 0)[:, None],
                                                  axis=-1)[:, 0], 0.0)
    w = jnp.take_along_axis(e, b[:, None, None], axis=1)[:, 0]  # [S, BLOCK]
    i = pick(jnp.cumsum(w, axis=-1), w, t - before)
    return (b * _DRAW_BLOCK + i).astype(jnp.int32), cum[:, -1]


def _uniform(seeds: jax.Array, sample_pos: jax.Array, rnd: jax.Array) -> jax.Array:
    """f32[S] in [0, 1): row ``i``'s uniform of draw round ``rnd`` (i32 scalar)."""
    def row(seed, pos):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), pos)
        return jax.random.uniform(jax.random.fold_in(key, rnd), (), jnp.float32)

    return jax.vmap(row)(seeds, sample_pos)


def _draw_round(x: jax.Array, e: jax.Array, pivot: jax.Array, target: jax.Array,
                u: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One round of top-p rejection over rows ``x``/``e`` (f32[R, V]: scaled logits and their
    kept weights): draw among the ids above ``pivot`` (f32[R]), accept the draw when the mass
    strictly above it is below ``target`` (f32[R]). Returns (ids i32[R], their logits, accepted
    bool[R])."""
    tok, _ = _draw(jnp.where(x > pivot[:, None], e, 0.0), u)
    xt = jnp.take_along_axis(x, tok[:, None], axis=-1)[:, 0]
    above = jnp.sum(jnp.where(x > xt[:, None], e, 0.0), axis=-1)
    return tok, xt, above < target


def draw_filtered(scaled: jax.Array, kth: jax.Array, top_p: jax.Array, min_p: jax.Array,
                  seeds: jax.Array, sample_pos: jax.Array) -> jax.Array:
    """One token per row of temperature-scaled logits ``f32[S, V]`` (row max 0), drawn from
    their softmax restricted by vLLM's filters: top-k (``kth``, f32[S], ``top_k_threshold``),
    then top-p over the top-k tokens' renormalised distribution (the smallest descending prefix
    whose mass reaches ``top_p``, arXiv:1904.09751; ``>= 1`` off), then min-p (``p >= min_p *
    p_max``, arXiv:2407.01082; ``<= 0`` off). ``i32[S]``; ``seeds`` u32[S, 2] and ``sample_pos``
    i32[S] key each row's uniforms.

    Top-p without a sort or a cut: rejection (as FlashInfer's sampling kernels). A round draws
    among the top-k / min-p tokens above the row's pivot and accepts the draw ``j`` when the
    mass strictly above it is below ``top_p`` of the top-k mass, which holds exactly when ``j``
    is in the nucleus; else the pivot rises to ``j``'s logit. The nucleus is an upper set, so a
    rejected draw lies below all of it and an accepted one is distributed as the nucleus'
    renormalised probabilities. Each round accepts with chance >= ``top_p``; the first costs two
    passes over the batch (draw, mass check) and later ones gather the few rows still drawing
    (``_FEW_ROWS``). Row ``i``'s round ``r`` draws at ``fold_in(fold_in(key(seed), pos), r)``.
    """
    s = scaled.shape[0]
    # p >= min_p * p_max  <=>  logit >= logit_max + log(min_p); log(0) = -inf keeps everything
    cut = jnp.maximum(kth, jnp.log(min_p))
    e = jnp.where(scaled >= cut[:, None], jnp.exp(scaled), 0.0)  # max 0: no overflow
    p_on = top_p < 1.0
    u = _uniform(seeds, sample_pos, jnp.int32(0))
    few = min(s, _FEW_ROWS)

    def nucleus(_):
        tok, mass = _draw(e, u)  # the first round: all kept ids (pivot -inf)
        mass_k = jax.lax.cond(  # the top-k mass, beyond the min-p cut
            jnp.any(p_on & (cut > kth)),
            lambda _: jnp.sum(jnp.where(scaled >= kth[:, None], jnp.exp(scaled), 0.0), axis=-1),
            lambda _: mass, None)
        target = jnp.where(p_on, top_p * mass_k, jnp.inf)
        xt = jnp.take_along_axis(scaled, tok[:, None], axis=-1)[:, 0]
        done = jnp.sum(jnp.where(scaled > xt[:, None], e, 0.0), axis=-1) < target

        def full(c):  # more than `few` rows left: a round over the batch
            tok, pivot, done, rnd = c
            t, x, ok = _draw_round(scaled, e, pivot, target, _uniform(seeds, sample_pos, rnd))
            return jnp.where(done, tok, t), jnp.where(done, pivot, x), done | ok, rnd + 1

        def gathered(c):  # the rows left, gathered once: their rounds read `few` rows each
            tok, pivot, done, rnd = c
            idx = jnp.nonzero(~done, size=few, fill_value=0)[0]
            # padding repeats a row left: it recomputes that row, the same writes
            idx = jnp.where(jnp.arange(few) < jnp.sum(~done), idx, idx[0])
            x, w, tg, sd, ps = scaled[idx], e[idx], target[idx], seeds[idx], sample_pos[idx]

            def round_(c):
                tok, pivot, done, rnd = c
                t, xt, ok = _draw_round(x, w, pivot, tg, _uniform(sd, ps, rnd))
                return (jnp.where(done, tok, t), jnp.where(done, pivot, xt), done | ok,
                        rnd + 1)

            t, _, _, rnd = jax.lax.while_loop(lambda c: jnp.any(~c[2]), round_,
                                              (tok[idx], pivot[idx], done[idx], rnd))
            return tok.at[idx].set(t), pivot, jnp.ones_like(done), rnd

        c = (tok, xt, done, jnp.int32(1))
        c = jax.lax.while_loop(lambda c: jnp.sum(~c[2]) > few, full, c)
        return jax.lax.cond(jnp.any(~c[2]), gathered, lambda c: c, c)[0]

    # without a top-p row, one draw (the same as a first round's) and no mass pass
    return jax.lax.cond(jnp.any(p_on), nucleus, lambda _: _draw(e, u)[0], None)


def mask_vocab(logits: jax.Array, vocab_limit: int | None) -> jax.Array:
    """f32 logits with ids >= ``vocab_limit`` (static; the tokenizer's vocabulary) masked."""
    logits = logits.astype(jnp.float32)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, _NEG)
    return logits


def sample(logits: jax.Array, rows: RowInputs, state: PenaltyState | None = None,
           vocab_limit: int | None = None) -> jax.Array:
    """Sample one token per row of ``f[S, V]`` logits; returns ``i32[S]``.

    Args:
      state: the rows' token history (None: no penalties).
      vocab_limit: static; ids at or above it are never sampled.
    """
    logits = mask_vocab(logits, vocab_limit)
    if state is not None:
        r = state.tokens.shape[0]
        any_pen = jnp.any((rows.slot >= 0) & (rows.slot < r))
        logits = jax.lax.cond(any_pen, apply_penalties, lambda lg, rw, st: lg, logits, rows,
                              state)
    # one max for both paths: a second max of the logits inside the cond below made XLA CPU's
    # greedy path cost ~13 ms instead of ~8 at [64, 49152] (CPU time, 2 cores)
    m, greedy = _row_max(logits)
    random_rows = rows.temperature > 0

    def random_path(logits, m):
        t = jnp.where(random_rows, rows.temperature, 1.0)[:, None]
        # shifted before scaling: the row's best is exactly 0 and nothing overflows, however
        # small the temperature (logits / 1e-9 would reach 1e10, where one ulp is 1024)
        # masked entries (suppressed, grammar-refused, past the vocabulary: <= _NEG, which
        # penalties only lower) stay at _NEG: divided by a huge temperature they would come
        # within reach of the allowed ones
        scaled = jnp.where(logits <= _NEG, _NEG, (logits - m) / t)
        # the filters of greedy rows are switched off so that they cost no passes
        kth = top_k_threshold(scaled, jnp.where(random_rows, rows.top_k, 0))
        return draw_filtered(scaled, kth, jnp.where(random_rows, rows.top_p, 1.0),
                             jnp.where(random_rows, rows.min_p, 0.0), rows.seeds,
                             rows.sample_pos)

    drawn = jax.lax.cond(jnp.any(random_rows), random_path, lambda lg, m: greedy, logits, m)
    return jnp.where(random_rows, drawn, greedy)


class Logprobs(NamedTuple):
    """Raw logprobs of ``N`` rows: top ``K`` descending, and a chosen id's (rank 1 = best, ties
    share the better rank)."""

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
