"""The offline API (``LLM.generate`` / ``LLM.chat``) on the real model, over the shared engine:
outputs, bad arguments, vLLM's ``min_tokens``, ``truncate_prompt_tokens`` and structured outputs,
``chat``'s template options, and the constructor's vLLM arguments (mapped without building an
engine)."""

from __future__ import annotations

import pytest

from jaxserve.config import EngineConfig
from jaxserve.llm import LLM, _engine_config
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture
def llm(engine) -> LLM:
    yield LLM.from_engine(engine)
    assert not engine.has_unfinished_requests()
    pool = engine.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_generate_text_and_token_ids_agree(llm: LLM, goldens: dict) -> None:
    gold = next(p for p in goldens["prompts"] if p["name"] == "france_text")
    by_text, by_ids = llm.generate(
        [gold["text"], {"prompt_token_ids": gold["prompt_token_ids"]}], GREEDY, use_tqdm=False)
    assert by_text.outputs[0].token_ids == gold["greedy_token_ids"][:8]
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert by_text.outputs[0].text == by_ids.outputs[0].text
    assert by_text.outputs[0].text.startswith(" Paris")
    assert by_text.outputs[0].finish_reason == "length"
    assert by_text.prompt == gold["text"] and by_ids.prompt is None


def test_chat_matches_golden(llm: LLM, goldens: dict) -> None:
    gold = next(p for p in goldens["prompts"] if p["name"] == "france_chat")
    [out] = llm.chat(gold["messages"], SamplingParams(temperature=0, max_tokens=32),
                     use_tqdm=False)
    assert out.prompt_token_ids == gold["prompt_token_ids"]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_outputs_in_input_order_with_per_prompt_params(llm: LLM) -> None:
    prompts = ["One, two, three,", "The capital city of France is", "Hello"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 1]


def test_prompt_ending_inside_a_character_leaks_no_prompt_text(llm: LLM) -> None:
    """A token-id prompt cut inside a 4-byte emoji, through the offline API."""
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello world \U0001F600")
    cut = ids[:-1]
    assert tok.decode(cut) != tok.decode(ids)  # the cut really splits the emoji
    [out] = llm.generate([{"prompt_token_ids": cut}], GREEDY, use_tqdm=False)
    assert "Hello world" not in out.outputs[0].text


@pytest.mark.parametrize("bad", ["", {"prompt_token_ids": []}, {"prompt_token_ids": [-1]},
                                 {"prompt_token_ids": [10**9]}, 42])
def test_bad_prompts_raise_and_run_nothing(llm: LLM, bad) -> None:
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        llm.generate(["fine", bad], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    [out] = llm.generate(["Hello"], GREEDY, use_tqdm=False)  # still serving
    assert len(out.outputs[0].token_ids) >= 1


def test_bad_arguments(llm: LLM) -> None:
    with pytest.raises(ValueError, match="messages"):
        llm.chat([])
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(max_num_seq=4)  # typo of max_num_seqs
    with pytest.raises(ValueError, match="max_model_len must be int"):
        LLM(max_model_len="abc")
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(None)
    with pytest.raises(ValueError, match="sampling_params must be"):
        llm.generate(["a"], {"temperature": 0})
    with pytest.raises(ValueError, match="must be a list of integers"):
        llm.generate([{"prompt_token_ids": [1.5]}])
    with pytest.raises(ValueError, match="stop_token_ids must be a list"):
        SamplingParams(stop_token_ids=5)
    [out] = llm.generate([{"prompt": "Hello"}], GREEDY, use_tqdm=False)  # vLLM's TextPrompt
    assert out.prompt == "Hello" and len(out.outputs[0].token_ids) >= 1


def test_huge_top_k_means_off(llm: LLM) -> None:
    """top_k at or above the vocabulary (even past int32) is off, never an engine failure."""
    base = SamplingParams(temperature=0.9, seed=7, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["Hello"] * 4, [
        base, SamplingParams(**{**vars(base), "top_k": 2**31}),
        SamplingParams(**{**vars(base), "top_k": 2**63}),
        SamplingParams(**{**vars(base), "top_k": -1})], use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


SAY_HI = [{"role": "user", "content": "Say hi."}]


def test_min_tokens_holds_eos_back(llm: LLM) -> None:
    """The greedy answer ends with EOS after fewer than 30 tokens; with min_tokens=30 it runs on
    the same tokens, with EOS masked at the step it came, until at least 30 exist."""
    eos = llm.get_tokenizer().eos_token_id
    [base] = llm.chat(SAY_HI, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    base_ids = base.outputs[0].token_ids
    assert base_ids[-1] == eos and len(base_ids) < 30
    [held] = llm.chat(SAY_HI, SamplingParams(temperature=0, max_tokens=40, min_tokens=30),
                      use_tqdm=False)
    ids = held.outputs[0].token_ids
    assert len(ids) >= 30 and eos not in ids[:30]
    assert ids[:len(base_ids) - 1] == base_ids[:-1]


def test_min_tokens_beats_a_logit_bias_on_eos_and_stop_ids(llm: LLM) -> None:
    """EOS (or a stop token id) biased to the top comes exactly at position min_tokens, greedy
    or sampled, per row: a batch-mate without min_tokens gets the tokens it gets alone."""
    tok = llm.get_tokenizer()
    eos, stop = tok.eos_token_id, tok.encode(" the")[0]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [alone] = llm.generate(["Hello"], plain, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=12, min_tokens=5, logit_bias={eos: 100}),
              SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12, min_tokens=4,
                             logit_bias={eos: 100}),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=3, stop_token_ids=[stop],
                             logit_bias={stop: 100}),
              plain]
    greedy, sampled, stopped, mate = llm.generate(["Hello"] * 4, params, use_tqdm=False)
    ids = greedy.outputs[0].token_ids
    assert len(ids) == 6 and ids[-1] == eos and eos not in ids[:5]
    assert greedy.outputs[0].finish_reason == "stop"
    for c in sampled.outputs:
        assert len(c.token_ids) == 5 and c.token_ids[-1] == eos and c.finish_reason == "stop"
    ids = stopped.outputs[0].token_ids
    assert len(ids) == 4 and ids[-1] == stop and stop not in ids[:3]
    assert stopped.outputs[0].stop_reason == stop
    assert mate.outputs[0].token_ids == alone.outputs[0].token_ids


def test_min_tokens_keeps_stop_strings_off_the_first_tokens(llm: LLM) -> None:
    """Greedy " four, five, six, ..." stops at its first comma, or with min_tokens=3 at the
    first comma after three tokens (" four", ",", " five")."""
    prompt = "One, two, three,"
    first, later = llm.generate([prompt] * 2, [
        SamplingParams(temperature=0, max_tokens=10, stop=[","]),
        SamplingParams(temperature=0, max_tokens=10, stop=[","], min_tokens=3)],
        use_tqdm=False)
    assert first.outputs[0].text == " four"
    assert later.outputs[0].text == " four, five" and later.outputs[0].stop_reason == ","


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM, goldens: dict) -> None:
    """vLLM's left truncation: the output is the golden continuation of the kept tokens, and
    the output's prompt_token_ids are the kept ones; -1 keeps what the window holds."""
    gold = next(p for p in goldens["prompts"] if p["name"] == "france_text")
    kept = gold["prompt_token_ids"]
    long = llm.get_tokenizer().encode("Some unrelated words come first. ") + kept
    [out] = llm.generate([{"prompt_token_ids": long}], SamplingParams(
        temperature=0, max_tokens=8, truncate_prompt_tokens=len(kept)), use_tqdm=False)
    assert out.prompt_token_ids == kept
    assert out.outputs[0].token_ids == gold["greedy_token_ids"][:8]
    window = llm.engine.max_model_len
    too_long = [1] * (window + 500)
    with pytest.raises(ValueError, match="max_model_len is"):
        llm.engine.validate(too_long, SamplingParams(max_tokens=1))
    assert llm.engine.validate(too_long, SamplingParams(max_tokens=1,
                                                        truncate_prompt_tokens=-1)) == 1
    with pytest.raises(ValueError, match="truncate_prompt_tokens .* greater than max_model_len"):
        llm.generate(["Hello"], SamplingParams(truncate_prompt_tokens=window + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        SamplingParams(truncate_prompt_tokens=0)


def test_min_tokens_is_validated_as_vllm() -> None:
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens=16"):
        SamplingParams(min_tokens=17)
    with pytest.raises(ValueError, match="min_tokens must be an integer >= 0"):
        SamplingParams(min_tokens=-1)
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100


def test_chat_continues_the_final_message(llm: LLM) -> None:
    """continue_final_message renders no end of turn and no generation prompt, so the model
    continues the assistant's words (as vLLM's LLM.chat)."""
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    [out] = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                     add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt,
                                                              add_special_tokens=False)
    assert out.outputs[0].text.startswith(" Paris")
    with pytest.raises(ValueError, match="not compatible"):
        llm.chat(msgs, continue_final_message=True, use_tqdm=False)


def test_chat_template_and_its_kwargs(llm: LLM) -> None:
    own = "{% for m in messages %}{{ m.content }}{% endfor %}{{ suffix }}"
    [out] = llm.chat(SAY_HI, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=own,
                     chat_template_kwargs={"suffix": " Hi"})
    assert out.prompt == "Say hi. Hi"
    [out] = llm.chat(SAY_HI, SamplingParams(max_tokens=1), use_tqdm=False,
                     chat_template_kwargs={"enable_thinking": False})  # unused by SmolLM2's
    assert out.prompt == llm.get_tokenizer().apply_chat_template(
        SAY_HI, tokenize=False, add_generation_prompt=True)


def test_vllm_constructor_arguments_map_onto_the_engine_config() -> None:
    cfg = _engine_config({"dtype": "half", "quantization": None, "kv_cache_dtype": "fp8_e4m3",
                          "seed": None, "max_model_len": 512, "tensor_parallel_size": 1,
                          "enable_prefix_caching": False}, gpu_memory_utilization=0.5)
    assert cfg == EngineConfig(dtype="float16", quantization="none", kv_cache_dtype="fp8",
                               max_model_len=512, enable_prefix_caching=False,
                               kv_cache_memory_fraction=0.5)
    assert _engine_config({"dtype": "float"}, None).dtype == "float32"
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        LLM(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="not both"):
        LLM(gpu_memory_utilization=0.5, kv_cache_memory_fraction=0.5)
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        LLM(enforce_eager="yes")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="unknown engine argument.*swap_space"):
        LLM(swap_space=4)


def test_vllms_structured_outputs_example_runs_as_written(llm: LLM) -> None:
    # vLLM's docs (features/structured_outputs.md, "Offline Inference"), the model aside
    structured_outputs_params = StructuredOutputsParams(choice=["Positive", "Negative"])
    sampling_params = SamplingParams(structured_outputs=structured_outputs_params)
    outputs = llm.generate(
        prompts="Classify this sentiment: vLLM is wonderful!",
        sampling_params=sampling_params,
    )
    print(outputs[0].outputs[0].text)
    assert outputs[0].outputs[0].text in ("Positive", "Negative")
    assert outputs[0].outputs[0].finish_reason == "stop"
