"""Offline batch inference after vLLM's ``LLM`` class.

``LLM(model=..., **engine_args)`` builds an ``LLMEngine`` and compiles its programs;
``generate`` / ``chat`` queue every prompt at once and step the engine until all finish, so the
prompts share batches (continuous batching), with a tqdm progress bar. The constructor takes
vLLM's common arguments too (``gpu_memory_utilization``, ``tokenizer``, ``dtype="half"``, ...),
so vLLM code runs when pasted; ``get_tokenizer()`` answers as a transformers tokenizer.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from tqdm import tqdm

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.hf_tokenizer import HFTokenizer
from jaxserve.outputs import RequestOutput
from jaxserve.platform import configure_process
from jaxserve.sampling_params import SamplingParams

Prompt = str | dict

_VLLM_DTYPES = {"half": "float16", "float": "float32"}
_VLLM_KV_CACHE_DTYPES = {"fp8_e4m3": "fp8"}  # jaxserve's fp8 KV cache is e4m3


class LLM:
    """Offline engine, constructed as vLLM's ``LLM``.

    Args:
      model: a GGUF file, an HF safetensors directory, an orbax checkpoint directory (``jaxserve
        convert``), or with ``load_format="dummy"`` a built-in config name; None: the default
        SmolLM2-135M-Instruct.
      tokenizer: an HF tokenizer directory or GGUF file to use instead of the model's (vLLM's
        ``tokenizer``); None or the model itself: the model's.
      load_format: "auto" or "dummy".
      served_model_name: a name for outputs (unused offline; kept for symmetry).
      gpu_memory_utilization: vLLM's name, mapped onto ``kv_cache_memory_fraction`` (here the
        fraction of the device memory left free after the weights that the KV cache takes;
        unused on the CPU, whose default cache is 2 GiB).
      enforce_eager, trust_remote_code: accepted for vLLM code and ignored, with one warning
        when set: every step runs as compiled XLA programs, and no code from a model
        directory is ever run.
      **engine_args: any ``EngineConfig`` field (max_model_len, tensor_parallel_size, dtype,
        quantization, kv_cache_dtype, seed, enable_prefix_caching, max_num_seqs, ...), with
        vLLM's spellings accepted: ``dtype`` "half" / "float", ``quantization=None``,
        ``kv_cache_dtype="fp8_e4m3"``, ``seed=None`` (the default seed).
    Raises:
      ValueError: an unknown engine argument (named), an invalid value, or
        ``gpu_memory_utilization`` given with ``kv_cache_memory_fraction``.
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 load_format: str = "auto", served_model_name: str | None = None,
                 gpu_memory_utilization: float | None = None, enforce_eager: bool = False,
                 trust_remote_code: bool = False, **engine_args: object) -> None:
        configure_process()  # XLA flags, allocator and malloc settings, as `jaxserve serve`
        # offline runs want throughput: no service objectives unless asked for (the server's
        # default is the platform's interactive ones, EngineConfig.ttft_slo_ms / itl_slo_ms)
        engine_args.setdefault("ttft_slo_ms", 0.0)
        engine_args.setdefault("itl_slo_ms", 0.0)
        config = _engine_config(engine_args, gpu_memory_utilization)
        ignored = []
        for name, value in (("enforce_eager", enforce_eager),
                            ("trust_remote_code", trust_remote_code)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
            if value:
                ignored.append(f"{name}=True")
        if ignored:
            warnings.warn(f"LLM: {', '.join(ignored)} ignored: jaxserve always runs compiled "
                          "XLA programs and never runs code from a model directory",
                          UserWarning, stacklevel=2)
        self.engine = LLMEngine(config, LoadConfig(model, load_format, served_model_name,
                                                   tokenizer))
        self.engine.warmup(progress=False)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An LLM over an engine built (and warmed up) elsewhere; it must be idle."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self) -> HFTokenizer:
        """The model's tokenizer with transformers' methods (``HFTokenizer``), as vLLM returns
        the HF tokenizer."""
        return HFTokenizer(self.engine.tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """A fresh ``SamplingParams()`` (vLLM's defaults; the model files set none here)."""
        return SamplingParams()

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
             use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of {role, content} dicts) or a list of them, with
        the model's chat template, as vLLM's ``LLM.chat``.

        Args:
          chat_template: jinja2 source to use instead of the model's.
          add_generation_prompt: end the prompt with the assistant header (default).
          continue_final_message: end it inside the last message instead, which the model
            then continues (needs ``add_generation_prompt=False``).
          chat_template_kwargs: further template variables (e.g. ``{"enable_thinking":
            False}``).
        Raises:
          ValueError: no messages, a malformed message, a model without a chat template and no
            ``chat_template`` (a base model: use ``generate`` with text), or as
            ``Tokenizer.apply_chat_template``.
        """
        if not messages:
            raise ValueError("messages must hold at least one message")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        if not tok.has_chat_template and chat_template is None:
            raise ValueError(f"messages: the model {self.engine.model_name!r} has no chat "
                             "template (a base model); pass the text to generate() instead")
        reqs = []
        for conv in convs:
            text = tok.apply_chat_template(
                conv, add_generation_prompt, continue_final_message=continue_final_message,
                chat_template=chat_template, template_kwargs=chat_template_kwargs)
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
        max_tokens = []  # every prompt is checked before any is queued
        for i, ((_, ids), p) in enumerate(zip(reqs, params)):
            try:
                max_tokens.append(eng.validate(ids, p))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        ids_of = []
        for (text, ids), p, m in zip(reqs, params, max_tokens):
            rid = eng.next_request_id()
            eng.add_request(rid, ids, p, text, max_tokens=m)
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


def _engine_config(engine_args: dict[str, object], gpu_memory_utilization: float | None
                   ) -> EngineConfig:
    """The EngineConfig of ``LLM``'s keyword arguments, vLLM's names and values mapped."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise ValueError(f"unknown engine argument(s) {unknown}; known: "
                         f"{sorted(known | {'gpu_memory_utilization'})}")
    args = dict(engine_args)
    if gpu_memory_utilization is not None:
        g = gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
        if "kv_cache_memory_fraction" in args:
            raise ValueError("give gpu_memory_utilization (vLLM's name) or "
                             "kv_cache_memory_fraction, not both")
        args["kv_cache_memory_fraction"] = gpu_memory_utilization
    for name, aliases in (("dtype", _VLLM_DTYPES), ("kv_cache_dtype", _VLLM_KV_CACHE_DTYPES)):
        if isinstance(args.get(name), str):
            args[name] = aliases.get(args[name], args[name])
    if "quantization" in args and args["quantization"] is None:
        args["quantization"] = "none"
    if "seed" in args and args["seed"] is None:
        del args["seed"]
    return EngineConfig(**args)  # type: ignore[arg-type]
