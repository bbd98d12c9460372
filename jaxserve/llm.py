"""Offline batch inference after vLLM's ``LLM`` class.

``LLM(model=..., **engine_args)`` builds an ``LLMEngine`` and compiles its programs;
``generate`` / ``chat`` queue every prompt at once and step the engine until all finish, so the
prompts share batches (continuous batching), with a tqdm progress bar.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm import tqdm

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

Prompt = str | dict


class LLM:
    """Offline engine.

    Args:
      model: a GGUF file, an HF safetensors directory, an orbax checkpoint directory (``jaxserve
        convert``), or with ``load_format="dummy"`` a built-in config name; None: the default
        SmolLM2-135M-Instruct.
      load_format: "auto" or "dummy".
      served_model_name: a name for outputs (unused offline; kept for symmetry).
      **engine_args: any ``EngineConfig`` field (block_size, max_num_seqs, max_model_len, ...).
    Raises:
      ValueError: an unknown engine argument (named) or an invalid value.
    """

    def __init__(self, model: str | None = None, *, load_format: str = "auto",
                 served_model_name: str | None = None, **engine_args: object) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineConfig(**engine_args),  # type: ignore[arg-type]
                                LoadConfig(model, load_format, served_model_name))
        self.engine.warmup(progress=False)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An LLM over an engine built (and warmed up) elsewhere; it must be idle."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self):
        """The engine's Tokenizer."""
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt; outputs in input order.

        prompts: a string, a ``{"prompt": str}`` or ``{"prompt_token_ids": [int, ...]}`` dict
          (vLLM's TextPrompt / TokensPrompt), or a list of those.
        sampling_params: one for all prompts or one per prompt (default ``SamplingParams()``).
        Raises ValueError (naming the prompt index) for a bad prompt; nothing is run then.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict or a list of those, got "
                             f"{type(prompts).__name__}")
        tok = self.engine.tokenizer
        reqs = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                reqs.append((p, tok.encode(p)))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                ids = p["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError(f"prompts[{i}]['prompt_token_ids'] must be a list of "
                                     f"integers, got {ids!r:.80}")
                reqs.append((p.get("prompt"), list(ids)))
            elif isinstance(p, dict) and isinstance(p.get("prompt"), str):
                reqs.append((p["prompt"], tok.encode(p["prompt"])))
            else:
                raise ValueError(f"prompts[{i}] must be a string or a dict with 'prompt' or "
                                 f"'prompt_token_ids', got {type(p).__name__}")
        return self._run(reqs, sampling_params, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Answer one conversation (a list of {role, content} dicts) or a list of them, with
        the model's chat template.

        Raises:
          ValueError: no messages, a malformed message, or a model without a chat template (a
            base model: use ``generate`` with text).
        """
        if not messages:
            raise ValueError("messages must hold at least one message")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        if not tok.has_chat_template:
            raise ValueError(f"messages: the model {self.engine.model_name!r} has no chat "
                             "template (a base model); pass the text to generate() instead")
        reqs = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            reqs.append((text, tok.encode(text, add_special_tokens=False)))
        return self._run(reqs, sampling_params, use_tqdm)

    def _run(self, reqs: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(reqs)
        else:
            if not isinstance(sampling_params, (list, tuple)) or not all(
                    isinstance(x, SamplingParams) for x in sampling_params):
                raise ValueError("sampling_params must be a SamplingParams or a list of them, "
                                 f"got {sampling_params!r:.80}")
            params = list(sampling_params)
            if len(params) != len(reqs):
                raise ValueError(f"sampling_params has {len(params)} entries for "
                                 f"{len(reqs)} prompts")
        eng = self.engine
        for i, ((_, ids), p) in enumerate(zip(reqs, params)):
            try:
                eng.validate(ids, p)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        ids_of = []
        for (text, ids), p in zip(reqs, params):
            rid = eng.next_request_id()
            eng.add_request(rid, ids, p, text)
            ids_of.append(rid)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            bar = tqdm(total=len(reqs), desc="generating", unit="req")
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            eng.abort_request(ids_of)  # leave the engine usable for the next call
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in ids_of]
