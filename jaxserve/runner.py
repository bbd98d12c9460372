"""The model runner: turns a scheduler plan into one padded step and runs the compiled program.

Per step:
  ``SchedulerOutput`` -> ``pack_step`` (numpy, into a preallocated ``i32`` buffer of the bucket's
  layout, floats bit-cast) -> one host-to-device transfer -> the bucket's compiled program
  ``step(params, kv_cache, packed) -> (kv_cache, sampled i32[S])`` with ``kv_cache`` donated ->
  sampled ids back to the host.
Every bucket's program is compiled once by ``warmup``; ``execute`` only looks programs up, so
serving never compiles (``num_compiles`` counts, and a test checks the jax compile events too).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.buckets import Bucket, make_buckets, pick_bucket
from jaxserve.sampler import sample
from models.llama import AttentionMetadata, LlamaForCausalLM
from pallas_kernels import KVCache
from pallas_kernels.kv_cache import PADDING_SLOT


@dataclass(frozen=True)
class RowParams:
    """Host-side sampling inputs of one scheduled sequence.

    temperature (0 = greedy), top_k (<= 0 off), top_p, seed (u64: the full 64 bits key the
    stream), sample_pos (output index of the token this step samples).
    """

    temperature: float
    top_k: int
    top_p: float
    seed: int
    sample_pos: int


class _Layout:
    """Offsets of each field in the packed ``i32`` step buffer of one bucket."""

    def __init__(self, bucket: Bucket, max_blocks: int) -> None:
        t, s = bucket.num_tokens, bucket.num_seqs
        sizes = [("token_ids", t), ("positions", t), ("slot_mapping", t),
                 ("block_tables", s * max_blocks), ("seq_lens", s), ("query_start_loc", s + 1),
                 ("num_seqs", 1), ("logits_indices", s), ("temperature", s), ("top_k", s),
                 ("top_p", s), ("seed_hi", s), ("seed_lo", s), ("sample_pos", s)]
        self.slices: dict[str, slice] = {}
        off = 0
        for name, n in sizes:
            self.slices[name] = slice(off, off + n)
            off += n
        self.size = off
        self.bucket = bucket
        self.max_blocks = max_blocks


class ModelRunner:
    """Owns params, the KV cache and the compiled step programs.

    Args:
      model: the model (``forward`` / ``compute_logits`` protocol).
      params: its params pytree, on the device.
      kv_cache: the paged cache; donated to every step and replaced by the result.
      max_num_batched_tokens, max_num_seqs: bucket limits.
      max_blocks_per_seq: block-table width (``cdiv(max_model_len, block_size)``).
      vocab_limit: ids at or above it are never sampled (tokenizer smaller than the embedding).
    """

    def __init__(self, model: LlamaForCausalLM, params, kv_cache: KVCache, *,
                 max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 vocab_limit: int | None = None) -> None:
        self.model = model
        self.params = params
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.max_blocks = max_blocks_per_seq
        self.buckets = make_buckets(max_num_batched_tokens, max_num_seqs)
        self.layouts = {b: _Layout(b, max_blocks_per_seq) for b in self.buckets}
        self.buffers = {b: np.zeros(lay.size, np.int32) for b, lay in self.layouts.items()}
        self.vocab_limit = vocab_limit
        self.compiled: dict[Bucket, jax.stages.Compiled] = {}
        self.num_compiles = 0

    # -- the device program ------------------------------------------------------------------
    def _step_fn(self, layout: _Layout):
        model, sl, b = self.model, layout.slices, layout.bucket

        def step(params, kv_cache: KVCache, packed: jax.Array):
            f = lambda name: packed[sl[name]]
            as_f32 = lambda name: jax.lax.bitcast_convert_type(f(name), jnp.float32)
            md = AttentionMetadata(
                slot_mapping=f("slot_mapping"),
                block_tables=f("block_tables").reshape(b.num_seqs, layout.max_blocks),
                seq_lens=f("seq_lens"), query_start_loc=f("query_start_loc"),
                num_seqs=f("num_seqs"))
            hidden, kv_cache = model.forward(params, f("token_ids"), f("positions"), kv_cache,
                                             md)
            logits = model.compute_logits(params, hidden[f("logits_indices")])
            seeds = jax.lax.bitcast_convert_type(
                jnp.stack([f("seed_hi"), f("seed_lo")], axis=-1), jnp.uint32)  # [S, 2]
            ids = sample(logits, as_f32("temperature"), f("top_k"), as_f32("top_p"), seeds,
                         f("sample_pos"), self.vocab_limit)
            return kv_cache, ids

        return step

    def warmup(self, progress: bool = True) -> dict[str, float]:
        """Compile every bucket's program (once; the persistent cache makes reruns cheap).

        Returns {"num_programs", "compile_s"}.
        """
        t0 = time.perf_counter()
        todo = [b for b in self.buckets if b not in self.compiled]
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(todo), desc="compiling step programs", unit="program")
        for b in todo:
            lay = self.layouts[b]
            jitted = jax.jit(self._step_fn(lay), donate_argnums=(1,))
            packed = jax.ShapeDtypeStruct((lay.size,), jnp.int32)
            self.compiled[b] = jitted.lower(self.params, self.kv_cache, packed).compile()
            self.num_compiles += 1
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return {"num_programs": float(len(self.buckets)), "compile_s": time.perf_counter() - t0}

    # -- host side -----------------------------------------------------------------------------
    def pack_step(self, token_ids: Sequence[Sequence[int]], start_pos: Sequence[int],
                  block_ids: Sequence[Sequence[int]], rows: Sequence[RowParams],
                  sample_index: Sequence[int] | None = None) -> tuple[Bucket, np.ndarray]:
        """Fill the bucket's buffer for a ragged batch.

        Args (one entry per scheduled sequence, in batch order): token_ids (this step's tokens),
        start_pos (position of the first of them), block_ids (the whole block table), rows
        (sampling inputs), sample_index (which of this step's tokens each sequence samples
        from, in ``[0, len(token_ids[i]))``; default: its last token; the static-batching
        baseline samples a right-padded prompt at its last real token).
        Returns the bucket and its packed ``i32`` buffer (reused across steps).
        Raises ValueError if no bucket fits, or a block table is wider than max_blocks_per_seq.
        """
        q_lens = [len(t) for t in token_ids]
        num_tokens, num_seqs = sum(q_lens), len(q_lens)
        b = pick_bucket(self.buckets, num_tokens, num_seqs)
        lay, buf = self.layouts[b], self.buffers[b]
        sl = lay.slices
        buf[:] = 0
        tok = np.fromiter((x for t in token_ids for x in t), np.int32, num_tokens)
        buf[sl["token_ids"]][:num_tokens] = tok
        qsl = np.zeros(b.num_seqs + 1, np.int32)
        np.cumsum(q_lens, out=qsl[1:num_seqs + 1])
        qsl[num_seqs + 1:] = num_tokens
        buf[sl["query_start_loc"]] = qsl
        pos = np.arange(num_tokens, dtype=np.int32) - np.repeat(qsl[:num_seqs], q_lens) + \
            np.repeat(np.asarray(start_pos, np.int32), q_lens)
        buf[sl["positions"]][:num_tokens] = pos
        tables = buf[sl["block_tables"]].reshape(b.num_seqs, lay.max_blocks)
        for i, blocks in enumerate(block_ids):
            if len(blocks) > lay.max_blocks:
                raise ValueError(f"block table of {len(blocks)} blocks exceeds "
                                 f"max_blocks_per_seq={lay.max_blocks}")
            tables[i, :len(blocks)] = blocks
        seq_of_tok = np.repeat(np.arange(num_seqs), q_lens)
        blk = tables[seq_of_tok, pos // self.block_size]
        slots = buf[sl["slot_mapping"]]
        slots[:] = PADDING_SLOT
        slots[:num_tokens] = blk * self.block_size + pos % self.block_size
        buf[sl["seq_lens"]][:num_seqs] = np.asarray(start_pos, np.int32) + np.asarray(q_lens)
        buf[sl["num_seqs"]] = num_seqs
        if sample_index is None:
            buf[sl["logits_indices"]][:num_seqs] = qsl[1:num_seqs + 1] - 1
        else:
            buf[sl["logits_indices"]][:num_seqs] = qsl[:num_seqs] + np.asarray(sample_index)
        temp = np.zeros(b.num_seqs, np.float32)
        top_p = np.ones(b.num_seqs, np.float32)
        temp[:num_seqs] = [r.temperature for r in rows]
        top_p[:num_seqs] = [r.top_p for r in rows]
        buf[sl["temperature"]] = temp.view(np.int32)
        buf[sl["top_p"]] = top_p.view(np.int32)
        buf[sl["top_k"]][:num_seqs] = [r.top_k for r in rows]
        seeds = np.array([r.seed for r in rows], np.uint64)
        buf[sl["seed_hi"]][:num_seqs] = (seeds >> np.uint64(32)).astype(np.uint32).view(np.int32)
        buf[sl["seed_lo"]][:num_seqs] = (seeds & np.uint64(0xFFFFFFFF)).astype(np.uint32) \
            .view(np.int32)
        buf[sl["sample_pos"]][:num_seqs] = [r.sample_pos for r in rows]
        return b, buf

    def execute(self, bucket: Bucket, packed: np.ndarray) -> np.ndarray:
        """Run one step; returns the sampled ids ``i32[num_seqs_bucket]`` on the host.

        Raises:
          RuntimeError: if the bucket was not compiled by warmup (serving never compiles).
        """
        prog = self.compiled.get(bucket)
        if prog is None:
            raise RuntimeError(f"bucket {bucket} was not compiled; call warmup() first")
        self.kv_cache, ids = prog(self.params, self.kv_cache, packed)
        return np.asarray(ids)
