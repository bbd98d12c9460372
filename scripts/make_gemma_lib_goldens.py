"""Write a tiny Gemma 3 checkpoint with Google DeepMind's ``gemma`` library, and what that library
computes for it (dev-only; tests/loading/test_gemma_lib.py serves it with jaxserve and compares).

The model is the library's own ``gm.nn.Gemma3_270M`` class with a reduced ``TransformerConfig``
(width 32, 8 layers in Gemma 3's 5-local-to-1-global pattern, 4 query / 2 KV heads of 8 so the
q/kv einsums of grouped attention are used, sliding window 8, RoPE bases 10k / 1M with the 4B+
global scale factor 8) and random weights drawn from a fixed seed (norm scales non-zero, so the
``1 + scale`` of its RMSNorm matters). Its tokenizer is a SentencePiece BPE model trained here on
a chapter of the shipped text, with Gemma 3's special ids (pad 0, eos 1, bos 2, unk 3,
``<start_of_turn>`` 105, ``<end_of_turn>`` 106) and byte fallback, loaded by the library's
``gm.text.Gemma3Tokenizer``.

Outputs under tests/goldens/gemma_lib/:

* ``ckpt/``: ``gm.ckpts.save_params(params, ...)`` (the library's NESTED orbax layout, float32),
  then ``tokenizer.model`` and ``gemma_config.json`` (the settings shapes cannot show, written
  from the library's config object) copied in; ``ckpt_flat/``: the same weights in the FLAT
  layout of the released checkpoints (``transformer/layer_0/attn/q_einsum`` -> ``{"w"}``), by
  the library's own mapping;
* ``goldens.json``: versions, the config, and per prompt its ids (the library's tokenizer, BOS
  added) and the library's greedy continuation (``gm.text.Sampler``, greedy, float32; it stops
  at EOS or ``<end_of_turn>``);
* ``logits.npz``: per prompt ``f32[len, vocab]``, the library's forward (``model.apply``) at
  every position in float32, and ``f32[vocab]`` of the last position with the params cast to
  bfloat16 (the library computing in bfloat16).

The library's import pulls in its training stack (kauldron -> TensorFlow, ~1.3 GB installed),
so it runs in its own venv, never the project's: ``pip install gemma==4.0.1`` gives one (or the
lighter ``--no-deps`` set docs/decisions/0045-foreign-checkpoints.md lists). Run from the
repository root:

    /tmp/gemmavenv/bin/python scripts/make_gemma_lib_goldens.py

It takes about a minute on 2 cores. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import sentencepiece as spm
from gemma import gm

OUT = Path("tests/goldens/gemma_lib")
CORPUS = Path("jaxserve/data/pride_and_prejudice_ch1-12.txt")
VOCAB = 512
# ids 4..106 as Gemma 3's tokenizer has them: <mask>, [multimodal], <unused0..98>, then the turns
SPECIALS = ["<mask>", "[multimodal]", *[f"<unused{i}>" for i in range(99)],
            "<start_of_turn>", "<end_of_turn>"]
PROMPTS = [
    "It is a truth universally acknowledged",
    "The capital city of France is",
    ("Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice, "
     "that the experience of three and twenty years had been insufficient to make his wife "
     "understand his character."),
    "<start_of_turn>user\nWho is Mr. Darcy?<end_of_turn>\n<start_of_turn>model\n",
    "Numbers: 12, 345 and 6789.",
    "  two leading spaces, a tab\tand a newline\nhere",
    "Elizabeth",
    "Zebras & émigrés ☃ were not in the corpus.",
]
MAX_NEW_TOKENS = 12
SEED = 0


def train_tokenizer(path: Path) -> None:
    """A SentencePiece BPE model with Gemma's normaliser settings and special ids."""
    spm.SentencePieceTrainer.train(
        input=str(CORPUS), model_prefix=str(path.with_suffix("")), vocab_size=VOCAB,
        model_type="bpe", byte_fallback=True, character_coverage=0.9995,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
        bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=SPECIALS,
        add_dummy_prefix=False, remove_extra_whitespaces=False, split_digits=True,
        normalization_rule_name="identity", allow_whitespace_only_pieces=True,
        num_threads=2, minloglevel=2)
    path.with_suffix(".vocab").unlink()


def model_config(vocab_size: int):
    base = gm.nn.Gemma3_270M.config
    return dataclasses.replace(
        base, num_embed=vocab_size, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
        num_kv_heads=2, sliding_window_size=8, global_scale_factor=8.0,
        attention_types=gm.nn.config.make_attention_layers_types(
            base.attention_types[:6], num_layers=8))


def random_params(params):
    """Every leaf redrawn from a fixed seed: embeddings N(0, 0.5), norm scales N(0, 0.3),
    projections N(0, 1/fan_in)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.PRNGKey(SEED), len(leaves))
    out = []
    for (path, leaf), key in zip(leaves, keys, strict=True):
        name = jax.tree_util.keystr(path)
        if "input_embedding" in name:
            std = 0.5
        elif "scale" in name:
            std = 0.3
        else:  # einsums contract the width (32; attn_vec: 4 heads x 8) or, mlp/linear, 64
            std = 1.0 / np.sqrt(leaf.shape[0] if name.endswith("['linear']") else 32)
        out.append(std * jax.random.normal(key, leaf.shape, jnp.float32))
    return jax.tree_util.tree_unflatten(treedef, out)


def config_sidecar(cfg) -> dict:
    """What the tensors' shapes cannot show, in the library's own field names."""
    return {"sliding_window_size": cfg.sliding_window_size,
            "local_base_frequency": cfg.local_base_frequency,
            "global_base_frequency": cfg.global_base_frequency,
            "local_scale_factor": cfg.local_scale_factor,
            "global_scale_factor": cfg.global_scale_factor,
            "query_pre_attn_norm": cfg.query_pre_attn_norm.name,
            "attention_types": [t.name for t in cfg.attention_types],
            "final_logit_softcap": cfg.final_logit_softcap,
            "attn_logits_soft_cap": cfg.attn_logits_soft_cap}


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    sp_path = OUT / "tokenizer.model"
    train_tokenizer(sp_path)
    tokenizer = gm.text.Gemma3Tokenizer(path=str(sp_path.resolve()))
    cfg = model_config(tokenizer.vocab_size)
    model = gm.nn.Gemma3_270M(config=cfg, dtype=jnp.float32)
    ids0 = jnp.asarray([tokenizer.encode(PROMPTS[0], add_bos=True)])
    params = random_params(model.init(jax.random.PRNGKey(1), ids0)["params"])

    ckpt = (OUT / "ckpt").resolve()
    gm.ckpts.save_params(params, ckpt, wait_until_finished=True)
    # the same weights in the FLAT layout of the released checkpoints, by the library's own
    # NESTED -> FLAT mapping (the inverse of what its load_params applies to them)
    flat = (OUT / "ckpt_flat").resolve()
    gm.ckpts.save_params(gm.ckpts._checkpoint._nested_to_flat(params), flat,
                         wait_until_finished=True)
    for d in (ckpt, flat):
        shutil.copy(sp_path, d / "tokenizer.model")
        (d / "gemma_config.json").write_text(json.dumps(config_sidecar(cfg), indent=2) + "\n")
    sp_path.unlink()

    params_bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    model_bf16 = gm.nn.Gemma3_270M(config=cfg, dtype=jnp.bfloat16)
    sampler = gm.text.Sampler(model=model, params=params, tokenizer=tokenizer,
                              cache_length=256, max_out_length=MAX_NEW_TOKENS, pad_length=None)
    arrays, prompts = {}, []
    for i, text in enumerate(PROMPTS):
        ids = tokenizer.encode(text, add_bos=True)
        out = model.apply({"params": params}, jnp.asarray([ids]), return_last_only=False)
        arrays[f"f32_{i}"] = np.asarray(out.logits[0], np.float32)
        out = model_bf16.apply({"params": params_bf16}, jnp.asarray([ids]),
                               return_last_only=True)
        arrays[f"bf16_last_{i}"] = np.asarray(out.logits[0], np.float32)
        state = sampler.sample(text, max_new_tokens=MAX_NEW_TOKENS, return_state=True)
        steps = int(state.state.step)  # the buffer holds max_new_tokens; these were decoded
        greedy = [int(t) for t in np.asarray(state.tokens)[:steps]]
        prompts.append({"text": text, "ids": [int(t) for t in ids], "greedy": greedy})
        print(f"prompt {i}: {len(ids)} tokens, greedy {greedy}")
    np.savez_compressed(OUT / "logits.npz", **arrays)
    versions = {p: metadata.version(p) for p in ("gemma", "jax", "flax", "orbax-checkpoint",
                                                 "sentencepiece")}
    data = {"versions": versions, "seed": SEED, "max_new_tokens": MAX_NEW_TOKENS,
            "config": {"num_embed": cfg.num_embed, "embed_dim": cfg.embed_dim,
                       "hidden_dim": cfg.hidden_dim, "num_heads": cfg.num_heads,
                       "head_dim": cfg.head_dim, "num_kv_heads": cfg.num_kv_heads,
                       **config_sidecar(cfg)},
            "prompts": prompts}
    (OUT / "goldens.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
