"""What batch invariance relies on, checked on the machine that runs the tests: XLA:CPU's dots of
SmolLM2's weight shapes give each row bit-identical results at every bucket from the
platform's row floor up (``cpu.DOT_ROW_FLOORS``), and ``models.llama.pairwise_sum`` (the norms'
sum) does at every row count, where XLA's reduce does not (docs/configuration.md
#batch-invariance). A CPU whose dot kernels change at other row counts fails here first."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device.buckets import token_buckets
from jaxserve.platform import cpu
from models.llama import pairwise_sum
from models.quant import qmatmul

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's row classes")

SHAPES = [(576, 1536), (1536, 576), (576, 192)]  # SmolLM2's layer weights, [k, n]
HEAD = (49152, 576)  # its tied LM head, contracted transposed


def _rows(f, x: np.ndarray, w: jax.Array, counts: list[int]) -> dict[int, np.ndarray]:
    """The first 3 rows of ``f(x[:t], w)`` for each ``t``, each from its own program."""
    return {t: np.asarray(jax.jit(f)(jnp.asarray(x[:t]), w))[:3] for t in counts}




@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dots_from_the_row_floor_up_are_one_row_class(dtype: str) -> None:
    floor = cpu.DOT_ROW_FLOORS[dtype]
    counts = sorted(set(token_buckets(1024, cpu.SMALL_BUCKETS, 64, floor)))
    assert counts[0] >= floor and counts[-1] == 1024
    rng = np.random.default_rng(0)
    for k, n in SHAPES:
        x = rng.standard_normal((1024, k)).astype(np.float32)
        w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, dtype)
        got = _rows(qmatmul, x, w, counts)  # the model's matmul
        odd = [t for t in counts if not np.array_equal(got[t], got[1024][:len(got[t])])]
        assert not odd, f"{dtype} [{k}, {n}]: rows at {odd} tokens differ from 1024's"
    # the LM head runs on the sampler's rows, none below the floor and never 1
    x = rng.standard_normal((64, HEAD[1])).astype(np.float32)
    w = jnp.asarray(rng.standard_normal(HEAD) * 0.05, dtype)
    head = functools.partial(qmatmul, transpose=True)
    rows = cpu.cpu_sampler_rows(64, floor)
    got = _rows(head, x, w, sorted(set(rows) | {64}))
    assert all(np.array_equal(got[r], got[64][:len(got[r])]) for r in rows), rows


def test_pairwise_sum_is_one_row_class_and_sums() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1024, 576)).astype(np.float32)
    counts = [1, 2, 3, 4, 5, 8, 64, 1024]
    tree = _rows(lambda x, _: pairwise_sum(x * x), x, None, counts)
    assert all(np.array_equal(tree[t], tree[1024][:len(tree[t])]) for t in counts)
    np.testing.assert_allclose(tree[1024][:, 0], (x[:3] ** 2).sum(-1), rtol=1e-5)
    odd = [5, 7, 9, 36]
    for n in odd:  # odd widths carry their last element up a level
        y = rng.standard_normal((2, n)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(pairwise_sum(jnp.asarray(y)))[:, 0], y.sum(-1),
                                   rtol=1e-5)
    assert pairwise_sum(jnp.ones((3, 1))).shape == (3, 1)
