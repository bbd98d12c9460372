"""Llama-family decoder in Flax (linen), over the paged KV cache.

Data flow of ``forward`` for a ragged batch of ``T`` tokens:
  embed ``[T, hidden]`` -> 30x (``nn.scan`` over stacked layer params) [RMSNorm -> q/k/v ->
  RoPE -> ``write_kv`` at (layer, slot) -> ``ragged_paged_attention`` at layer -> o-proj ->
  residual -> RMSNorm -> SwiGLU MLP -> residual] -> final RMSNorm ``[T, hidden]``.
The KV cache (``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` each for K and V)
rides in the scan *carry* with the layer index, so every layer reads and writes the one buffer in
place; passing it as scan xs/ys would slice and re-stack (copy) it. An 8-bit cache's scales
(``f32[num_layers, num_kv_heads]`` each, static) ride with the step's constants and reach
``write_kv`` and the attention op as ``k_scale`` / ``v_scale`` (not passed for a float cache, so
attention functions that know no scales keep working). Kernel-backed weights that read their
layer from the whole stack (``models.interface.KernelWeight``, e.g. the CPU's packed bfloat16
weights) are, for the same reason, not scanned over: ``forward`` passes them as the
``BROADCAST`` collection, which the scan broadcasts, and ``weight`` binds the layer index to
them.

Features: GQA, optional sliding-window attention (Mistral), RoPE (rotate-half layout of HF
transformers; GGUF q/k rows are un-permuted at load time) with theta and Llama-3 frequency scaling,
RMSNorm, SwiGLU, tied or untied embeddings, optional q/k/v bias. Source: Touvron et al. 2023
(arXiv:2302.13971) and HF transformers' ``modeling_llama.py``.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.causal_lm import FlaxCausalLM
from models.config import ModelConfig
from models.interface import AttentionFn, AttentionMetadata
from models.quant import BROADCAST, embed_lookup, qmatmul, weight
from pallas_kernels import KVCache, ragged_paged_attention, write_kv


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies ``f32[head_dim // 2]``, with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor)
    mid = (1 - smooth) * inv / sc.factor + smooth * inv
    return jnp.where(wavelen > low_wavelen, inv / sc.factor,
                     jnp.where(wavelen < high_wavelen, inv, mid))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: ``[T, heads, head_dim]``; cos, sin: ``f32[T, head_dim // 2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def pairwise_sum(x: jax.Array) -> jax.Array:
    """``x [..., n]`` -> ``[..., 1]`` in ``x``'s dtype: the sum over the last axis as one fixed
    tree of elementwise adds (pairwise summation): the halves added, level by level, an odd
    element carried. XLA:CPU's reduce sums a row in
    another order when the array has few rows (``[T, 576]`` with T <= 5, 2-core Zen 3), so a
    token's norm depended on how many tokens its step had; this order is the same for any
    number of rows (batch invariance: docs/configuration.md#batch-invariance)."""
    n = x.shape[-1]
    while n > 1:
        h = n // 2
        y = x[..., :h] + x[..., h:2 * h]
        x = jnp.concatenate([y, x[..., 2 * h:]], axis=-1) if n % 2 else y
        n = x.shape[-1]
    return x


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32, weight ``[hidden]``; the mean
    square summed by ``pairwise_sum``, so each row's result does not depend on the rows beside
    it."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        ms = pairwise_sum(xf * xf) / x.shape[-1]
        xf = xf * jax.lax.rsqrt(ms + self.eps)
        return (xf * w.astype(jnp.float32)).astype(self.dtype)


def kv_scale_kwargs(scales: tuple[jax.Array, jax.Array] | None) -> dict[str, jax.Array]:
    """``{"k_scale", "v_scale"}`` for ``write_kv`` and the attention op from an 8-bit cache's
    ``(k_scale, v_scale)`` (each ``f32[num_layers, num_kv_heads]``); ``{}`` for None."""
    return {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}


def cache_scales(kv_cache: KVCache) -> tuple[jax.Array, jax.Array] | None:
    """``(k_scale, v_scale)`` of an 8-bit cache, None for a float one."""
    return None if kv_cache.k_scale is None else (kv_cache.k_scale, kv_cache.v_scale)


class DecoderLayer(nn.Module):
    """One decoder layer; called by nn.scan with carry ``(x, k_cache, v_cache, layer)`` and
    constants ``(md, cos, sin, scales)`` (``scales``: see ``kv_scale_kwargs``)."""

    cfg: ModelConfig
    dtype: jnp.dtype
    attention_fn: AttentionFn

    @nn.compact
    def __call__(self, carry, consts):
        x, k_cache, v_cache, layer = carry
        md, cos, sin, scales = consts
        cfg, dt = self.cfg, self.dtype
        init = nn.initializers.normal(0.02)
        h, nq, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t = x.shape[0]

        # float, quantised, or kernel-backed (bound to this layer)
        w = lambda name, shape: weight(self, name, init, shape, dt, layer)
        y = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        q = qmatmul(y, w("wq", (h, nq * hd)))
        k = qmatmul(y, w("wk", (h, nkv * hd)))
        v = qmatmul(y, w("wv", (h, nkv * hd)))
        if cfg.qkv_bias:
            q = q + self.param("bq", nn.initializers.zeros, (nq * hd,), dt)
            k = k + self.param("bk", nn.initializers.zeros, (nkv * hd,), dt)
            v = v + self.param("bv", nn.initializers.zeros, (nkv * hd,), dt)
        q = apply_rope(q.reshape(t, nq, hd), cos, sin)
        k = apply_rope(k.reshape(t, nkv, hd), cos, sin)
        v = v.reshape(t, nkv, hd)
        kw = kv_scale_kwargs(scales)
        k_cache, v_cache = write_kv(k_cache, v_cache, layer, k, v, md.slot_mapping, **kw)
        attn = self.attention_fn(
            q, k_cache, v_cache, layer, md.block_tables, md.seq_lens, md.query_start_loc,
            md.num_seqs, sm_scale=hd ** -0.5, sliding_window=cfg.sliding_window, **kw)
        x = x + qmatmul(attn.reshape(t, nq * hd).astype(dt), w("wo", (nq * hd, h)))

        y = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
        i = cfg.intermediate_size
        gate = qmatmul(y, w("w_gate", (h, i)))
        up = qmatmul(y, w("w_up", (h, i)))
        x = x + qmatmul(jax.nn.silu(gate) * up, w("w_down", (i, h)))
        return (x, k_cache, v_cache, layer + 1), None


def setup_decoder(module: nn.Module, layer: type[nn.Module], in_axes: object) -> None:
    """The ``setup`` every decoder here starts with, for a module with fields ``cfg``, ``dtype``
    and ``attention_fn``: ``embed [vocab, hidden]``, ``layers`` (``layer(cfg, dtype,
    attention_fn)`` under ``nn.scan`` over ``cfg.num_layers``: params stacked on axis 0, the
    ``BROADCAST`` collection broadcast, the scanned inputs ``in_axes``) and ``final_norm``."""
    cfg = module.cfg
    module.embed = weight(module, "embed", nn.initializers.normal(0.02),
                          (cfg.vocab_size, cfg.hidden_size), module.dtype)
    scanned = nn.scan(layer, variable_axes={"params": 0},
                      variable_broadcast=BROADCAST, split_rngs={"params": True},
                      in_axes=in_axes, length=cfg.num_layers)
    module.layers = scanned(cfg, module.dtype, module.attention_fn)
    module.final_norm = RMSNorm(cfg.rms_norm_eps, module.dtype)


class LlamaModel(nn.Module):
    """The decoder. Params: ``embed [vocab, hidden]``, ``layers/*`` stacked ``[num_layers, ...]``,
    ``final_norm/weight [hidden]``, ``lm_head [hidden, vocab]`` when untied."""

    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention

    def setup(self) -> None:
        cfg = self.cfg
        setup_decoder(self, DecoderLayer, nn.broadcast)
        if not cfg.tie_word_embeddings:
            self.lm_head = weight(self, "lm_head", nn.initializers.normal(0.02),
                                  (cfg.hidden_size, cfg.vocab_size), self.dtype)

    def __call__(self, token_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                 md: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        x = embed_lookup(self.embed, token_ids, self.dtype)
        ang = positions.astype(jnp.float32)[:, None] * rope_frequencies(self.cfg)[None, :]
        carry = (x, kv_cache.k, kv_cache.v, jnp.int32(0))
        scales = cache_scales(kv_cache)
        (x, k, v, _), _ = self.layers(carry, (md, jnp.cos(ang), jnp.sin(ang), scales))
        return self.final_norm(x), KVCache(k, v, kv_cache.k_scale, kv_cache.v_scale)

    def logits(self, hidden: jax.Array) -> jax.Array:
        h = hidden.astype(self.dtype)
        if self.cfg.tie_word_embeddings:
            return qmatmul(h, self.embed, transpose=True).astype(jnp.float32)
        return qmatmul(h, self.lm_head).astype(jnp.float32)


class LlamaForCausalLM(FlaxCausalLM):
    """``models/interface.py:CausalLM`` over a ``LlamaModel`` (``models.causal_lm``)."""

    module_class = LlamaModel
