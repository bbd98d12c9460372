"""The offline API (``LLM.generate`` / ``LLM.chat``) on the real model, over the shared engine."""

from __future__ import annotations

import pytest

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams

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
