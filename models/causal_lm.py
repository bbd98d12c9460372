"""The ``CausalLM`` wrapper every built-in architecture shares: a Flax module called for one
ragged step (``module(token_ids, positions, kv_cache, md) -> (hidden, kv_cache)``) with a
``logits(hidden)`` method, its params applied with the kernel-backed weights that the layer
scan broadcasts split out (``models.quant.flax_variables``). An architecture names its module
class (``LlamaForCausalLM``: ``LlamaModel``; ``Gemma3ForCausalLM``: ``Gemma3Model``)."""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.interface import AttentionFn, AttentionMetadata, ModelConfigLike
from models.quant import flax_variables
from pallas_kernels import KVCache, ragged_paged_attention


class FlaxCausalLM:
    """``models/interface.py:CausalLM`` over a Flax module of class ``module_class``, built as
    ``module_class(cfg, dtype, attention_fn)``.

    ``forward(params, token_ids i32[T], positions i32[T], kv_cache, md) -> (hidden [T, hidden],
    kv_cache)`` and ``compute_logits(params, hidden [L, hidden]) -> f32[L, vocab]``. Any Flax
    model with these two methods that calls the paged-attention op can be served.
    """

    module_class: ClassVar[type[nn.Module]]

    def __init__(self, cfg: ModelConfigLike, dtype: jnp.dtype = jnp.float32,
                 attention_fn: AttentionFn = ragged_paged_attention) -> None:
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.module = self.module_class(cfg, self.dtype, attention_fn)

    def forward(self, params, token_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                md: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        """``(hidden [T, hidden], kv_cache)`` for one ragged step of ``T`` tokens."""
        return self.module.apply(flax_variables(params), token_ids, positions, kv_cache, md)

    def compute_logits(self, params, hidden: jax.Array) -> jax.Array:
        """``f32[L, vocab]`` from ``hidden [L, hidden]``."""
        return self.module.apply(flax_variables(params), hidden, method=self.module_class.logits)

    def param_shapes(self):
        """The params pytree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
        cfg = self.cfg
        kv = KVCache(*(jax.ShapeDtypeStruct((cfg.num_layers, 2, 1, cfg.num_kv_heads,
                                             cfg.head_dim), self.dtype) for _ in range(2)))
        md = AttentionMetadata(jnp.zeros((1,), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                               jnp.ones((1,), jnp.int32), jnp.array([0, 1], jnp.int32),
                               jnp.ones((1,), jnp.int32))
        shapes = jax.eval_shape(
            lambda kv: self.module.init(jax.random.PRNGKey(0), jnp.zeros((1,), jnp.int32),
                                        jnp.zeros((1,), jnp.int32), kv, md), kv)
        return shapes["params"]
