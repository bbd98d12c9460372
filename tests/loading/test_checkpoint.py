"""Orbax checkpoints: ``jaxserve convert`` -> serve round trip, dtype casts, layout errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cli.main import main as cli_main
from jaxserve.config import LoadConfig
from jaxserve.loading.load import load_model
from jaxserve.loading.model_files import default_gguf_path
from models import checkpoint
from models.config import builtin_config
from models.llama import LlamaForCausalLM
from models.loader import dummy_params
from tests.support.prefill import prefill_logits


def _bitwise_equal(a, b) -> bool:
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True))


def test_convert_then_load_is_bit_identical_to_the_gguf(engine, tmp_path) -> None:
    """``jaxserve convert`` of the SmolLM2 GGUF, loaded as ``serve`` loads it: the same config,
    bitwise the same params, the same logits, and a tokenizer that encodes and renders alike."""
    dst = str(tmp_path / "smollm2")
    assert cli_main(["convert", default_gguf_path(), dst, "--dtype", "float32"]) == 0
    loaded = load_model(LoadConfig(dst), engine.dtype, seed=0)
    cfg, params, tok = loaded.model_config, loaded.params, loaded.tokenizer
    assert loaded.name == "smollm2"
    assert cfg == engine.model_config
    assert _bitwise_equal(params, engine.runner.params)
    seqs = [engine.tokenizer.encode("The capital city of France is"), [1, 2, 3, 500, 40000]]
    want = prefill_logits(engine.model, engine.runner.params, seqs)
    got = prefill_logits(engine.model, params, seqs)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)

    src = engine.tokenizer
    text = "Hello, wörld! <|im_start|>user 123 \n\t emoji 🤖"
    assert tok.encode(text) == src.encode(text)
    assert tok.decode(src.encode(text), skip_special_tokens=False) == text
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == src.apply_chat_template(msgs)
    assert (tok.eos_token_ids, tok.bos_token_id, tok.add_bos_token, tok.vocab_size) == (
        src.eos_token_ids, src.bos_token_id, src.add_bos_token, src.vocab_size)


def test_convert_to_hf_loads_back_to_the_same_model(engine, tmp_path) -> None:
    """``--format hf`` (for other engines on the same weights): our own HF loader reads it back
    to the same config and bitwise the same params, and the tokenizer files come along."""
    dst = str(tmp_path / "smollm2-hf")
    assert cli_main(["convert", default_gguf_path(), dst, "--dtype", "float32",
                     "--format", "hf"]) == 0
    data = json.loads((Path(dst) / "config.json").read_text())
    assert data["architectures"] == ["LlamaForCausalLM"] and data["torch_dtype"] == "float32"
    assert data["eos_token_id"] == engine.tokenizer.eos_token_id
    loaded = load_model(LoadConfig(dst), engine.dtype, seed=0)
    assert loaded.model_config == engine.model_config.replace(name="llama")
    assert _bitwise_equal(loaded.params, engine.runner.params)
    text = "Hello, wörld! <|im_start|>user"
    assert loaded.tokenizer.encode(text) == engine.tokenizer.encode(text)
    with pytest.raises(ValueError, match="float weights only"):
        from jaxserve.cli.convert import convert
        convert(default_gguf_path(), str(tmp_path / "q"), quantization="int8", format="hf")
    with pytest.raises(ValueError, match="already holds a model"):
        convert(default_gguf_path(), dst, format="hf")


@pytest.fixture()
def tiny(tmp_path):
    """A tiny-config checkpoint stored in bfloat16 (and its float32 source params)."""
    cfg = builtin_config("tiny")
    params = dummy_params(LlamaForCausalLM(cfg, jnp.float32), seed=3)
    path = str(tmp_path / "tiny")
    checkpoint.save_checkpoint(path, cfg, params, jnp.bfloat16)
    return path, cfg, params


def test_stored_dtype_is_cast_on_restore_into_the_given_shardings(tiny) -> None:
    path, cfg, params = tiny
    assert checkpoint.is_checkpoint(path)
    dev = jax.devices()[-1]
    shapes = LlamaForCausalLM(cfg, jnp.float32).param_shapes()
    shardings = jax.tree_util.tree_map(lambda _: jax.sharding.SingleDeviceSharding(dev), shapes)
    got_cfg, got = checkpoint.load_checkpoint(path, jnp.float32, shardings)
    assert got_cfg == cfg
    want = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    assert _bitwise_equal(got, want)
    assert all(x.sharding == jax.sharding.SingleDeviceSharding(dev)
               for x in jax.tree_util.tree_leaves(got))


def test_layout_mismatch_names_the_param(tiny) -> None:
    path, _, _ = tiny
    config_json = Path(path) / "config.json"
    data = json.loads(config_json.read_text())
    data["intermediate_size"] = 96
    config_json.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"param \['layers'\]\['w_down'\] has shape"):
        checkpoint.load_checkpoint(path, jnp.float32)
    data["tie_word_embeddings"] = False
    config_json.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"lacks params \[.lm_head.\]"):
        checkpoint.load_checkpoint(path, jnp.float32)
    del data["architecture"]
    config_json.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="lacks the key 'architecture'"):
        checkpoint.load_checkpoint(path, jnp.float32)


def test_existing_destination_and_plain_directories_are_refused(tiny, tmp_path) -> None:
    path, cfg, params = tiny
    with pytest.raises(ValueError, match="exists already"):
        checkpoint.save_checkpoint(path, cfg, params)
    with pytest.raises(ValueError, match="neither an orbax checkpoint"):
        load_model(LoadConfig(str(tmp_path)), jnp.float32, seed=0)


def test_convert_checks_the_kv_calibration_before_writing(tmp_path) -> None:
    """A calibration file without an 8-bit KV dtype is refused before loading; one too short
    to calibrate is refused before DST is written, so a corrected retry can use the same DST."""
    from jaxserve.cli.convert import convert

    short = tmp_path / "short.txt"
    short.write_text("hello", encoding="utf-8")
    dst = tmp_path / "ck"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        convert("no-such-model.gguf", str(dst), kv_calibration_file=str(short))
    with pytest.raises(ValueError, match="kv_calibration_file="):
        convert(default_gguf_path(), str(dst), kv_cache_dtype="int8",
                kv_calibration_file=str(short))
    assert not dst.exists()
