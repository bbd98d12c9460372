"""A SentencePiece ``tokenizer.model`` (Gemma's, as the ``gemma`` library ships it) read into a
``jaxserve.tokenizer.Tokenizer``: no hub download, no SentencePiece at serving time.

The file is a ``ModelProto``, parsed with the ``sentencepiece`` package's own schema. Its pieces
become a byte-fallback BPE of the ``tokenizers`` library the way transformers' ``GemmaConverter``
builds one: every split of a normal piece into two pieces of the vocabulary is a merge, ranked by
the merged piece's score (SentencePiece's BPE merges the adjacent pair whose merged piece scores
highest), then by the longer left part; spaces are spelled "▁". Control pieces (``<bos>``,
``<eos>``, ``<pad>``) become special added tokens, user-defined ones (``<start_of_turn>``) plain
added tokens matched in text, as SentencePiece matches them. BOS is prepended (the library's
``Tokenizer.encode(add_bos=True)``, which its sampler uses); ``<end_of_turn>`` ends generation
beside EOS (its sampler's ``end_tokens``); where the vocabulary has the turn markers, the chat
template is the library's turn format (``gm.text._template``).

The built backend is cached by the file's hash (``cache_dir()``): building
the merges of a 262k-piece vocabulary takes seconds. Only the settings Gemma's model uses are read: BPE, identity normalisation, no dummy prefix, no
removal of extra whitespace; another file is refused with the field named. ``tests/test_tokenizer
_spm.py`` checks the ids against ``sentencepiece`` itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable

import tokenizers
from tokenizers import AddedToken, decoders, normalizers
from tokenizers.models import BPE

from jaxserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GEMMA_TURN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<start_of_turn>user\n' + message['content'] | trim + '\n\n' }}"
    "{% else %}"
    "{% if not (loop.index0 > 0 and loop.previtem['role'] == 'system') %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
    "{% endif %}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma's turns (``<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n``, the
``gemma`` library's ``PROMPT`` / ``ANSWER``); a system message opens the first user turn, as the
Gemma 3 chat template of HF transformers does."""

# sentencepiece_model.proto: ModelProto.SentencePiece.Type, TrainerSpec.ModelType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BPE_MODEL = 2
CONVERTER_VERSION = "2"
"""Part of the cache key: bump it when ``_backend`` builds anything differently."""


def load_sentencepiece(path: str, name: str = "") -> Tokenizer:
    """The ``Tokenizer`` of a SentencePiece BPE ``.model`` file (module doc).

    Args:
      path: the ``tokenizer.model`` file.
      name: the model's display name.

    Raises:
      ValueError: naming the file: unreadable, not a ModelProto, or a setting other than
        Gemma's (the field named).
    """
    from sentencepiece import sentencepiece_model_pb2  # only when such a file is read

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        proto.ParseFromString(data)
    except OSError as e:
        raise ValueError(f"cannot read tokenizer file {path}: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and kin
        raise ValueError(f"{path} is not a SentencePiece model file: {e}") from None
    if not proto.pieces:
        raise ValueError(f"{path} is not a SentencePiece model file (no pieces)")
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    for field, value, want in (
            ("trainer_spec.model_type", trainer.model_type, BPE_MODEL),
            ("normalizer_spec.add_dummy_prefix", norm.add_dummy_prefix, False),
            ("normalizer_spec.remove_extra_whitespaces", norm.remove_extra_whitespaces, False),
            ("normalizer_spec.precompiled_charsmap", bool(norm.precompiled_charsmap), False),
            ("trainer_spec.treat_whitespace_as_suffix", trainer.treat_whitespace_as_suffix,
             False)):
        if value != want:
            raise ValueError(f"{path}: {field}={value!r}; jaxserve reads SentencePiece models "
                             f"with Gemma's settings ({field}={want!r})")
    backend = _cached_backend(data, lambda: _backend(proto))
    start, end = (backend.token_to_id(t) for t in ("<start_of_turn>", "<end_of_turn>"))
    turns = start is not None and end is not None
    num_pieces = len(proto.pieces)
    special = lambda i: i if 0 <= i < num_pieces else None  # -1: the model has none
    return Tokenizer(
        backend, bos_token_id=special(trainer.bos_id), eos_token_id=special(trainer.eos_id),
        pad_token_id=special(trainer.pad_id), add_bos_token=special(trainer.bos_id) is not None,
        chat_template=GEMMA_TURN_TEMPLATE if turns else None, vocab_size=num_pieces,
        extra_eos_token_ids=[end] if turns else [],
        name=name or os.path.basename(os.path.dirname(os.path.abspath(path))))


def cache_dir() -> str:
    """Where converted backends are kept: ``$XDG_CACHE_HOME/jaxserve/sentencepiece`` (default
    ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxserve", "sentencepiece")


def _cached_backend(model_bytes: bytes, build: Callable[[], tokenizers.Tokenizer]
                    ) -> tokenizers.Tokenizer:
    """``build()``'s backend, kept as ``tokenizer.json`` under ``cache_dir()`` by the SHA-256
    of the model file and this converter's version: building the merges of Gemma's 262k pieces
    takes seconds of Python, reading them back is the cost of any ``tokenizer.json``. A cache
    that cannot be written (read-only home) is skipped."""
    key = hashlib.sha256(model_bytes + CONVERTER_VERSION.encode()).hexdigest()
    file = os.path.join(cache_dir(), f"{key}.json")
    if os.path.isfile(file):
        try:
            return tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - a damaged cache entry is rebuilt
            log.warning("rebuilding the tokenizer cached in %s: %s", file, e)
    backend = build()
    with contextlib.suppress(OSError):
        os.makedirs(cache_dir(), exist_ok=True)
        tmp = f"{file}.{os.getpid()}.tmp"
        backend.save(tmp)
        os.replace(tmp, file)
    return backend


def _backend(proto) -> tokenizers.Tokenizer:
    """The whole backend of a parsed ``ModelProto``: the BPE, then its control pieces as
    special added tokens and its user-defined ones as plain added tokens."""
    pieces = [p.piece for p in proto.pieces]
    types = [p.type for p in proto.pieces]
    backend = _bpe_backend(pieces, [p.score for p in proto.pieces], types)
    backend.add_special_tokens([AddedToken(p, normalized=False, special=True)
                                for p, t in zip(pieces, types, strict=True) if t == CONTROL])
    backend.add_tokens([AddedToken(p, normalized=False, special=False)
                        for p, t in zip(pieces, types, strict=True) if t == USER_DEFINED])
    return backend


def _bpe_backend(pieces: list[str], scores: list[float], types: list[int]
                 ) -> tokenizers.Tokenizer:
    """Byte-fallback BPE over the pieces in id order, merges ranked as the module doc says."""
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []  # (score, len(left), -id(left), -id(right), left, right), best first
    for merged, score, kind in zip(pieces, scores, types):
        if kind != NORMAL:
            continue
        for k in range(1, len(merged)):
            left, right = merged[:k], merged[k:]
            if left in vocab and right in vocab:
                merges.append((score, k, -vocab[left], -vocab[right], left, right))
    merges.sort(reverse=True)
    unk = next((p for p, t in zip(pieces, types) if t == UNKNOWN), None)
    bpe = BPE(vocab, [m[4:] for m in merges], fuse_unk=True, byte_fallback=True, unk_token=unk)
    backend = tokenizers.Tokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    return backend
