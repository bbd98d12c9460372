"""Tensor parallelism: how the params and the KV cache are split over a one-axis ``"tp"`` mesh.

Megatron-LM's layout (arXiv:1909.08053, section 3): q/k/v and gate/up are column-parallel (a
slice of the output features: heads, intermediate dim), o and down row-parallel (the matching
input slice, a partial sum), so a layer needs two all-reduces of ``[T, hidden]``, after o and
after down. The KV cache ``[L, num_blocks, block_size, kv_heads, head_dim]`` and an 8-bit
cache's scales ``[L, kv_heads]`` split over kv heads; attention runs per device under
``shard_map`` with no communication (``shard_attention``), and XLA's partitioner splits
``write_kv``'s scatter over the same heads. Embedding and LM head split over the vocabulary.

With ``num_kv_heads < tp`` each kv head is replicated ``tp // num_kv_heads`` times (needs
``tp % num_kv_heads == 0``); query heads that do not divide by ``tp`` are refused.

A ``models.quant_formats.QuantizedWeight`` splits like the weight it replaces: ``q``, ``scale`` and
``zero`` take its spec, except a per-channel scale is replicated along the contraction axis.
Every split axis must divide by ``tp`` (int4 row-parallel: ``in / quantization_group_size``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.quant_formats import QuantizedWeight

TP_AXIS = "tp"

# (regex on the tree path, spec for the *stacked* [L, ...] leaf, or for a top-level leaf)
_LAYER_RULES: list[tuple[str, tuple]] = [
    (r"\bwq$|\bwk$|\bwv$", (None, None, TP_AXIS)),  # [L, hidden, heads*hd]: column-parallel
    (r"\bbq$|\bbk$|\bbv$", (None, TP_AXIS)),  # [L, heads*hd]
    (r"\bw_gate$|\bw_up$", (None, None, TP_AXIS)),  # [L, hidden, inter]: column-parallel
    (r"\bwo$|\bw_down$", (None, TP_AXIS, None)),  # [L, in, hidden]: row-parallel
]


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Refuse a TP size the model's shapes cannot take.

    Raises:
      ValueError: naming the numbers, if ``tp < 1``, ``tp`` does not divide ``num_heads``,
        ``intermediate_size`` or ``vocab_size``, or kv heads neither divide by nor divide it.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if tp == 1:
        return
    if cfg.num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's num_heads={cfg.num_heads} "
            f"(query heads are split evenly over devices); choose a divisor of "
            f"{cfg.num_heads}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} and num_kv_heads={cfg.num_kv_heads}: kv heads are "
            f"split when tp divides them and replicated when they divide tp; neither holds")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size="
                         f"{cfg.intermediate_size}")
    if cfg.vocab_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide vocab_size="
                         f"{cfg.vocab_size}")


def kv_replication(cfg: ModelConfig, tp: int) -> int:
    """How many copies of each kv head the TP layout keeps (1 unless num_kv_heads < tp)."""
    return tp // cfg.num_kv_heads if cfg.num_kv_heads < tp else 1


def sharded_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded model runs with: kv heads replicated up to ``tp`` if fewer."""
    check_tensor_parallel(cfg, tp)
    r = kv_replication(cfg, tp)
    return cfg if r == 1 else cfg.replace(num_kv_heads=cfg.num_kv_heads * r)


def replicate_kv_heads(params: dict, cfg: ModelConfig, tp: int) -> dict:
    """Copy each kv head's k/v columns (``[L, hidden, kv*hd]``, biases ``[L, kv*hd]``)
    ``tp // num_kv_heads`` times, adjacent, so q head ``h`` keeps its original kv head."""
    r = kv_replication(cfg, tp)
    if r == 1:
        return params
    hd, kv = cfg.head_dim, cfg.num_kv_heads

    def rep(a: jax.Array) -> jax.Array:
        lead = a.shape[:-1]
        a = a.reshape(*lead, kv, 1, hd)
        return jnp.broadcast_to(a, (*lead, kv, r, hd)).reshape(*lead, kv * r * hd)

    layers = dict(params["layers"])
    for name in ("wk", "wv", "bk", "bv"):
        if name in layers:  # a QuantizedWeight's q, scale and zero all end with the kv*hd axis
            layers[name] = jax.tree_util.tree_map(rep, layers[name])
    return {**params, "layers": layers}


def param_partition_specs(params, cfg: ModelConfig) -> dict:
    """A PartitionSpec per leaf of a Llama-family params tree (a ``QuantizedWeight`` of specs
    for a quantised one); norms replicate."""
    del cfg

    def spec(path, leaf) -> P:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        s: tuple = (None,) * len(np.shape(leaf) if not isinstance(leaf, QuantizedWeight)
                                 else leaf.shape)
        if name == "embed":
            s = (TP_AXIS, None)
        elif name == "lm_head":
            s = (None, TP_AXIS)
        elif name.startswith("layers/"):
            for pattern, rule in _LAYER_RULES:
                if re.search(pattern, name):
                    s = rule
                    break
        if not isinstance(leaf, QuantizedWeight):
            return P(*s)
        ax = leaf.axis % leaf.q.ndim
        scale = list(s)
        if leaf.scale.shape[ax] == 1:  # per-channel: one scale along the contraction axis
            scale[ax] = None
        return dataclasses.replace(leaf, q=P(*s), scale=P(*scale),
                                   zero=None if leaf.zero is None else P(*scale))

    return jax.tree_util.tree_map_with_path(
        spec, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def check_divisible(params, specs, tp: int) -> None:
    """Refuse a leaf whose split axis does not divide by ``tp``.

    Raises:
      ValueError: naming the leaf, its shape, the axis and ``tp`` (int4: the group size).
    """
    pairs = zip(jax.tree_util.tree_flatten_with_path(params)[0],
                jax.tree_util.tree_leaves(specs), strict=True)
    for (path, leaf), spec in pairs:
        for ax, name in enumerate(spec):
            if name == TP_AXIS and leaf.shape[ax] % tp:
                where = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
                hint = ""
                if where.endswith(("/scale", "/q", "/zero")):
                    hint = (" (a quantised weight: for int4 the split axis holds "
                            "in / quantization_group_size groups, or in / 2 packed rows; "
                            "choose a quantization_group_size that leaves a multiple of "
                            f"{tp} groups, or another tensor_parallel_size)")
                raise ValueError(f"tensor_parallel_size={tp} does not divide axis {ax} of "
                                 f"param {where} with shape {tuple(leaf.shape)}{hint}")


def kv_cache_spec() -> P:
    """``[L, num_blocks, block_size, kv_heads, head_dim]`` split over kv heads."""
    return P(None, None, None, TP_AXIS, None)


def kv_scale_spec() -> P:
    """An 8-bit cache's ``k_scale`` / ``v_scale`` ``f32[L, kv_heads]``: split like the cache."""
    return P(None, TP_AXIS)


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``("tp",)`` mesh over the first ``tp`` devices; ValueError if there are fewer."""
    devs = list(devices if devices is not None else jax.devices())
    if len(devs) < tp:
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; "
                         f"{len(devs)} available ({jax.devices()[0].platform})")
    return Mesh(np.array(devs[:tp]), (TP_AXIS,))


def place_params(params, cfg: ModelConfig, mesh: Mesh):
    """Re-lay a tree already on ``mesh`` (kv heads replicated) with ``param_partition_specs``,
    e.g. after quantising, whose output XLA may have sharded otherwise.

    Raises:
      ValueError: as ``check_divisible``.
    """
    specs = param_partition_specs(params, cfg)
    check_divisible(params, specs, mesh.shape[TP_AXIS])
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)
    return jax.jit(lambda p: p, out_shardings=shardings)(params)


def shard_params(params, cfg: ModelConfig, mesh: Mesh):
    """The params placed with ``param_partition_specs``, kv heads replicated first if needed."""
    tp = mesh.shape[TP_AXIS]
    params = replicate_kv_heads(params, cfg, tp)
    specs = param_partition_specs(params, cfg)
    check_divisible(params, specs, tp)
    if jax.process_count() == 1:
        return jax.tree_util.tree_map(
            lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)

    def place(a, s):  # every process holds the whole tree and contributes its own shards
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, s),
                                            lambda idx: host[idx])

    return jax.tree_util.tree_map(place, params, specs)


def shard_attention(attention_fn: Callable[..., jax.Array], mesh: Mesh
                    ) -> Callable[..., jax.Array]:
    """Wrap the pinned attention op so each device attends with its own heads.

    q ``[T, heads, hd]`` and out split over heads, caches and ``k_scale`` / ``v_scale`` over kv
    heads, block tables and lengths replicated; no communication inside.
    """
    heads = P(None, TP_AXIS, None)
    cache = kv_cache_spec()

    def wrapped(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs,
                k_scale=None, v_scale=None, **kw):
        args = (q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, num_seqs)
        specs = (heads, cache, cache, P(), P(), P(), P(), P())
        if k_scale is None:
            body = lambda *a: attention_fn(*a, **kw)
        else:  # the scales enter as arguments (not closed over) so that they are split too
            body = lambda *a: attention_fn(*a[:-2], k_scale=a[-2], v_scale=a[-1], **kw)
            args += (k_scale, v_scale)
            specs += (kv_scale_spec(), kv_scale_spec())
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)
        return f(*args)

    return wrapped
