"""Per-request sampling parameters, following vLLM's ``SamplingParams`` defaults.

The engine turns these into per-row device arrays (``f32[S]`` temperatures, ``i32[S]`` top-k, ...)
every step, so no value here is ever a static argument of a compiled program.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from jaxserve.errors import InvalidRequest

MAX_LOGPROBS = 20
"""Most alternatives ``logprobs`` / ``prompt_logprobs`` may ask for (vLLM's default
``max_logprobs``; OpenAI's ``top_logprobs`` limit). The step program computes this many."""
MAX_LOGIT_BIAS = 1024
"""Most entries one request's ``logit_bias`` may hold."""
MAX_MIN_TOKENS_STOP_IDS = 32
"""Most distinct stop ids (EOS ids and ``stop_token_ids`` together) a request with
``min_tokens`` may have: the step program masks this many per row."""


# Above this the distribution is uniform to float32 precision anyway (the device reads
# temperatures as f32, whose range ends near 3.4e38); masked tokens stay masked at any
# temperature (``device.sampler.sample``).
MAX_TEMPERATURE = 1e6


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, as vLLM's ``StructuredOutputsParams``: exactly one of
    ``json``, ``regex``, ``choice``, ``grammar`` and ``json_object``.

    Fields:
      json: a JSON Schema (a dict, or its JSON text); the output is one JSON value valid
        against it.
      regex: the output matches this regular expression (Rust ``regex`` syntax, anchored at
        both ends).
      choice: the output is exactly one of these strings.
      grammar: a context-free grammar, in Lark syntax or llama.cpp's GBNF.
      json_object: True: the output is one JSON object (any keys and values).
      disable_any_whitespace: JSON without whitespace (``{"a":1,"b":2}``); by default one space
        follows each ``,`` and ``:`` and no other whitespace is generated, as many models write
        JSON inline and a small model given free whitespace may emit it without end.
      disable_additional_properties: objects of ``json`` whose schema does not set
        ``additionalProperties`` get no keys beyond their ``properties``.
      whitespace_pattern: the regular expression whitespace between JSON tokens matches
        (overrides the two whitespace settings above).

    Raises:
      InvalidRequest: none or several constraints, or a field of the wrong type
        (``param="structured_outputs"``). A schema, regex or grammar the grammar engine
        refuses is found when the engine compiles it (also an ``InvalidRequest``).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    def validate(self) -> None:
        """Check the fields (see the class); raises InvalidRequest."""
        bad = lambda msg: InvalidRequest(msg, param="structured_outputs")
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise bad("structured outputs take exactly one of json, regex, choice, grammar and "
                      f"json_object, got {kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise bad(f"json must be a JSON Schema (an object or its JSON text), got "
                      f"{type(self.json).__name__}")
        try:
            if isinstance(self.json, str) and not isinstance(json.loads(self.json), dict):
                raise ValueError("not an object")
            if isinstance(self.json, dict):
                json.dumps(self.json)
        except (TypeError, ValueError) as e:
            raise bad(f"json is not a JSON Schema object: {e}") from None
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise bad(f"{name} must be a string, got {type(v).__name__}")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) for c in self.choice)):
            raise bad("choice must be a non-empty list of strings")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise bad(f"{name} must be a bool, got {v!r}")

    @property
    def key(self) -> str:
        """The constraint as canonical JSON text: equal constraints have equal keys (the
        grammar cache's key)."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if isinstance(self.json, str):
            fields["json"] = json.loads(self.json)
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    Fields (defaults as vLLM's):
      max_tokens: output tokens to generate at most (default 16); ``None`` means "up to the
        context window" (``max_model_len - prompt_len``). Longer requests are clamped to the
        window and end with ``finish_reason == "length"``.
      temperature: softmax temperature; 0 means greedy (argmax); at most ``MAX_TEMPERATURE``.
      top_p: nucleus probability mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; 0 or -1 disables it, and so does any k at or above
        the vocabulary size.
      seed: per-request RNG seed, any 64-bit integer (negative ones are taken modulo 2**64);
        the random stream depends only on (seed, output position), never on batch-mates.
        ``None`` draws a fresh seed for the request.
      stop: strings that end generation when they appear in the output text; the stop string
        is cut off unless ``include_stop_str_in_output``.
      stop_token_ids: token ids that end generation, in addition to EOS.
      ignore_eos: do not stop at EOS (nor the model's end-of-turn tokens).
      skip_special_tokens: leave special tokens out of the text.
      n: number of choices (independent samples) to return, >= 1. Choice ``i`` samples with its
        own stream: with a ``seed`` the whole set is reproducible, choice 0 draws exactly what
        an ``n=1`` request with that seed draws, and the others use seeds derived from
        ``(seed, i)``; without one every choice draws a fresh seed.
      min_p: in [0, 1]; after temperature, drop tokens whose probability is below
        ``min_p`` times the most likely token's (0 = off; 1 keeps only the most likely).
      repetition_penalty: > 0 and <= 2 (1 = off); the logit of every token seen in the prompt
        or the output so far is divided by it when positive and multiplied by it when negative
        (CTRL, Keskar et al. 2019, arXiv:1909.05858; vLLM's semantics).
      presence_penalty / frequency_penalty: in [-2, 2] (0 = off); subtracted from the logit
        of every token generated so far, once (presence) or once per occurrence (frequency).
        Prompt tokens do not count (OpenAI's semantics).
      logit_bias: ``{token_id: bias}`` added to those logits before sampling, bias in
        [-100, 100], at most ``MAX_LOGIT_BIAS`` entries; ids outside the vocabulary are
        rejected by the engine.
      logprobs: None (off) or 0..``MAX_LOGPROBS``: return, per generated token, its logprob and
        that many most likely alternatives, all from the raw model distribution (before
        logit_bias, penalties, temperature, top-k, top-p and min-p).
      prompt_logprobs: None (off) or 0..``MAX_LOGPROBS``: the same for every prompt token
        after the first (the first has no logprob: ``None``).
      min_tokens: in [0, max_tokens]: EOS and ``stop_token_ids`` cannot be sampled (they are
        masked on the device) and stop strings do not match the text of the first
        ``min_tokens`` output tokens (vLLM's semantics); 0 = off.
      truncate_prompt_tokens: None (off), k >= 1: keep only the last k prompt tokens (left
        truncation, as vLLM), or -1: the last ``max_model_len - 1`` (the most the context window
        holds with room for one output token). k above ``max_model_len`` is refused by the
        engine.
      structured_outputs: None (free text) or a ``StructuredOutputsParams``: every sampled
        token is one the constraint allows from the output so far (masked on the device), and
        the output ends (EOS) only where the constraint is complete.
      cache_salt: None or a non-empty string hashed into the request's first KV block (vLLM's
        request field of that name): only requests with the same salt share cached prefix
        blocks (docs/kv-events.md#block-hashes). Not a sampling setting, but carried with
        them to the scheduler.

    Raises:
      InvalidRequest: for any out-of-range value, ``param`` naming the field.
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
    n: int = 1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise InvalidRequest(f"{name} must be a list, got {value!r}", param=name)
            setattr(self, name, list(value))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be a bool, got {getattr(self, name)!r}",
                                     param=name)
        self.validate()

    def validate(self) -> None:
        """Check every field.

        Raises:
          InvalidRequest: for the first bad field, ``param`` naming it.
        """
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            raise InvalidRequest(f"cache_salt must be a non-empty string, got "
                                 f"{self.cache_salt!r}", param="cache_salt")
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise InvalidRequest(f"max_tokens must be an integer, got {self.max_tokens!r}",
                                     param="max_tokens")
            if self.max_tokens < 1:
                raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}",
                                     param="max_tokens")
        if not _finite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got "
                                 f"{self.temperature!r}", param="temperature")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1, 0 (off) or a positive integer, got "
                                 f"{self.top_k!r}", param="top_k")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
            or not -(2**63) <= self.seed < 2**64
        ):
            raise InvalidRequest(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}",
                                 param="seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop must hold non-empty strings, got {s!r}", param="stop")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidRequest(f"stop_token_ids must hold non-negative integers, got {t!r}",
                                     param="stop_token_ids")
        if not _int(self.n) or self.n < 1:
            raise InvalidRequest(f"n must be an integer >= 1, got {self.n!r}", param="n")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p!r}", param="min_p")
        if not _finite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequest(f"repetition_penalty must be in (0, 2], got "
                                 f"{self.repetition_penalty!r}", param="repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2.0 <= v <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {v!r}", param=name)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequest(f"logit_bias must be a dict of token id -> bias, got "
                                     f"{self.logit_bias!r:.80}", param="logit_bias")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries; at most "
                                     f"{MAX_LOGIT_BIAS} are allowed", param="logit_bias")
            for t, b in self.logit_bias.items():
                if not _int(t) or t < 0:
                    raise InvalidRequest(f"logit_bias keys must be token ids >= 0, got {t!r}",
                                         param="logit_bias")
                if not _finite(b) or not -100.0 <= b <= 100.0:
                    raise InvalidRequest(f"logit_bias values must be in [-100, 100], got {b!r} "
                                         f"for token {t}", param="logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or "
                                     f"None, got {v!r}", param=name)
        if not _int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
                                 param="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens must be at most max_tokens={self.max_tokens}, got "
                                 f"{self.min_tokens}", param="min_tokens")
        t = self.truncate_prompt_tokens
        if t is not None and (not _int(t) or not (t == -1 or t >= 1)):
            raise InvalidRequest(f"truncate_prompt_tokens must be -1, an integer >= 1 or None, "
                                 f"got {t!r}", param="truncate_prompt_tokens")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise InvalidRequest(f"structured_outputs must be a StructuredOutputsParams or "
                                     f"None, got {type(so).__name__}", param="structured_outputs")
            so.validate()

    @property
    def greedy(self) -> bool:
        """True when the request samples by argmax."""
        return self.temperature == 0.0

    @property
    def uses_penalty_state(self) -> bool:
        """True when sampling needs the request's token history or bias row on the device
        (any penalty, or a logit_bias)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
