"""The packed step buffer: one ragged step's host inputs in one ``i32`` array per bucket.

A step's tokens, positions, slot mapping, block tables, sequence lengths, logits indices and
each row's sampling inputs (floats bit-cast) are written with numpy into a preallocated buffer
of the bucket's ``Layout``, and sent to the device in one transfer. The model program reads
the fields before ``Layout.sampler_start``; the sampler program reads the tail, laid out the
same for every bucket with as many rows. ``flags`` selects the optional work: logprobs,
prompt logprobs, and (set by ``ModelRunner.execute``) an allowed-token mask sent beside it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from jaxserve.device.buckets import Bucket, pick_bucket
from jaxserve.sampling_params import MAX_MIN_TOKENS_STOP_IDS
from pallas_kernels.kv_cache import PADDING_SLOT

FLAG_LOGPROBS = 1
FLAG_PROMPT_LOGPROBS = 2
FLAG_ALLOWED = 4  # set by ModelRunner.execute when a mask is sent


class StepChunk(Protocol):
    """One scheduled sequence's share of a step, as ``pack_step`` reads it (the scheduler's
    ``ScheduledSeq`` is one; ``device/`` imports nothing from ``core/``)."""

    token_ids: Sequence[int]  # this step's tokens, at positions start_pos ..
    start_pos: int
    block_ids: Sequence[int]  # the whole block table


@dataclass(frozen=True)
class Chunk:
    """A ``StepChunk`` for callers without a scheduler plan (probes, benchmarks)."""

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int]


@dataclass(frozen=True)
class RowParams:
    """Host-side sampling inputs of one scheduled sequence.

    temperature (0 = greedy), top_k (<= 0 off), top_p, seed (u64: the full 64 bits key the
    stream), sample_pos (output index of the token this step samples), min_p (0 off).
    Penalties: slot (the request's penalty-state slot, -1 = none; see jaxserve.device.sampler),
    repetition / presence / frequency penalty, reset (restart the slot's history: the chunk
    starts at position 0), num_prompt_tokens (tokens of the request at positions below it are
    prompt tokens). prompt_targets: for prompt logprobs, per token of this step's chunk the
    prompt token id that follows it (-1: none); None when the request does not ask.
    suppress_ids: ids this step must not sample (EOS and stop ids while the request is short of
    min_tokens), at most ``MAX_MIN_TOKENS_STOP_IDS``.
    """

    temperature: float
    top_k: int
    top_p: float
    seed: int
    sample_pos: int
    min_p: float = 0.0
    slot: int = -1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    reset: bool = False
    num_prompt_tokens: int = 0
    prompt_targets: Sequence[int] | None = None
    suppress_ids: Sequence[int] = ()


def _sampler_fields(s: int) -> list[tuple[str, int]]:
    """The packed fields the sampler program reads, in order: the buffer's tail, laid out the
    same for every bucket of ``s`` rows."""
    return [("temperature", s), ("top_k", s), ("top_p", s), ("seed_hi", s), ("seed_lo", s),
            ("sample_pos", s), ("min_p", s), ("slot", s), ("repetition_penalty", s),
            ("presence_penalty", s), ("frequency_penalty", s),
            ("suppress_ids", s * MAX_MIN_TOKENS_STOP_IDS), ("flags", 1)]


def sampler_rows_for(num_seqs: int, sampler_rows: tuple[int, ...]) -> int:
    """The rows of the sampler program a bucket of ``num_seqs`` rows shares: the smallest of
    ``sampler_rows`` at least ``num_seqs``; ``num_seqs`` itself when there is none."""
    return min((r for r in sampler_rows if r >= num_seqs), default=num_seqs)


def _offsets(sizes: list[tuple[str, int]], start: int = 0) -> tuple[dict[str, slice], int]:
    out, off = {}, start
    for name, n in sizes:
        out[name] = slice(off, off + n)
        off += n
    return out, off


class Layout:
    """Offsets of each field in the packed ``i32`` step buffer of one bucket: the model
    program's fields, then the sampler's (``sampler_start`` on; ``sampler_slices`` relative
    to it, the same for every bucket with as many sampler rows). ``sampler_rows`` (>= the
    bucket's rows, default equal) is the row count of the sampler program the bucket shares:
    its logits are padded to it, and its sampler fields have that many rows."""

    def __init__(self, bucket: Bucket, max_blocks: int, sampler_rows: int | None = None
                 ) -> None:
        t, s = bucket.num_tokens, bucket.num_seqs
        self.sampler_rows = r = s if sampler_rows is None else sampler_rows
        if r < s:
            raise ValueError(f"Layout: sampler_rows={r} is less than the bucket's {s} rows")
        model = [("token_ids", t), ("positions", t), ("slot_mapping", t),
                 ("block_tables", s * max_blocks), ("seq_lens", s), ("query_start_loc", s + 1),
                 ("num_seqs", 1), ("logits_indices", s), ("reset_slot", s),
                 ("tok_slot", t), ("tok_is_output", t), ("tok_target", t), ("src_row", t)]
        self.slices, self.sampler_start = _offsets(model)
        tail, self.size = _offsets(_sampler_fields(r), self.sampler_start)
        self.slices.update(tail)
        self.sampler_slices = _offsets(_sampler_fields(r))[0]
        self.bucket = bucket
        self.max_blocks = max_blocks


class StepPacker:
    """Fills a bucket's buffer for one ragged step.

    Args:
      buckets: the compiled step shapes, ascending.
      max_blocks: block-table width per sequence.
      block_size: tokens per KV block.
      num_penalty_slots: rows of the penalty state (the "no slot" value in the buffer).
      sampler_rows: the row counts that have a sampler program; a bucket samples with the
        smallest at least its rows (``sampler_rows_for``; empty: its own row count).

    Attribute ``usable``: the buckets a step may be packed into, ascending (default: all);
    while some programs are still compiling it holds the compiled ones, and a step goes into
    the smallest of them that holds it (``ModelRunner.warmup``). The largest bucket is always
    among them, so every step still fits. Replaced whole, never changed in place, so another
    thread may publish a new list between steps. ``wanted`` counts, per bucket not yet usable,
    the steps that padded up for want of it (what to compile next).
    """

    def __init__(self, buckets: list[Bucket], max_blocks: int, block_size: int,
                 num_penalty_slots: int, sampler_rows: tuple[int, ...] = ()) -> None:
        self.buckets, self.block_size = buckets, block_size
        self.usable: list[Bucket] = list(buckets)
        self.wanted: collections.Counter[Bucket] = collections.Counter()
        self.num_penalty_slots = num_penalty_slots
        self.layouts = {b: Layout(b, max_blocks, sampler_rows_for(b.num_seqs, sampler_rows))
                        for b in buckets}
        # two buffers per bucket, used in turn: a dispatched step may still read its buffer
        # (on the CPU the program can alias the numpy memory) while the next one is packed
        self.buffers = {b: (np.zeros(lay.size, np.int32), np.zeros(lay.size, np.int32))
                        for b, lay in self.layouts.items()}
        self._num_packed = 0

    def pack(self, chunks: Sequence[StepChunk], rows: Sequence[RowParams], *,
                  sample_index: Sequence[int] | None = None, want_logprobs: bool = False,
                  src_rows: Sequence[int] | None = None) -> tuple[Bucket, np.ndarray]:
        """Fill the bucket's i32 buffer for one ragged step; returns (bucket, buffer), the
        buffer reused every other call (a step dispatched with it must have finished by then).

        Args:
          chunks: the scheduled sequences, in batch order.
          rows: their sampling inputs. Prompt logprobs are computed when any row has
            ``prompt_targets``.
          sample_index: per chunk, the token whose logits are sampled, in
            ``[0, len(token_ids))`` (default: its last; the static-batching baseline samples a
            right-padded prompt at its last real token).
          want_logprobs: compute the sampled rows' logprobs (any row asks).
          src_rows: per chunk, -1 or the row of the previous ``execute`` whose sampled id is
            the chunk's last token (its value in ``token_ids`` is then ignored).

        Raises:
          ValueError: no bucket fits, or a block table is wider than max_blocks_per_seq.
        """
        token_ids = [c.token_ids for c in chunks]
        start_pos = [c.start_pos for c in chunks]
        q_lens = [len(t) for t in token_ids]
        num_tokens, num_seqs = sum(q_lens), len(q_lens)
        b = pick_bucket(self.usable, num_tokens, num_seqs)
        if len(self.usable) < len(self.buckets):
            fit = pick_bucket(self.buckets, num_tokens, num_seqs)
            if fit != b:
                self.wanted[fit] += 1
        lay, buf = self.layouts[b], self.buffers[b][self._num_packed % 2]
        self._num_packed += 1
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
        for i, blocks in enumerate(c.block_ids for c in chunks):
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
        temp = np.zeros(lay.sampler_rows, np.float32)
        top_p = np.ones(lay.sampler_rows, np.float32)
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
        src = buf[sl["src_row"]]
        src[:] = -1
        if src_rows is not None:
            for i, r in enumerate(src_rows):
                if r >= 0:
                    src[qsl[i + 1] - 1] = r
                    buf[sl["token_ids"]][qsl[i + 1] - 1] = 0
        self._pack_extras(lay, buf, rows, q_lens, qsl, pos, num_tokens, want_logprobs)
        return b, buf

    def _pack_extras(self, lay: Layout, buf: np.ndarray, rows: Sequence[RowParams],
                     q_lens: list[int], qsl: np.ndarray, pos: np.ndarray, num_tokens: int,
                     want_logprobs: bool) -> None:
        """min-p, penalties, suppressed ids and logprob fields (the cheap defaults when no row
        uses them)."""
        sl, s = lay.slices, lay.sampler_rows
        r = self.num_penalty_slots
        f32 = lambda name, vals, fill: _put_f32(buf, sl[name], s, vals, fill)
        f32("min_p", [x.min_p for x in rows], 0.0)
        buf[sl["slot"]] = r
        buf[sl["reset_slot"]] = r
        buf[sl["tok_slot"]] = r
        buf[sl["tok_target"]] = -1
        buf[sl["suppress_ids"]] = -1
        suppress = buf[sl["suppress_ids"]].reshape(s, MAX_MIN_TOKENS_STOP_IDS)
        for i, x in enumerate(rows):
            if x.suppress_ids:
                suppress[i, :len(x.suppress_ids)] = x.suppress_ids
        flags = FLAG_LOGPROBS if want_logprobs else 0
        pen = [i for i, x in enumerate(rows) if x.slot >= 0]
        if pen:
            f32("repetition_penalty", [x.repetition_penalty for x in rows], 1.0)
            f32("presence_penalty", [x.presence_penalty for x in rows], 0.0)
            f32("frequency_penalty", [x.frequency_penalty for x in rows], 0.0)
            slots, resets = buf[sl["slot"]], buf[sl["reset_slot"]]
            tok_slot, tok_out = buf[sl["tok_slot"]], buf[sl["tok_is_output"]]
            for i in pen:
                x = rows[i]
                slots[i] = x.slot
                if x.reset:
                    resets[i] = x.slot
                a, e = qsl[i], qsl[i] + q_lens[i]
                tok_slot[a:e] = x.slot
                tok_out[a:e] = pos[a:e] >= x.num_prompt_tokens
        else:
            f32("repetition_penalty", [], 1.0)
        plp = [i for i, x in enumerate(rows) if x.prompt_targets is not None]
        if plp:
            flags |= FLAG_PROMPT_LOGPROBS
            tgt = buf[sl["tok_target"]]
            for i in plp:
                tgt[qsl[i]:qsl[i] + q_lens[i]] = rows[i].prompt_targets
        buf[sl["flags"]] = flags


def _put_f32(buf: np.ndarray, where: slice, size: int, vals: list[float], fill: float) -> None:
    out = np.full(size, fill, np.float32)
    out[:len(vals)] = vals
    buf[where] = out.view(np.int32)
