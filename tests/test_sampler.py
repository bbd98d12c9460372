"""The on-device sampler: per-row parameters, filtering, seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampler import sample

V = 50
sample_jit = jax.jit(sample, static_argnames=("vocab_limit",))


def _rows(n: int, **kw):
    base = {"temperature": np.ones(n, np.float32), "top_k": np.zeros(n, np.int32),
            "top_p": np.ones(n, np.float32),
            "seeds": np.stack([np.zeros(n), np.arange(n)], 1).astype(np.uint32),
            "sample_pos": np.zeros(n, np.int32)}
    base.update(kw)
    return base


def _draw(logits: np.ndarray, **kw) -> np.ndarray:
    r = _rows(len(logits), **kw)
    return np.asarray(sample_jit(jnp.asarray(logits), r["temperature"], r["top_k"], r["top_p"],
                                 r["seeds"], r["sample_pos"], kw.get("vocab_limit")))


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
