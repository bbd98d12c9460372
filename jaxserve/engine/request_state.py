"""What the engine keeps per request, and the ``RequestOutput``s built from it.

A request (``RequestGroup``) has ``n`` choices (``Choice``), each one scheduler sequence. The
engine's ``RequestTable`` owns the live ones: requests by request id, choices by sequence id;
the step's dispatcher and output processor read it and change it through its methods only.
After a step, each choice that sampled a token records its logprobs, detokenises, and when it
has new text or a finish takes a fresh ``CompletionOutput``; ``group_output`` then gathers the
latest output of every choice into the request's ``RequestOutput``, carrying each delta once.
A choice's output tokens are its sequence's (``SeqState.output_token_ids``), not a copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.core.plan import ScheduledSeq
from jaxserve.core.sequence import SeqState
from jaxserve.device.step_buffer import RowParams
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.structured_output import Grammar, GrammarState
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer


@dataclass
class RequestGroup:
    """One user request: its ``n`` choices share the prompt and the metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    choices: list[Choice] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token
    num_finished: int = 0


@dataclass
class Choice:
    """One choice of a group: one scheduler sequence (``seq_id``: the group's request id when
    n == 1, else ``<id>[<index>]``)."""

    seq_id: str
    group: RequestGroup
    index: int
    params: SamplingParams
    seed: int  # u64
    seq: SeqState
    detok: IncrementalDetokenizer
    last_token_time: float | None = None
    num_emitted_tokens: int = 0
    pending_text: str = ""  # detokenised in this step's stop check, not yet emitted
    slot: int = -1  # penalty-state slot while running, else -1
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    output: CompletionOutput | None = None  # the latest one
    finished: bool = False
    grammar: GrammarState | None = None  # the structured-output constraint's state

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens sampled so far (the sequence's, past its prompt)."""
        return self.seq.output_token_ids


class RequestTable:
    """The engine's live requests: the one owner of request state.

    Requests (``RequestGroup``) by request id, their unfinished choices by sequence id. A
    request is added with all its choices (``add``); a choice leaves when it finishes
    (``finish_choice``), a request when all its choices have finished (``pop_finished``) or
    when it is aborted (``pop``).
    """

    def __init__(self) -> None:
        self._groups: dict[str, RequestGroup] = {}
        self._choices: dict[str, Choice] = {}

    def __len__(self) -> int:
        """Live requests."""
        return len(self._groups)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def request_ids(self) -> list[str]:
        """The live requests' ids, oldest first."""
        return list(self._groups)

    def has_seq(self, seq_id: str) -> bool:
        """Whether an unfinished choice has this sequence id."""
        return seq_id in self._choices

    def choice(self, seq_id: str) -> Choice:
        """The unfinished choice of a sequence id (KeyError when there is none)."""
        return self._choices[seq_id]

    def is_live(self, choice: Choice) -> bool:
        """Whether ``choice`` is still unfinished here (not finished nor aborted since)."""
        return self._choices.get(choice.seq_id) is choice

    def choices(self) -> Iterator[Choice]:
        """The unfinished choices."""
        return iter(self._choices.values())

    def add(self, group: RequestGroup) -> None:
        """Add a request and its choices.

        Raises:
          ValueError: its request id or a choice's sequence id is already live.
        """
        if group.request_id in self._groups or any(
                c.seq_id in self._choices for c in group.choices):
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        self._groups[group.request_id] = group
        for c in group.choices:
            self._choices[c.seq_id] = c

    def finish_choice(self, choice: Choice) -> None:
        """Mark a choice finished and drop it (its request stays until ``pop_finished``)."""
        choice.finished = True
        choice.group.num_finished += 1
        del self._choices[choice.seq_id]

    def pop_finished(self, group: RequestGroup) -> bool:
        """Drop ``group`` if all its choices have finished; returns whether it did."""
        if group.num_finished < len(group.choices):
            return False
        self._groups.pop(group.request_id, None)
        return True

    def pop(self, request_id: str) -> RequestGroup | None:
        """Drop a request (aborted) and its unfinished choices; returns it (None: unknown)."""
        group = self._groups.pop(request_id, None)
        if group is not None:
            for c in group.choices:
                if self._choices.get(c.seq_id) is c:
                    del self._choices[c.seq_id]
        return group


_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads choice seeds (SplitMix64)


def choice_seeds(seed: int | None, n: int, rng: np.random.Generator) -> list[int]:
    """The u64 sampling seeds of a request's ``n`` choices: ``seed``'s for choice 0 and
    distinct streams derived from it (SplitMix64's increment) for the others; drawn from
    ``rng`` when the request has no seed."""
    if seed is None:
        return [int(rng.integers(2**63)) for _ in range(n)]
    return [(seed % 2**64 + i * _GOLDEN_GAMMA) % 2**64 for i in range(n)]


def open_request(request_id: str, seq_ids: list[str], seeds: list[int], prompt: str | None,
                 prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
                 max_tokens: int, stop_ids: frozenset[int], tokenizer: Tokenizer,
                 grammar: Grammar | None) -> RequestGroup:
    """A new request and its choices, one per sequence id, each with its scheduler sequence
    (``Choice.seq``, not yet added to the scheduler), seed (u64) and detokeniser."""
    group = RequestGroup(request_id, prompt, prompt_token_ids, params, arrival_time)
    if params.prompt_logprobs is not None:
        group.prompt_logprobs = [None] * len(prompt_token_ids)
    for i, (sid, seed) in enumerate(zip(seq_ids, seeds, strict=True)):
        seq = SeqState(
            seq_id=sid, token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids), max_tokens=max_tokens,
            stop_token_ids=stop_ids, cache_salt=params.cache_salt, arrival_time=arrival_time,
            skip_prefix_cache=params.uses_penalty_state or (
                i == 0 and params.prompt_logprobs is not None))
        detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens)
        group.choices.append(Choice(
            sid, group, i, params, seed, seq, detok,
            logprobs=[] if params.logprobs is not None else None,
            grammar=grammar.start() if grammar is not None else None))
    return group


def logprob_entry(tokenizer: Tokenizer, ids, vals, n: int, chosen: int, chosen_lp: float,
                  chosen_rank: int, skip_special: bool) -> TokenLogprobs:
    """The top ``n`` alternatives (``ids``/``vals``: the device's top ids and logprobs, best
    first) with their text, plus the chosen token (``chosen_rank``: 1-based) if not among
    them."""
    text = lambda t: tokenizer.token_bytes(t, skip_special).decode("utf-8", "replace")
    entry = {int(ids[j]): Logprob(float(vals[j]), j + 1, text(int(ids[j]))) for j in range(n)}
    if chosen not in entry:
        entry[chosen] = Logprob(float(chosen_lp), int(chosen_rank), text(chosen))
    return entry


def record_logprobs(tokenizer: Tokenizer, choice: Choice, token: int, lp, row: int) -> None:
    """Append the sampled ``token``'s entry (row ``row`` of the step's logprobs ``lp``)."""
    entry = logprob_entry(tokenizer, lp.top_ids[row], lp.top_logprobs[row],
                          choice.params.logprobs, token, lp.chosen_logprob[row],
                          lp.chosen_rank[row], choice.params.skip_special_tokens)
    choice.logprobs.append(entry)
    choice.cumulative_logprob += entry[token].logprob


def record_prompt_logprobs(tokenizer: Tokenizer, scheduled: Sequence[ScheduledSeq],
                           choices: Sequence[Choice], rows: list[RowParams],
                           which: list[int], plp) -> None:
    """Fill the groups' prompt logprobs from one step's per-token logprobs ``plp``.

    Args:
      tokenizer: gives the tokens' text.
      scheduled: the step's sequences, in batch order (their tokens are ``plp``'s rows).
      choices: the choice each scheduled sequence ran for, in batch order.
      rows: the step's sampling inputs, ``prompt_targets`` set for the rows in ``which``.
      which: the batch rows that asked for prompt logprobs.
      plp: the step's prompt logprobs (``top_ids``, ``top_logprobs``, ``chosen_logprob``,
        ``chosen_rank``, one row per scheduled token).
    """
    starts = np.cumsum([0] + [len(s.token_ids) for s in scheduled])
    for i in which:
        s, g = scheduled[i], choices[i].group
        for j, target in enumerate(rows[i].prompt_targets):
            q = s.start_pos + j + 1  # the prompt position this token's logits predict
            if target < 0 or g.prompt_logprobs[q] is not None:
                continue  # recomputed after a preemption: keep the first values
            t = starts[i] + j
            g.prompt_logprobs[q] = logprob_entry(
                tokenizer, plp.top_ids[t], plp.top_logprobs[t], g.params.prompt_logprobs,
                target, plp.chosen_logprob[t], plp.chosen_rank[t], g.params.skip_special_tokens)


def emit(choice: Choice, delta: str, finish: str | None, stop_reason: str | int | None
         ) -> None:
    """Give ``choice`` a fresh output carrying ``delta`` and the tokens not emitted before."""
    c = choice
    out_ids = c.output_token_ids
    new_ids = out_ids[c.num_emitted_tokens:]
    c.num_emitted_tokens = len(out_ids)
    c.output = CompletionOutput(
        index=c.index, text=c.detok.text, token_ids=out_ids,
        finish_reason=finish, stop_reason=stop_reason, delta_text=delta,
        delta_token_ids=new_ids,
        logprobs=None if c.logprobs is None else list(c.logprobs),
        cumulative_logprob=None if c.logprobs is None else c.cumulative_logprob)


def group_output(g: RequestGroup, now: float) -> RequestOutput:
    """The request's output after a step in which some choice changed; each choice's delta is
    handed out once (later outputs of an unchanged choice carry none)."""
    outs = []
    for c in g.choices:
        o = c.output
        if o is None:
            o = CompletionOutput(index=c.index, text="", token_ids=[],
                                 logprobs=None if c.logprobs is None else [])
        elif o.delta_text or o.delta_token_ids:
            c.output = dataclasses.replace(o, delta_text="", delta_token_ids=[])
        outs.append(o)
    metrics = {"arrival_time": g.arrival_time}
    if g.first_token_time is not None:
        metrics["first_token_time"] = g.first_token_time
    if g.first_scheduled_time is not None:
        metrics["first_scheduled_time"] = g.first_scheduled_time
    finished = g.num_finished == len(g.choices)
    if finished:
        metrics["finished_time"] = now
    cached = g.choices[0].seq.num_cached_tokens  # -1 until first scheduled
    return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, finished=finished,
                         metrics=metrics, prompt_logprobs=g.prompt_logprobs,
                         num_cached_tokens=cached if cached >= 0 else None)
