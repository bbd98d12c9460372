"""A SentencePiece ``tokenizer.model`` read into our tokenizer gives SentencePiece's own ids.

The file is the one scripts/make_gemma_lib_goldens.py trained (BPE with Gemma's settings and
special ids, byte fallback); ``sentencepiece`` itself is the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from jaxserve.loading.load import load_tokenizer
from jaxserve.tokenizer_spm import load_sentencepiece

MODEL = Path(__file__).resolve().parent / "goldens" / "gemma_lib" / "ckpt" / "tokenizer.model"
CORPUS = Path(__file__).resolve().parents[1] / "jaxserve" / "data" / "pride_and_prejudice_ch1-12.txt"
EXTRA = ["", " ", "   ", "a\n\nb", "\t\ttabs", "x" * 40, "ÀÉÎ ñ 中文 🙂 ☃", "12345678",
         "<start_of_turn>user\nHi<end_of_turn>\n", "trailing  ", "it's \"quoted\" (text)!"]


@pytest.fixture(scope="module")
def pair():
    return load_sentencepiece(str(MODEL)), spm.SentencePieceProcessor(model_file=str(MODEL))


def test_ids_equal_sentencepiece_on_a_corpus(pair) -> None:
    ours, ref = pair
    lines = [ln for ln in CORPUS.read_text(encoding="utf-8").splitlines() if ln][:400]
    texts = lines + ["\n".join(lines[:30])] + EXTRA
    bad = [t for t in texts if ours.encode(t, add_special_tokens=False) != ref.encode(t)]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first {bad[0]!r}"
    for t in texts[:50] + EXTRA:
        assert ours.decode(ref.encode(t)) == ref.decode(ref.encode(t))


def test_special_ids_and_turns(pair) -> None:
    ours, ref = pair
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        ref.bos_id(), ref.eos_id(), ref.pad_id())
    assert ours.encode("Hi")[0] == ref.bos_id()  # BOS added, as the gemma library does
    assert ours.eos_token_ids == {ref.eos_id(), ref.piece_to_id("<end_of_turn>")}
    text = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert load_tokenizer(str(MODEL)).encode("Hi") == ours.encode("Hi")


def test_other_sentencepiece_settings_are_refused(tmp_path) -> None:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(MODEL.read_bytes())
    proto.normalizer_spec.add_dummy_prefix = True
    bad = tmp_path / "llama2.model"
    bad.write_bytes(proto.SerializeToString())
    with pytest.raises(ValueError, match=r"llama2\.model: normalizer_spec\.add_dummy_prefix"):
        load_sentencepiece(str(bad))
    (tmp_path / "junk.model").write_bytes(b"\x00not a proto")
    with pytest.raises(ValueError, match="junk.model is not a SentencePiece model file"):
        load_sentencepiece(str(tmp_path / "junk.model"))


def test_the_built_backend_is_cached_by_content(tmp_path, monkeypatch, pair) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    text = "It is a truth universally acknowledged, ☃ 42."
    first = load_sentencepiece(str(MODEL))
    (entry,) = (tmp_path / "jaxserve" / "sentencepiece").iterdir()
    assert load_sentencepiece(str(MODEL)).encode(text) == first.encode(text) == [
        pair[1].bos_id(), *pair[1].encode(text)]
    entry.write_text("{not json")  # a damaged entry is rebuilt and rewritten
    assert load_sentencepiece(str(MODEL)).encode(text) == first.encode(text)
    assert entry.read_text().startswith("{") and len(entry.read_text()) > 100
