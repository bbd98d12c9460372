"""The interface between the engine and a model: the config fields the engine reads
(``ModelConfigLike``), the model protocol (``CausalLM``), the per-step attention layout
(``AttentionMetadata``) and the weights a kernel outside the models computes with
(``KernelWeight``). Any Flax model that implements ``CausalLM`` and calls the paged-attention
op it is given can be served (``models.registry``, ``examples/tiny_gpt.py``,
docs/architecture.md#model-protocol)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

AttentionFn = Callable[..., jax.Array]


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """Per-step layout of the ragged batch (see pallas_kernels.ragged_paged_attention).

    Fields:
      slot_mapping: ``i32[T]`` cache slot of each token (padding -> block 0).
      block_tables: ``i32[S, max_blocks_per_seq]``.
      seq_lens: ``i32[S]`` context length including this step's tokens.
      query_start_loc: ``i32[S + 1]``.
      num_seqs: ``i32[1]`` real sequences.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    num_seqs: jax.Array


class ModelConfigLike(Protocol):
    """What the engine reads from a model config (a frozen dataclass in practice).

    Fields: ``architecture`` (the registry name), ``name`` (served name), ``vocab_size``,
    ``num_layers``, ``num_kv_heads``, ``head_dim`` (the KV cache is
    ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``), ``max_position_embeddings``
    (context window, tokens). ``to_dict()`` gives the JSON-able form that ``config.json`` of an
    orbax checkpoint holds; the architecture's ``config_from_dict`` reads it back.
    """

    architecture: str
    name: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int

    def to_dict(self) -> dict: ...


class CausalLM(Protocol):
    """The model protocol: what the engine calls on a model.

    ``forward(params, token_ids i32[T], positions i32[T], kv_cache, md) -> (hidden [T, hidden],
    kv_cache)``: one ragged step; ``md`` is an ``AttentionMetadata``; layer ``l``
    writes its new K/V with ``pallas_kernels.write_kv(k, v, l, k_new, v_new, md.slot_mapping)``
    and attends with ``attention_fn(q, k_cache, v_cache, l, md.block_tables, md.seq_lens,
    md.query_start_loc, md.num_seqs, sm_scale=...)`` (the op the engine passes in; stack layers
    and run them with ``nn.scan``/``lax.scan`` carrying the cache, so compile time does not grow
    with depth and the cache is not copied).
    ``compute_logits(params, hidden [L, hidden]) -> f32[L, vocab]``.
    ``param_shapes()``: the params pytree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated);
    the orbax loader restores into it and dummy weights are drawn in its shapes.
    """

    cfg: ModelConfigLike
    dtype: jnp.dtype

    def forward(self, params, token_ids: jax.Array, positions: jax.Array, kv_cache, md
                ) -> tuple[jax.Array, object]: ...

    def compute_logits(self, params, hidden: jax.Array) -> jax.Array: ...

    def param_shapes(self): ...


@runtime_checkable
class KernelWeight(Protocol):
    """A weight in the params whose products a kernel outside the model layer computes (the CPU
    platform's packed bfloat16 and native int4 weights, ``jaxserve.platform.cpu_weights``). The
    layers reach it only through ``models.quant``'s ``qmatmul``, ``embed_lookup`` and ``weight``.
    """

    scan_broadcast: ClassVar[bool]
    """Whether the layer scan broadcasts it whole (its kernel reads the layer it is bound to
    by ``at_layer``) instead of slicing its arrays per layer as it does the params."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape of one layer's weight: ``(k, m)`` of ``x @ w``."""
        ...

    def matmul(self, x: jax.Array, *, transpose: bool) -> jax.Array:
        """``x [T, k] @ w`` (``@ w.T`` with ``transpose``) -> ``[T, m]`` in ``x.dtype``."""
        ...

    def embed_rows(self, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """Rows ``w[ids]`` of an embedding table: ``i32[T]`` -> ``[T, hidden]`` in ``dtype``."""
        ...

    def at_layer(self, layer: jax.Array | None) -> KernelWeight:
        """This weight bound to the scan's layer index (``i32[]``; None outside the scan)."""
        ...
