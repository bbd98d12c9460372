"""Static batching, the baseline that continuous batching is measured against.

``StaticBatchEngine`` drives an ``LLMEngine``'s own model runner (the same compiled step programs,
KV cache and block pool) the way a static-batching server does (FasterTransformer-style
``generate`` on fixed batches; the schedule the vLLM and Orca papers compare against):

  1. requests are taken in arrival order in batches of ``max_num_seqs``; no request joins a
     running batch;
  2. KV blocks for every row of the batch are reserved up front for the batch's maximum length
     (longest prompt ``L`` + longest output ``M``) and held until the whole batch ends;
  3. every row's prompt is right-padded to ``L`` and the padded prompts are prefilled together
     (in chunks of at most ``max_num_batched_tokens`` tokens per step, the engine's step budget);
     each row's first token is sampled from the logits of its last real prompt token;
  4. the batch decodes ``M - 1`` steps, one token per row per step, until its longest request
     finishes; a row that has finished keeps its slot and is fed a padding token every step.

So the padding and the idle slots cost what they cost in a static server: the prefill computes
``B * L`` tokens for ``sum(p_r)`` useful ones and the decode ``B * (M - 1)`` rows for
``sum(n_r - 1)`` useful ones. One simplification favours static batching: a row's decode token
is written at its real next position (overwriting the padding's K/V) and attends only to its
real context, where a masked implementation reads and discards the padded positions too; the
measured continuous-over-static gain is therefore a lower bound. Sampling uses the same rows and
seeds as the engine (a request's stream depends only on its seed and output position), so both
modes generate the same tokens for the same requests, up to floating-point differences between
batch shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxserve.core.sequence import cdiv
from jaxserve.device.step_buffer import Chunk, RowParams
from jaxserve.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class StaticRequest:
    """One request: its prompt ids, exactly ``num_output_tokens`` (>= 1) to generate (EOS
    ignored), and its sampling (``temperature`` 0 = greedy, ``seed`` a u64)."""

    prompt_token_ids: list[int]
    num_output_tokens: int
    temperature: float = 1.0
    seed: int = 0


@dataclass
class StaticStats:
    """Token counts and times of a static run (times in s of wall clock, host and device).

    ``prefill_slots = sum over batches of B * L``; ``prefill_padding = prefill_slots - sum(p_r)``;
    ``decode_slots = sum of B * (M - 1)``; ``decode_idle = decode_slots - sum(n_r - 1)``.
    """

    num_batches: int = 0
    prefill_slots: int = 0
    prefill_padding: int = 0
    decode_slots: int = 0
    decode_idle: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)  # generated ids, in request order


class StaticBatchEngine:
    """Runs requests with static batching on ``engine``'s runner (module doc).

    Args:
      engine: a warmed-up, idle ``LLMEngine`` (nothing waiting or running); its KV cache and
        block pool are borrowed for the run and every block is given back.
      pad_token_id: the token that fills padded prompt positions and finished rows (default:
        the tokenizer's EOS, else 0).
    """

    def __init__(self, engine: LLMEngine, pad_token_id: int | None = None) -> None:
        self.engine = engine
        eos = engine.tokenizer.eos_token_id
        self.pad = pad_token_id if pad_token_id is not None else (eos if eos is not None else 0)

    def run(self, requests: list[StaticRequest]) -> StaticStats:
        """Generate every request in static batches; returns the counts, times and outputs.

        Raises:
          ValueError: the engine is busy, a request is empty or asks for < 1 token, a batch's
            ``L + M`` exceeds ``max_model_len``, or the KV cache cannot hold one batch's
            up-front reservation (raise ``kv_cache_memory_gib`` / ``num_kv_blocks``).
        """
        self.check(requests)
        stats = StaticStats(outputs=[[] for _ in requests])
        batch = self.engine.config.max_num_seqs
        for lo in range(0, len(requests), batch):
            self._run_batch(requests[lo:lo + batch], lo, stats)
        return stats

    def check(self, requests: list[StaticRequest]) -> None:
        """Raise the ValueError ``run`` would raise (see there), before any work is done."""
        eng = self.engine
        if eng.has_unfinished_requests():
            raise ValueError("the engine must be idle to run a static-batching baseline")
        for i, r in enumerate(requests):
            if not r.prompt_token_ids or r.num_output_tokens < 1:
                raise ValueError(f"request {i}: needs a non-empty prompt and "
                                 f"num_output_tokens >= 1")
        batch, bs = eng.config.max_num_seqs, eng.config.block_size
        free = eng.scheduler.block_pool.num_free_blocks
        for lo in range(0, len(requests), batch):
            rows = requests[lo:lo + batch]
            L = max(len(r.prompt_token_ids) for r in rows)
            M = max(r.num_output_tokens for r in rows)
            if L + M > eng.max_model_len:
                raise ValueError(f"a static batch needs L + M = {L} + {M} positions (longest "
                                 f"prompt + longest output), above max_model_len="
                                 f"{eng.max_model_len}")
            if len(rows) * cdiv(L + M, bs) > free:
                raise ValueError(
                    f"a static batch of {len(rows)} rows reserves {len(rows) * cdiv(L + M, bs)} "
                    f"KV blocks of {bs} tokens up front (L + M = {L + M}); the cache has {free} "
                    f"free; raise kv_cache_memory_gib or num_kv_blocks")

    def _run_batch(self, rows: list[StaticRequest], first: int, stats: StaticStats) -> None:
        eng = self.engine
        bs = eng.config.block_size
        pool = eng.scheduler.block_pool
        p = [len(r.prompt_token_ids) for r in rows]
        n = [r.num_output_tokens for r in rows]
        L, M, B = max(p), max(n), len(rows)
        need = cdiv(L + M, bs)  # per row; check() made sure the pool holds B * need
        tables = [pool.allocate(need) for _ in rows]
        try:
            stats.num_batches += 1
            stats.prefill_slots += B * L
            stats.prefill_padding += B * L - sum(p)
            stats.decode_slots += B * (M - 1)
            stats.decode_idle += B * (M - 1) - sum(k - 1 for k in n)
            outs = [stats.outputs[first + i] for i in range(B)]
            t0 = time.perf_counter()
            self._prefill(rows, p, L, tables, outs, stats)
            t1 = time.perf_counter()
            for t in range(1, M):
                self._decode_step(rows, p, n, t, tables, outs)
            stats.num_decode_steps += M - 1
            stats.prefill_s += t1 - t0
            stats.decode_s += time.perf_counter() - t1
        finally:
            for blocks in tables:
                pool.free(blocks)

    def _row(self, r: StaticRequest, sample_pos: int) -> RowParams:
        return RowParams(r.temperature, 0, 1.0, r.seed % 2**64, sample_pos)

    def _prefill(self, rows: list[StaticRequest], p: list[int], L: int,
                 tables: list[list[int]], outs: list[list[int]], stats: StaticStats) -> None:
        """The padded prompts ``B x L`` in steps of at most ``max_num_batched_tokens`` tokens
        (each row at most once a step, rows in order, each row's chunks in order)."""
        eng = self.engine
        budget_max = eng.config.max_num_batched_tokens
        padded = [r.prompt_token_ids + [self.pad] * (L - len(r.prompt_token_ids)) for r in rows]
        done = [0] * len(rows)
        while done[-1] < L:
            budget = budget_max
            toks, starts, blocks, params, index, owners = [], [], [], [], [], []
            for i, row in enumerate(padded):
                if budget == 0:
                    break
                if done[i] == L:
                    continue
                k = min(L - done[i], budget)
                toks.append(row[done[i]:done[i] + k])
                starts.append(done[i])
                blocks.append(tables[i])
                params.append(self._row(rows[i], 0))
                last_real = p[i] - 1  # sample where the real prompt ends, if in this chunk
                index.append(last_real - done[i] if done[i] <= last_real < done[i] + k else k - 1)
                owners.append(i if done[i] <= last_real < done[i] + k else -1)
                done[i] += k
                budget -= k
            bucket, packed = eng.runner.pack_step(
                [Chunk(*c) for c in zip(toks, starts, blocks, strict=True)], params,
                sample_index=index)
            ids = eng.runner.execute(bucket, packed).ids
            stats.num_prefill_steps += 1
            for j, i in enumerate(owners):
                if i >= 0:
                    outs[i].append(int(ids[j]))

    def _decode_step(self, rows: list[StaticRequest], p: list[int], n: list[int], t: int,
                     tables: list[list[int]], outs: list[list[int]]) -> None:
        """Decode step ``t`` (1 .. M-1): every row feeds one token at position ``p + t - 1``;
        rows with all ``n`` tokens feed padding and their samples are dropped."""
        eng = self.engine
        toks, starts, params = [], [], []
        for i, r in enumerate(rows):
            active = t < n[i]
            toks.append([outs[i][t - 1] if active else self.pad])
            starts.append(p[i] + t - 1)
            params.append(self._row(r, t))
        bucket, packed = eng.runner.pack_step(
            [Chunk(*c) for c in zip(toks, starts, tables, strict=True)], params)
        ids = eng.runner.execute(bucket, packed).ids
        for i in range(len(rows)):
            if t < n[i]:
                outs[i].append(int(ids[i]))
