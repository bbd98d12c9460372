"""Checkpoints of Google DeepMind's ``gemma`` library, served as they are, against that library.

``tests/goldens/gemma_lib/`` comes from scripts/make_gemma_lib_goldens.py: the library's own
``gm.nn.Gemma3_270M`` class with a reduced config (width 32, 8 layers of Gemma 3's 5:1 pattern,
GQA 4/2 heads of 8, sliding window 8, global RoPE scaling 8), random weights, saved with
``gm.ckpts.save_params``; its SentencePiece ``tokenizer.model``; the library's float32 forward at
every position, its bfloat16 forward at the last position, and its greedy decode
(``gm.text.Sampler``). Every prompt but one is longer than the window (the longest, 119 tokens).
``ckpt_flat/`` holds the same weights in the FLAT layout of the released checkpoints.
The library itself is not installed here: its import pulls its training stack (TensorFlow, ~1.3
GB), see docs/decisions/0045-foreign-checkpoints.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxserve.cli.main import main as cli_main
from jaxserve.config import LoadConfig
from jaxserve.llm import LLM
from jaxserve.loading.load import load_model
from jaxserve.sampling_params import SamplingParams
from models import gemma_lib
from models.registry import get_architecture
from tests.support.prefill import prefill_logits

GOLDENS = Path(__file__).resolve().parents[1] / "goldens" / "gemma_lib"
CKPT = GOLDENS / "ckpt"
# Max |logit - library| measured 7.3e-6 at float32 over the 8 prompts, every position (logits up
# to ~14 in magnitude): summation order; the bound is ~7x. bfloat16 (both sides compute in
# bfloat16 from the same float32 weights cast once): measured 0.19 at the last positions, where
# the library's own bfloat16 and float32 logits differ by up to 0.12; the bound is ~2x.
ATOL_F32 = 5e-5
ATOL_BF16 = 0.4


@pytest.fixture(scope="module")
def goldens() -> dict:
    data = json.loads((GOLDENS / "goldens.json").read_text())
    with np.load(GOLDENS / "logits.npz") as z:
        data["logits"] = {k: z[k] for k in z.files}
    return data


def _load(path: Path, dtype=jnp.float32):
    loaded = load_model(LoadConfig(str(path)), dtype, 0)
    model = get_architecture(loaded.model_config.architecture).model(loaded.model_config, dtype)
    return loaded, model


def test_config_derived_from_shapes_and_sidecar(goldens: dict) -> None:
    cfg = gemma_lib.read_gemma_lib(str(CKPT)).config
    lib = goldens["config"]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim) == (lib["num_embed"], lib["embed_dim"],
                                                lib["hidden_dim"], lib["num_heads"],
                                                lib["num_kv_heads"], lib["head_dim"])
    assert (cfg.num_layers, cfg.sliding_window, cfg.sliding_window_pattern) == (8, 8, 6)
    assert (cfg.rope_scaling_factor, cfg.query_pre_attn_scalar) == (8.0, 8.0)


def test_float32_logits_match_the_library(goldens: dict) -> None:
    loaded, model = _load(CKPT)
    assert loaded.name == "ckpt" and loaded.tokenizer.vocab_size == 512
    prompts = goldens["prompts"]
    for p in prompts:  # our reading of tokenizer.model gives the library's ids
        assert loaded.tokenizer.encode(p["text"]) == p["ids"]
    assert max(len(p["ids"]) for p in prompts) > 8 * 14  # far past the window of 8
    got = prefill_logits(model, loaded.params, [p["ids"] for p in prompts])
    for i, g in enumerate(got):
        err = float(np.max(np.abs(g - goldens["logits"][f"f32_{i}"])))
        assert err <= ATOL_F32, f"prompt {i}: max |logit diff| {err:.3g}"


def test_bfloat16_logits_within_bound(goldens: dict) -> None:
    loaded, model = _load(CKPT, jnp.bfloat16)
    got = prefill_logits(model, loaded.params, [p["ids"] for p in goldens["prompts"]])
    for i, g in enumerate(got):
        err = float(np.max(np.abs(g[-1] - goldens["logits"][f"bf16_last_{i}"])))
        assert err <= ATOL_BF16, f"prompt {i}: max |logit diff| {err:.3g} at bfloat16"


def test_greedy_tokens_equal_the_library_sampler(goldens: dict) -> None:
    llm = LLM(str(CKPT), dtype="float32", max_model_len=256, kv_cache_memory_gib=0.05)
    prompts = goldens["prompts"]
    outs = llm.generate([{"prompt_token_ids": p["ids"]} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=goldens["max_new_tokens"]))
    for p, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == p["greedy"], p["text"]


def test_convert_writes_our_layout_with_the_same_logits(goldens: dict, tmp_path) -> None:
    dst = tmp_path / "converted"
    assert cli_main(["convert", str(CKPT), str(dst), "--dtype", "float32"]) == 0
    loaded, model = _load(dst)
    assert loaded.tokenizer.encode(goldens["prompts"][2]["text"]) == goldens["prompts"][2]["ids"]
    got = prefill_logits(model, loaded.params, [goldens["prompts"][2]["ids"]])[0]
    assert np.max(np.abs(got - goldens["logits"]["f32_2"])) <= ATOL_F32


def test_width_of_a_library_class_needs_no_sidecar(tmp_path) -> None:
    """Without gemma_config.json a width the library defines takes that class's settings; any
    other width is refused, naming the file to write."""
    bare = tmp_path / "bare"
    shutil.copytree(CKPT, bare)
    (bare / gemma_lib.CONFIG_FILE).unlink()
    with pytest.raises(ValueError, match=r"width 32 is none of .*Gemma3_270M: 640.*"
                                         r"gemma_config\.json"):
        gemma_lib.read_gemma_lib(str(bare))
    assert gemma_lib.LIBRARY_CLASSES[1152]["sliding_window_size"] == 512


def test_a_library_width_without_sidecar_and_fused_qkv(tmp_path) -> None:
    """Width 640 is Gemma3_270M: its window (512) applies with no gemma_config.json. With as
    many kv heads as query heads the library stores one ``qkv_einsum``; its parts land in
    wq / wk / wv, heads contiguous, and norms load as ``1 + scale``."""
    rng = np.random.default_rng(0)
    d, h, f = 640, 8, 16
    draw = lambda *s: rng.standard_normal(s).astype(np.float32)
    tree = {"embedder": {"input_embedding": draw(8, d)}, "final_norm": {"scale": draw(d)}}
    for i in range(2):
        tree[f"layer_{i}"] = {
            "attn": {"qkv_einsum": {"w": draw(3, 2, d, h)}, "attn_vec_einsum": {"w": draw(2, h, d)},
                     "_query_norm": {"scale": draw(h)}, "_key_norm": {"scale": draw(h)}},
            "mlp": {"gating_einsum": draw(2, f, d), "linear": draw(f, d)},
            **{f"{n}_norm": {"scale": draw(d)} for n in ("pre_attention", "post_attention",
                                                          "pre_ffw", "post_ffw")}}
    path = tmp_path / "g270"
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(str(path), tree)
    ckpt.wait_until_finished()
    ckpt.close()
    read = gemma_lib.read_gemma_lib(str(path))
    cfg = read.config
    assert read.fused_qkv and (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 2, 8)
    assert (cfg.sliding_window, cfg.rope_scaling_factor, cfg.max_position_embeddings) == (
        512, 1.0, 32768)
    params = gemma_lib.load_gemma_lib_params(read, jnp.float32)
    qkv = tree["layer_1"]["attn"]["qkv_einsum"]["w"]
    np.testing.assert_array_equal(params["layers"]["wk"][1][:, h:2 * h], qkv[1, 1])
    np.testing.assert_array_equal(params["layers"]["wq"][1][:, :h], qkv[0, 0])
    np.testing.assert_array_equal(params["layers"]["w_up"][0], tree["layer_0"]["mlp"][
        "gating_einsum"][1].T)
    np.testing.assert_allclose(params["layers"]["k_norm"]["weight"][0],
                               1 + tree["layer_0"]["attn"]["_key_norm"]["scale"])


def test_the_flat_layout_of_released_checkpoints_loads_the_same(goldens: dict) -> None:
    """``ckpt_flat/`` holds the same weights in the FLAT layout (written by the library's own
    NESTED -> FLAT mapping): the same params, so the same logits."""
    nested = load_model(LoadConfig(str(CKPT)), jnp.float32, 0)
    flat = load_model(LoadConfig(str(GOLDENS / "ckpt_flat")), jnp.float32, 0)
    assert flat.model_config.replace(name="ckpt") == nested.model_config
    for a, b in zip(jax.tree_util.tree_leaves(flat.params),
                    jax.tree_util.tree_leaves(nested.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
