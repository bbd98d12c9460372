"""Constrained decoding with llguidance: grammars compiled off the step thread, token masks
computed on the host beside the step and applied on the device.

A request with ``SamplingParams.structured_outputs`` goes:
  ``GrammarCompiler.compile(spec)`` (the caller's thread: the server's thread pool, or the
  offline caller) -> a ``Grammar``: an llguidance matcher in its start state, built in the
  compiler's own threads under ``timeout_s`` and cached by ``spec.key``;
  ``add_request``: each choice takes ``grammar.start()``, its own ``GrammarState``;
  every step: each row that samples under a grammar gets its allowed-token bitmask from
  ``masks`` (the compiler's own ``i32[n, ceil(V / 32)]`` buffer, token ``t`` is bit ``t & 31``
  of word ``t >> 5``; rows without a grammar keep all bits set), which the step's dispatcher
  hands to the runner with the step, and the step program applies before sampling
  (``jaxserve/device/sampler.py:suppress_tokens``);
  after the step: ``state.advance(token)`` for each sampled token.
A grammar allows the EOS ids only where the output so far is complete, and nothing else once
it can go no further, so a constrained output ends exactly where its constraint does. A state
that breaks (a token it refuses, its per-step work limit hit) allows only EOS from then on.

llguidance was chosen over outlines-core and xgrammar by measurement
(``docs/decisions/0008-grammar-engine.md``): it compiles a JSON schema in about a millisecond
where outlines-core's regex index takes 5 ms to 8 s, and it needs neither torch nor
transformers (xgrammar needs both).
"""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np

from jaxserve.errors import InvalidRequest
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.tokenizer import Tokenizer

PARAM = "structured_outputs"
"""``InvalidRequest.param`` of every constraint error (the server names its own field)."""
DEFAULT_WHITESPACE = {"whitespace_flexible": False, "item_separator": ", ",
                      "key_separator": ": "}
"""JSON layout when the request sets none: one space after ``,`` and ``:``, no other
whitespace (a small model given free whitespace can emit newlines without end)."""
COMPACT_WHITESPACE = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # the library's fuel limits


def mask_words(vocab_size: int) -> int:
    """Words of one row's allowed-token bitmask: ``ceil(vocab_size / 32)``."""
    return -(-vocab_size // 32)


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: each id's bytes (as ``Tokenizer.token_bytes``
    decodes it; special tokens by name, which llguidance keeps out of text), the special ids and
    an encoder."""

    def __init__(self, tok: Tokenizer) -> None:
        special = tok.all_special_ids
        self.tokens = [(tok.id_to_token(i) or "").encode() if i in special
                       else tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(special)
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self._tok = tok

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: the matcher in its start state (never advanced; copied)."""

    matcher: llguidance.LLMatcher
    kind: str  # "json", "regex", "choice", "grammar" or "json_object"

    def start(self) -> GrammarState:
        """A fresh state at the start of the output."""
        return GrammarState(self.matcher.deep_copy())


class GrammarState:
    """One choice's position in its grammar; advanced on the engine thread only."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def advance(self, token: int) -> bool:
        """Consume one sampled token; False if the grammar refused it (the state is then
        broken and allows only EOS)."""
        return self.matcher.consume_token(int(token))

    @property
    def done(self) -> bool:
        """True once the grammar takes no further token (it has consumed EOS, or only EOS
        may follow)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the state broke, or None."""
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarCompiler:
    """Builds and caches ``Grammar``s for one tokenizer; thread-safe.

    Args:
      tokenizer: the engine's tokenizer (llguidance's view of it is built on first use).
      vocab_size: the width of the model's logits (>= the tokenizer's ids): one mask row's bits.
      timeout_s: the longest ``compile`` waits for a grammar; then InvalidRequest.
      cache_size: grammars kept (least recently used dropped first), failures included.
      num_threads: compiler threads.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, timeout_s: float,
                 cache_size: int = 256, num_threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[str, Future[Grammar]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="jaxserve-grammar")
        self._lltok: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._masks = np.empty((0, mask_words(vocab_size)), np.int32)  # ``masks``' buffer
        self.num_compiled = 0  # grammars built (cache misses)

    def prepare(self) -> Future[llguidance.LLTokenizer]:
        """Start building llguidance's view of the tokenizer in a compiler thread, so that the
        first constrained request need not wait for it (0.2 s for SmolLM2's 49152 ids, about
        4 s for Gemma 3's 262144 on a 2-core CPU). Returns at once; the future is the build."""
        return self._pool.submit(self._llg_tokenizer)

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The grammar of ``spec``, from the cache or built now (in the compiler's threads).

        Raises:
          InvalidRequest: ``param="structured_outputs"``: a schema, regex or grammar llguidance
            refuses (its message), or a build longer than ``timeout_s``.
        """
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._cache[key] = self._pool.submit(self._build, spec)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        try:
            return fut.result(timeout=self.timeout_s)
        except TimeoutError:
            raise InvalidRequest(f"compiling the {_kind(spec)} constraint took longer than "
                                 f"{self.timeout_s:g} s", param=PARAM) from None

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tok_lock:
            if self._lltok is None:
                eos = sorted(self.tokenizer.eos_token_ids) or None
                self._lltok = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_Vocabulary(self.tokenizer)),
                    n_vocab=self.vocab_size, eos_token=eos)
            return self._lltok

    def _build(self, spec: StructuredOutputsParams) -> Grammar:
        kind = _kind(spec)
        text = grammar_text(spec)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), text, log_level=0,
                                       limits=_LIMITS)
        if matcher.is_error():
            raise InvalidRequest(f"invalid {kind} constraint: {_one_line(matcher.get_error())}",
                                 param=PARAM)
        with self._lock:
            self.num_compiled += 1
        return Grammar(matcher, kind)

    def masks(self, rows: Sequence[tuple[GrammarState, int, Collection[int]]], num_rows: int
              ) -> np.ndarray:
        """The allowed-token bitmasks of a step's first ``num_rows`` rows, ``i32[num_rows,
        mask_words(vocab_size)]``: ``rows`` as ``fill_masks`` takes them, every other row all
        allowed. The buffer is the compiler's, reused by the next call (engine thread only)."""
        if self._masks.shape[0] < num_rows:
            self._masks = np.empty((num_rows, self._masks.shape[1]), np.int32)
        out = self._masks[:num_rows]
        out.fill(-1)
        self.fill_masks(rows, out)
        return out

    def fill_masks(self, rows: Sequence[tuple[GrammarState, int, Collection[int]]],
                   out: np.ndarray) -> None:
        """Write each state's allowed-token bitmask into row ``i`` of ``out``.

        Args:
          rows: (state, row index, withheld ids) triples, distinct rows; the withheld ids
            (``min_tokens``' stop ids) are cleared from the row's mask unless that would leave
            nothing allowed (then the grammar wins: the output must be able to end).
          out: ``i32[S, mask_words(vocab_size)]``, C-contiguous; other rows are left as they
            are.
        """
        if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != mask_words(self.vocab_size) \
                or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"mask buffer must be a contiguous i32[S, "
                             f"{mask_words(self.vocab_size)}], got {out.dtype}{list(out.shape)}")
        if any(not 0 <= i < out.shape[0] for _, i, _ in rows):
            raise ValueError(f"a mask row index is outside [0, {out.shape[0]})")
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(s.matcher, i) for s, i, _ in rows],
                                               out.ctypes.data, out.shape[1] * 4, out.shape[0])
        for _, i, withheld in rows:
            if withheld:
                row = out[i].view(np.uint32)
                kept = row.copy()
                for t in withheld:
                    if t >> 5 < kept.size:
                        kept[t >> 5] &= ~np.uint32(1 << (t & 31))
                if kept.any():
                    row[:] = kept


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec`` (not yet checked: the matcher's build checks it).

    Raises:
      InvalidRequest: a grammar that is neither Lark nor GBNF (``param="structured_outputs"``).
    """
    if spec.whitespace_pattern is not None:
        layout = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
    else:
        layout = COMPACT_WHITESPACE if spec.disable_any_whitespace else DEFAULT_WHITESPACE
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        if spec.disable_additional_properties:
            schema = no_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=layout)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=layout)
    if spec.regex is not None:
        return llguidance.grammar_from("regex", spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    try:
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise InvalidRequest(f"invalid grammar constraint: {_one_line(str(e))}",
                             param=PARAM) from None


def no_additional_properties(schema: object) -> object:
    """``schema`` with ``additionalProperties: false`` on every object schema that has
    ``properties`` and does not set it."""
    if isinstance(schema, list):
        return [no_additional_properties(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: no_additional_properties(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _kind(spec: StructuredOutputsParams) -> str:
    if spec.json_object:
        return "json_object"
    return next(k for k in ("json", "regex", "choice", "grammar") if getattr(spec, k) is not None)


_NOISE = re.compile(r"^(\d+ \|.*|[\s^]*)$")  # llguidance's source excerpts and carets


def _one_line(message: str) -> str:
    """llguidance's error as one line: its source excerpts and carets dropped."""
    lines = [ln.strip() for ln in message.splitlines() if not _NOISE.match(ln.strip())]
    return " ".join(lines)[:400] or "refused"
