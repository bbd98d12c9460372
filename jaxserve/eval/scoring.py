"""Scoring through the engine: a corpus in overlapping windows (per token: the target's logprob
and the argmax, from ``prompt_logprobs=1``), greedy continuations of a prompt set, and the
memory an engine holds. Every window or prompt is submitted at once, so the engine batches them.

Windows (the strided evaluation of Hugging Face's "Perplexity of fixed-length models" guide):
corpus token 0 is never scored (nothing precedes it); window ``k`` ends at
``e_k = min(window + k * stride, N)``, starts at ``max(0, e_k - window)``, and scores the tokens
from ``e_{k-1}`` (1 for ``k = 0``) to ``e_k - 1``. Every token 1..N-1 is scored exactly once,
and each (after the first window) sees at least ``window - stride`` tokens of context.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from tqdm import tqdm

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from models.quant import param_bytes


def eval_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """The scoring windows of a corpus of ``num_tokens`` tokens, as ``(start, first_scored,
    end)``: the window is tokens ``[start, end)`` and scores ``[first_scored, end)`` (see the
    module docstring). Every token ``1..num_tokens-1`` is scored exactly once.

    Raises:
      ValueError: ``num_tokens < 2``, ``window < 2``, or ``stride`` outside ``[1, window-1]``.
    """
    if num_tokens < 2:
        raise ValueError(f"the corpus has {num_tokens} token(s); perplexity needs at least 2")
    if window < 2:
        raise ValueError(f"--eval-window must be >= 2, got {window}")
    if not 1 <= stride < window:
        raise ValueError(f"--eval-stride must be in [1, {window - 1}] (below --eval-window "
                         f"{window}), got {stride}")
    out, prev_end = [], 1
    end = min(window, num_tokens)
    while True:
        out.append((max(0, end - window), prev_end, end))
        if end == num_tokens:
            return out
        prev_end, end = end, min(end + stride, num_tokens)


@dataclass
class CorpusScores:
    """Per scored corpus position ``1..N-1``, at index ``q - 1`` for corpus token ``q``."""

    logprobs: np.ndarray  # f64[N-1]: log p of the token given its window's context
    argmax: np.ndarray  # i64[N-1]: the most likely token there

    @property
    def ppl(self) -> float:
        return float(math.exp(-float(self.logprobs.mean())))


def _run_requests(engine: LLMEngine, token_ids: Sequence[list[int]], params: SamplingParams,
                  desc: str, unit: str, weights: Sequence[int] | None,
                  progress: bool) -> list[RequestOutput]:
    """Add every request at once, step the engine until all finish; outputs in input order.

    The bar advances by ``weights[i]`` (tokens) when request ``i`` finishes, else by 1.
    """
    for i, ids in enumerate(token_ids):
        try:
            engine.validate(ids, params)
        except ValueError as e:
            raise ValueError(f"{desc} request {i}: {e}") from None
    rids = []
    for ids in token_ids:
        rids.append(engine.next_request_id())
        engine.add_request(rids[-1], ids, params)
    index = {r: i for i, r in enumerate(rids)}
    done: dict[str, RequestOutput] = {}
    bar = tqdm(total=sum(weights) if weights else len(rids), desc=desc, unit=unit,
               disable=not progress, file=sys.stderr)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(weights[index[out.request_id]] if weights else 1)
    except BaseException:
        engine.abort_request(rids)
        raise
    finally:
        bar.close()
    return [done[r] for r in rids]


def score_corpus(engine: LLMEngine, ids: Sequence[int], window: int, stride: int, *,
                 progress: bool = False, desc: str = "perplexity") -> CorpusScores:
    """Score every token of ``ids`` (after the first) through ``engine`` with
    ``prompt_logprobs=1``, all windows submitted together (see ``eval_windows``).

    Raises:
      ValueError: bad window settings, or a window the engine refuses (too long for
        max_model_len or the KV cache; the message names the window).
    """
    wins = eval_windows(len(ids), window, stride)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = _run_requests(engine, [list(ids[s:e]) for s, _, e in wins], params, desc, "tok",
                         [e - f for _, f, e in wins], progress)
    lps = np.zeros(len(ids) - 1, np.float64)
    top = np.zeros(len(ids) - 1, np.int64)
    for (s, f, e), out in zip(wins, outs):
        for q in range(f, e):
            entry = out.prompt_logprobs[q - s]  # {argmax: ..., [target: ...]}
            lps[q - 1] = entry[ids[q]].logprob
            top[q - 1] = next(iter(entry))
    return CorpusScores(lps, top)


def greedy_tokens(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int, *,
                  progress: bool = False, desc: str = "greedy") -> tuple[list[list[int]], float]:
    """Greedy continuations (temperature 0, at most ``max_tokens``, stopping at EOS) of every
    prompt, submitted together; returns (token ids per prompt, wall seconds)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    outs = _run_requests(engine, prompts, params, desc, "req", None, progress)
    wall_s = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], wall_s


def memory_bytes(engine: LLMEngine) -> tuple[int, int, float]:
    """(params bytes, KV-cache bytes, KV bytes per token) of an engine: sums of leaf
    ``nbytes`` (global sizes, also when sharded); per token: over ``num_blocks * block_size``
    (block 0 included in both)."""
    weights = int(param_bytes(engine.runner.params)["total_bytes"])
    kv = sum(int(x.nbytes) for x in jax.tree.leaves(engine.runner.kv_cache))
    return weights, kv, kv / (engine.num_blocks * engine.config.block_size)
