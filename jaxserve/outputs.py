"""What the engine hands back for a request, after vLLM's ``RequestOutput``.

The engine emits one ``RequestOutput`` per request per step in which the request produced new
text or finished. ``CompletionOutput.text`` and ``token_ids`` are cumulative; ``delta_text`` and
``delta_token_ids`` are what is new since the previous output of the same request (what a
streaming client is sent).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the raw model distribution (vLLM's ``Logprob``).

    Fields: logprob (natural log, finite, <= 0), rank (1 = most likely; tokens with equal
    logprobs share the better rank), decoded_token (the token's text, ``Tokenizer.token_bytes``
    decoded with U+FFFD for a partial character; "" for a skipped special token).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]
"""Logprobs at one position, keyed by token id: the requested top-N in descending order, then
the sampled (or prompt) token if it is not among them."""


@dataclass
class CompletionOutput:
    """One generated sequence.

    Fields:
      index: choice index (0 for n == 1).
      text: the detokenised output so far, with stop strings cut off and held-back text (a
        possible stop-string prefix, an incomplete UTF-8 character) not yet included.
      token_ids: every generated token id so far (including the stop token when one fired).
      finish_reason: None while running; "stop" (EOS, stop token or stop string), "length"
        (max_tokens or the context window) or "abort".
      stop_reason: the stop string or stop token id that ended it, else None.
      delta_text / delta_token_ids: new since the previous output of this request.
      logprobs: with ``SamplingParams.logprobs``, one ``TokenLogprobs`` per entry of
        ``token_ids`` (a stop token included), else None.
      cumulative_logprob: the sum of the sampled tokens' logprobs (with logprobs), else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        """True once a finish_reason is set."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    Fields:
      request_id: the caller's id.
      prompt: the prompt text when known, else None.
      prompt_token_ids: the prompt as token ids.
      outputs: one CompletionOutput per choice, in index order (``SamplingParams.n``); a
        choice with nothing new in this step has empty deltas.
      finished: True when every choice has finished.
      prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt token:
        None for the first, then the ``TokenLogprobs`` of each next prompt token given the ones
        before it (the prompt token first is included in the dict).
      metrics: timing in seconds (monotonic clock): arrival_time, first_scheduled_time,
        first_token_time, finished_time, when known.
      num_cached_tokens: prompt tokens whose K/V the prefix cache held when the request (its
        first choice) was first scheduled (vLLM's field); None before that.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int | None = None
