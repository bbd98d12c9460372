"""What the GGUF golden generators share: the common prompts, and transformers' greedy decode.

Imported by make_goldens.py and make_gemma3_goldens.py, which run in the goldens venv (torch,
transformers, gguf; see make_goldens.py); torch and transformers are imported inside the
functions, so the constants import anywhere.
"""

from __future__ import annotations

import platform
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
