"""IncrementalDetokenizer: exact streaming text (S == NS) and stop strings, on the real SmolLM2
byte-level BPE tokenizer and on small SentencePiece-style tokenizers built here: characters split
across tokens and across the prompt's end, SentencePiece leading spaces, and stop strings cut
wherever they fall.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.tokenizer import Tokenizer

FFFD = "\ufffd"
PROPERTY = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def multibyte_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids whose token alone is a partial or whole non-ASCII character (bytes >= 0x80)."""
    return [
        i
        for i in range(17, tokenizer.vocab_size)
        if any(ord(c) >= 0x80 for c in tokenizer.decode([i]))
    ]


def chunked(ids: list[int], sizes: Sequence[int]) -> list[list[int]]:
    """Split ids into consecutive chunks of the given sizes (cycled), as a stream interval."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = max(1, sizes[k % len(sizes)]) if sizes else 1
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


def stream(det: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    """Feed chunks, then finish; return every delta (the last one is finish()'s)."""
    deltas = [det.add_tokens(c) for c in chunks]
    deltas.append(det.finish())
    assert "".join(deltas) == det.text
    return deltas


def id_lists(tokenizer: Tokenizer, multibyte_ids: list[int]) -> st.SearchStrategy[list[int]]:
    any_id = st.integers(0, tokenizer.vocab_size - 1)
    return st.lists(st.one_of(st.sampled_from(multibyte_ids), any_id), max_size=40)


# ---- ids -> text ----------------------------------------------------------------------------


@PROPERTY
@given(data=st.data(), skip=st.booleans(), sizes=st.lists(st.integers(1, 8), max_size=4))
def test_random_ids_concat_equals_decode(
    tokenizer: Tokenizer,
    multibyte_ids: list[int],
    data: st.DataObject,
    skip: bool,
    sizes: list[int],
) -> None:
    ids = data.draw(id_lists(tokenizer, multibyte_ids))
    det = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
    deltas = stream(det, chunked(ids, sizes))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    # An incomplete character is held, never streamed as U+FFFD; only finish() may flush one.
    assert not any(d.endswith(FFFD) for d in deltas[:-1])


@PROPERTY
@given(
    prompt=st.text(max_size=20),
    text=st.text(
        st.characters(
            codec="utf-8", max_codepoint=0x3FFFF, exclude_characters="\x04\x06\x13\x14\x16\x1d"
        ),
        max_size=40,
    ),
    sizes=st.lists(st.integers(1, 8), max_size=4),
)
def test_text_after_prompt_concat_equals_decode(
    tokenizer: Tokenizer, prompt: str, text: str, sizes: list[int]
) -> None:
    # A prompt that ends on a character boundary leaves the output's text unchanged.
    ids = tokenizer.encode(text)
    kw = {"skip_special_tokens": False}
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), **kw)
    one_by_one = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), **kw)
    assert "".join(stream(det, chunked(ids, sizes))) == tokenizer.decode(ids, **kw) == text
    assert "".join(stream(one_by_one, chunked(ids, [1]))) == text


def test_mixed_unicode_streams_once(tokenizer: Tokenizer) -> None:
    # Serving case 2: "A 世ab 😀 x 🌶 y" token by token: no duplicated or replaced characters.
    text = "Repeat exactly: A 世ab 😀 x 🌶 y"
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    deltas = stream(det, [[t] for t in ids])
    assert "".join(deltas) == text and FFFD not in "".join(deltas)
    assert "" in deltas  # some tokens are partial characters and were held


@pytest.mark.parametrize(("emoji", "cut"), [("😀", 1), ("🌶", 1), ("🌶", 2)])
def test_prompt_ending_mid_character(tokenizer: Tokenizer, emoji: str, cut: int) -> None:
    # Serving case 1: the prompt ids end inside the emoji's bytes; the output completes it.
    ids = tokenizer.encode("Hello world " + emoji)
    assert tokenizer.decode(ids[:-cut]).endswith(FFFD)
    prompt, out = ids[:-cut], ids[-cut:] + tokenizer.encode(" and more")
    for chunks in ([[t] for t in out], [out]):
        det = IncrementalDetokenizer(tokenizer, prompt)
        s = "".join(stream(det, chunks))
        assert "Hello world" not in s and FFFD not in s
        assert s == tokenizer.decode(ids + out[cut:])[len("Hello world ") :] == emoji + " and more"


def test_unfinished_character_flushed_at_finish(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀")[:-1]
    det = IncrementalDetokenizer(tokenizer, [])
    assert det.add_tokens(ids) == "ok"
    assert det.finish() == tokenizer.decode(ids)[2:] and det.text == tokenizer.decode(ids)
    with pytest.raises(RuntimeError):
        det.add_tokens([5])


def test_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hi<|im_end|> there")
    shown = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    hidden = IncrementalDetokenizer(tokenizer, [])
    assert "".join(stream(shown, [[t] for t in ids])) == "Hi<|im_end|> there"
    assert "".join(stream(hidden, [[t] for t in ids])) == "Hi there"


# ---- stop strings ---------------------------------------------------------------------------

ALPHABET = "ab c\n.世😀"
stop_texts = st.text(ALPHABET, min_size=1, max_size=4)


def reference_stop(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Non-streaming semantics: cut at the stop occurrence that ends first (longest on a tie)."""
    for end in range(1, len(full) + 1):
        hits = [s for s in stops if full[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return full[: end if include else end - len(s)], s
    return full, None


@PROPERTY
@given(
    text=st.text(ALPHABET, max_size=40),
    data=st.data(),
    include=st.booleans(),
    sizes=st.lists(st.integers(1, 6), max_size=4),
)
def test_stop_strings_match_reference(
    tokenizer: Tokenizer, text: str, data: st.DataObject, include: bool, sizes: list[int]
) -> None:
    # Stops are random strings or substrings of the text (which then fire), ending mid-token.
    substrings = st.builds(
        lambda i, n: text[i : i + n], st.integers(0, max(len(text) - 1, 0)), st.integers(1, 6)
    ).filter(bool)
    stops = data.draw(st.lists(st.one_of(stop_texts, substrings), min_size=1, max_size=3))
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, [], stop=stops, include_stop_str_in_output=include)
    fed: list[int] = []
    for chunk in chunked(ids, sizes):
        det.add_tokens(chunk)
        fed += chunk
        if det.stopped:
            break
        # Nothing that could still become a stop string has been emitted.
        decoded = tokenizer.decode(fed)
        assert decoded.startswith(det.text)
        for s in stops:
            for k in range(1, len(s)):
                if decoded.endswith(s[:k]):
                    assert len(det.text) <= len(decoded) - k
    if det.stopped:  # later tokens (e.g. one step late) add nothing
        assert det.add_tokens(ids[:2]) == ""
    det.finish()
    expected, reason = reference_stop(text, stops, include)
    assert (det.text, det.stop_reason, det.stopped) == (expected, reason, reason is not None)


def test_partial_stop_never_streamed(tokenizer: Tokenizer) -> None:
    # Serving case 4: "DEF", "GH", "I" are held until "J" completes "DEFGHIJ".
    ids = tokenizer.encode("Here is the English alphabet: ABCDEFGHIJKLMNOP")
    det = IncrementalDetokenizer(tokenizer, [], stop=["DEFGHIJ"])
    deltas = stream(det, [[t] for t in ids])
    assert "".join(deltas) == "Here is the English alphabet: ABC" and det.stop_reason == "DEFGHIJ"
    kept = IncrementalDetokenizer(tokenizer, [], stop=["DEFGHIJ"], include_stop_str_in_output=True)
    assert "".join(stream(kept, [[t] for t in ids])).endswith("ABCDEFGHIJ")


@pytest.mark.parametrize("stop", ["Par", "Pari", "Paris", "is P"])
def test_stop_mid_token(tokenizer: Tokenizer, stop: str) -> None:
    # Serving case 5: " Paris" is one token; "Pari" must still fire, mid-token.
    full = "The capital city of France is Paris. It is"
    ids = tokenizer.encode(full)
    for chunks in ([[t] for t in ids], [ids]):
        det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Q:"), stop=[stop])
        assert "".join(stream(det, chunks)) == full[: full.index(stop)]
        assert det.stopped and det.stop_reason == stop


def test_newline_stop_keeps_tail(tokenizer: Tokenizer) -> None:
    # Serving case 7: the text held back before "\n" is emitted when the stop fires.
    full = " What colour is the sky on Mars?\nB: Red"
    ids = tokenizer.encode(full)
    streamed = IncrementalDetokenizer(tokenizer, [], stop=["\n"])
    whole = IncrementalDetokenizer(tokenizer, [], stop=["\n"])
    assert "".join(stream(streamed, [[t] for t in ids])) == whole.add_tokens(ids) + whole.finish()
    assert streamed.text == " What colour is the sky on Mars?"


def test_min_tokens_keeps_stop_strings_off_the_first_tokens(tokenizer: Tokenizer) -> None:
    """vLLM's ``min_tokens``: a stop string in the text of the first ``min_tokens`` ids does
    not fire; the first one after them does, streamed or all at once."""
    full = " one, two, three, four"
    ids = tokenizer.encode(full)
    n = len(tokenizer.encode(" one, two"))  # the first two commas lie in these ids' text
    assert tokenizer.decode(ids[:n]) == " one, two"
    for chunks in ([[t] for t in ids], [ids]):
        det = IncrementalDetokenizer(tokenizer, [], stop=[","], min_tokens=n)
        assert "".join(stream(det, chunks)) == " one, two"
        assert det.stop_reason == ","
        late = IncrementalDetokenizer(tokenizer, [], stop=[", four"], min_tokens=n)
        assert "".join(stream(late, chunks)) == " one, two, three"
    off = IncrementalDetokenizer(tokenizer, [], stop=[","], min_tokens=0)
    assert "".join(stream(off, [ids])) == " one"


def test_empty_stop_rejected(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, [], stop=[""])


# ---- SentencePiece family: a token's leading space depends on what precedes it ---------------

SENTENCES = [
    "The engineers spent the morning locating logs and exploring the cluster.",
    "Streaming text must keep every space between words, even at chunk boundaries.",
    "A small model answers questions about the weather on Mars and the sky.",
    "Tokens arrive one at a time, and the decoder must not drop a leading space.",
]


def _metaspace_unigram() -> HFTokenizer:
    tok = HFTokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(
        SENTENCES,
        trainers.UnigramTrainer(
            vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>"
        ),
    )
    return tok


def _llama_style_bpe() -> HFTokenizer:
    # Llama-2 layout: normalizer prepends "▁" and maps spaces; decoder strips one leading space.
    tok = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator(
        SENTENCES, trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"])
    )
    return tok


SP_TOKENIZERS = {"metaspace_unigram": _metaspace_unigram(), "llama_style_bpe": _llama_style_bpe()}


@pytest.fixture(params=sorted(SP_TOKENIZERS))
def sp_tokenizer(request: pytest.FixtureRequest) -> HFTokenizer:
    return SP_TOKENIZERS[request.param]


@pytest.mark.parametrize("chunk", [1, 8])
def test_sentencepiece_spaces_at_chunk_boundaries(sp_tokenizer: HFTokenizer, chunk: int) -> None:
    prompt = sp_tokenizer.encode("The engineers spent the morning").ids
    out = sp_tokenizer.encode("locating logs and exploring the cluster.").ids
    det = IncrementalDetokenizer(sp_tokenizer, prompt)
    s = "".join(stream(det, chunked(out, [chunk])))
    whole = sp_tokenizer.decode(prompt + out)
    assert (
        s
        == whole[len(sp_tokenizer.decode(prompt)) :]
        == " locating logs and exploring the cluster."
    )
    # No prompt: the first token's leading space is dropped, exactly as decode(all) drops it.
    det = IncrementalDetokenizer(sp_tokenizer, [])
    assert "".join(stream(det, chunked(out, [chunk]))) == sp_tokenizer.decode(out)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), sizes=st.lists(st.integers(1, 8), max_size=4), skip=st.booleans())
def test_sentencepiece_random_ids(data: st.DataObject, sizes: list[int], skip: bool) -> None:
    for sp in SP_TOKENIZERS.values():
        ids = data.draw(st.lists(st.integers(0, sp.get_vocab_size() - 1), max_size=30))
        prompt = data.draw(st.lists(st.integers(3, sp.get_vocab_size() - 1), max_size=6))
        det = IncrementalDetokenizer(sp, prompt, skip_special_tokens=skip)
        s = "".join(stream(det, chunked(ids, sizes)))
        if prompt:
            p = sp.decode(prompt, skip_special_tokens=skip)
            assert s == sp.decode(prompt + ids, skip_special_tokens=skip)[len(p) :]
        else:
            assert s == sp.decode(ids, skip_special_tokens=skip)
