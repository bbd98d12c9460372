"""Bad checkpoints get one error naming the file and the tensor, before any weight is read.

Each format (a gemma library checkpoint, our orbax layout, a GGUF file) is broken four ways: a
missing tensor, a tensor of the wrong shape, an architecture nobody registered, no tokenizer.
The weight readers (orbax's restore, GGUF dequantisation) are replaced by ones that fail the
test, so each error is shown to come before any weight is read or put on the device.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxserve.config import LoadConfig
from jaxserve.loading.load import load_model
from models import loader
from models.checkpoint import save_checkpoint
from models.config import builtin_config
from models.loader import dummy_params
from models.registry import get_architecture

GEMMA = Path(__file__).resolve().parents[1] / "goldens" / "gemma_lib" / "ckpt"


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if a loader reads weights (orbax restore, GGUF dequantisation)."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were read before the checkpoint was checked")

    for reader in (ocp.StandardCheckpointer, ocp.PyTreeCheckpointer):
        monkeypatch.setattr(reader, "restore", refuse)
    monkeypatch.setattr(loader, "dequantize", refuse)


def _load(path) -> None:
    load_model(LoadConfig(str(path)), jnp.float32, 0)


# -- gemma library checkpoints --------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_tree():
    ckpt = ocp.StandardCheckpointer()
    try:
        return ckpt.restore(str(GEMMA))
    finally:
        ckpt.close()


def _gemma_dir(tmp_path, tree, *, tokenizer: bool = True) -> Path:
    """``tree`` saved as the gemma library's ``gm.ckpts.save_params`` saves (one
    ``StandardCheckpointer().save``), with the goldens' sidecar and tokenizer."""
    path = tmp_path / "gemma"
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(str(path), tree)
    ckpt.wait_until_finished()
    ckpt.close()
    shutil.copy(GEMMA / "gemma_config.json", path)
    if tokenizer:
        shutil.copy(GEMMA / "tokenizer.model", path)
    return path


def test_gemma_missing_tensor(tmp_path, gemma_tree, no_weight_reads) -> None:
    tree = jax.tree_util.tree_map(np.asarray, gemma_tree)
    del tree["layer_3"]["mlp"]["linear"]
    path = _gemma_dir(tmp_path, tree)
    with pytest.raises(ValueError, match=rf"{path}: the checkpoint lacks tensor "
                                         r"'layer_3/mlp/linear'"):
        _load(path)


def test_gemma_wrong_shape(tmp_path, gemma_tree, no_weight_reads) -> None:
    tree = jax.tree_util.tree_map(np.asarray, gemma_tree)
    tree["layer_6"]["attn"]["kv_einsum"]["w"] = np.zeros((2, 2, 32, 4), np.float32)
    path = _gemma_dir(tmp_path, tree)
    with pytest.raises(ValueError, match=r"tensor 'layer_6/attn/kv_einsum/w' has shape "
                                         r"\(2, 2, 32, 4\); the model expects \(2, 2, 32, 8\)"):
        _load(path)


def test_gemma_unknown_architecture(tmp_path, gemma_tree, no_weight_reads) -> None:
    """A Gemma 2 tree (no q/k norms) and a tree of something else entirely."""
    tree = jax.tree_util.tree_map(np.asarray, gemma_tree)
    for i in range(8):
        del tree[f"layer_{i}"]["attn"]["_query_norm"], tree[f"layer_{i}"]["attn"]["_key_norm"]
    path = _gemma_dir(tmp_path, tree)
    with pytest.raises(ValueError, match=r"'layer_0/attn/_query_norm/scale' is missing: a "
                                         r"Gemma 3 checkpoint has q/k norms"):
        _load(path)
    other = _gemma_dir(tmp_path / "other", {"encoder": {"w": np.zeros((2, 2), np.float32)}})
    with pytest.raises(ValueError, match=r"no Gemma transformer in the checkpoint"):
        _load(other)
    state = _gemma_dir(tmp_path / "state", {"params": tree, "step": np.zeros((), np.int32)})
    with pytest.raises(ValueError, match=r"a Kauldron train state \(params/\.\.\.\), which "
                                         r"is not read; .*gm\.ckpts\.load_params"):
        _load(state)


def test_gemma_missing_tokenizer(tmp_path, gemma_tree, no_weight_reads) -> None:
    path = _gemma_dir(tmp_path, jax.tree_util.tree_map(np.asarray, gemma_tree), tokenizer=False)
    with pytest.raises(ValueError, match=rf"{path} has no tokenizer: .*tokenizer\.model"):
        _load(path)


# -- our orbax layout -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_params():
    cfg = builtin_config("tiny")
    return cfg, jax.tree_util.tree_map(
        np.asarray, dummy_params(get_architecture("llama").model(cfg, jnp.float32), 0))


def _orbax_dir(tmp_path, cfg, params, tokenizer_obj=None) -> Path:
    path = tmp_path / "ours"
    save_checkpoint(str(path), cfg, params)
    if tokenizer_obj is not None:
        tokenizer_obj.save_pretrained(str(path))
    return path


def test_orbax_missing_tensor_and_wrong_shape(tmp_path, tiny_params, tokenizer,
                                              no_weight_reads) -> None:
    cfg, params = tiny_params
    params = dict(params, layers=dict(params["layers"]))
    del params["layers"]["w_up"]
    path = _orbax_dir(tmp_path / "a", cfg, params, tokenizer)
    with pytest.raises(ValueError, match=rf"{path}/params lacks params \['layers'\]\['w_up'\]"):
        _load(path)
    params["layers"]["w_up"] = np.zeros((2, 64, 64), np.float32)
    path = _orbax_dir(tmp_path / "b", cfg, params, tokenizer)
    with pytest.raises(ValueError, match=r"param \['layers'\]\['w_up'\] has shape \(2, 64, 64\)"
                                         r", the model expects \(2, 64, 128\)"):
        _load(path)


def test_orbax_damaged_files_are_one_value_error(tmp_path, tiny_params, tokenizer) -> None:
    """A deleted ``_METADATA`` and a truncated data file: a ValueError naming the params
    directory, not orbax's or TensorStore's traceback."""
    cfg, params = tiny_params
    path = _orbax_dir(tmp_path / "a", cfg, params, tokenizer)
    (path / "params" / "_METADATA").unlink()
    with pytest.raises(ValueError, match=rf"checkpoint {path}/params: .*(metadata|_METADATA)"):
        _load(path)
    path = _orbax_dir(tmp_path / "b", cfg, params, tokenizer)
    data = max((f for f in (path / "params").rglob("*") if f.is_file()),
               key=lambda f: f.stat().st_size)  # the largest file holds weights
    data.write_bytes(data.read_bytes()[:64])
    with pytest.raises(ValueError, match=rf"checkpoint {path}/params: "):
        _load(path)


def test_orbax_unknown_architecture_and_missing_tokenizer(tmp_path, tiny_params, tokenizer,
                                                          no_weight_reads) -> None:
    cfg, params = tiny_params
    path = _orbax_dir(tmp_path, cfg, params)
    with pytest.raises(ValueError, match=rf"{path} has no tokenizer\.json"):
        _load(path)
    tokenizer.save_pretrained(str(path))
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, "architecture": "mamba"}))
    with pytest.raises(ValueError, match=rf"{path}/config\.json: unknown model architecture "
                                         r"'mamba'"):
        _load(path)


# -- GGUF -----------------------------------------------------------------------------------------

def _gguf(tmp_path, *, arch: str = "llama", drop: str = "", shapes: dict | None = None,
          tokenizer: bool = True) -> Path:
    """A tiny llama GGUF (hidden 8, 1 layer, 2 heads of 4, vocab 4) in float32."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("embedding_length", 8), ("block_count", 1), ("feed_forward_length", 16),
                       ("attention.head_count", 2), ("attention.head_count_kv", 2),
                       ("context_length", 64)):
        w.add_uint32(f"{arch}.{key}", value)
    if tokenizer:
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_array("tokenizer.ggml.tokens", ["a", "b", "c", "ab"])
        w.add_array("tokenizer.ggml.merges", ["a b"])
        w.add_array("tokenizer.ggml.token_type", [1, 1, 1, 1])
    want = {"token_embd.weight": (4, 8), "output_norm.weight": (8,),
            "blk.0.attn_norm.weight": (8,), "blk.0.ffn_norm.weight": (8,),
            "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (8, 8),
            "blk.0.attn_v.weight": (8, 8), "blk.0.attn_output.weight": (8, 8),
            "blk.0.ffn_gate.weight": (16, 8), "blk.0.ffn_up.weight": (16, 8),
            "blk.0.ffn_down.weight": (8, 16), **(shapes or {})}
    for name, shape in want.items():
        if name != drop:
            w.add_tensor(name, np.ones(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_bad_files(tmp_path, no_weight_reads) -> None:
    path = _gguf(tmp_path / "a", drop="blk.0.ffn_up.weight")
    with pytest.raises(ValueError, match=rf"{path} lacks tensor blk\.0\.ffn_up\.weight"):
        _load(path)
    path = _gguf(tmp_path / "b", shapes={"blk.0.attn_k.weight": (4, 8)})
    with pytest.raises(ValueError, match=rf"{path}: tensor blk\.0\.attn_k\.weight has shape "
                                         r"\(4, 8\); the model expects \(8, 8\)"):
        _load(path)
    path = _gguf(tmp_path / "c", arch="rwkv6")
    with pytest.raises(ValueError, match=rf"{path}: general\.architecture: unknown model "
                                         r"architecture 'rwkv6'"):
        load_model(LoadConfig(str(path), tokenizer=str(_gguf(tmp_path / "d"))), jnp.float32, 0)
    path = _gguf(tmp_path / "e", tokenizer=False)
    with pytest.raises(ValueError, match=rf"{path}: no tokenizer in the GGUF metadata"):
        _load(path)
