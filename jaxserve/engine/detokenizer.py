"""Incremental detokenisation and stop strings for one output sequence.

The engine feeds each sequence's new token ids into its ``IncrementalDetokenizer`` after every
step; what comes back is the text that is safe to send to a streaming client now. The two layers:

1. Token ids -> text, exactly. Decoding one token at a time is wrong in two ways: a UTF-8
   character can be split across tokens (decoding the first part alone gives U+FFFD), and
   SentencePiece-style decoders drop or keep a token's leading space depending on whether it is
   the first token decoded. So each step decodes a short window of ids that begins before the
   new ones (``ids[prefix_offset:]``), and emits only what that window adds beyond the already
   emitted part (``ids[prefix_offset:read_offset]``); while the window's text ends in U+FFFD (an
   incomplete character) nothing is emitted and the offsets stay. This is vLLM's
   ``detokenize_incrementally`` (vllm/transformers_utils/detokenizer_utils.py, after TGI);
   ``tokenizers.decoders.DecodeStream`` is the same algorithm in Rust. The last few prompt ids
   seed the window, so the first output token's leading space is decoded in context; when the
   prompt ends partway through a character, its trailing U+FFFD is not counted as prompt text,
   so the character that the output completes is emitted whole and no prompt text leaks;
   U+FFFDs of stray prompt bytes that the output does not change stay the prompt's.
2. Stop strings, on the emitted text. Text is held back while a suffix of it could still grow
   into a stop string (the longest suffix that is a proper prefix of one); when a stop string
   appears, the text is cut at the stop occurrence that ends first (earliest start on a tie),
   the stop string is kept only with ``include_stop_str_in_output``, and nothing more is emitted.
   The cut does not depend on how the text was split into tokens or chunks.

Invariant (``S == NS``): the concatenation of every ``add_tokens`` delta and ``finish()`` is the
final ``text``; without stop strings it equals the text of all output ids decoded in the prompt's
context -- ``tokenizer.decode(output_ids)`` when the prompt is empty or ends on a character
boundary, for byte-level BPE tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt ids decoded as context (vLLM's INITIAL_..._OFFSET)
_TRIM_AT = 256  # drop ids before prefix_offset once this many have piled up


class TextDecoder(Protocol):
    """What the detokenizer needs of a tokenizer: ``jaxserve.tokenizer.Tokenizer`` and a bare
    ``tokenizers.Tokenizer`` both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into streamable text deltas.

    Args:
      tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
      prompt_token_ids: the prompt; its last few ids give the first output token its context.
      skip_special_tokens: leave special tokens out of the text.
      stop: stop strings (non-empty).
      include_stop_str_in_output: keep the stop string that fired at the end of the text.

    Attributes:
      text: all text emitted so far (the concatenation of every returned delta).
      stopped: a stop string fired; further tokens produce no text.
      stop_reason: the stop string that fired, else None.

    Raises:
      ValueError: an empty stop string.
    """

    def __init__(
        self,
        tokenizer: TextDecoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None
        self._held = ""  # decoded text held back as a possible stop-string prefix
        self._finished = False
        prompt = [int(t) for t in prompt_token_ids]
        self._ids = prompt[max(len(prompt) - PROMPT_CONTEXT_TOKENS, 0) :]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # A prompt that ends partway through a character decodes with a trailing U+FFFD. That
        # tail is not counted as emitted, so the output ids that complete the character emit
        # it; a tail the output leaves as it was (stray bytes) stays the prompt's (_cut).
        prompt_text = self._decode(self._ids)
        self._prefix_text = prompt_text.rstrip(REPLACEMENT_CHAR)
        self._prompt_text: str | None = prompt_text if prompt_text != self._prefix_text else None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Take new output ids; return the text delta that is safe to emit now ("" if none).

        After a stop string fired, ids are accepted and add nothing.

        Raises:
          RuntimeError: called after ``finish()`` (unless a stop string had fired).
        """
        if self.stopped:
            return ""
        if self._finished:
            raise RuntimeError("add_tokens() after finish()")
        new_text = "".join(self._step(int(t)) for t in token_ids)
        return self._emit(new_text, final=False)

    def finish(self) -> str:
        """End of the sequence (EOS, length, abort): return the held-back text, including an
        incomplete trailing character as the decoder renders it (U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        text = self._decode(self._ids[self._prefix_offset :])
        return self._emit(text[self._cut(text) :], final=True)

    # ---- layer 1: ids -> text ---------------------------------------------------------------

    def _step(self, token_id: int) -> str:
        """Append one id; return the text it makes final, or "" while it is incomplete."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character (or nothing new, e.g. a skipped special token)
        delta = text[self._cut(text) :]
        self._prompt_text = None
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return delta

    def _cut(self, text: str) -> int:
        """Where the new part of a window's ``text`` starts: after the emitted prefix text and,
        before the first emission, after whatever of the prompt's U+FFFD tail ``text`` keeps."""
        cut = len(self._prefix_text)
        if self._prompt_text is not None:
            end = min(len(text), len(self._prompt_text))
            while cut < end and text[cut] == self._prompt_text[cut]:
                cut += 1
        return cut

    # ---- layer 2: stop strings --------------------------------------------------------------

    def _emit(self, new_text: str, *, final: bool) -> str:
        """Run stop-string checks over the held text plus ``new_text``; return what to emit."""
        buf = self._held + new_text
        self._held = ""
        if self._stop:
            hit = self._first_stop(buf)
            if hit is not None:
                start, stop = hit
                buf = buf[: start + len(stop)] if self._include_stop else buf[:start]
                self.stopped, self.stop_reason = True, stop
            elif not final:
                keep = self._partial_stop_len(buf)
                if keep:
                    buf, self._held = buf[:-keep], buf[-keep:]
        self.text += buf
        return buf

    def _first_stop(self, buf: str) -> tuple[int, str] | None:
        """The stop occurrence in ``buf`` that ends first (then starts first), or None.

        Occurrences cannot begin in text already emitted: that text never ends with a proper
        prefix of a stop string, so searching ``buf`` (held + new text) suffices."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            i = buf.find(stop)
            if i >= 0:
                key = (i + len(stop), i, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest
