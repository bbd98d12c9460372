"""``HFTokenizer``: transformers' tokenizer methods and defaults over the real SmolLM2 tokenizer,
as vLLM code calls ``llm.get_tokenizer()``."""

from __future__ import annotations

import pytest

from jaxserve.hf_tokenizer import HFTokenizer
from jaxserve.tokenizer import Tokenizer

MSGS = [{"role": "user", "content": "Hi!"}]


@pytest.fixture
def hf(tokenizer: Tokenizer) -> HFTokenizer:
    return HFTokenizer(tokenizer)


def test_special_tokens(hf: HFTokenizer) -> None:
    assert (hf.bos_token, hf.bos_token_id) == ("<|im_start|>", 1)
    assert (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", 2)
    assert (hf.pad_token, hf.pad_token_id) == ("<|im_end|>", 2)
    assert 2 in hf.all_special_ids and "<|im_end|>" in hf.all_special_tokens
    assert hf.vocab_size == len(hf) == 49152
    assert hf.convert_tokens_to_ids("<|im_end|>") == 2
    assert hf.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert hf.get_vocab()["<|im_end|>"] == 2


def test_call_encode_decode(hf: HFTokenizer, tokenizer: Tokenizer) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tokenizer.encode(text)
    assert hf.encode(text) == ids
    enc = hf(text)
    assert enc["input_ids"] == enc.input_ids == ids and enc.attention_mask == [1] * len(ids)
    both = hf(["Hello", "Hello world"])
    assert both.input_ids == [hf.encode("Hello"), hf.encode("Hello world")]
    assert [len(m) for m in both.attention_mask] == [len(i) for i in both.input_ids]
    # transformers' decode keeps special tokens unless asked
    assert hf.decode(ids) == text
    assert hf.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert hf.decode(ids[0]) == "<|im_start|>"
    assert hf.batch_decode([ids, hf.encode("Hello")], skip_special_tokens=True) == [
        "user\nhi", "Hello"]
    assert "".join(hf.tokenize("Hello world")) == "HelloĠworld"
    with pytest.raises(ValueError, match="text must be"):
        hf(5)  # type: ignore[arg-type]


def test_apply_chat_template_as_transformers(hf: HFTokenizer, tokenizer: Tokenizer) -> None:
    """tokenize=True by default (ids without added special tokens), no generation prompt
    unless asked, and a list of conversations gives a list."""
    text = hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert text == tokenizer.apply_chat_template(MSGS, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert hf.apply_chat_template(MSGS, tokenize=False) == tokenizer.apply_chat_template(
        MSGS, add_generation_prompt=False)
    assert hf.apply_chat_template(MSGS, add_generation_prompt=True) == tokenizer.encode(
        text, add_special_tokens=False)
    assert hf.apply_chat_template([MSGS, MSGS], tokenize=False, add_generation_prompt=True) == [
        text, text]
    cont = hf.apply_chat_template(MSGS + [{"role": "assistant", "content": "Hello"}],
                                  tokenize=False, continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\nHello")
    tools = [{"type": "function", "function": {"name": "f"}}]
    own = "{% for t in tools %}{{ t.function.name }}{% endfor %}{{ flavour }}"
    assert hf.apply_chat_template(MSGS, tools=tools, tokenize=False, chat_template=own,
                                  flavour="!") == "f!"
    assert hf.chat_template == tokenizer.chat_template
