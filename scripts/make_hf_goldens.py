"""Write tiny random Llama, Mistral and Qwen2 checkpoints as HF safetensors directories, and the
float32 logits HF transformers computes for them (dev-only; tests/loading/test_hf.py checks against them).

Each model is tiny (hidden 32, 2 layers, vocab 320) with random weights drawn from a fixed seed
(norms near 1, biases non-zero, so every tensor matters), chosen to exercise what differs between
the three configurations:

* llama:   untied embeddings, Llama-3 RoPE scaling (all three frequency bands at head_dim 8),
           GQA 4/2, stored in bfloat16 (the loader upcasts; HF logits are of the bf16 weights
           in float32);
* mistral: a sliding window of 8 (the prompts are longer), head_dim 16 != hidden / heads,
           float32, config.json rewritten in transformers v4's form (``rope_theta`` at the top);
* qwen2:   q/k/v bias, tied embeddings, float32, sharded into several files with an index.

Every directory gets the same tiny byte-level BPE tokenizer (trained here with ``tokenizers`` on
a paragraph of text, 320 ids with ChatML special tokens) and a ``tokenizer_config.json`` with a
ChatML template. Outputs under tests/goldens/hf_tiny/: ``{llama,mistral,qwen2}/`` and
``goldens.json`` (versions, prompts as token ids) plus ``logits.npz`` (``f32[len, vocab]`` per
model and prompt, every position).

Needs the Python 3.11 venv with torch (CPU) and transformers described in
scripts/make_goldens.py; run from the repository root:

    /tmp/goldvenv/bin/python scripts/make_hf_goldens.py

It takes a few seconds. Nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path("tests/goldens/hf_tiny")
VOCAB = 320
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = """The capital city of France is Paris. Paris is known for the Eiffel Tower, the Louvre and
its cafes. A language model reads a sequence of tokens and predicts the next one; attention lets
each position look back at the positions before it. Serving engines keep the keys and values of
past tokens in a cache so that every new token costs one step. The quick brown fox jumps over the
lazy dog. Numbers such as 12, 345 and 6789 appear in text too, and so do questions: what is the
weather like today? It is sunny, with a light wind from the west."""
PROMPTS = [
    "The capital city of France is Paris, and the quick brown fox jumps over the lazy dog today.",
    "<|im_start|>user\nHi!<|im_end|>\n",
]


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: norms 1 + N(0, 0.1), biases and weights N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.1
            p.copy_((1.0 + noise) if "norm" in name else noise)


def configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": 2,
              "bos_token_id": 0}
    return {
        "llama": (LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            torch.bfloat16, None),
        "mistral": (MistralConfig(**common, head_dim=16, sliding_window=8,
                                  tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
                    torch.float32, None),
        "qwen2": (Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                  torch.float32, "40KB"),
    }


def to_v4_config(path: Path) -> None:
    """Rewrite config.json as transformers v4 writes it (rope_theta/rope_scaling at the top)."""
    data = json.loads((path / "config.json").read_text())
    rope = data.pop("rope_parameters")
    data["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        data["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(data, indent=2) + "\n")


def main() -> None:
    from transformers import AutoModelForCausalLM

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    tok = make_tokenizer()
    prompts = [tok.encode(p).ids for p in PROMPTS]
    logits = {}
    for seed, (name, (config, dtype, shard)) in enumerate(configs().items()):
        d = OUT / name
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        randomize(model, seed)
        model.to(dtype).save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
             "chat_template": CHATML}, indent=2) + "\n")
        if name == "mistral":
            to_v4_config(d)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                   attn_implementation="eager").eval()
        for i, ids in enumerate(prompts):
            with torch.no_grad():
                out = ref(torch.tensor([ids])).logits[0].float().numpy()
            logits[f"{name}/{i}"] = out.astype(np.float32)
        print(name, sorted(p.name for p in d.iterdir()))
    np.savez_compressed(OUT / "logits.npz", **logits)
    (OUT / "goldens.json").write_text(json.dumps({
        "versions": {k: metadata.version(k) for k in ("torch", "transformers", "tokenizers")},
        "prompts": PROMPTS, "prompt_token_ids": prompts}, indent=1) + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1e3:.0f} kB); prompt lengths {[len(p) for p in prompts]}")


if __name__ == "__main__":
    main()
