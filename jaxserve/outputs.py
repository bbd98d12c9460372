"""What the engine hands back for a request, after vLLM's ``RequestOutput``.

The engine emits one ``RequestOutput`` per request per step in which the request produced new
text or finished. ``CompletionOutput.text`` and ``token_ids`` are cumulative; ``delta_text`` and
``delta_token_ids`` are what is new since the previous output of the same request (what a
streaming client is sent).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None

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
      outputs: one CompletionOutput per choice.
      finished: True when every choice has finished.
      metrics: timing in seconds (monotonic clock): arrival_time, first_scheduled_time,
        first_token_time, finished_time, when known.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
