"""Random ragged paged-attention inputs for tests and the GPU check (numpy only).

Shared by tests/kernels/test_attention.py, tests/kernels/test_pallas_attention.py and
scripts/gpu_check.py, so all three exercise the same adversarial layout: permuted block tables, NaN
in every page and slot no sequence owns, padding sequences and tokens.
"""

from __future__ import annotations

import numpy as np


def make_case(rng: np.random.Generator, q_lens: list[int], ctx_lens: list[int], *,
              block_size: int, num_seqs_pad: int, tokens_pad: int, num_layers: int = 2,
              kv_heads: int = 2, group: int = 3, head_dim: int = 16, extra_blocks: int = 4):
    """A ragged batch over a random paged cache.

    Block tables are a random permutation of blocks 1..; every page no sequence owns and every
    slot past a context holds NaN. Padded sequences have zero query rows and a zero context, and
    tokens past the last real one are padding.
    Returns ``(q, k, v, block_tables, seq_lens, query_start_loc, num_seqs)`` as float64/int32
    numpy arrays.
    """
    if len(q_lens) != len(ctx_lens) or any(q > c for q, c in zip(q_lens, ctx_lens)):
        raise ValueError(f"need one context per query length, each >= it: {q_lens=} {ctx_lens=}")
    if sum(q_lens) > tokens_pad or len(q_lens) > num_seqs_pad:
        raise ValueError(f"{sum(q_lens)=} tokens of {len(q_lens)} sequences do not fit "
                         f"{tokens_pad=}, {num_seqs_pad=}")
    nbs = [-(-c // block_size) for c in ctx_lens]
    max_blocks = max(nbs) + 1
    num_blocks = 1 + sum(nbs) + extra_blocks
    shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
    k = np.full(shape, np.nan)
    v = np.full(shape, np.nan)
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((num_seqs_pad, max_blocks), np.int32)
    used = 0
    for s, (c, nb) in enumerate(zip(ctx_lens, nbs)):
        tables[s, :nb] = perm[used:used + nb]
        used += nb
        pos = np.arange(c)
        blk, off = tables[s, pos // block_size], pos % block_size
        k[:, blk, off] = rng.standard_normal((num_layers, c, kv_heads, head_dim))
        v[:, blk, off] = rng.standard_normal((num_layers, c, kv_heads, head_dim))
    qsl = np.zeros(num_seqs_pad + 1, np.int32)
    qsl[1:len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1:] = qsl[len(q_lens)]
    seq_lens = np.zeros(num_seqs_pad, np.int32)
    seq_lens[:len(ctx_lens)] = ctx_lens
    q = rng.standard_normal((tokens_pad, kv_heads * group, head_dim)) * 2.0
    return q, k, v, tables, seq_lens, qsl, np.array([len(q_lens)], np.int32)
