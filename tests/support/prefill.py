"""One ragged prefill through any ``models.registry.CausalLM``: logits of every position.

Used by the checkpoint, HF-safetensors and bring-your-own-model tests to compare a loaded model
with its source (or with HF goldens) without the engine's sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.interface import AttentionMetadata
from pallas_kernels import allocate_kv_cache

BLOCK_SIZE = 16
_FNS: dict = {}  # (model class, config, dtype) -> jitted forward + logits, so tests share compiles


def prefill_logits(model, params, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Run ``seqs`` (token ids, each from position 0) as one ragged step in a fresh paged cache.

    Returns per sequence ``f32[len(seq), vocab]``. Sequences get consecutive blocks after the
    reserved block 0.
    """
    cfg = model.cfg
    blocks = [-(-len(s) // BLOCK_SIZE) for s in seqs]
    kv = allocate_kv_cache(cfg.num_layers, 1 + sum(blocks), BLOCK_SIZE, cfg.num_kv_heads,
                           cfg.head_dim, model.dtype)
    width = max(blocks)
    tables = np.zeros((len(seqs), width), np.int32)
    tok, pos, slots, qsl = [], [], [], [0]
    nxt = 1
    for i, (s, nb) in enumerate(zip(seqs, blocks, strict=True)):
        tables[i, :nb] = np.arange(nxt, nxt + nb)
        nxt += nb
        p = np.arange(len(s))
        tok += list(s)
        pos += p.tolist()
        slots += (tables[i, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE).tolist()
        qsl.append(qsl[-1] + len(s))
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray([len(s) for s in seqs], jnp.int32),
        query_start_loc=jnp.asarray(qsl, jnp.int32),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32))

    key = (type(model), cfg, jnp.dtype(model.dtype))
    if key not in _FNS:
        def forward_logits(params, kv, tok, pos, md):
            hidden, _ = model.forward(params, tok, pos, kv, md)
            return model.compute_logits(params, hidden)

        _FNS[key] = jax.jit(forward_logits)
    fn = _FNS[key]
    logits = np.asarray(fn(params, kv, jnp.asarray(tok, jnp.int32), jnp.asarray(pos, jnp.int32),
                           md))
    return [logits[qsl[i]:qsl[i + 1]] for i in range(len(seqs))]
