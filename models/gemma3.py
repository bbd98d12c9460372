"""Gemma 3 text decoder in Flax (linen), over the paged KV cache; and its GGUF reader.

Data flow of ``forward`` for a ragged batch of ``T`` tokens:
  embed ``[T, hidden]`` x sqrt(hidden) -> ``nn.scan`` over the stacked layers, each
  [RMSNorm -> q/k/v -> q/k RMSNorm (over head_dim) -> RoPE (local or global base) -> ``write_kv``
  -> ``ragged_paged_attention`` with the layer's window -> o-proj -> RMSNorm -> residual ->
  RMSNorm -> GELU-tanh gated MLP -> RMSNorm -> residual] -> final RMSNorm ``[T, hidden]``;
  logits against the tied embedding.

Local and global layers: five sliding-window layers (window 512 in 270m/1B, RoPE base 1e4) then
one global layer (whole context, RoPE base 1e6, linear position scaling in 4B+), repeated. The
pattern is data, not structure: the scan's per-layer inputs carry each layer's window
(``i32[num_layers]``; a global layer's window, 2**30, covers any context) and a flag that picks
its RoPE table, so every layer runs the one compiled body and the attention op takes the window
as a traced scalar. The KV cache rides in the scan carry as in ``models.llama``.

Norms: Gemma's RMSNorm multiplies by ``1 + weight``. Our params hold that ``1 + weight``
already (llama.cpp's converter folds the 1 into GGUF norm weights; HF transformers subtracts it
again when it loads a GGUF), so ``models.llama.RMSNorm`` serves unchanged, and dummy weights of
1 are Gemma's zero-initialised norms.

Sources: the Gemma 3 technical report (arXiv:2503.19786); HF transformers' ``modeling_gemma3.py``
and llama.cpp's ``gemma3`` graph for the details (norm placement, q/k norms, scaling).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.causal_lm import FlaxCausalLM
from models.config import Gemma3Config
from models.llama import (
    AttentionFn,
    AttentionMetadata,
    RMSNorm,
    apply_rope,
    cache_scales,
    kv_scale_kwargs,
    setup_decoder,
)
from models.loader import check_gguf_tensors, gguf_tensor_getter, stack_layers
from models.quant import embed_lookup, qmatmul, weight
from pallas_kernels import KVCache, ragged_paged_attention, write_kv

GLOBAL_WINDOW = 1 << 30
"""The window a global layer passes to the attention op: larger than any context."""


def layer_windows(cfg: Gemma3Config) -> np.ndarray:
    """``i32[num_layers]``: each layer's attention window (``GLOBAL_WINDOW`` for global ones)."""
    return np.array([GLOBAL_WINDOW if cfg.is_global_layer(i) else cfg.sliding_window
                     for i in range(cfg.num_layers)], np.int32)


def _rope_tables(positions: jax.Array, theta: float, head_dim: int, scale: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
    """cos, sin ``f32[T, head_dim // 2]`` of rotate-half RoPE at ``positions / scale``."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    ang = (positions.astype(jnp.float32) / scale)[:, None] * inv[None, :]
    return jnp.cos(ang), jnp.sin(ang)


class Gemma3DecoderLayer(nn.Module):
    """One layer; called by nn.scan with carry ``(x, k_cache, v_cache, layer)``, the step's
    constants (metadata, both RoPE tables and an 8-bit cache's scales or None, see
    ``models.llama.kv_scale_kwargs``) and this layer's ``(window i32, is_global bool)``.
    """

    cfg: Gemma3Config
    dtype: jnp.dtype
    attention_fn: AttentionFn

    @nn.compact
    def __call__(self, carry, consts, per_layer):
        x, k_cache, v_cache, layer = carry
        md, (cos_l, sin_l), (cos_g, sin_g), scales = consts
        window, is_global = per_layer
        cfg, dt = self.cfg, self.dtype
        init = nn.initializers.normal(0.02)
        h, nq, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        t = x.shape[0]

        # float, quantised, or packed (bound to this layer)
        w = lambda name, shape: weight(self, name, init, shape, dt, layer)
        y = RMSNorm(eps, dt, name="attn_norm")(x)
        q = qmatmul(y, w("wq", (h, nq * hd))).reshape(t, nq, hd)
        k = qmatmul(y, w("wk", (h, nkv * hd))).reshape(t, nkv, hd)
        v = qmatmul(y, w("wv", (h, nkv * hd))).reshape(t, nkv, hd)
        q = RMSNorm(eps, dt, name="q_norm")(q)
        k = RMSNorm(eps, dt, name="k_norm")(k)
        cos = jnp.where(is_global, cos_g, cos_l)
        sin = jnp.where(is_global, sin_g, sin_l)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kw = kv_scale_kwargs(scales)
        k_cache, v_cache = write_kv(k_cache, v_cache, layer, k, v, md.slot_mapping, **kw)
        attn = self.attention_fn(
            q, k_cache, v_cache, layer, md.block_tables, md.seq_lens, md.query_start_loc,
            md.num_seqs, sm_scale=cfg.query_pre_attn_scalar ** -0.5, sliding_window=window,
            **kw)
        o = qmatmul(attn.reshape(t, nq * hd).astype(dt), w("wo", (nq * hd, h)))
        x = x + RMSNorm(eps, dt, name="post_attn_norm")(o)

        y = RMSNorm(eps, dt, name="mlp_norm")(x)
        i = cfg.intermediate_size
        gate = qmatmul(y, w("w_gate", (h, i)))
        up = qmatmul(y, w("w_up", (h, i)))
        y = qmatmul(jax.nn.gelu(gate, approximate=True) * up, w("w_down", (i, h)))
        x = x + RMSNorm(eps, dt, name="post_mlp_norm")(y)
        return (x, k_cache, v_cache, layer + 1), None


class Gemma3Model(nn.Module):
    """The decoder. Params: ``embed [vocab, hidden]`` (tied output), ``final_norm/weight``,
    ``layers/*`` stacked ``[num_layers, ...]``: ``wq [h, nq*hd]``, ``wk``/``wv [h, nkv*hd]``,
    ``wo [nq*hd, h]``, ``w_gate``/``w_up [h, inter]``, ``w_down [inter, h]`` and the norms
    ``{attn,post_attn,mlp,post_mlp}_norm/weight [h]``, ``{q,k}_norm/weight [hd]``."""

    cfg: Gemma3Config
    dtype: jnp.dtype = jnp.float32
    attention_fn: AttentionFn = ragged_paged_attention

    def setup(self) -> None:
        setup_decoder(self, Gemma3DecoderLayer, (nn.broadcast, 0))

    def __call__(self, token_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                 md: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        cfg = self.cfg
        # HF rounds the scale to the weights' dtype before multiplying; so do we
        x = embed_lookup(self.embed, token_ids, self.dtype) * jnp.asarray(math.sqrt(cfg.hidden_size),
                                                                   self.dtype)
        local = _rope_tables(positions, cfg.rope_local_theta, cfg.head_dim)
        glob = _rope_tables(positions, cfg.rope_theta, cfg.head_dim, cfg.rope_scaling_factor)
        windows = jnp.asarray(layer_windows(cfg))
        per_layer = (windows, windows == GLOBAL_WINDOW)
        carry = (x, kv_cache.k, kv_cache.v, jnp.int32(0))
        (x, k, v, _), _ = self.layers(carry, (md, local, glob, cache_scales(kv_cache)),
                                      per_layer)
        return self.final_norm(x), KVCache(k, v, kv_cache.k_scale, kv_cache.v_scale)

    def logits(self, hidden: jax.Array) -> jax.Array:
        return qmatmul(hidden.astype(self.dtype), self.embed, transpose=True).astype(jnp.float32)


class Gemma3ForCausalLM(FlaxCausalLM):
    """``models/interface.py:CausalLM`` over a ``Gemma3Model`` (``models.causal_lm``)."""

    module_class = Gemma3Model


# -- GGUF ------------------------------------------------------------------------------------------

def gemma3_gguf_config(reader) -> Gemma3Config:
    """Gemma3Config from a ``gguf.GGUFReader`` of a ``gemma3`` GGUF.

    From the file: sizes, head_dim (``attention.key_length``), eps, the global RoPE base
    (``rope.freq_base``), linear RoPE scaling (``rope.scaling.factor``), the window
    (``attention.sliding_window``) and the context length. Absent from llama.cpp's Gemma 3
    GGUFs, so taken from the architecture as llama.cpp and transformers take them: the local
    RoPE base 1e4, the pattern of five local layers to one global, and the score scale
    ``head_dim ** -0.5`` (``(hidden / num_heads) ** -0.5`` for the 62-layer 27B).

    Raises:
      ValueError: another architecture, or a missing key.
    """
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    if (arch := field("general.architecture")) != "gemma3":
        raise ValueError(f"GGUF architecture {arch!r} is not 'gemma3'")

    def get(key: str, default=None):
        v = field(f"gemma3.{key}", default)
        if v is None:
            raise ValueError(f"GGUF file lacks metadata key gemma3.{key}")
        return v

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    layers = int(get("block_count"))
    head_dim = int(get("attention.key_length", 256))
    vocab = field("gemma3.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scale = head_dim if layers != 62 else hidden // heads
    return Gemma3Config(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_layers=layers, num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 1_000_000.0)),
        rope_scaling_factor=float(field("gemma3.rope.scaling.factor", 1.0) or 1.0),
        sliding_window=int(get("attention.sliding_window", 512)),
        query_pre_attn_scalar=float(scale),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length", 32768)),
        name=str(field("general.name", "gemma3")))


_GGUF_LINEAR = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
                "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
_GGUF_NORMS = {"attn_norm": "attn_norm", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
               "post_attn_norm": "post_attention_norm", "mlp_norm": "ffn_norm",
               "post_mlp_norm": "post_ffw_norm"}


def gemma3_gguf_params(reader, cfg: Gemma3Config, dtype: jnp.dtype) -> dict:
    """Params of ``Gemma3ForCausalLM`` from a ``gemma3`` GGUF, every tensor dequantised to
    float32 with ``gguf`` and put on the default device in ``dtype``.

    Linear weights are transposed to ``[in, out]``; q/k rows stay as they are (llama.cpp runs
    Gemma with rotate-half "NEOX" RoPE, so its converter does not permute them); norm weights
    are used as stored (the converter folded Gemma's ``1 + weight`` into them).

    Raises:
      ValueError: a missing tensor or one of another shape (naming the file and the tensor,
        before any is dequantised).
    """
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    linear = {"wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q),
              "w_gate": (cfg.intermediate_size, h), "w_up": (cfg.intermediate_size, h),
              "w_down": (h, cfg.intermediate_size)}
    expected = {"token_embd.weight": (cfg.vocab_size, h), "output_norm.weight": (h,)}
    for i in range(cfg.num_layers):
        expected.update({f"blk.{i}.{theirs}.weight": linear[ours]
                         for ours, theirs in _GGUF_LINEAR.items()})
        expected.update({f"blk.{i}.{theirs}.weight": (d,) if ours in ("q_norm", "k_norm")
                         else (h,) for ours, theirs in _GGUF_NORMS.items()})
    check_gguf_tensors(reader, expected)
    get = gguf_tensor_getter(reader, getattr(reader, "path", "GGUF file"))
    per_layer = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layer: dict = {ours: get(p + theirs + ".weight").T for ours, theirs in _GGUF_LINEAR.items()}
        layer.update({ours: {"weight": get(p + theirs + ".weight")}
                      for ours, theirs in _GGUF_NORMS.items()})
        per_layer.append(layer)
    return {"embed": jnp.asarray(get("token_embd.weight"), dtype),
            "layers": stack_layers(per_layer, dtype),
            "final_norm": {"weight": jnp.asarray(get("output_norm.weight"), dtype)}}
