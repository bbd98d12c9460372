"""A Hugging Face-style face on a ``Tokenizer``, for code written against transformers.

vLLM's ``LLM.get_tokenizer()`` returns the model's transformers tokenizer, and code pasted from
vLLM calls it as one: ``tokenizer(text)``, ``encode``, ``decode``, ``batch_decode``,
``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``,
``eos_token_id``. ``HFTokenizer`` offers those methods over jaxserve's own ``Tokenizer``
(transformers is not a dependency), with transformers' defaults where they differ from
jaxserve's: ``decode`` keeps special tokens, ``apply_chat_template`` returns token ids unless
``tokenize=False`` and adds no generation prompt unless asked.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.tokenizer import Tokenizer


class BatchEncoding(dict):
    """What ``HFTokenizer.__call__`` returns: ``input_ids`` and ``attention_mask``, as keys and
    as attributes (transformers' ``BatchEncoding``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFTokenizer:
    """transformers' tokenizer methods over ``tokenizer`` (kept as ``.tokenizer``).

    Args:
      tokenizer: the model's jaxserve ``Tokenizer``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __repr__(self) -> str:
        return f"HFTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"

    # ---- special tokens -----------------------------------------------------------------------

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.tokenizer.pad_token_id

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self._token(self.pad_token_id)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.tokenizer.all_special_ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return [self.tokenizer.id_to_token(i) for i in self.all_special_ids]

    # ---- vocabulary ---------------------------------------------------------------------------

    @property
    def name_or_path(self) -> str:
        return self.tokenizer.name

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size (transformers: without added tokens)."""
        return self.tokenizer.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """The vocabulary's size with added tokens."""
        return self.tokenizer.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self.tokenizer.backend.get_vocab(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (None when it has none)."""
        return self.tokenizer.chat_template if self.tokenizer.has_chat_template else None

    @property
    def backend_tokenizer(self):
        """The ``tokenizers.Tokenizer`` underneath (as transformers' fast tokenizers)."""
        return self.tokenizer.backend

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.tokenizer.id_to_token(ids)
        return self.tokenizer.convert_ids_to_tokens(ids)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.tokenizer.token_to_id(tokens)
        return [self.tokenizer.token_to_id(t) for t in tokens]

    # ---- text <-> ids ---------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[str]:
        """The token strings of ``text`` (no special tokens added)."""
        return self.convert_ids_to_tokens(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, BOS/EOS as the model adds them."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True
                 ) -> BatchEncoding:
        """``{"input_ids", "attention_mask"}`` of one text (lists of ints) or of several
        (lists of lists, unpadded).

        Raises:
          ValueError: ``text`` is neither a string nor a list of strings.
        """
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))
        if not isinstance(text, (list, tuple)) or not all(isinstance(t, str) for t in text):
            raise ValueError(f"text must be a string or a list of strings, got {text!r:.80}")
        ids = [self.encode(t, add_special_tokens) for t in text]
        return BatchEncoding(input_ids=ids, attention_mask=[[1] * len(i) for i in ids])

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (special tokens kept unless ``skip_special_tokens``)."""
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
                     ) -> list[str]:
        """``decode`` of each sequence."""
        return [self.decode(s, skip_special_tokens) for s in sequences]

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, conversation: list[dict] | Sequence[list[dict]],
                            tools: list[dict] | None = None, tokenize: bool = True,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool = False,
                            chat_template: str | None = None,
                            **template_kwargs: object) -> str | list[int] | list:
        """Render one conversation (a list of ``{role, content}`` dicts) or a list of them.

        Returns the text when ``tokenize=False``, else its ids (encoded without added special
        tokens: the template holds them); a list of those for a list of conversations.
        ``tools`` (JSON-schema dicts) and ``template_kwargs`` become template variables.

        Raises:
          ValueError: as ``Tokenizer.apply_chat_template``.
        """
        batched = isinstance(conversation, (list, tuple)) and bool(conversation) and \
            isinstance(conversation[0], (list, tuple))
        out = []
        for conv in conversation if batched else [conversation]:
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt, continue_final_message=continue_final_message,
                chat_template=chat_template,
                template_kwargs={**template_kwargs, **({"tools": tools} if tools else {})})
            out.append(self.tokenizer.encode(text, add_special_tokens=False) if tokenize
                       else text)
        return out if batched else out[0]
