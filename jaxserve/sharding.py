"""Tensor parallelism: how the params and the KV cache are split over a device mesh.

Megatron-LM's layout (Shoeybi et al. 2019, arXiv:1909.08053, section 3): in every decoder layer
q/k/v and the MLP's gate/up projections are *column-parallel* (each device holds a slice of the
output features, i.e. of the heads / of the intermediate dimension), o and down are
*row-parallel* (each device holds the matching slice of the input features and produces a partial
sum). The activations between a column-parallel and its row-parallel partner stay split, so a
layer needs exactly two all-reduces of ``[T, hidden]``: after the attention output projection
and after the MLP's down projection. Attention itself is independent per kv head, so the paged KV
cache ``[L, num_blocks, block_size, kv_heads, head_dim]`` is split over kv heads and the attention
op (and ``write_kv``) run per device under ``shard_map`` on their local heads, with no
communication. The embedding table and the LM head are split over the vocabulary. An 8-bit
cache's scales ``[L, kv_heads]`` are split over kv heads the same way (``kv_scale_spec``), so each
device holds the scales of its own heads.

The mesh has one axis, ``"tp"``. Where ``num_kv_heads`` is smaller than the TP size the kv heads
are *replicated* (each kv head copied ``tp // num_kv_heads`` times, so every device holds one),
which needs ``tp % num_kv_heads == 0``; query-head counts that do not divide by the TP size are
refused (padding them would add a zero head's matmul and attention on every device).

Quantised weights (``models.quant.QuantizedWeight``) split like the float weight they replace:
``q`` takes the weight's spec (int4's packed axis holds adjacent input rows, so a shard is a
contiguous range of rows), ``scale`` (and int4's ``zero``) the same spec, except that a
per-channel scale (one entry along the contraction axis) is replicated along it. Every split
axis must divide by the TP size (int4 row-parallel weights: their number of groups, ``in /
quantization_group_size``); ``shard_params`` refuses others naming the leaf and the numbers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.quant import QuantizedWeight

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
      ValueError: naming the numbers, if ``tp < 1``, ``num_heads % tp != 0``,
        ``intermediate_size % tp != 0``, ``vocab_size % tp != 0``, or kv heads neither divide
        by ``tp`` nor divide it (replication needs ``tp % num_kv_heads == 0``).
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
    """Copy each kv head's k/v projection columns ``tp // num_kv_heads`` times (adjacent), so
    q head ``h`` still meets its original kv head ``h // (num_heads // num_kv_heads)`` after the
    group size shrinks. A no-op when no replication is needed. Leaves: ``[L, hidden, kv*hd]``
    weights and ``[L, kv*hd]`` biases."""
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
    """A PartitionSpec for every leaf of a Llama-family params tree (same structure).

    Stacked layer leaves ``[L, ...]`` follow the column/row rules above; ``embed
    [vocab, hidden]`` splits the vocabulary, ``lm_head [hidden, vocab]`` too; norms replicate.
    A ``QuantizedWeight`` gets a ``QuantizedWeight`` of specs (module docstring).
    """
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
        return QuantizedWeight(P(*s), P(*scale), leaf.method, leaf.group_size, leaf.axis,
                               None if leaf.zero is None else P(*scale))

    return jax.tree_util.tree_map_with_path(
        spec, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def check_divisible(params, specs, tp: int) -> None:
    """Refuse a leaf whose split axis does not divide by ``tp``.

    Raises:
      ValueError: naming the leaf, its shape, the axis and ``tp`` (for int4 weights also the
        group size to change).
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
    """A 1-D ``("tp",)`` mesh over the first ``tp`` devices (or the given ones).

    Raises ValueError if fewer than ``tp`` devices exist.
    """
    devs = list(devices if devices is not None else jax.devices())
    if len(devs) < tp:
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; "
                         f"{len(devs)} available ({jax.default_backend()})")
    return Mesh(np.array(devs[:tp]), (TP_AXIS,))


def place_params(params, cfg: ModelConfig, mesh: Mesh):
    """Lay a params tree already on ``mesh`` (kv heads replicated, e.g. weights quantised
    after a sharded load) out with ``param_partition_specs``, so quantised leaves get their
    documented shardings rather than whatever XLA propagated through the quantisation.

    Raises:
      ValueError: as ``check_divisible``.
    """
    specs = param_partition_specs(params, cfg)
    check_divisible(params, specs, mesh.shape[TP_AXIS])
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)
    return jax.jit(lambda p: p, out_shardings=shardings)(params)


def shard_params(params, cfg: ModelConfig, mesh: Mesh):
    """Place a params tree on the mesh with ``param_partition_specs`` (kv heads replicated
    first where needed). Returns the placed tree."""
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

    q ``[T, heads, hd]`` and out are split over heads, the caches over kv heads, the batch
    layout (block tables, lengths) replicated; no communication happens inside. An 8-bit
    cache's ``k_scale`` / ``v_scale`` keywords are split over kv heads too (``kv_scale_spec``).
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


def shard_write_kv(write_fn: Callable, mesh: Mesh) -> Callable:
    """Wrap ``write_kv`` so each device scatters its own kv heads into its cache shard."""
    heads = P(None, TP_AXIS, None)
    cache = kv_cache_spec()

    def wrapped(k_cache, v_cache, layer, k_new, v_new, slot_mapping, k_scale=None,
                v_scale=None):
        args = (k_cache, v_cache, layer, k_new, v_new, slot_mapping)
        specs = (cache, cache, P(), heads, heads, P())
        if k_scale is None:
            body = write_fn
        else:
            body = lambda *a: write_fn(*a[:-2], k_scale=a[-2], v_scale=a[-1])
            args += (k_scale, v_scale)
            specs += (kv_scale_spec(), kv_scale_spec())
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(cache, cache),
                          check_vma=False)
        return f(*args)

    return wrapped
