"""vLLM's own offline examples, pasted: the quickstart (``examples/offline_inference/basic/
basic.py`` and the docs' chat-template note) and ``basic/generate.py``'s sampling-params
example with vLLM's common constructor arguments. Their code is unchanged but for the import
(``from vllm import LLM, SamplingParams``), the model name (the default model here) and, where
the docs load an HF tokenizer, ``llm.get_tokenizer()``. Each test builds its own ``LLM`` (the
code under test constructs it), so there are two constructions in this module.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.loading.model_files import default_gguf_path
from jaxserve.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def test_quickstart_runs_as_written(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture) -> None:
    # LLM(model=...) takes the default compilation cache under ~; keep it in the repo's cache
    monkeypatch.setenv("HOME", str(REPO_ROOT / ".jax_cache" / "home"))
    model = default_gguf_path()

    # --- the quickstart, as vLLM writes it ---
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

    llm = LLM(model=model)

    outputs = llm.generate(prompts, sampling_params)

    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    # --- its note on chat templates (AutoTokenizer.from_pretrained -> llm.get_tokenizer()) ---
    tokenizer = llm.get_tokenizer()
    messages_list = [
        [{"role": "user", "content": prompt}]
        for prompt in prompts
    ]
    texts = tokenizer.apply_chat_template(
        messages_list,
        tokenize=False,
        add_generation_prompt=True,
    )

    templated = llm.generate(texts, sampling_params)

    for output in templated:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    chats = llm.chat(messages_list, sampling_params)
    for idx, output in enumerate(chats):
        prompt = prompts[idx]
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    # --- what it printed and returned ---
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 12 and all(line.startswith("Prompt: ") for line in lines)
    assert [o.prompt for o in outputs] == PROMPTS
    assert [o.prompt for o in templated] == [o.prompt for o in chats] == texts
    assert [o.prompt_token_ids for o in templated] == [o.prompt_token_ids for o in chats]
    for o in outputs + templated + chats:
        c = o.outputs[0]
        assert o.finished and isinstance(c.text, str)
        assert (len(c.token_ids), c.finish_reason) == (16, "length") or c.finish_reason == "stop"
    assert all(t.startswith("<|im_start|>") and t.endswith("<|im_start|>assistant\n")
               for t in texts)


def _generate_example(args: dict) -> list:
    """The body of vLLM's ``examples/offline_inference/basic/generate.py`` ``main``, returning
    its outputs (vLLM's only prints them)."""
    # Pop arguments not used by LLM
    max_tokens = args.pop("max_tokens")
    temperature = args.pop("temperature")
    top_p = args.pop("top_p")
    top_k = args.pop("top_k")

    # Create an LLM
    llm = LLM(**args)

    # Create a sampling params object
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    if top_p is not None:
        sampling_params.top_p = top_p
    if top_k is not None:
        sampling_params.top_k = top_k

    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    outputs = llm.generate(prompts, sampling_params)
    # Print the outputs.
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    return outputs


def test_generate_example_with_vllm_engine_arguments(tokenizer: Tokenizer,
                                                     tmp_path: Path) -> None:
    """generate.py's ``LLM(**args)`` with the arguments vLLM users pass: mapped ones
    (gpu_memory_utilization, dtype "float", tokenizer, seed, quantization None, ...) and the
    documented no-ops, which give one warning."""
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    args = {
        "model": default_gguf_path(), "tokenizer": str(tmp_path / "tok"),
        "gpu_memory_utilization": 0.9, "enforce_eager": True, "trust_remote_code": True,
        "dtype": "float", "seed": 0, "max_model_len": 1024, "tensor_parallel_size": 1,
        "quantization": None, "kv_cache_dtype": "auto", "enable_prefix_caching": True,
        # the shared test engine's settings, so its compiled programs are reused
        "num_kv_blocks": 160, "compilation_cache_dir": str(REPO_ROOT / ".jax_cache"),
        "max_tokens": 8, "temperature": 0.0, "top_p": None, "top_k": None,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = _generate_example(args)
    ours = [w for w in caught if str(w.message).startswith("LLM:")]
    assert len(ours) == 1
    assert "enforce_eager=True, trust_remote_code=True ignored" in str(ours[0].message)
    assert [o.prompt for o in outputs] == PROMPTS
    france = outputs[2].outputs[0]
    assert france.text.startswith(" Paris") and len(france.token_ids) <= 8
