"""A request as the scheduler and the KV manager see it: its tokens, its progress and its blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.core.block_pool import BlockHash


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


@dataclass
class SeqState:
    """One request as the scheduler sees it. ``token_ids[:num_prompt_tokens]`` is the prompt;
    ``max_tokens`` (>= 1) is clamped by the caller so that prompt + max_tokens <= max_model_len;
    ``stop_token_ids`` is empty when the request ignores EOS. ``block_ids`` is the block table:
    block ``block_ids[p // block_size]`` holds the K/V of position ``p``. A swapped-out request
    (waiting) has no device blocks and its K/V in ``host_block_ids`` instead. ``cache_salt``
    (None: none) enters the prefix-cache hash, so only requests with the same salt share
    blocks. ``block_hashes`` caches the chained hashes of full blocks; the first
    ``num_registered_blocks`` blocks have been offered to the prefix cache.
    ``skip_prefix_cache``: every token of this request must go through the model (the engine
    needs logits at prompt positions for prompt logprobs, or counts the fed tokens for
    penalties), so cached blocks must not stand in for any of its tokens.

    With async scheduling a step is planned before the previous one's results are read:
    ``num_inflight_tokens`` are scheduled in steps ``Scheduler.update`` has not seen yet (their
    K/V is being computed), and ``num_output_placeholders`` of those steps' samples are not yet
    in ``token_ids``; both are 0 between steps of the synchronous loop."""

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    arrival_index: int = -1  # set by Scheduler.add
    num_preemptions: int = 0
    skip_prefix_cache: bool = False
    cache_salt: str | None = None
    host_block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission
    num_inflight_tokens: int = 0
    num_output_placeholders: int = 0
    num_prefill_skips: int = 0  # steps other prompts got prefill and this one none (its turn)
    # the engine's clock (s, ``Scheduler.schedule(now)`` / ``update(now=...)``): when the request
    # arrived, when its first and its latest token reached the host, and its largest gap so far
    arrival_time: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None
    max_gap_s: float = 0.0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def record_token_time(self, now: float) -> None:
        """A sampled token reached the host at ``now``: the first token's time, or a gap."""
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            self.max_gap_s = max(self.max_gap_s, now - self.last_token_time)
        self.last_token_time = now


def decodes(seq: SeqState, start: int) -> bool:
    """The sequence has outputs and its chunk from ``start`` is its one next token."""
    num_tokens = len(seq.token_ids) + seq.num_output_placeholders
    return num_tokens - start == 1 and num_tokens > seq.num_prompt_tokens


def last_sample_pending(seq: SeqState, max_model_len: int) -> bool:
    """The sequence's in-flight sample is its last (``max_tokens`` or ``max_model_len``):
    nothing is planned after it (async scheduling)."""
    n = seq.num_output_placeholders
    return n > 0 and (seq.num_output_tokens + n >= seq.max_tokens
                      or len(seq.token_ids) + n >= max_model_len)
