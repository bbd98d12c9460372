"""Incremental detokenisation and stop strings for one output sequence.

After every step the engine feeds a sequence's new ids to its ``IncrementalDetokenizer`` and
gets back the text safe to stream now, in two layers:

1. Ids -> text. One token alone can split a UTF-8 character (U+FFFD) or lose a SentencePiece
   leading space, so each step decodes a window ``ids[prefix_offset:]`` and emits what it adds
   beyond ``ids[prefix_offset:read_offset]``, nothing while it ends in U+FFFD. vLLM's
   ``detokenize_incrementally`` (vllm/transformers_utils/detokenizer_utils.py, after TGI);
   ``tokenizers.decoders.DecodeStream`` in Rust. The last prompt ids seed the window; a
   prompt's trailing U+FFFD is emitted once the output completes the character.
2. Stop strings, on the emitted text: a suffix that could still grow into a stop string is held
   back; the text is cut at the occurrence that ends first (then starts first), keeping the
   stop string only with ``include_stop_str_in_output``. Token boundaries do not move the cut.
   The text of the first ``min_tokens`` output ids is emitted unchecked (vLLM's ``min_tokens``:
   no stop before that many tokens), so a stop string matches only text after it.

Invariant: the deltas of ``add_tokens`` and ``finish()`` concatenate to ``text``; without stop
strings that is the output decoded in the prompt's context (``tokenizer.decode(output_ids)`` for
byte-level BPE when the prompt ends on a character boundary).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt ids decoded as context (vLLM's INITIAL_..._OFFSET)
_TRIM_AT = 256  # drop ids before prefix_offset once this many have piled up


class TextDecoder(Protocol):
    """What the detokenizer needs: ``jaxserve.tokenizer.Tokenizer`` or ``tokenizers.Tokenizer``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into streamable text deltas.

    Args:
      tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
      prompt_token_ids: the prompt; its last few ids give the first output token its context.
      skip_special_tokens: leave special tokens out of the text.
      stop: stop strings (non-empty).
      include_stop_str_in_output: keep the stop string that fired at the end of the text.
      min_tokens: stop strings do not match the text of the first this many output ids.

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
        min_tokens: int = 0,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._unchecked_tokens = min_tokens  # output ids left whose text skips the stop check
        self.text = ""  # every delta emitted so far, concatenated
        self.stopped = False  # a stop string fired; further tokens add no text
        self.stop_reason: str | None = None  # the stop string that fired
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
        """Take new output ids; return the text delta safe to emit now ("" if none, or stopped).

        Raises:
          RuntimeError: called after ``finish()`` (unless a stop string had fired).
        """
        if self.stopped:
            return ""
        if self._finished:
            raise RuntimeError("add_tokens() after finish()")
        unchecked, new_text = "", ""
        for t in token_ids:
            if self._unchecked_tokens > 0:
                self._unchecked_tokens -= 1
                unchecked += self._step(int(t))
            else:
                new_text += self._step(int(t))
        self.text += unchecked
        return unchecked + self._emit(new_text, final=False)

    def finish(self) -> str:
        """End of the sequence: return the held-back text (an incomplete character as U+FFFD)."""
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
        """Where the new part of a window's ``text`` starts (past the prompt's kept U+FFFD tail)."""
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
        """The stop occurrence in ``buf`` (held + new text) that ends first, then starts first.

        None if there is none; emitted text never ends in a stop prefix, so ``buf`` suffices."""
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
