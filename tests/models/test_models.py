"""Model definitions and loaders beyond the real-model goldens: built-in configs, dummy weights,
Llama-3 RoPE scaling, q/k/v bias, the GGUF row un-permutation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import builtin_config
from models.config import RopeScaling
from models.interface import AttentionMetadata
from models.llama import LlamaForCausalLM, rope_frequencies
from models.loader import dummy_params, unpermute_qk
from pallas_kernels import allocate_kv_cache


def test_builtin_configs_have_the_published_sizes() -> None:
    # parameter counts of the published checkpoints (Llama-3.1-8B: 8.03 B; 70B: 70.6 B)
    assert abs(builtin_config("llama-3.1-8b").num_params / 8.03e9 - 1) < 0.01
    assert abs(builtin_config("llama-3.1-70b").num_params / 70.55e9 - 1) < 0.01
    assert abs(builtin_config("smollm2-135m").num_params / 134.5e6 - 1) < 0.01
    shapes = LlamaForCausalLM(builtin_config("llama-3.1-8b"), jnp.bfloat16).param_shapes()
    n = sum(int(np.prod(s.shape)) for s in jax.tree_util.tree_leaves(shapes))
    assert n == builtin_config("llama-3.1-8b").num_params
    assert shapes["layers"]["wq"].shape == (32, 4096, 4096)
    assert {s.dtype for s in jax.tree_util.tree_leaves(shapes)} == {jnp.dtype(jnp.bfloat16)}
    with pytest.raises(ValueError, match="unknown built-in model config 'llama-9'"):
        builtin_config("llama-9")


def test_dummy_weights_are_deterministic_per_seed_and_in_dtype() -> None:
    model = LlamaForCausalLM(builtin_config("tiny"), jnp.bfloat16)
    a, b, c = dummy_params(model, 1), dummy_params(model, 1), dummy_params(model, 2)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert not np.array_equal(np.asarray(a["embed"], np.float32),
                              np.asarray(c["embed"], np.float32))
    np.testing.assert_array_equal(np.asarray(a["final_norm"]["weight"], np.float32), 1.0)


def _llama3_inv_freq(theta: float, dim: int, sc: RopeScaling) -> np.ndarray:
    """Meta's Llama 3.1 ``apply_scaling``, written out per frequency."""
    out = []
    for f in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * math.pi / f
        if wavelen < sc.original_max_position_embeddings / sc.high_freq_factor:
            out.append(f)
        elif wavelen > sc.original_max_position_embeddings / sc.low_freq_factor:
            out.append(f / sc.factor)
        else:
            smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
                sc.high_freq_factor - sc.low_freq_factor)
            out.append((1 - smooth) * f / sc.factor + smooth * f)
    return np.array(out)


def test_llama3_rope_scaling() -> None:
    cfg = builtin_config("llama-3.1-8b")
    want = _llama3_inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)
    got = np.asarray(rope_frequencies(cfg))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    plain = np.asarray(rope_frequencies(cfg.replace(rope_scaling=None)))
    assert got[0] == pytest.approx(plain[0]) and got[-1] == pytest.approx(plain[-1] / 8)


def test_qkv_bias_variant_runs_and_uses_the_bias() -> None:
    cfg = builtin_config("tiny").replace(qkv_bias=True, num_layers=1)
    model = LlamaForCausalLM(cfg, jnp.float32)
    params = dummy_params(model, 0)
    assert params["layers"]["bq"].shape == (1, cfg.num_heads * cfg.head_dim)
    kv = allocate_kv_cache(1, 4, 16, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    md = AttentionMetadata(jnp.arange(16, 21, dtype=jnp.int32), jnp.array([[1, 0]], jnp.int32),
                           jnp.array([5], jnp.int32), jnp.array([0, 5], jnp.int32),
                           jnp.array([1], jnp.int32))
    ids, pos = jnp.array([5, 6, 7, 8, 9], jnp.int32), jnp.arange(5, dtype=jnp.int32)
    h0, _ = model.forward(params, ids, pos, kv, md)
    params["layers"]["bv"] = params["layers"]["bv"] + 1.0
    h1, _ = model.forward(params, ids, pos, kv, md)
    assert np.all(np.isfinite(np.asarray(h0))) and not np.allclose(h0, h1)


def testunpermute_qk_inverts_llama_cpp_rope_permutation() -> None:
    """llama.cpp's converter interleaves the two RoPE halves of each head's rows."""
    heads, head_dim, cols = 3, 8, 5
    w = np.random.default_rng().standard_normal((heads * head_dim, cols))
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)
    assert not np.array_equal(permuted, w)


def test_gemma3_270m_config() -> None:
    """The built-in Gemma 3 270M: the published size (268 M: 168 M embedding, 100 M in the
    layers), its params pytree, and five local layers to one global."""
    from models.gemma3 import GLOBAL_WINDOW, Gemma3ForCausalLM, layer_windows

    cfg = builtin_config("gemma3-270m")
    assert abs(cfg.num_params / 268.1e6 - 1) < 0.01
    shapes = Gemma3ForCausalLM(cfg).param_shapes()
    assert sum(int(np.prod(s.shape)) for s in jax.tree_util.tree_leaves(shapes)) == \
        cfg.num_params
    assert shapes["layers"]["wq"].shape == (18, 640, 1024)
    assert shapes["layers"]["q_norm"]["weight"].shape == (18, 256)
    assert layer_windows(cfg).tolist() == ([512] * 5 + [GLOBAL_WINDOW]) * 3
    with pytest.raises(ValueError, match="sliding_window"):
        cfg.replace(sliding_window=0)
