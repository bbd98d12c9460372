"""Per-request sampling parameters, following vLLM's ``SamplingParams`` defaults.

The engine turns these into per-row device arrays (``f32[S]`` temperatures, ``i32[S]`` top-k, ...)
every step, so no value here is ever a static argument of a compiled program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    Fields (defaults as vLLM's):
      max_tokens: output tokens to generate at most (default 16); ``None`` means "up to the
        context window" (``max_model_len - prompt_len``). Longer requests are clamped to the
        window and end with ``finish_reason == "length"``.
      temperature: softmax temperature; 0 means greedy (argmax).
      top_p: nucleus probability mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; 0 or -1 disables it, and so does any k at or above
        the vocabulary size.
      seed: per-request RNG seed, any 64-bit integer (negative ones are taken modulo 2**64);
        the random stream depends only on (seed, output position), never on batch-mates. ``None`` draws a fresh seed for the request.
      stop: strings that end generation when they appear in the output text; the stop string
        is cut off unless ``include_stop_str_in_output``.
      stop_token_ids: token ids that end generation, in addition to EOS.
      ignore_eos: do not stop at EOS (nor the model's end-of-turn tokens).
      skip_special_tokens: leave special tokens out of the text.

    Raises:
      ValueError: naming the field, for any out-of-range value.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}")
            setattr(self, name, list(value))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.validate()

    def validate(self) -> None:
        """Check every field; raise ValueError naming the first bad one."""
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
            or not -(2**63) <= self.seed < 2**64
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")

    @property
    def greedy(self) -> bool:
        """True when the request samples by argmax."""
        return self.temperature == 0.0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
