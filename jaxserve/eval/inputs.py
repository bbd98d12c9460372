"""What ``jaxserve eval`` runs on: the configurations named by ``--compare``, the corpus and
the prompt set (read and checked before any model is loaded), and the default set that ships
with the package. See ``jaxserve.eval.quality`` for what is measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

from jaxserve.config import EngineConfig
from jaxserve.tokenizer import Tokenizer

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
DEFAULT_CORPUS = os.path.join(DATA_DIR, "pride_and_prejudice_ch1-12.txt")
"""Chapters 1-12 of Jane Austen's *Pride and Prejudice* (1813; public domain; the wording of
Project Gutenberg's plain-text eBook #1342, without its header and licence): 24,993 tokens of
SmolLM2's tokenizer."""
DEFAULT_PROMPTS = os.path.join(DATA_DIR, "eval_prompts.jsonl")
"""60 original chat prompts (the project's licence)."""

# one --compare part -> (EngineConfig field, value); "none" / "baseline" change nothing
COMPARE_PARTS: dict[str, tuple[str, object]] = {
    "int8": ("quantization", "int8"),
    "int4": ("quantization", "int4"),
    "fp8": ("quantization", "fp8"),
    "emb": ("quantize_embeddings", True),
    "bfloat16": ("dtype", "bfloat16"),
    "float32": ("dtype", "float32"),
    "kv-bfloat16": ("kv_cache_dtype", "bfloat16"),
    "kv-fp8": ("kv_cache_dtype", "fp8"),
    "kv-int8": ("kv_cache_dtype", "int8"),
}
NO_CHANGE = ("none", "baseline")
UNQUANTISED: dict[str, object] = {"quantization": "none", "quantize_embeddings": False,
                                  "kv_cache_dtype": "auto", "kv_calibration_file": None}
"""The fields that make a configuration quantised, at their unquantised values."""


def config_fields() -> set[str]:
    """The names of this build's EngineConfig fields."""
    return {f.name for f in dataclasses.fields(EngineConfig)}


def parse_compare(spec: str) -> list[tuple[str, dict[str, object]]]:
    """``"int8,int4+kv-fp8,none"`` -> ``[(name, EngineConfig overrides), ...]``.

    Items are separated by commas; each item joins parts with ``+``: a weight format (int8,
    int4, fp8), a float dtype (bfloat16, float32: ``--dtype``), ``emb`` (also quantise the
    embedding / LM head; needs a weight format), a KV format (kv-bfloat16, kv-fp8, kv-int8), or ``none`` / ``baseline`` alone (the unquantised model again).

    Raises:
      ValueError: naming ``--compare``: an empty item, an unknown part (listing the valid
        ones), two values for one field, ``emb`` without a weight format, a repeated item, or a
        part whose EngineConfig field this build does not have.
    """
    fields = config_fields()
    out: list[tuple[str, dict[str, object]]] = []
    for item in spec.split(","):
        name = item.strip()
        if not name:
            raise ValueError(f"--compare {spec!r}: empty configuration name")
        overrides: dict[str, object] = {}
        parts = name.split("+")
        if len(parts) == 1 and name in NO_CHANGE:
            out.append((name, overrides))
            continue
        for part in parts:
            if part not in COMPARE_PARTS:
                valid = ", ".join([*COMPARE_PARTS, *NO_CHANGE])
                raise ValueError(f"--compare: unknown configuration {part!r} in {name!r}; valid "
                                 f"names (joined with '+'): {valid}")
            field, value = COMPARE_PARTS[part]
            if field in overrides:
                raise ValueError(f"--compare {name!r}: two values for {field}")
            if field not in fields:
                raise ValueError(f"--compare {name!r}: unsupported configuration: this build's "
                                 f"EngineConfig has no {field!r} field")
            overrides[field] = value
        if "quantize_embeddings" in overrides and "quantization" not in overrides:
            raise ValueError(f"--compare {name!r}: 'emb' needs a weight format, e.g. int8+emb")
        out.append((name, overrides))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--compare {spec!r}: a configuration is named twice")
    return out


def baseline_config(config: EngineConfig) -> EngineConfig:
    """``config`` with every quantisation field this build has at its unquantised value."""
    fields = config_fields()
    return dataclasses.replace(config, **{k: v for k, v in UNQUANTISED.items() if k in fields})


def describe(config: EngineConfig) -> str:
    """A --compare style name of a config's quantisation (``"int8+emb+kv-fp8"``, ``"none"``)."""
    parts = []
    q = getattr(config, "quantization", "none")
    if q != "none":
        parts.append(str(q))
        if getattr(config, "quantize_embeddings", False):
            parts.append("emb")
    kv = getattr(config, "kv_cache_dtype", "auto")
    if kv != "auto":
        parts.append(f"kv-{kv}")
    return "+".join(parts) or "none"


# -- inputs -----------------------------------------------------------------------------------

def read_corpus(path: str) -> str:
    """The text of a UTF-8 corpus file.

    Raises:
      ValueError: naming ``--text``: unreadable, not UTF-8, or empty (whitespace only).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ValueError(f"--text {path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise ValueError(f"--text {path}: the corpus is empty")
    return text


def read_prompts(path: str) -> list[dict]:
    """The prompts of a JSONL file: one ``{"prompt": str}`` or ``{"messages": [{"role",
    "content"}, ...]}`` object per line (blank lines skipped).

    Raises:
      ValueError: naming ``--prompts`` and the 1-based line number: unreadable file, invalid
        JSON, not an object, neither or both keys, other keys, an empty prompt, or malformed
        messages; or a file with no prompts.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts {path}: cannot read it: {getattr(e, 'strerror', None) or e}"
                         ) from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts {path} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or len(set(obj) & {"prompt", "messages"}) != 1:
            raise ValueError(f"{where}: want an object with exactly one of 'prompt' or "
                             f"'messages', got {line.strip()[:80]!r}")
        extra = sorted(set(obj) - {"prompt", "messages"})
        if extra:
            raise ValueError(f"{where}: unknown key(s) {extra}")
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        else:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in msgs):
                raise ValueError(f"{where}: 'messages' must be a non-empty list of "
                                 f"{{'role': str, 'content': str}} objects")
        prompts.append(obj)
    if not prompts:
        raise ValueError(f"--prompts {path}: the file holds no prompts")
    return prompts


def prompt_token_ids(prompts: Sequence[dict], tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of each prompt: ``prompt`` text as is; ``messages`` through the model's chat
    template with the generation prompt (as ``LLM.chat`` and the chat endpoint do).

    Raises:
      ValueError: messages for a model without a chat template, or a prompt that encodes to
        no tokens (naming its index).
    """
    out = []
    for i, p in enumerate(prompts):
        if "messages" in p:
            if not tokenizer.has_chat_template:
                raise ValueError(f"prompts[{i}]: 'messages' need a chat template, and the model "
                                 f"has none; use {{'prompt': text}} lines")
            text = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(p["prompt"])
        if not ids:
            raise ValueError(f"prompts[{i}] encodes to no tokens")
        out.append(list(ids))
    return out
