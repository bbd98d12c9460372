"""A fake ``AsyncEngine`` for server tests: same interface, no model, scripted output.

Tokens are characters (``encode`` is ``ord`` per character, ``decode`` is ``chr``), the reply is
a fixed script, one character per step. It honours max_tokens (clamped to the window), stop
strings, ignore_eos, validates prompts as the real engine does, and records aborts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from jaxserve.engine.metrics import EngineMetrics
from jaxserve.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequest
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

EOS = 0


class FakeTokenizer:
    """One token per character; the chat template is ``<|role|>content\\n`` per message."""

    vocab_size = 0x110000
    eos_token_ids = frozenset({EOS})
    bos_token_id = None
    eos_token_id = EOS
    add_bos_token = False
    add_eos_token = False
    has_chat_template = True
    chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% endif %}")

    def id_to_token(self, token_id: int) -> str:
        return chr(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        return b"" if token_id == EOS else chr(token_id).encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            template_kwargs: dict | None = None) -> str:
        """As ``chat_template`` says; ``tools`` (from ``template_kwargs``) are listed first as
        ``<|tools|>name,name``, an assistant's ``tool_calls`` as ``<|call|>name(args)``."""
        if not messages:
            raise ValueError("messages must be a non-empty list of message objects")
        tools = (template_kwargs or {}).get("tools")
        out = [f"<|tools|>{','.join(t['function']['name'] for t in tools)}\n"] if tools else []
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
                raise ValueError(f"role must be a chat role, got {m['role']!r}")
            out.append(f"<|{m['role']}|>{m['content']}\n")
            for c in m.get("tool_calls") or ():
                out.append(f"<|call|>{c['function']['name']}({c['function']['arguments']})\n")
        return "".join(out) + ("<|assistant|>" if add_generation_prompt else "")


class FakeEngine:
    """Scripted engine.

    Args:
      script: the reply text; after it comes EOS (unless ignore_eos, then the script repeats).
      max_model_len: the context window.
      step_s: sleep between outputs (0 still yields to the event loop).
      fail_after: raise RuntimeError after this many outputs (an engine fault mid-stream).
      first_delay_s: extra sleep before the first output (a queued request: counted by
        ``num_waiting``).
    """

    def __init__(
        self,
        script: str = "Hello there, how are you?",
        max_model_len: int = 64,
        step_s: float = 0.0,
        fail_after: int | None = None,
        first_delay_s: float = 0.0,
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.model_name = "fake-model"
        self.metrics = EngineMetrics(self.model_name)
        self.alive = True
        self.script = script
        self.step_s = step_s
        self.fail_after = fail_after
        self.first_delay_s = first_delay_s
        self.requests: dict[str, tuple[list[int], SamplingParams, str | None]] = {}
        self.aborted: list[str] = []
        self.steps: dict[str, int] = {}
        self.running: set[str] = set()
        self.waiting: set[str] = set()  # running requests still in their first_delay_s

    def num_unfinished(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.running.discard(request_id)
            self.aborted.append(request_id)
            prompt = self.requests[request_id][0]
            self.metrics.record_finished("abort", 0.0, num_prompt_tokens=len(prompt),
                                         num_generation_tokens=self.steps[request_id])

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("prompt is empty", param="prompt")
        if n >= self.max_model_len:
            raise InvalidRequest(f"prompt has {n} tokens; max_model_len is {self.max_model_len}",
                                 param="prompt", code=CONTEXT_LENGTH_EXCEEDED)
        for t in prompt_token_ids:
            if not 0 <= t < self.tokenizer.vocab_size:
                raise InvalidRequest(
                    f"prompt token id {t} is out of range [0, {self.tokenizer.vocab_size})",
                    param="prompt")
        for t in sampling_params.stop_token_ids:
            if t >= self.tokenizer.vocab_size:
                raise InvalidRequest(f"stop_token_ids holds {t}, outside the vocabulary",
                                     param="stop_token_ids")
        window = self.max_model_len - n
        max_tokens = (
            window
            if sampling_params.max_tokens is None
            else min(sampling_params.max_tokens, window)
        )
        self.requests[request_id] = (list(prompt_token_ids), sampling_params, prompt)
        self.running.add(request_id)
        self.steps[request_id] = 0
        try:
            if self.first_delay_s:
                self.waiting.add(request_id)
                try:
                    await asyncio.sleep(self.first_delay_s)
                finally:
                    self.waiting.discard(request_id)
            async for out in self._run(
                request_id, prompt_token_ids, prompt, sampling_params, max_tokens
            ):
                yield out
        finally:
            # Leaving early (aclose / cancellation) aborts, as the real engine does.
            self.abort(request_id)

    async def _run(
        self, rid: str, ids: list[int], prompt: str | None, sp: SamplingParams, max_tokens: int
    ) -> AsyncIterator[RequestOutput]:
        token_ids: list[int] = []
        text = ""
        sent = 0
        i = 0
        while True:
            await asyncio.sleep(self.step_s)
            self.steps[rid] += 1
            if self.fail_after is not None and self.steps[rid] > self.fail_after:
                raise RuntimeError("simulated engine fault")
            if i < len(self.script) or sp.ignore_eos:
                tok = ord(self.script[i % len(self.script)])
            else:
                tok = EOS
            i += 1
            token_ids.append(tok)
            finish = None
            if tok == EOS:
                finish = "stop"
            else:
                text += chr(tok)
                for s in sp.stop:
                    if s in text:
                        cut = text.index(s) + (len(s) if sp.include_stop_str_in_output else 0)
                        text, finish = text[:cut], "stop"
                        break
            if finish is None and len(token_ids) >= max_tokens:
                finish = "length"
            visible = len(text) if finish is not None else len(text) - _held_back(text, sp.stop)
            delta, sent = text[sent:visible], max(sent, visible)
            if finish is not None:
                self.running.discard(rid)
                self.metrics.record_finished(finish, 0.01, num_prompt_tokens=len(ids),
                                             num_generation_tokens=len(token_ids))
            out = CompletionOutput(
                index=0,
                text=text[:sent],
                token_ids=list(token_ids),
                finish_reason=finish,
                delta_text=delta,
                delta_token_ids=[tok],
            )
            yield RequestOutput(
                request_id=rid,
                prompt=prompt,
                prompt_token_ids=list(ids),
                outputs=[out],
                finished=finish is not None,
            )
            if finish is not None:
                return


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best
