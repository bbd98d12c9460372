"""What the GGUF golden generators share: the command line, the common prompts, transformers'
greedy decode, each prompt's record, the tokenizer cases and the JSON file.

Imported by make_goldens.py and make_gemma3_goldens.py, which run in the goldens venv (torch,
transformers, gguf; see make_goldens.py); torch and transformers are imported inside the
functions, so the constants import anywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

LONG_PROSE = (
    "The old lighthouse stood at the edge of the cliff, its white paint faded by a century of salt "
    "and wind. Every evening, the keeper climbed the narrow spiral staircase, counting the steps as "
    "his father had taught him, and lit the great lamp that swept its beam across the restless sea. "
    "Ships that passed in the night owed their safety to that steady light, though few of their "
    "sailors ever thought about the man who tended it. In the winter, storms rolled in from the west "
    "and rattled the windows of the small cottage at the foot of the tower. The keeper would sit by "
    "the fire with a cup of tea, listening to the waves crash against the rocks below, and write in "
    "his logbook the weather, the ships he had seen, and the small events of his solitary days. One "
    "morning, after a particularly fierce storm, he walked down to the shore and found a wooden "
    "chest half buried in the sand. Its brass lock was green with age, and carved into the lid was a "
    "name he had never seen before. He carried it home, set it on the kitchen table, and"
)

TOP_K_FIRST = 64  # the first step's top logits kept per prompt ("first_step_top64")
TOP_K_STEP = 5  # the top logits kept per greedy step ("step_top5")

TOKENIZER_CASES: list[str] = [
    "", "hello", " hello", "   three leading spaces", "two  spaces   three    four",
    "line one\nline two\n\n\nthree newlines", "\ttab\tseparated\t\tvalues", "trailing space ",
    "1234567890 3.14159 -42 1e10 2024-06-01", "def f(x):\n    return x**2  # square\n",
    "if (a != b) { printf(\"%d\\n\", a); }", "Crème brûlée, naïve façade, Ångström, señor",
    "日本語のテキストと中文字符", "😀🎉👍🏽 🇫🇷 👨‍👩‍👧", "<|im_start|>user\nhi<|im_end|>\n",
]


def topk_pairs(row: Any, k: int) -> list[list[Any]]:
    """Top-k [token_id, logit] pairs of a 1-D float32 tensor, highest first."""
    vals, ids = row.topk(k)
    return [[int(i), float(v)] for i, v in zip(ids.tolist(), vals.tolist())]


def greedy(model: Any, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[Any]]:
    """``num_tokens`` argmax tokens with a KV cache, ignoring EOS; returns the ids and each step's
    float32 logits row ``[vocab]``.

    Args:
      model: a transformers causal LM.
      prompt_ids: the prompt's token ids.
      num_tokens: how many tokens to generate.
    """
    import torch

    ids, rows = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(num_tokens):
            row = out.logits[0, -1].float()
            rows.append(row)
            nxt = int(row.argmax())
            ids.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, rows


def load_gguf_reference(path: Path) -> tuple[Any, Any]:
    """(tokenizer, model) of transformers for a GGUF file: dequantised to float32, eager
    attention, eval mode, ``torch.manual_seed(0)``.

    Args:
      path: the GGUF file.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return tok, model


def versions() -> dict[str, str]:
    """Versions of the reference stack (transformers, torch, gguf, tokenizers, numpy, python)."""
    import numpy as np
    import tokenizers
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "gguf": metadata.version("gguf"), "tokenizers": tokenizers.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def parse_args(description: str, gguf_help: str) -> argparse.Namespace:
    """The generators' command line: ``--gguf PATH`` (help ``gguf_help``) and ``--out-dir``
    (default tests/goldens)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--gguf", help=gguf_help)
    ap.add_argument("--out-dir", default="tests/goldens")
    return ap.parse_args()


def open_reference(description: str, gguf_help: str, find_gguf: Callable[[str | None], Path]
                   ) -> tuple[argparse.Namespace, Path, Any, Any]:
    """Parse the command line (``parse_args``), find the GGUF (``find_gguf(args.gguf)``) and
    load transformers' reference of it: ``(args, path, tokenizer, model)``."""
    args = parse_args(description, gguf_help)
    path = find_gguf(args.gguf)
    tok, model = load_gguf_reference(path)
    return args, path, tok, model


def gguf_fields(path: Path) -> dict[str, Any]:
    """The golden's source fields: the GGUF's file name and SHA-256, and ``versions()``."""
    return {"gguf_file": path.name,
            "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "versions": versions()}


def greedy_record(rec: dict[str, Any], tok: Any, model: Any, ids: list[int], num_tokens: int
                  ) -> list[Any]:
    """Run ``num_tokens`` greedy steps from prompt ``ids`` and add to ``rec``, in this order:
    ``prompt_token_ids``, ``first_step_top64``, ``greedy_token_ids``, ``greedy_text``,
    ``eos_positions``, ``top2_margins``, ``step_top5`` and
    ``cached_vs_full_forward_max_abs_diff``; returns each step's float32 logits row ``[vocab]``.

    Raises:
      AssertionError: one full forward over prompt + generated tokens picks other argmaxes
        than the cached decode.
    """
    import torch

    rec["prompt_token_ids"] = ids
    gen, rows = greedy(model, ids, num_tokens)
    with torch.no_grad():  # one full forward over prompt + generated: the same argmaxes
        tf = model(torch.tensor([ids + gen[:-1]])).logits[0, len(ids) - 1:].float()
    assert tf.argmax(-1).tolist() == gen, f"{rec['name']}: cached vs full-forward argmax differ"
    eos_id = int(tok.eos_token_id)
    rec["first_step_top64"] = topk_pairs(rows[0], TOP_K_FIRST)
    rec["greedy_token_ids"] = gen
    rec["greedy_text"] = tok.decode(gen, skip_special_tokens=False)
    rec["eos_positions"] = [i for i, t in enumerate(gen) if t == eos_id]
    rec["top2_margins"] = [float(r.topk(2).values[0] - r.topk(2).values[1]) for r in rows]
    rec["step_top5"] = [topk_pairs(r, TOP_K_STEP) for r in rows]
    rec["cached_vs_full_forward_max_abs_diff"] = float((tf - torch.stack(rows)).abs().max())
    return rows


def tokenizer_cases(tok: Any, *, with_tokens: bool) -> list[dict[str, Any]]:
    """``TOKENIZER_CASES`` through ``tok`` without special tokens: each case's ``text``,
    ``token_ids``, (``tokens``,) ``decoded`` (special tokens kept) (and ``roundtrip``: decoded
    == text); the bracketed keys only ``with_tokens``."""
    cases = []
    for s in TOKENIZER_CASES:
        ids = tok(s, add_special_tokens=False).input_ids
        dec = tok.decode(ids, skip_special_tokens=False)
        case: dict[str, Any] = {"text": s, "token_ids": ids}
        if with_tokens:
            case["tokens"] = tok.convert_ids_to_tokens(ids)
        case["decoded"] = dec
        if with_tokens:
            case["roundtrip"] = dec == s
        cases.append(case)
    return cases


def write_json(out_dir: str, name: str, golden: dict[str, Any]) -> Path:
    """Write ``golden`` as ``out_dir/name`` (UTF-8, indent 1, a final newline); returns the
    directory (made if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n",
                            encoding="utf-8")
    return out
