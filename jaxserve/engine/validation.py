"""Request checks the engine runs before anything is queued: a request it can never finish is
refused at once instead of waiting forever."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequest
from jaxserve.sampling_params import MAX_MIN_TOKENS_STOP_IDS, SamplingParams


@dataclass(frozen=True)
class RequestBounds:
    """What one engine can hold."""

    vocab_size: int  # the tokenizer's
    max_model_len: int
    num_blocks: int  # of the KV cache, including padding block 0
    block_size: int
    multiprocess: bool  # one model spans several processes
    eos_token_ids: frozenset[int] = frozenset()  # the tokenizer's end-of-generation ids

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can hold: the context window, or the
        whole KV cache when that is smaller."""
        return min(self.max_model_len, (self.num_blocks - 1) * self.block_size)


def truncate_prompt(prompt_token_ids: Sequence[int], params: SamplingParams,
                    bounds: RequestBounds) -> Sequence[int]:
    """The prompt after ``params.truncate_prompt_tokens`` (its last k tokens; -1: the last
    ``max_model_len - 1``); the prompt itself when that is None or the prompt is shorter.

    Raises:
      InvalidRequest: k above ``max_model_len`` (param ``truncate_prompt_tokens``).
    """
    k = params.truncate_prompt_tokens
    if k is None:
        return prompt_token_ids
    if k == -1:
        k = bounds.max_model_len - 1
    elif k > bounds.max_model_len:
        raise InvalidRequest(f"truncate_prompt_tokens ({k}) is greater than max_model_len "
                             f"({bounds.max_model_len})", param="truncate_prompt_tokens")
    return prompt_token_ids[-k:] if len(prompt_token_ids) > k else prompt_token_ids


def stop_ids_of(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The ids that end a request: ``stop_token_ids`` and, unless ``ignore_eos``, the EOS ids."""
    ids = frozenset(params.stop_token_ids)
    return ids if params.ignore_eos else ids | eos_token_ids


def validate_request(prompt_token_ids: Sequence[int], params: SamplingParams,
                     bounds: RequestBounds) -> int:
    """Check a request against ``bounds``; returns the effective max_tokens.

    That is ``params.max_tokens`` capped by what the context window leaves, or when it is None,
    what the KV cache leaves (``max_request_tokens`` minus the prompt).

    Args:
      prompt_token_ids: the prompt, checked as ``truncate_prompt`` leaves it.
      params: its sampling parameters (``SamplingParams.validate`` runs first on them).
      bounds: the engine's.

    Raises:
      InvalidRequest: naming the field (``param``): an empty prompt, ids out of range, a
        prompt with no room for output in the context window or the KV cache, ids of
        ``stop_token_ids`` or ``logit_bias`` outside the vocabulary, ``logit_bias`` or
        ``structured_outputs`` on a model spanning processes, ``min_tokens`` with more than
        ``MAX_MIN_TOKENS_STOP_IDS`` stop ids, ``truncate_prompt_tokens`` above max_model_len,
        or prompt + max_tokens over the KV cache (with the numbers).
      ValueError: as ``SamplingParams.validate``.
    """
    params.validate()
    prompt_token_ids = truncate_prompt(prompt_token_ids, params, bounds)
    b, n, vocab = bounds, len(prompt_token_ids), bounds.vocab_size
    if n == 0:
        raise InvalidRequest("prompt must not be empty (it has 0 tokens)", param="prompt")
    for t in prompt_token_ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
            raise InvalidRequest(f"prompt token id {t!r} is out of range [0, {vocab})",
                                 param="prompt")
    if n >= b.max_model_len:
        raise InvalidRequest(
            f"prompt has {n} tokens; max_model_len is {b.max_model_len}, which leaves no "
            f"room for output (the prompt must have at most {b.max_model_len - 1})",
            param="prompt", code=CONTEXT_LENGTH_EXCEEDED)
    for t in params.stop_token_ids:
        if t >= vocab:
            raise InvalidRequest(f"stop_token_ids holds {t}, outside the vocabulary "
                                 f"[0, {vocab})", param="stop_token_ids")
    for t in params.logit_bias or {}:
        if t >= vocab:
            raise InvalidRequest(f"logit_bias holds token id {t}, outside the vocabulary "
                                 f"[0, {vocab})", param="logit_bias")
    if params.min_tokens and len(stop := stop_ids_of(params, b.eos_token_ids)) > \
            MAX_MIN_TOKENS_STOP_IDS:
        raise InvalidRequest(f"min_tokens takes at most {MAX_MIN_TOKENS_STOP_IDS} distinct stop "
                             f"ids (EOS included); this request has {len(stop)}",
                             param="stop_token_ids")
    if params.logit_bias and b.multiprocess:
        raise InvalidRequest("logit_bias is not supported when one model spans several "
                             "processes (--num-processes > 1)", param="logit_bias")
    if params.structured_outputs is not None and b.multiprocess:
        raise InvalidRequest("structured outputs are not supported when one model spans "
                             "several processes (--num-processes > 1)",
                             param="structured_outputs")
    cache_tokens = (b.num_blocks - 1) * b.block_size
    if n >= b.max_request_tokens:
        raise InvalidRequest(
            f"prompt has {n} tokens; the KV cache holds {cache_tokens} tokens "
            f"({b.num_blocks - 1} blocks of {b.block_size}), which leaves no "
            f"room for output (the prompt must have at most {b.max_request_tokens - 1})",
            param="prompt", code=CONTEXT_LENGTH_EXCEEDED)
    if params.max_tokens is None:
        return b.max_request_tokens - n
    max_tokens = min(params.max_tokens, b.max_model_len - n)
    if n + max_tokens > cache_tokens:
        raise InvalidRequest(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens "
            f"can never fit in the KV cache of {cache_tokens} tokens "
            f"({b.num_blocks - 1} blocks of {b.block_size}); lower max_tokens "
            f"to at most {cache_tokens - n}", param="max_tokens",
            code=CONTEXT_LENGTH_EXCEEDED)
    return max_tokens
