"""Synthetic workloads for ``jaxserve bench serve``.

``random``: input and output lengths uniform on the integers of
``[floor(len * (1 - r)), ceil(len * (1 + r))]`` (vLLM's RandomDataset rule, ``r`` =
``--random-range-ratio`` in [0, 1); output lengths at least 1).
``prefix``: ``num_prefixes`` distinct shared prefixes, each followed by fresh random suffixes
(vLLM's ``prefix_repetition``); requests are spread evenly over the prefixes and shuffled.

Prompts are token ids for ``/v1/completions`` (exact lengths: the server takes token-id prompts
as they are) and text for ``/v1/chat/completions``: one vocabulary word per intended token from
``WORDS``. A chat prompt's true length depends on the server's tokenizer and chat template, so it
is measured from the response's ``usage.prompt_tokens``; ``SampleRequest.prompt_len`` is then only
the word count.

Token ids are drawn from ``token_range`` (default [1000, 30000)): ids every common vocabulary
holds (Llama 32k/128k, SmolLM2 49k, GPT-2 50k) away from the special tokens, which sit at the low
end (SmolLM2: 0-16) or high end (Llama 3: >= 128000) of a vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULT_TOKEN_RANGE = (1000, 30000)

# Short common English words; with a leading space each is one token in the usual BPE vocabularies.
_WORD_TEXT = """
    the of and to in is it you that he was for on are with as his they be at one have this from
    or had by hot word but what some we can out other were all there when up use your how said
    an each she which do their time if will way about many then them write would like so these
    her long make thing see him two has look more day could go come did number sound no most
    people my over know water than call first who may down side been now find any new work part
    take get place made live where after back little only round man year came show every good
    me give our under name very through just form great think say help low line before turn
    cause same mean differ move right boy old too does tell sentence set three want air well
    also play small end put home read hand port large spell add even land here must big high
    such follow act why ask men change went light kind off need house picture try us again
    animal point mother world near build self earth father head stand own page should country
    found answer school grow study still learn plant cover food sun four thought let keep eye
    never last door between city tree cross since hard start might story saw far sea draw left
    late run while press close night real life few stop open seem together next white children
    begin got walk example ease paper often always music those both mark book letter until mile
    river car feet care second group carry took rain eat room friend began idea fish mountain
    north once base hear horse cut sure watch color face wood main enough plain girl usual
    young ready above ever red list though feel talk bird soon body dog family direct pose
    leave song measure state product black short numeral class wind question happen complete
    ship area half rock order fire south problem piece told knew pass farm top whole king size
    heard best hour better true during hundred am remember step early hold west ground interest
    reach fast five sing listen six table travel less morning ten simple several vowel toward
    war lay against pattern slow center love person money serve appear road map science rule
    govern pull cold notice voice fall power town fine certain fly unit lead cry dark machine
    note wait plan figure star box noun field rest correct able pound done beauty drive stood
    contain front teach week final gave green oh quick develop sleep warm free minute strong
    special mind behind clear tail produce fact street inch lot nothing course stay wheel full
    force blue object decide surface deep moon island foot yet busy test record boat common
    gold possible plane age dry wonder laugh thousand ago ran check game shape yes cool miss
    brought heat snow bed bring sit perhaps fill east weight language among
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class SampleRequest:
    """One request of a workload.

    Attributes:
      prompt: token ids (completions) or text (chat).
      prompt_len: tokens for id prompts; words for text prompts (the server's usage replaces it).
      expected_output_len: ``max_tokens`` to ask for (tokens).
    """

    prompt: list[int] | str
    prompt_len: int
    expected_output_len: int


def length_bounds(length: int, range_ratio: float, minimum: int = 0) -> tuple[int, int]:
    """Inclusive integer bounds ``[floor(length*(1-r)), ceil(length*(1+r))]``, each >= minimum.

    Raises:
      ValueError: ``range_ratio`` outside [0, 1) or a negative length.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if length < 0:
        raise ValueError(f"lengths must be >= 0, got {length}")
    low = max(math.floor(length * (1 - range_ratio)), minimum)
    high = max(math.ceil(length * (1 + range_ratio)), minimum)
    return low, high


def _ids(rng: np.random.Generator, n: int, token_range: tuple[int, int]) -> list[int]:
    lo, hi = token_range
    return rng.integers(lo, hi, size=n).tolist()


def _text(ids: list[int]) -> str:
    """Text of one word per id (the id picks the word): same length in words as ``ids``."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


def _check_range(token_range: tuple[int, int]) -> None:
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ValueError(f"--random-token-range needs 0 <= LOW < HIGH, got {lo} {hi}")


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    chat: bool,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
) -> list[SampleRequest]:
    """``num_prompts`` requests with uniformly drawn input and output lengths (tokens).

    Raises:
      ValueError: bad ratio or token range, or an input length that can reach 0.
    """
    _check_range(token_range)
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio, minimum=1)
    if in_lo < 1:
        raise ValueError(
            f"--random-input-len {input_len} with --random-range-ratio {range_ratio} can draw "
            "empty prompts; raise the length or lower the ratio"
        )
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    out: list[SampleRequest] = []
    for n, m in zip(in_lens.tolist(), out_lens.tolist()):
        ids = _ids(rng, n, token_range)
        out.append(SampleRequest(_text(ids) if chat else ids, n, m))
    return out


def prefix_dataset(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int,
    chat: bool,
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
) -> list[SampleRequest]:
    """``num_prompts`` requests: prefix ``i % num_prefixes`` (``prefix_len`` tokens) + a fresh
    random suffix (``suffix_len`` tokens), shuffled; every output ``output_len`` tokens.

    Raises:
      ValueError: non-positive counts or lengths, or a bad token range.
    """
    _check_range(token_range)
    if num_prefixes < 1 or prefix_len + suffix_len < 1 or output_len < 1:
        raise ValueError("prefix workload needs num_prefixes >= 1, prefix_len + suffix_len >= 1 "
                         "and output_len >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [_ids(rng, prefix_len, token_range) for _ in range(num_prefixes)]
    out: list[SampleRequest] = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + _ids(rng, suffix_len, token_range)
        out.append(SampleRequest(_text(ids) if chat else ids, len(ids), output_len))
    order = rng.permutation(num_prompts).tolist()
    return [out[j] for j in order]
