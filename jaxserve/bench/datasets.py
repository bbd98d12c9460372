"""Workloads for ``jaxserve bench serve`` and ``jaxserve bench throughput``.

``random``: input and output lengths around ``--random-input-len`` / ``--random-output-len`` from
one of ``LENGTH_DISTRIBUTIONS`` (``--random-length-distribution``), ``r`` =
``--random-range-ratio``:
  uniform    integers of ``[floor(len * (1 - r)), ceil(len * (1 + r))]`` (vLLM's RandomDataset
             rule, ``r`` in [0, 1); the default);
  fixed      exactly ``len`` (``r`` must be 0);
  normal     ``N(len, (r * len)^2)``, rounded;
  lognormal  mean ``len`` and coefficient of variation ``r`` (``sigma^2 = ln(1 + r^2)``,
             ``mu = ln(len) - sigma^2 / 2``), rounded;
every length clipped below at 1.
``sharegpt-like``: lengths of ShareGPT conversations without the data set (see ``SHAREGPT_*``),
prompts cut from real English text.
``prefix``: ``num_prefixes`` distinct shared prefixes, each followed by fresh random suffixes
(vLLM's ``prefix_repetition``); requests are spread evenly over the prefixes and shuffled.
``trace``: a trace file replayed (``traces.py``: Mooncake-style JSONL, Azure CSV).

Prompts are token ids for ``/v1/completions`` (exact lengths: the server takes token-id prompts
as they are) and text for ``/v1/chat/completions``. ``random`` and ``prefix`` text prompts are one
vocabulary word per intended token from ``WORDS``; ``sharegpt-like`` and ``trace`` prompts are
windows of ``CORPUS_PATH`` cut at the wanted token count with the benchmark's tokenizer and, for
chat, decoded back to text. A chat prompt's true length depends on the server's tokenizer and chat
template, so it is measured from the response's ``usage.prompt_tokens``; ``SampleRequest
.prompt_len`` is then only an estimate.

Token ids are drawn from ``token_range`` (default [1000, 30000)): ids every common vocabulary
holds (Llama 32k/128k, SmolLM2 49k, GPT-2 50k) away from the special tokens, which sit at the low
end (SmolLM2: 0-16) or high end (Llama 3: >= 128000) of a vocabulary.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import tokenizers

from jaxserve.loading.model_files import default_gguf_path
from jaxserve.tokenizer import Tokenizer

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


LENGTH_DISTRIBUTIONS = ("uniform", "fixed", "normal", "lognormal")


def sample_lengths(
    rng: np.random.Generator,
    n: int,
    length: int,
    distribution: str,
    range_ratio: float,
    minimum: int = 1,
) -> np.ndarray:
    """``n`` lengths (``int64[n]``, tokens) around ``length`` from ``distribution`` (module doc),
    each at least ``minimum``.

    Raises:
      ValueError: unknown distribution, a ratio outside its range (uniform: [0, 1); fixed: 0;
        normal and lognormal: >= 0, lognormal > 0 unless fixed), or a negative length.
    """
    if distribution not in LENGTH_DISTRIBUTIONS:
        raise ValueError(f"--random-length-distribution must be one of {LENGTH_DISTRIBUTIONS}, "
                         f"got {distribution!r}")
    if length < 0:
        raise ValueError(f"lengths must be >= 0, got {length}")
    if distribution == "uniform":
        lo, hi = length_bounds(length, range_ratio, minimum)
        return rng.integers(lo, hi + 1, size=n)
    if distribution == "fixed":
        if range_ratio != 0:
            raise ValueError(f"--random-range-ratio must be 0 with the fixed distribution, "
                             f"got {range_ratio}")
        return np.full(n, max(length, minimum), np.int64)
    if not range_ratio >= 0:
        raise ValueError(f"--random-range-ratio must be >= 0, got {range_ratio}")
    if distribution == "normal":
        x = rng.normal(length, range_ratio * length, size=n)
    else:
        sigma2 = math.log1p(range_ratio**2)
        mu = math.log(max(length, 1)) - sigma2 / 2
        x = rng.lognormal(mu, math.sqrt(sigma2), size=n)
    return np.maximum(np.rint(x), minimum).astype(np.int64)


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
    distribution: str = "uniform",
) -> list[SampleRequest]:
    """``num_prompts`` requests with input and output lengths (tokens) drawn from
    ``distribution`` (module doc).

    Raises:
      ValueError: bad distribution, ratio or token range, or a uniform input length that can
        reach 0.
    """
    _check_range(token_range)
    if distribution == "uniform" and length_bounds(input_len, range_ratio)[0] < 1:
        raise ValueError(
            f"--random-input-len {input_len} with --random-range-ratio {range_ratio} can draw "
            "empty prompts; raise the length or lower the ratio"
        )
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, distribution, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, distribution, range_ratio)
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


# -- real text ------------------------------------------------------------------------------------

CORPUS_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                           "pride_and_prejudice_ch1-12.txt")
"""Chapters 1-12 of Jane Austen's *Pride and Prejudice* (1813; public domain), plain text."""


class TextCorpus:
    """Windows of real English text, as token ids of a given tokenizer.

    Args:
      tokenizer: a ``tokenizers.Tokenizer``; the text is encoded once (no special tokens).
      path: a UTF-8 text file (default ``CORPUS_PATH``).
    Raises:
      ValueError: the text encodes to no tokens.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, path: str = CORPUS_PATH) -> None:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        self.tokenizer = tokenizer
        self.ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int64)
        if not len(self.ids):
            raise ValueError(f"{path} encodes to no tokens")

    def window(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` consecutive token ids from a random start (wrapping around the end)."""
        start = int(rng.integers(len(self.ids)))
        return np.take(self.ids, np.arange(start, start + n), mode="wrap").tolist()

    def prompt(self, rng: np.random.Generator, n: int, chat: bool) -> list[int] | str:
        """A prompt of ``n`` tokens: the ids (completions) or their text (chat)."""
        ids = self.window(rng, n)
        return self.tokenizer.decode(ids) if chat else ids


def load_tokenizer(path: str | None) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` of a GGUF file, a ``tokenizer.json`` file, or a folder that
    holds ``tokenizer.json``; None: the default model's (SmolLM2-135M-Instruct GGUF).

    Raises:
      ValueError: none of those at ``path``.
      FileNotFoundError: ``path`` is None and the default model is not installed.
    """
    if path is None:
        return Tokenizer.from_gguf(default_gguf_path()).backend
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer {path!r}: no such file (want a .gguf file, a "
                         "tokenizer.json, or a folder holding tokenizer.json)")
    if path.lower().endswith(".gguf"):
        return Tokenizer.from_gguf(path).backend
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 -- tokenizers raises its own exception types
        raise ValueError(f"--tokenizer {path!r} is not a tokenizer.json: {e}") from None


# -- sharegpt-like --------------------------------------------------------------------------------

# Published ShareGPT statistics: Kwon et al., "Efficient Memory Management for Large Language
# Model Serving with PagedAttention" (vLLM, SOSP 2023), Sec. 6.1 and Fig. 11a: ShareGPT prompts
# average 161.31 tokens and outputs 337.99 tokens ("8.4x longer input prompts and 5.8x longer
# outputs" than Alpaca's 19.31 / 58.45). The paper gives the means and the long right-skewed
# histograms, not a fitted shape, so the shape is our assumption: independent lognormals with
# sigma 1.0 (inputs) and 0.8 (outputs), kept only where vLLM's ShareGPT sampler keeps a
# conversation (prompt and output >= 4 tokens, prompt <= 1024, prompt + output <= 2048), with
# ``mu`` solved numerically so that the kept lengths have exactly the published means (medians
# then ~107 and ~254 tokens; ~2% of draws are rejected).
SHAREGPT_MEAN_INPUT_LEN = 161.31
SHAREGPT_MEAN_OUTPUT_LEN = 337.99
SHAREGPT_LOGNORMAL_INPUT = (4.6864, 1.0)  # (mu, sigma) of ln(prompt tokens)
SHAREGPT_LOGNORMAL_OUTPUT = (5.5451, 0.8)  # (mu, sigma) of ln(output tokens)
SHAREGPT_MIN_LEN, SHAREGPT_MAX_INPUT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048


def sharegpt_like_lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt, output) token lengths (``int64[n]`` each) of the sharegpt-like workload,
    drawn by rejection from the truncated lognormals described above."""
    ins: list[np.ndarray] = []
    outs: list[np.ndarray] = []
    got = 0
    while got < n:
        m = max(2 * (n - got), 16)
        i = np.rint(rng.lognormal(*SHAREGPT_LOGNORMAL_INPUT, size=m)).astype(np.int64)
        o = np.rint(rng.lognormal(*SHAREGPT_LOGNORMAL_OUTPUT, size=m)).astype(np.int64)
        ok = ((i >= SHAREGPT_MIN_LEN) & (o >= SHAREGPT_MIN_LEN) & (i <= SHAREGPT_MAX_INPUT_LEN)
              & (i + o <= SHAREGPT_MAX_TOTAL_LEN))
        ins.append(i[ok])
        outs.append(o[ok])
        got += int(ok.sum())
    return np.concatenate(ins)[:n], np.concatenate(outs)[:n]


def sharegpt_like_dataset(
    num_prompts: int, seed: int, chat: bool, corpus: TextCorpus
) -> list[SampleRequest]:
    """``num_prompts`` requests with ShareGPT-like lengths and prompts cut from ``corpus``."""
    rng = np.random.default_rng(seed)
    in_lens, out_lens = sharegpt_like_lengths(num_prompts, rng)
    return [SampleRequest(corpus.prompt(rng, n, chat), n, m)
            for n, m in zip(in_lens.tolist(), out_lens.tolist())]
