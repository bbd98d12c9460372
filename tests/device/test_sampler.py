"""The on-device sampler: per-row parameters, filtering, seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.device.sampler import RowInputs, sample, suppress_tokens

V = 50
sample_jit = jax.jit(sample, static_argnames=("vocab_limit",))


def _rows(n: int, **kw):
    base = {"temperature": np.ones(n, np.float32), "top_k": np.zeros(n, np.int32),
            "top_p": np.ones(n, np.float32),
            "seeds": np.stack([np.zeros(n), np.arange(n)], 1).astype(np.uint32),
            "sample_pos": np.zeros(n, np.int32), "min_p": np.zeros(n, np.float32),
            "slot": np.full(n, 1 << 20, np.int32),
            "repetition_penalty": np.ones(n, np.float32),
            "presence_penalty": np.zeros(n, np.float32),
            "frequency_penalty": np.zeros(n, np.float32)}
    base.update({k: v for k, v in kw.items() if k in base})
    return base


def _draw(logits: np.ndarray, state=None, **kw) -> np.ndarray:
    rows = RowInputs(**_rows(len(logits), **kw))
    return np.asarray(sample_jit(jnp.asarray(logits), rows, state, kw.get("vocab_limit")))


def test_greedy_rows_take_the_argmax_beside_random_rows() -> None:
    rng = np.random.default_rng()
    logits = rng.standard_normal((8, V)).astype(np.float32)
    temp = np.array([0, 1, 0, 1, 0, 1, 0, 1], np.float32)
    got = _draw(logits, temperature=temp)
    np.testing.assert_array_equal(got[temp == 0], logits.argmax(-1)[temp == 0])


def test_top_k_and_top_p_keep_only_the_allowed_tokens() -> None:
    n = 512
    logits = np.tile(np.linspace(0.0, 3.0, V, dtype=np.float32), (n, 1))  # best token: V-1
    seeds = np.stack([np.arange(n), np.arange(n)], 1).astype(np.uint32)
    got = _draw(logits, top_k=np.full(n, 3, np.int32), seeds=seeds)
    assert set(got.tolist()) <= {V - 1, V - 2, V - 3} and len(set(got.tolist())) == 3
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1]  # smallest set >= 0.5
    got = _draw(logits, top_p=np.full(n, 0.5, np.float32), seeds=seeds)
    assert set(got.tolist()) <= set(keep.tolist())
    assert len(set(got.tolist())) > 1
    # top_k at or above the vocabulary, and top_k 0/-1, mean off
    off = [_draw(logits, top_k=np.full(n, k, np.int32), seeds=seeds) for k in (0, -1, V, V + 7)]
    for o in off[1:]:
        np.testing.assert_array_equal(o, off[0])


def test_temperature_follows_the_distribution() -> None:
    n = 4000
    logits = np.tile(np.array([0.0, np.log(3.0)] + [-1e9] * (V - 2), np.float32), (n, 1))
    seeds = np.stack([np.arange(n) // 7, np.arange(n)], 1).astype(np.uint32)
    frac = (_draw(logits, seeds=seeds) == 1).mean()
    assert abs(frac - 0.75) < 0.03, frac  # p(1) = 3/4 at temperature 1
    frac_hot = (_draw(logits, seeds=seeds, temperature=np.full(n, 1e6, np.float32)) == 1).mean()
    assert abs(frac_hot - 0.5) < 0.03, frac_hot  # a very high temperature flattens it


def test_streams_depend_on_seed_and_position_only() -> None:
    rng = np.random.default_rng(0)
    logits = np.tile(rng.standard_normal(V).astype(np.float32), (4, 1))
    seeds = np.array([[0, 5], [0, 5], [1, 5], [0, 6]], np.uint32)
    pos = np.array([3, 3, 3, 3], np.int32)
    a = _draw(logits, seeds=seeds, sample_pos=pos)
    b = _draw(logits[[1, 0, 2, 3]], seeds=seeds[[1, 0, 2, 3]], sample_pos=pos)  # reordered batch
    assert a[0] == a[1] == b[0] == b[1]
    many = [_draw(logits[:1], seeds=seeds[:1], sample_pos=np.array([p], np.int32))[0]
            for p in range(30)]
    assert len(set(many)) > 1  # the position moves the stream


def test_vocab_limit_is_never_sampled() -> None:
    logits = np.zeros((256, V), np.float32)
    logits[:, 40:] = 5.0  # the most likely ids lie past the limit
    seeds = np.stack([np.arange(256), np.zeros(256)], 1).astype(np.uint32)
    got = _draw(logits, seeds=seeds, vocab_limit=40)
    assert got.max() < 40
    assert _draw(logits, temperature=np.zeros(256, np.float32), vocab_limit=40).max() < 40


def test_min_p_keeps_tokens_within_the_fraction_of_the_top() -> None:
    n = 512
    logits = np.tile(np.log(np.array([0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4), np.float32)),
                     (n, 1))
    seeds = np.stack([np.arange(n), np.arange(n)], 1).astype(np.uint32)
    # p >= 0.5 * 0.5 = 0.25 keeps ids 0 and 1 only
    got = _draw(logits, min_p=np.full(n, 0.5, np.float32), seeds=seeds)
    assert set(got.tolist()) == {0, 1}
    # min_p = 1 keeps only the most likely token: the same as greedy
    assert set(_draw(logits, min_p=np.ones(n, np.float32), seeds=seeds).tolist()) == {0}
    assert len(set(_draw(logits, seeds=seeds).tolist())) >= 3  # control: min_p 0 is off


def _ref_penalties(logits, prompt, output, rep, pres, freq, bias):
    out = logits.astype(np.float64).copy()
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    for t, b in bias.items():
        out[t] += b
    return out


def test_penalties_and_bias_match_the_reference() -> None:
    from jaxserve.device.penalties import (
        apply_penalties,
        feed_tokens,
        new_penalty_state,
        set_bias_row,
    )

    rng = np.random.default_rng()
    r = 4
    state = new_penalty_state(r, V)
    logits = rng.standard_normal((3, V)).astype(np.float32) * 3
    # row 0: slot 2 (prompt + output), row 1: no slot, row 2: slot 0 (bias only)
    prompt, output = [3, 4, 4, 9], [9, 7, 7, 7, 11]
    bias = {5: 4.0, 6: -100.0}
    state = set_bias_row(state, jnp.int32(0), jnp.asarray(
        np.array([bias.get(i, 0.0) for i in range(V)], np.float32)))
    toks = np.array(prompt + output + [1, 2], np.int32)  # the last two belong to no slot
    tok_slot = np.array([2] * 9 + [r, r], np.int32)
    is_out = np.array([0] * 4 + [1] * 5 + [1, 0], np.int32)
    reset = np.array([2, r, r], np.int32)
    state = jax.jit(feed_tokens)(state, reset, tok_slot, toks, is_out)
    rows = RowInputs(**_rows(3, slot=np.array([2, r, 0], np.int32),
                             repetition_penalty=np.array([1.3, 1.0, 1.0], np.float32),
                             presence_penalty=np.array([0.5, 0.0, 0.0], np.float32),
                             frequency_penalty=np.array([0.25, 0.0, 0.0], np.float32)))
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), rows, state))
    np.testing.assert_allclose(got[0], _ref_penalties(logits[0], prompt, output, 1.3, 0.5,
                                                      0.25, {}), rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[1], logits[1])
    np.testing.assert_allclose(got[2], _ref_penalties(logits[2], [], [], 1.0, 0, 0, bias),
                               rtol=1e-6, atol=1e-5)
    # a reset forgets the history; feeding it again rebuilds the same row (preemption)
    again = jax.jit(feed_tokens)(state, reset, tok_slot, toks, is_out)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(state.tokens))


def test_logprobs_are_the_raw_log_softmax() -> None:
    from jaxserve.device.sampler import logprobs_of

    rng = np.random.default_rng()
    logits = (rng.standard_normal((5, V)) * 4).astype(np.float32)
    chosen = rng.integers(0, V, 5).astype(np.int32)
    lp = jax.jit(logprobs_of, static_argnames=("k",))(jnp.asarray(logits), chosen, k=4)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    order = np.argsort(-ref, axis=-1)[:, :4]
    np.testing.assert_array_equal(np.asarray(lp.top_ids), order)
    np.testing.assert_allclose(np.asarray(lp.top_logprobs), np.take_along_axis(ref, order, -1),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(lp.chosen_logprob), ref[np.arange(5), chosen],
                               atol=1e-5)
    ranks = (ref > ref[np.arange(5), chosen][:, None]).sum(-1) + 1
    np.testing.assert_array_equal(np.asarray(lp.chosen_rank), ranks)


def _ref_cut(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[float, bool]:
    """The cut of one row by a full descending sort in float64 (vLLM's order), and whether it
    is unambiguous (the top-p boundary not within float32 rounding of ``top_p``)."""
    x = x.astype(np.float64)
    srt = -np.sort(-x)
    cut, clear = -np.inf, True
    if 0 < top_k < len(x):
        cut = srt[top_k - 1]
    if top_p < 1.0:
        kept = srt[srt >= cut]
        p = np.exp(kept - kept[0])
        cum = np.cumsum(p / p.sum())
        idx = int(np.sum(cum < top_p))
        cut = max(cut, kept[min(idx, len(kept) - 1)])
        near = cum[max(idx - 1, 0):idx + 1]
        clear = bool(np.all(np.abs(near - top_p) > 1e-4))
    if min_p > 0:
        cut = max(cut, srt[0] + np.log(min_p))
    return cut, clear


def _random_rows(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """f32[n, vocab] logits of several spreads, a third of the rows with many ties."""
    x = rng.standard_normal((n, vocab)) * rng.choice([0.5, 2.0, 6.0], (n, 1))
    x[: n // 3] = np.round(x[: n // 3], 1)
    return x.astype(np.float32)


def test_top_k_threshold_equals_the_sorted_definition() -> None:
    from jaxserve.device.sampler import top_k_threshold

    rng = np.random.default_rng(7)
    fn = jax.jit(top_k_threshold)
    # per step, the largest k picks 256 blocks of 16 ids (where the vocabulary has as many) or
    # the bisection
    tiers = [[0, -1, 1, 5, 40, 63, 64], [0, 1, 40, 65, 100, 255, 256], [0, 5, 256, 257, 400, -2],
             [1, 300, 1000, 1024], [2, 1025, 3000]]
    for vocab in (50, 300, 1000, 5000, 20000):
        for tier in tiers:
            n = 64
            x = _random_rows(rng, n, vocab)
            top_k = rng.choice(tier + [vocab, vocab + 3], n).astype(np.int32)
            top_k[top_k == -2] = vocab - 1
            cut = np.asarray(fn(jnp.asarray(x), top_k))
            for i in range(n):
                ref, _ = _ref_cut(x[i], int(top_k[i]), 1.0, 0.0)
                np.testing.assert_array_equal(np.flatnonzero(x[i] >= cut[i]),
                                              np.flatnonzero(x[i] >= ref),
                                              err_msg=f"V={vocab} row {i}: k={top_k[i]}")


def test_filtered_draws_stay_in_the_sorted_definition_and_reach_its_edge() -> None:
    """Top-k, top-p (rejection) and min-p against a float64 sort: each row drawn under 300
    seeds never leaves the kept set, and takes its least likely kept token whenever that one's
    renormalised chance makes missing it in 300 draws improbable (< 1e-5)."""
    from jaxserve.device.sampler import draw_filtered, top_k_threshold

    rng = np.random.default_rng(11)
    ks = [0, 0, 1, 5, 40, 65, 100]
    ps = [1.0, 0.999, 0.95, 0.9, 0.5, 0.1, 1e-9]
    mps = [0.0, 0.0, 0.0, 0.01, 0.3, 1.0]
    reps = 300

    @jax.jit
    def draw(x, top_k, top_p, min_p, seeds):
        scaled = x - jnp.max(x, axis=-1, keepdims=True)
        return draw_filtered(scaled, top_k_threshold(scaled, top_k), top_p, min_p, seeds,
                             jnp.zeros(len(x), jnp.int32))

    checked = edges = 0
    for vocab in (50, 1000):
        n = 48
        x = _random_rows(rng, n, vocab)
        x -= x.max(-1, keepdims=True)
        top_k = rng.choice(ks, n).astype(np.int32)
        top_p = rng.choice(ps, n).astype(np.float32)
        min_p = rng.choice(mps, n).astype(np.float32)
        seeds = np.stack([np.arange(n * reps), np.full(n * reps, 3)], 1).astype(np.uint32)
        got = np.asarray(draw(jnp.asarray(np.repeat(x, reps, 0)), np.repeat(top_k, reps),
                              np.repeat(top_p, reps), np.repeat(min_p, reps), seeds))
        got = got.reshape(n, reps)
        for i in range(n):
            ref, clear = _ref_cut(x[i], int(top_k[i]), float(top_p[i]), float(min_p[i]))
            if not clear:
                continue
            checked += 1
            keep = x[i].astype(np.float64) >= ref
            msg = f"V={vocab} row {i}: k={top_k[i]} p={top_p[i]} min_p={min_p[i]}"
            assert keep[got[i]].all(), msg
            w = np.where(keep, np.exp(x[i].astype(np.float64)), 0.0)
            edge = np.flatnonzero(keep & (x[i] == x[i][keep].min()))
            if (1 - w[edge].sum() / w.sum()) ** reps < 1e-5:
                edges += 1
                assert np.isin(edge, got[i]).any(), msg
    assert checked > 80 and edges > 20


def test_draw_follows_the_filtered_distribution() -> None:
    """Over a vocabulary of several draw blocks: no token outside the kept set, and the
    frequencies match the renormalised probabilities."""
    vocab, n = 700, 20000
    rng = np.random.default_rng(3)
    row = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    logits = np.tile(row, (n, 1))
    seeds = np.stack([np.arange(n) // 5, np.arange(n)], 1).astype(np.uint32)
    rows = RowInputs(**_rows(n, seeds=seeds, top_p=np.full(n, 0.8, np.float32),
                             temperature=np.full(n, 0.9, np.float32)))
    got = np.asarray(sample_jit(jnp.asarray(logits), rows, None, None))
    x = row / np.float32(0.9)  # scaled as the sampler scales, in float32
    cut, _ = _ref_cut(x, 0, 0.8, 0.0)
    keep = x >= cut
    x = x.astype(np.float64)
    assert keep.sum() > 50  # the nucleus spans several blocks' worth of ids
    assert keep[got].all()
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    freq = np.bincount(got, minlength=vocab) / n
    assert 0.5 * np.abs(freq - p).sum() < 0.05  # total variation; ~0.03 expected from noise


def test_greedy_takes_the_first_of_tied_maxima() -> None:
    logits = np.zeros((3, V), np.float32)
    logits[0, [7, 3, 40]] = 2.0
    logits[1, :] = 1.0
    logits[2, V - 1] = 5.0
    got = _draw(logits, temperature=np.zeros(3, np.float32))
    np.testing.assert_array_equal(got, [3, 0, V - 1])


def test_a_tiny_temperature_draws_the_argmax() -> None:
    """logits / 1e-9 would reach 1e10 (one ulp = 1024): the draw must still take the best."""
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((16, 700)) * 3 + 15).astype(np.float32)
    rows = RowInputs(**_rows(16, temperature=np.full(16, 1e-9, np.float32)))
    got = np.asarray(sample_jit(jnp.asarray(logits), rows, None, None))
    np.testing.assert_array_equal(got, logits.argmax(-1))


def test_masked_tokens_stay_masked_at_any_temperature() -> None:
    """-1e30 / 1e30 = -1 would sit beside the allowed logits: masks must outlast scaling."""
    n = 64
    logits = np.zeros((n, V), np.float32)
    logits[:, :3] = 5.0
    masked = np.asarray(jax.jit(suppress_tokens)(
        jnp.asarray(logits), jnp.tile(jnp.arange(3, V, dtype=jnp.int32), (n, 1))))
    seeds = np.stack([np.arange(n), np.arange(n)], 1).astype(np.uint32)
    for t in (1.0, 1e6, 1e30, 3e38):
        got = _draw(masked, temperature=np.full(n, t, np.float32), seeds=seeds)
        assert set(got.tolist()) <= {0, 1, 2}, t


def test_suppressed_ids_are_never_sampled_and_padding_masks_nothing() -> None:
    """Each row masks its own ids (min_tokens' EOS / stop ids), repeats included; -1 and ids
    outside the vocabulary are padding; a step with no id to mask leaves the logits as they
    were."""
    rng = np.random.default_rng()
    n = 256
    logits = rng.standard_normal((n, V)).astype(np.float32)
    logits[:, 7] = 50.0  # every row's argmax, and all but certain under sampling
    ids = np.full((n, 4), -1, np.int32)
    ids[::2, 0] = 7  # even rows may not take it
    ids[::4, 2] = 7  # a repeat
    ids[2::4, 1] = 33  # a second id, in the next bitmask word
    ids[1::4, 1] = V + 3  # out of range: nothing
    suppress = jax.jit(suppress_tokens)
    masked = np.asarray(suppress(jnp.asarray(logits), jnp.asarray(ids)))
    assert (masked[::2, 7] < -1e29).all() and (masked[2::4, 33] < -1e29).all()
    np.testing.assert_array_equal(np.delete(masked[::4], 7, axis=1), np.delete(logits[::4], 7, 1))
    np.testing.assert_array_equal(np.delete(masked[2::4], [7, 33], axis=1),
                                  np.delete(logits[2::4], [7, 33], axis=1))
    np.testing.assert_array_equal(masked[1::2], logits[1::2])
    seeds = np.stack([np.arange(n), np.arange(n)], 1).astype(np.uint32)
    for temp in (0.0, 1.0):
        got = _draw(masked, temperature=np.full(n, temp, np.float32), seeds=seeds)
        assert (got[::2] != 7).all() and (got[1::2] == 7).all()
    none = np.asarray(suppress(jnp.asarray(logits), jnp.full((n, 4), -1, jnp.int32)))
    np.testing.assert_array_equal(none, logits)


def _bitmask(allowed_ids: list[list[int]] | None, n: int, vocab: int) -> np.ndarray:
    """i32[n, ceil(vocab / 32)] with the given ids' bits set per row (None row: all bits)."""
    words = -(-vocab // 32)
    out = np.zeros((n, words), np.uint32)
    for i, ids in enumerate(allowed_ids):
        if ids is None:
            out[i] = 0xFFFFFFFF
        for t in ids or ():
            out[i, t >> 5] |= np.uint32(1 << (t & 31))
    return out.view(np.int32)


def test_allowed_mask_keeps_only_its_tokens_per_row_and_all_ones_change_nothing() -> None:
    """A constrained row's bitmask (bit t & 31 of word t >> 5) leaves only its tokens
    sampleable, under greedy and random sampling, with the suppressed ids still masked; rows
    with every bit set keep their logits bit for bit, and so does every row when the step's
    flag says no mask was sent."""
    rng = np.random.default_rng()
    n, vocab = 6, 70  # 70: the last mask word is partly beyond the vocabulary
    logits = rng.standard_normal((n, vocab)).astype(np.float32)
    logits[:, 5] = 40.0  # every row's argmax
    rows = [[3, 33, 69], None, [64], None, [5, 6], [0, 1, 2, 40]]
    allowed = jnp.asarray(_bitmask(rows, n, vocab))
    ids = np.full((n, 2), -1, np.int32)
    ids[4, 0] = 5  # row 4 also suppresses 5 (min_tokens): only 6 is left
    masked = np.asarray(jax.jit(suppress_tokens)(jnp.asarray(logits), jnp.asarray(ids), allowed))
    for i, keep in enumerate(rows):
        kept = set(range(vocab)) if keep is None else set(keep) - ({5} if i == 4 else set())
        np.testing.assert_array_equal(masked[i, sorted(kept)], logits[i, sorted(kept)])
        assert (np.delete(masked[i], sorted(kept)) < -1e29).all()
    seeds = np.stack([np.arange(n), np.arange(n)], 1).astype(np.uint32)
    for temp in (0.0, 1.0):
        for pos in range(20):
            got = _draw(masked, temperature=np.full(n, temp, np.float32), seeds=seeds,
                        sample_pos=np.full(n, pos, np.int32))
            assert got[0] in rows[0] and got[2] == 64 and got[4] == 6 and got[5] in rows[5]
            assert got[1] == 5 or temp > 0
    ones = jnp.full((n, -(-vocab // 32)), -1, jnp.int32)
    none = np.asarray(jax.jit(suppress_tokens)(jnp.asarray(logits), jnp.full((n, 2), -1),
                                               ones))
    np.testing.assert_array_equal(none, logits)
    # the flag decides: a mask with use_allowed False is not read, with True it is
    flagged = jax.jit(suppress_tokens)
    off = np.asarray(flagged(jnp.asarray(logits), jnp.full((n, 2), -1), allowed, False))
    np.testing.assert_array_equal(off, logits)
    on = np.asarray(flagged(jnp.asarray(logits), jnp.asarray(ids), allowed, True))
    np.testing.assert_array_equal(on, masked)


def test_greedy_over_several_blocks_is_the_first_argmax() -> None:
    """A vocabulary of several 256-id blocks (and a padded last one): the first of tied maxima
    across blocks, and jnp.argmax on random rows."""
    vocab = 1000
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, vocab)).astype(np.float32)
    logits[0, [700, 300, 999]] = 9.0  # ties in blocks 1, 2 and the padded block 3
    logits[1, [999]] = 9.0
    logits[2, :] = -1e30  # all masked: the first id
    got = _draw(logits, temperature=np.zeros(6, np.float32))
    assert got[:3].tolist() == [300, 999, 0]
    np.testing.assert_array_equal(got[3:], logits[3:].argmax(-1))
