"""Published request traces replayed by ``jaxserve bench serve --dataset-name trace``.

Two formats, told apart by the file's first line (JSONL when it is JSON, else a CSV header):

**JSONL** (Mooncake's traces, AIPerf's ``mooncake_trace``, vLLM's ``timed_trace``), one request
a line:
  - arrival: ``timestamp`` (milliseconds, as Mooncake's traces) or ``arrival_time`` (seconds);
  - prompt: ``prompt`` (text, sent as it is) or ``input_length`` (tokens), the latter with
    optional ``hash_ids``: the prompt is built from blocks of ``block_size`` tokens
    (``--trace-block-size``, default 512 as Mooncake's traces and AIPerf's ``mooncake_trace``
    loader; vLLM's ``timed_trace`` uses 16), hash id ``h`` always giving the same tokens, so
    requests that share leading hash ids share a prompt prefix (the prefix a server's cache
    can hit). As AIPerf's ``PromptGenerator._build_token_sequence``: the prompt has exactly
    ``input_length`` tokens; when ``input_length`` ends inside the last hash id's block, that
    block is cut (its leading tokens, still the same for the same id); when it runs past the
    hash ids, fresh tokens fill the rest. Without ``hash_ids`` the prompt is a fresh window.
  - ``output_length`` (tokens).
**CSV** (the Azure LLM inference traces 2023 and 2024: ``TIMESTAMP,ContextTokens,
GeneratedTokens``; the timestamp a date-time such as ``2023-11-16 18:15:46.6805900``, read as
UTC; or a number of seconds): prompt length, output length, arrival; prompts are fresh windows.

Prompt tokens are windows of real English text (``datasets.TextCorpus``), as token ids for
``/v1/completions`` and their decoded text for ``/v1/chat/completions``. Arrivals are returned
as seconds after the first request, sorted.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import zlib

import numpy as np

from jaxserve.bench.datasets import SampleRequest, TextCorpus

DEFAULT_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's traces
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_trace(
    path: str, num_prompts: int | None, seed: int, chat: bool, corpus: TextCorpus,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[list[SampleRequest], np.ndarray]:
    """Requests and their send times (s after the first arrival, ``float64[n]``) from a trace
    file (module docstring), sorted by arrival; the first ``num_prompts`` (None: all).

    Raises:
      ValueError: naming the file, line and field: bad JSON or CSV, a missing, negative or
        non-integer field, both or neither of a pair, a bad ``block_size``, or no request.
    """
    if block_size < 1:
        raise ValueError(f"trace block_size must be >= 1, got {block_size}")
    with open(path, encoding="utf-8", newline="") as fh:
        first = fh.readline()
        fh.seek(0)
        if first.lstrip()[:1] in ("{", "[", ""):  # JSON values, or blank
            rows = _jsonl(fh, path, seed, chat, corpus, block_size)
        else:
            rows = _azure_csv(fh, path, seed, chat, corpus)
    if not rows:
        raise ValueError(f"trace {path} holds no request")
    rows.sort(key=lambda r: r[0])
    rows = rows[:num_prompts] if num_prompts is not None else rows
    times = np.array([r[0] for r in rows], np.float64)
    return [r[1] for r in rows], times - times[0]


def _jsonl(fh, path: str, seed: int, chat: bool, corpus: TextCorpus, block_size: int
           ) -> list[tuple[float, SampleRequest]]:
    rows, rng, blocks = [], np.random.default_rng(seed), HashBlocks(corpus, seed, block_size)
    for k, line in enumerate(fh, 1):
        if not line.strip():
            continue
        where = f"trace {path} line {k}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: must be a JSON object")
        t = _one_of(obj, where, "arrival_time", "timestamp")
        at = float(_number(obj, where, t)) * (1e-3 if t == "timestamp" else 1.0)
        out_len = _positive(obj, where, "output_length")
        if _one_of(obj, where, "prompt", "input_length") == "prompt":
            text = obj["prompt"]
            if not isinstance(text, str) or not text:
                raise ValueError(f"{where}: prompt must be a non-empty string")
            n = len(corpus.tokenizer.encode(text, add_special_tokens=False).ids)
            rows.append((at, SampleRequest(text, n, out_len)))
            continue
        n = _positive(obj, where, "input_length")
        hash_ids = obj.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise ValueError(f"{where}: hash_ids must be a list of integers, got {hash_ids!r}")
        if len(hash_ids) and (len(hash_ids) - 1) * block_size >= n:
            raise ValueError(f"{where}: {len(hash_ids)} hash_ids of {block_size} tokens are "
                             f"more than input_length {n} needs (--trace-block-size?)")
        ids = blocks.prompt(hash_ids, n, rng)
        rows.append((at, SampleRequest(corpus.tokenizer.decode(ids) if chat else ids, n,
                                       out_len)))
    return rows


def _azure_csv(fh, path: str, seed: int, chat: bool, corpus: TextCorpus
               ) -> list[tuple[float, SampleRequest]]:
    reader = csv.DictReader(fh)
    missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"trace {path}: a CSV trace needs the columns {AZURE_COLUMNS} "
                         f"(the Azure LLM inference trace's), missing {missing}")
    rows, rng = [], np.random.default_rng(seed)
    for k, rec in enumerate(reader, 2):
        where = f"trace {path} line {k}"
        at = _timestamp(rec["TIMESTAMP"], where)
        n, out_len = (_csv_int(rec, where, c) for c in AZURE_COLUMNS[1:])
        rows.append((at, SampleRequest(corpus.prompt(rng, n, chat), n, out_len)))
    return rows


class HashBlocks:
    """The tokens of each hash id: a window of ``block_size`` tokens of the corpus chosen by
    ``(seed, hash id)``, so the same id gives the same tokens in every request and run."""

    def __init__(self, corpus: TextCorpus, seed: int, block_size: int) -> None:
        self.corpus, self.seed, self.block_size = corpus, seed, block_size
        self._blocks: dict[int, list[int]] = {}

    def block(self, h: int) -> list[int]:
        """``block_size`` token ids of hash id ``h``."""
        if h not in self._blocks:
            rng = np.random.default_rng([self.seed, zlib.crc32(str(h).encode())])
            self._blocks[h] = self.corpus.window(rng, self.block_size)
        return self._blocks[h]

    def prompt(self, hash_ids: list[int], n: int, rng: np.random.Generator) -> list[int]:
        """``n`` token ids: the hash ids' blocks (the last cut to fit), then fresh tokens."""
        ids = [t for h in hash_ids for t in self.block(h)][:n]
        return ids + (self.corpus.window(rng, n - len(ids)) if len(ids) < n else [])


def _timestamp(text: str, where: str) -> float:
    """Seconds since the epoch of an Azure trace's TIMESTAMP (or a plain number of seconds)."""
    s = text.strip()
    try:
        return float(s)
    except ValueError:
        pass
    head, dot, frac = s.partition(".")
    try:
        t = dt.datetime.fromisoformat(head).replace(tzinfo=dt.UTC)
        return t.timestamp() + (float("0." + frac) if dot and frac.isdigit() else 0.0)
    except ValueError:
        raise ValueError(f"{where}: TIMESTAMP {text!r} is neither a date-time nor seconds"
                         ) from None


def _csv_int(rec: dict, where: str, key: str) -> int:
    try:
        v = int(rec[key])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {key} must be an integer >= 1, got {rec[key]!r}") from None
    if v < 1:
        raise ValueError(f"{where}: {key} must be an integer >= 1, got {v}")
    return v


def _one_of(obj: dict, where: str, a: str, b: str) -> str:
    if (a in obj) == (b in obj):
        raise ValueError(f"{where}: give exactly one of {a!r} and {b!r}")
    return a if a in obj else b


def _number(obj: dict, where: str, key: str, integer: bool = False) -> float:
    v = obj.get(key)
    kinds = (int,) if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kinds) or v < 0:
        kind = "a non-negative integer" if integer else "a non-negative number"
        raise ValueError(f"{where}: {key} must be {kind}, got {v!r}")
    return v


def _positive(obj: dict, where: str, key: str) -> int:
    v = int(_number(obj, where, key, integer=True))
    if v < 1:
        raise ValueError(f"{where}: {key} must be >= 1, got {v}")
    return v
