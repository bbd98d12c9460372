"""HF safetensors directories (tiny random Llama, Mistral, Qwen2) against HF transformers logits.

The directories and logits come from scripts/make_hf_goldens.py (transformers on the CPU, float32,
eager attention): llama is stored in bfloat16 with Llama-3 RoPE scaling and untied embeddings,
mistral has a sliding window of 8 (the first prompt has 48 tokens) and head_dim != hidden/heads
with a v4-style config.json, qwen2 has q/k/v bias, tied embeddings and three shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cli.main import main as cli_main
from jaxserve.config import LoadConfig
from jaxserve.loading.load import load_model
from jaxserve.loading.model_files import default_gguf_path
from models.hf import llama_hf_config
from models.registry import get_architecture
from tests.support.prefill import prefill_logits

HF_DIR = Path(__file__).resolve().parents[1] / "goldens" / "hf_tiny"
MODELS = ("llama", "mistral", "qwen2")
# Max |logit - golden| measured 1.6e-6 over all three models and every position (logits up to
# ~2.5 in magnitude); float32 summation order is the only difference. The tolerance is ~10x.
ATOL = 2e-5


@pytest.fixture(scope="module")
def goldens() -> dict:
    data = json.loads((HF_DIR / "goldens.json").read_text())
    with np.load(HF_DIR / "logits.npz") as z:
        data["logits"] = {k: z[k] for k in z.files}
    return data


def _logits(name: str, cfg_changes: dict | None = None, path: Path | None = None):
    loaded = load_model(LoadConfig(str(path or HF_DIR / name)), jnp.float32, 0)
    cfg, params, tok, served = loaded.model_config, loaded.params, loaded.tokenizer, loaded.name
    if cfg_changes:
        cfg = cfg.replace(**cfg_changes)
    model = get_architecture(cfg.architecture).model(cfg, jnp.float32)
    return cfg, tok, served, model, params


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name: str, goldens: dict) -> None:
    _, tok, served, model, params = _logits(name)
    assert served == name
    ids = goldens["prompt_token_ids"]
    for text, want in zip(goldens["prompts"], ids, strict=True):
        assert tok.encode(text) == want
    for i, got in enumerate(prefill_logits(model, params, ids)):
        want = goldens["logits"][f"{name}/{i}"]
        err = float(np.max(np.abs(got - want)))
        assert err <= ATOL, f"{name} prompt {i}: max |logit diff| {err:.3g}"


def test_configs_read_as_written() -> None:
    cfgs = {name: _logits(name)[0] for name in MODELS}
    llama, mistral, qwen2 = cfgs["llama"], cfgs["mistral"], cfgs["qwen2"]
    assert llama.rope_scaling is not None and llama.rope_scaling.original_max_position_embeddings \
        == 64 and not llama.tie_word_embeddings
    assert (mistral.sliding_window, mistral.head_dim, mistral.rope_theta) == (8, 16, 5e5)
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and qwen2.sliding_window is None
    assert all(c.architecture == "llama" for c in cfgs.values())


def test_the_sliding_window_is_what_makes_mistral_match(goldens: dict) -> None:
    """Without the window the long prompt's logits past position 8 leave the goldens."""
    _, _, _, model, params = _logits("mistral", {"sliding_window": None})
    got = prefill_logits(model, params, goldens["prompt_token_ids"][:1])[0]
    want = goldens["logits"]["mistral/0"]
    assert np.max(np.abs(got[:8] - want[:8])) <= ATOL
    assert np.max(np.abs(got[8:] - want[8:])) > 100 * ATOL


def test_convert_from_hf_serves_the_same_logits(goldens: dict, tmp_path) -> None:
    dst = tmp_path / "qwen2-orbax"
    assert cli_main(["convert", str(HF_DIR / "qwen2"), str(dst), "--dtype", "float32"]) == 0
    _, tok, _, model, params = _logits("qwen2", path=dst)
    ids = goldens["prompt_token_ids"]
    _, _, _, src_model, src_params = _logits("qwen2")
    for got, want in zip(prefill_logits(model, params, ids),
                         prefill_logits(src_model, src_params, ids), strict=True):
        assert np.array_equal(got, want)
    assert tok.eos_token_ids == frozenset({2})
    assert tok.apply_chat_template([{"role": "user", "content": "Hi!"}],
                                   add_generation_prompt=False) == goldens["prompts"][1]


@pytest.mark.parametrize(("change", "match"), [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope type 'yarn'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "use_sliding_window"),
    ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not one of"),
])
def test_unsupported_config_values_are_named(change: dict, match: str) -> None:
    data = json.loads((HF_DIR / "llama" / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        llama_hf_config({**data, **change})


def test_missing_tensor_is_named(tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "broken"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((HF_DIR / "mistral" / f).read_bytes())
    tensors = load_file(str(HF_DIR / "mistral" / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(LoadConfig(str(d)), jnp.float32, 0)


def test_tokenizer_from_elsewhere(tmp_path) -> None:
    """``LoadConfig.tokenizer`` (vLLM's ``tokenizer``) replaces the model's tokenizer; a path
    that is no tokenizer, or one with more tokens than the model, fails before weights load."""
    model = str(HF_DIR / "llama")
    own = load_model(LoadConfig(model), jnp.float32, 0).tokenizer
    own.save_pretrained(str(tmp_path / "tok"))
    loaded = load_model(LoadConfig(model, tokenizer=str(tmp_path / "tok")), jnp.float32, 0)
    assert loaded.tokenizer.name == "tok" and own.name == "llama"
    assert loaded.tokenizer.encode("Hello world") == own.encode("Hello world")
    same = load_model(LoadConfig(model, tokenizer=model), jnp.float32, 0)
    assert same.tokenizer.name == "llama"
    with pytest.raises(ValueError, match="nothing is downloaded"):
        load_model(LoadConfig(model, tokenizer="HuggingFaceTB/SmolLM2-135M"), jnp.float32, 0)
    with pytest.raises(ValueError, match="has 49152 tokens; the model's vocabulary has 320"):
        load_model(LoadConfig(model, tokenizer=default_gguf_path()), jnp.float32, 0)
