"""Text <-> token ids, and chat-template rendering, for one model.

``Tokenizer`` wraps a Hugging Face ``tokenizers.Tokenizer`` (BPE is never hand-rolled) with what
the model file says about it: BOS/EOS ids, whether BOS is prepended, chat template, name.

From a GGUF file the backend is built as transformers builds it from the same file, so the ids
agree (checked by ``tests/goldens/smollm2.json`` and ``gemma3.json``):

- ``tokenizer.ggml.model`` ``gpt2``: ``GGUFLlamaConverter``'s "llama-3" branch
  (``transformers/integrations/ggml.py``), a byte-level BPE (``_byte_level_backend``).
- ``llama`` (SentencePiece) of a Gemma architecture: ``gemma_tokenizer``
  (``transformers/integrations/gguf/gguf_tokenizer_mapping.py``, ``_gemma_backend``): the file
  has no merges, so every split of a token into two vocabulary tokens is one, ranked by the
  merged token's position, then longer left part first; all-space tokens are respelled "▁".

Control tokens (``token_type == 3``) become special added tokens, so ``<|im_start|>`` is one
id; Gemma's user-defined ones (4) become plain added tokens when spelled in the vocabulary.

Chat templates render as transformers' ``apply_chat_template`` does (``jaxserve.chat_template``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from functools import cached_property

import jinja2
import jinja2.ext
import tokenizers
from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from jaxserve.chat_template import CHATML_TEMPLATE, compile_template, render_chat

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
"""Special tokens that end an assistant turn when a chat template uses them."""

GGUF_CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
GGUF_USER_DEFINED_TOKEN_TYPE = 4  # llama.cpp's LLAMA_TOKEN_TYPE_USER_DEFINED
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
"""GGUF architectures whose SentencePiece tokenizer is built as transformers' GemmaTokenizer."""


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (openai/gpt-2 ``encoder.py``),
    which byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """One model's tokenizer; the arguments are kept as attributes of the same names.

    Args:
      backend: the ``tokenizers.Tokenizer`` that maps text to ids and back.
      bos_token_id / eos_token_id: the model's BOS and EOS ids (None if it has none).
      pad_token_id: the padding id the model files name (None if none; nothing here pads).
      add_bos_token / add_eos_token: whether ``encode(..., add_special_tokens=True)`` adds them.
      chat_template: jinja2 source; None falls back to ``CHATML_TEMPLATE``.
      vocab_size: rows of the model's embedding; default: the backend's size with added tokens.
      extra_eos_token_ids: further end-of-generation ids (GGUF ``eot_token_id``/``eom_token_id``).
      name: the model's display name.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        vocab_size: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        name: str = "",
        pad_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.has_chat_template = chat_template is not None
        self.chat_template = chat_template if chat_template is not None else CHATML_TEMPLATE
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self._extra_eos = frozenset(int(i) for i in extra_eos_token_ids)
        self.name = name

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str, reader: object = None) -> Tokenizer:
        """Build the tokenizer a GGUF file carries, as transformers does (module doc).

        Args:
          reader: an open ``GGUFFile`` (or ``gguf.GGUFReader``) of ``path``; default: open it.

        Raises:
          ValueError: no tokenizer, or a model other than ``gpt2`` (or Gemma's ``llama``).
        """
        from models.gguf_reader import GGUFFile  # lazy: models/ imports jax; this module does not

        fields = (reader if reader is not None else GGUFFile(path)).fields

        def get(key: str, default: object = None) -> object:
            field = fields.get(key)
            return default if field is None else field.contents()

        def strings(key: str) -> list[str]:
            return list(get(key))

        model = get("tokenizer.ggml.model")
        if model is None or "tokenizer.ggml.tokens" not in fields:
            raise ValueError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.*)")
        arch = get("general.architecture")
        gemma = model == "llama" and arch in GEMMA_ARCHITECTURES
        if model != "gpt2" and not gemma:
            raise ValueError(
                f"{path}: tokenizer.ggml.model={model!r} (architecture {arch!r}) is not "
                "supported; GGUF tokenizers are: 'gpt2' (byte-level BPE), and 'llama' "
                f"(SentencePiece) of the architectures {', '.join(GEMMA_ARCHITECTURES)}"
            )
        tokens = strings("tokenizer.ggml.tokens")
        types = [int(t) for t in get("tokenizer.ggml.token_type", [])]
        if gemma:
            backend = _gemma_backend(tokens)
        else:
            merges = [tuple(m.split(" ")) for m in strings("tokenizer.ggml.merges")]
            if bad := [m for m in merges if len(m) != 2][:1]:
                raise ValueError(f"{path}: malformed BPE merge {' '.join(bad[0])!r} in the GGUF")
            backend = _byte_level_backend(tokens, merges, get("tokenizer.ggml.unknown_token_id"))
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, kind in zip(tokens, types)
                                    if kind == GGUF_CONTROL_TOKEN_TYPE])  # fmt: skip
        if gemma:  # as transformers: only those whose spelling is in the vocabulary
            known = backend.get_vocab()
            backend.add_tokens([AddedToken(t, normalized=False, special=False)
                                for t, kind in zip(tokens, types)
                                if kind == GGUF_USER_DEFINED_TOKEN_TYPE and t in known])  # fmt: skip
        extra = [get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        return cls(
            backend,
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_id=get("tokenizer.ggml.eos_token_id"),
            add_bos_token=bool(get("tokenizer.ggml.add_bos_token", False)),
            add_eos_token=bool(get("tokenizer.ggml.add_eos_token", False)),
            chat_template=get("tokenizer.chat_template"),
            vocab_size=len(tokens),
            extra_eos_token_ids=[i for i in extra if i is not None],
            name=str(get("general.name", "") or ""),
            pad_token_id=get("tokenizer.ggml.padding_token_id"),
        )

    @classmethod
    def from_files(
        cls,
        tokenizer_json: str,
        chat_template: str | None = None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        name: str = "",
    ) -> Tokenizer:
        """Build from an HF ``tokenizer.json`` and the caller-read ``tokenizer_config.json``
        values; ``add_bos_token`` is applied here, not by the file's post-processor.

        Raises:
          ValueError: a named BOS/EOS token is not in the vocabulary.
        """
        backend = tokenizers.Tokenizer.from_file(tokenizer_json)
        ids = {what: None if t is None else backend.token_to_id(t)
               for what, t in (("bos_token", bos_token), ("eos_token", eos_token))}  # fmt: skip
        for what, t in (("bos_token", bos_token), ("eos_token", eos_token)):
            if t is not None and ids[what] is None:
                raise ValueError(f"{what}={t!r} is not in the vocabulary of {tokenizer_json}")
        return cls(backend, bos_token_id=ids["bos_token"], eos_token_id=ids["eos_token"],
                   add_bos_token=add_bos_token, chat_template=chat_template, name=name)  # fmt: skip

    @classmethod
    def from_pretrained_dir(cls, path: str) -> Tokenizer:
        """Build from an HF-layout directory (also ``jaxserve convert``'s): ``tokenizer.json``
        and, if present, ``tokenizer_config.json``, ``chat_template.jinja`` and
        ``generation_config.json``. Without ``add_bos_token``, BOS follows the post-processor.

        Raises:
          ValueError: no tokenizer.json, unreadable JSON, or a BOS/EOS token not in the
            vocabulary.
        """
        def read_json(name: str) -> dict:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                return {}
            try:
                with open(file, encoding="utf-8") as fh:
                    return json.load(fh)
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read {file}: {e}") from None

        tokenizer_json = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            raise ValueError(f"{path} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(tokenizer_json)
        config = read_json("tokenizer_config.json")

        def token_id(key: str, strict: bool = True) -> int | None:
            token = config.get(key)
            if isinstance(token, dict):
                token = token.get("content")
            if not isinstance(token, str):
                return None
            i = backend.token_to_id(token)
            if i is None and strict:
                raise ValueError(f"{path}/tokenizer_config.json: {key}={token!r} is not in the "
                                 f"vocabulary")
            return i

        bos, eos, pad = token_id("bos_token"), token_id("eos_token"), token_id("pad_token", strict=False)
        template = config.get("chat_template")
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as fh:
                template = fh.read()
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [
                bos]
        gen_eos = read_json("generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        if eos is None and extra:
            eos = int(extra[0])
        return cls(backend, bos_token_id=bos, eos_token_id=eos, add_bos_token=bool(add_bos),
                   add_eos_token=bool(config.get("add_eos_token", False)),
                   chat_template=template, extra_eos_token_ids=[int(i) for i in extra],
                   name=os.path.basename(os.path.normpath(path)), pad_token_id=pad)

    def save_pretrained(self, path: str) -> None:
        """Write the files ``from_pretrained_dir(path)`` rebuilds an equal tokenizer from."""
        os.makedirs(path, exist_ok=True)
        self.backend.save(os.path.join(path, "tokenizer.json"))
        config: dict = {
            "bos_token": None if self.bos_token_id is None else self.id_to_token(self.bos_token_id),
            "eos_token": None if self.eos_token_id is None else self.id_to_token(self.eos_token_id),
            "pad_token": None if self.pad_token_id is None else self.id_to_token(self.pad_token_id),
            "add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token}
        if self.has_chat_template:
            config["chat_template"] = self.chat_template
        eos_ids = sorted(self._extra_eos | ({self.eos_token_id} - {None}))
        for name, data in (("tokenizer_config.json", config),
                           ("generation_config.json", {"eos_token_id": eos_ids})):
            with open(os.path.join(path, name), "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=2, ensure_ascii=False)
                fh.write("\n")

    # ---- facts ----------------------------------------------------------------------------

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (GGUF control tokens), which decode can skip."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """EOS, GGUF eot/eom ids, and the template's special ``END_OF_TURN_TOKENS`` entry."""
        ids = set(self._extra_eos)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        for token in END_OF_TURN_TOKENS:
            i = self.backend.token_to_id(token)
            if token in self.chat_template and i is not None and i in self.all_special_ids:
                ids.add(i)
        return frozenset(ids)

    # ---- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``<|im_start|>`` is one id); BOS/EOS as the model says.

        Raises:
          ValueError: ``text`` holds a lone surrogate (not encodable as UTF-8)."""
        try:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        except TypeError as e:
            if isinstance(text, str):
                raise ValueError(f"text is not valid Unicode (lone surrogate?): {e}") from e
            raise
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that do not form valid UTF-8 decode to U+FFFD."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (e.g. ``'Ġworld'``); None if unknown."""
        return self.backend.id_to_token(int(token_id))

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The bytes one id adds to decoded text (maybe part of a character; a skipped special
        token: ``b""``); joined, they are ``decode``'s UTF-8 (SentencePiece: but its leading
        space)."""
        t = int(token_id)
        if t in self.all_special_ids:
            return b"" if skip_special_tokens else (self.id_to_token(t) or "").encode()
        cache = self._token_bytes
        if t not in cache:
            piece = self.id_to_token(t) or ""
            m = _BYTE_TOKEN.fullmatch(piece)
            if m is not None:
                cache[t] = bytes([int(m.group(1), 16)])
            elif self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
                cache[t] = bytes(_UNICODE_TO_BYTE[c] for c in piece)
            else:
                cache[t] = piece.replace("\u2581", " ").encode()
        return cache[t]

    @cached_property
    def _token_bytes(self) -> dict[int, bytes]:
        return {}

    @cached_property
    def _byte_level(self) -> bool:
        """Whether the backend's decoder maps pieces through the GPT-2 byte-to-unicode table."""
        return '"ByteLevel"' in json.dumps(json.loads(self.backend.to_str()).get("decoder"))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False,
                            chat_template: str | None = None,
                            template_kwargs: dict | None = None) -> str:
        """Render ``messages`` with the chat template (``chat_template.render_chat``).

        Args:
          add_generation_prompt: end with the header that starts an assistant turn.
          continue_final_message: end inside the last message, right after its content, so
            the model continues it (transformers' and vLLM's option; needs
            ``add_generation_prompt=False``).
          chat_template: jinja2 source to render with instead of the model's.
          template_kwargs: further template variables (vLLM's ``chat_template_kwargs``, e.g.
            ``{"enable_thinking": False}``); they may override ``bos_token``, ``eos_token``,
            ``tools`` and ``documents``.

        Raises:
          ValueError: a malformed message (naming the field, e.g. ``messages[2].content``), the
            template called ``raise_exception``, or the template failed (syntax, sandbox);
            ``continue_final_message`` with ``add_generation_prompt`` or with a final message
            the template does not render; ``template_kwargs`` setting ``messages`` or
            ``add_generation_prompt``.
        """
        bos, eos = (None if i is None else self.id_to_token(i)
                    for i in (self.bos_token_id, self.eos_token_id))  # fmt: skip
        return render_chat(self._template if chat_template is None else chat_template,
                           messages, add_generation_prompt, continue_final_message, bos, eos,
                           template_kwargs)

    @cached_property
    def _template(self) -> jinja2.Template:
        return compile_template(self.chat_template)


def _byte_level_backend(tokens: list[str], merges: list[tuple[str, ...]],
                        unk_id: int | None) -> tokenizers.Tokenizer:
    """The byte-level BPE of a ``gpt2`` GGUF tokenizer (module doc), before added tokens."""
    bpe = BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=True, byte_fallback=True,
              unk_token=tokens[unk_id] if unk_id is not None else None)  # fmt: skip
    backend = tokenizers.Tokenizer(bpe)
    backend.normalizer = normalizers.Sequence([])
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(**byte_level)
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Replace("▁", " "),
                                         decoders.ByteLevel(**byte_level)])  # fmt: skip
    return backend


def _gemma_backend(tokens: list[str]) -> tokenizers.Tokenizer:
    """The SentencePiece-as-BPE of a Gemma GGUF's vocabulary, in id order (module doc)."""
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated spelling keeps its last id
    rank = {t: -i for i, t in enumerate(tokens)}  # earlier in the file merges first
    merges = []  # (score, len(left), len(right), vocab[left], vocab[right], left, right)
    for merged, score in rank.items():
        for k in range(1, len(merged)):
            left = merged[:k]
            if left in vocab and (right := merged[k:]) in vocab:
                merges.append((score, k, len(right), -vocab[left], -vocab[right], left, right))
    # best first: by merged token, then longer left part; ties in the order of the two ids
    merges.sort(reverse=True)
    bpe = BPE(vocab, [m[5:] for m in merges], fuse_unk=True, byte_fallback=True,
              unk_token="<unk>")
    backend = tokenizers.Tokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])  # fmt: skip
    return backend


