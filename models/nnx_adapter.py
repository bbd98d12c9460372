"""Serve a Flax NNX model of your own: its dense attention replaced by the paged-attention op.

What a module must satisfy (checked when the architecture is built, with ``nnx.eval_shape``,
nothing allocated; each failure is a ``ValueError`` whose message starts ``"nnx module:"`` and
names the attribute):

1. ``model.embed(token_ids i32[B, T]) -> [B, T, hidden]`` and ``model.logits(x [B, T, hidden])
   -> [B, T, vocab]`` (final norm and head inside);
2. ``model.layers``: a non-empty list (``nnx.List`` or ``list``) of blocks with one structure
   (same classes, shapes and static attributes), each called ``block(x [B, T, hidden],
   positions i32[B, T]) -> [B, T, hidden]`` and holding exactly one ``PagedAttention``, which it
   calls once with its queries, keys and values (positions already applied, e.g. RoPE);
3. only ``nnx.Param`` state (no ``BatchStat``, no ``RngState``: build it without dropout RNGs);
4. its dense forward is ``logits(layers(embed(tokens), positions))`` with positions from 0
   (``dense_forward``), which is what it is served as.

Its config needs what the engine reads (``models.interface.ModelConfigLike``): ``num_layers``,
``num_kv_heads`` and ``head_dim`` must equal the module's (checked).

How it is served: the blocks' params are stacked on a leading axis and run under one
``lax.scan`` (compile time does not grow with depth), the KV cache in the carry; inside the scan
body each block is rebuilt (``nnx.merge``) from its slice, its ``PagedAttention`` is handed the
cache, the layer index and the step's ``AttentionMetadata`` for that call, and it writes K/V with
``pallas_kernels.write_kv`` and attends with the engine's ``attention_fn``. The ragged batch of
``T`` tokens runs as one row ``[1, T]``: everything but attention works token by token. Outside
the engine ``PagedAttention`` is plain dense causal attention (GQA, optional window and soft-cap),
so the module trains and evaluates as before.

The params pytree (what ``params_of`` returns and ``models.checkpoint.save_checkpoint`` writes):
``{"rest": {"path/to/leaf": array}, "layers": {"path/in/block": f[L, ...]}}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from models.interface import AttentionFn, AttentionMetadata, ModelConfigLike
from models.registry import Architecture
from pallas_kernels import KVCache, ragged_paged_attention, write_kv

MakeModule = Callable[[ModelConfigLike, nnx.Rngs], nnx.Module]


@dataclass
class _PagedCall:
    """What one ``PagedAttention`` call reads inside the engine's layer scan; it replaces the
    caches with the written ones."""

    k_cache: jax.Array  # [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: jax.Array
    layer: jax.Array  # i32 scalar
    md: AttentionMetadata
    attention_fn: AttentionFn
    scales: dict  # {"k_scale", "v_scale"} of an 8-bit cache, or {}
    calls: int = 0


class PagedAttention(nnx.Module):
    """The attention a block marks for serving: dense causal attention in the module's own
    forward, the paged-attention op inside the engine (module doc).

    ``__call__(q [B, T, num_heads, head_dim], k, v [B, T, num_kv_heads, head_dim]) -> [B, T,
    num_heads, head_dim]``; scores are ``q . k * sm_scale`` (default ``head_dim ** -0.5``),
    soft-capped as ``cap * tanh(s / cap)`` when ``logit_soft_cap`` is set, and a query at
    position ``i`` sees keys ``j`` with ``i - sliding_window < j <= i``.

    Raises:
      ValueError: heads not a multiple of kv heads; inputs of other shapes (naming them).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 sm_scale: float | None = None, sliding_window: int | None = None,
                 logit_soft_cap: float | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        self.sliding_window, self.logit_soft_cap = sliding_window, logit_soft_cap
        self.paged: _PagedCall | None = None

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        want_q = (self.num_heads, self.head_dim)
        want_kv = (self.num_kv_heads, self.head_dim)
        if q.ndim != 4 or q.shape[2:] != want_q or k.shape[2:] != want_kv or k.shape != v.shape:
            raise ValueError(f"PagedAttention: q {q.shape}, k {k.shape}, v {v.shape}; expected "
                             f"q [B, T, {want_q[0]}, {want_q[1]}] and k, v [B, T, {want_kv[0]}, "
                             f"{want_kv[1]}]")
        call = self.paged
        if call is None:
            return dense_attention(q, k, v, self.sm_scale, self.sliding_window,
                                   self.logit_soft_cap)
        call.calls += 1
        call.k_cache, call.v_cache = write_kv(call.k_cache, call.v_cache, call.layer, k[0],
                                              v[0], call.md.slot_mapping, **call.scales)
        out = call.attention_fn(
            q[0], call.k_cache, call.v_cache, call.layer, call.md.block_tables,
            call.md.seq_lens, call.md.query_start_loc, call.md.num_seqs,
            sm_scale=self.sm_scale, sliding_window=self.sliding_window,
            logit_soft_cap=self.logit_soft_cap, **call.scales)
        return out[None].astype(q.dtype)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, sm_scale: float,
                    sliding_window: int | None = None, logit_soft_cap: float | None = None
                    ) -> jax.Array:
    """Causal GQA attention over positions ``0..T-1`` in float32; shapes as
    ``PagedAttention``."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qf = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(jnp.float32)) * sm_scale
    if logit_soft_cap is not None:
        s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    mask = j <= i
    if sliding_window is not None:
        mask &= j > i - sliding_window
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)


def dense_forward(model: nnx.Module, token_ids: jax.Array) -> jax.Array:
    """The forward the adapter serves, dense: ``token_ids i32[B, T]`` from position 0 ->
    ``f32[B, T, vocab]``."""
    positions = jnp.broadcast_to(jnp.arange(token_ids.shape[1]), token_ids.shape)
    x = model.embed(token_ids)
    for block in model.layers:
        x = block(x, positions)
    return model.logits(x).astype(jnp.float32)


def _key(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def _param_leaves(module: nnx.Module, where: str) -> list[tuple[tuple, nnx.Variable]]:
    _, state = nnx.split(module)
    leaves = list(nnx.to_flat_state(state))
    for path, var in leaves:
        if not isinstance(var, nnx.Param):
            dotted = ".".join(str(p) for p in path)
            raise ValueError(f"nnx module: {where}.{dotted} is a {type(var).__name__}; only "
                             f"nnx.Param state is served (build the module without dropout "
                             f"RNGs or batch statistics)")
    return leaves


def _markers(block: nnx.Module) -> list[PagedAttention]:
    return [m for _, m in nnx.iter_graph(block) if isinstance(m, PagedAttention)]


def check_module(model: nnx.Module, cfg: ModelConfigLike) -> PagedAttention:
    """Check the shape the module doc lists; returns the first block's ``PagedAttention``.

    Raises:
      ValueError: ``"nnx module: ..."`` naming what is missing or differs.
    """
    for name in ("embed", "logits"):
        if not callable(getattr(model, name, None)):
            raise ValueError(f"nnx module: {type(model).__name__} has no method {name!r} "
                             f"(embed(token_ids [B, T]) -> [B, T, hidden]; logits(x) -> "
                             f"[B, T, vocab])")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple, nnx.List)) or len(layers) == 0:
        raise ValueError(f"nnx module: {type(model).__name__}.layers must be a non-empty list "
                         f"of blocks (nnx.List), got {type(layers).__name__}")
    first = nnx.graphdef(layers[0])
    for i, block in enumerate(layers):
        marks = _markers(block)
        if len(marks) != 1:
            raise ValueError(f"nnx module: layers[{i}] holds {len(marks)} PagedAttention "
                             f"modules; each block must hold exactly one")
        if i and nnx.graphdef(block) != first:
            raise ValueError(f"nnx module: layers[{i}] differs in structure from layers[0] "
                             f"(classes, shapes or static attributes): the blocks are stacked "
                             f"and scanned, so they must be alike")
        _param_leaves(block, f"layers[{i}]")
    mark = _markers(layers[0])[0]
    for field, have in (("num_layers", len(layers)), ("num_kv_heads", mark.num_kv_heads),
                        ("head_dim", mark.head_dim)):
        if getattr(cfg, field) != have:
            raise ValueError(f"nnx module: config {field}={getattr(cfg, field)} but the module "
                             f"has {have}")
    return mark


def params_of(model: nnx.Module) -> dict:
    """The served params pytree of a module (module doc): blocks stacked, the rest flat.

    Raises:
      ValueError: as ``check_module`` for state other than ``nnx.Param``.
    """
    stacked: dict[str, list] = {}
    for i, block in enumerate(model.layers):
        for path, var in _param_leaves(block, f"layers[{i}]"):
            stacked.setdefault(_key(path), []).append(var[...])
    rest = {_key(p): v[...] for p, v in _param_leaves(model, "model") if p[0] != "layers"}
    return {"rest": rest, "layers": {k: jnp.stack(v) for k, v in stacked.items()}}


def _param_shapes(abstract: nnx.Module) -> dict:
    """``params_of``'s tree as ``jax.ShapeDtypeStruct`` leaves, from an abstract module."""
    num_layers = len(abstract.layers)
    layers = {_key(p): jax.ShapeDtypeStruct((num_layers, *v.get_value().shape),
                                            v.get_value().dtype)
              for p, v in _param_leaves(abstract.layers[0], "layers[0]")}
    rest = {_key(p): jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype)
            for p, v in _param_leaves(abstract, "model") if p[0] != "layers"}
    return {"rest": rest, "layers": layers}


class NNXCausalLM:
    """``models/interface.py:CausalLM`` over a user's NNX module built by ``make_module(cfg,
    rngs)`` (module doc). ``forward(params, token_ids i32[T], positions i32[T], kv_cache, md)
    -> (hidden [T, hidden], kv_cache)``; ``compute_logits(params, hidden [L, hidden]) ->
    f32[L, vocab]``.

    Raises:
      ValueError: as ``check_module``.
    """

    def __init__(self, cfg: ModelConfigLike, dtype: jnp.dtype, attention_fn: AttentionFn,
                 make_module: MakeModule) -> None:
        self.cfg, self.dtype, self.attention_fn = cfg, jnp.dtype(dtype), attention_fn
        abstract = nnx.eval_shape(lambda: make_module(cfg, nnx.Rngs(0)))
        check_module(abstract, cfg)
        self._graphdef, self._state = nnx.split(abstract)
        self._layer_graphdef, self._layer_state = nnx.split(abstract.layers[0])
        self._shapes = _param_shapes(abstract)

    def _merged(self, params) -> nnx.Module:
        """The whole module on ``params``; the blocks get the first slice (they are unused)."""
        flat = []
        for path, var in nnx.to_flat_state(self._state):
            if path[0] == "layers":
                value = params["layers"][_key(path[2:])][0]
            else:
                value = params["rest"][_key(path)]
            flat.append((path, var.replace(value)))
        return nnx.merge(self._graphdef, nnx.from_flat_state(flat))

    def _block(self, layer_params: dict) -> nnx.Module:
        flat = [(p, v.replace(layer_params[_key(p)]))
                for p, v in nnx.to_flat_state(self._layer_state)]
        return nnx.merge(self._layer_graphdef, nnx.from_flat_state(flat))

    def forward(self, params, token_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                md: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        """``(hidden [T, hidden], kv_cache)`` for one ragged step of ``T`` tokens."""
        x = self._merged(params).embed(token_ids[None])
        scales = ({} if kv_cache.k_scale is None
                  else {"k_scale": kv_cache.k_scale, "v_scale": kv_cache.v_scale})

        def body(carry, layer_params):
            x, k, v, layer = carry
            block = self._block(layer_params)
            mark = _markers(block)[0]
            call = _PagedCall(k, v, layer, md, self.attention_fn, scales)
            mark.paged = call
            x = block(x, positions[None])
            if call.calls != 1:
                raise ValueError(f"nnx module: a block called its PagedAttention {call.calls} "
                                 f"times in one forward; it must call it once")
            return (x, call.k_cache, call.v_cache, layer + 1), None

        carry = (x, kv_cache.k, kv_cache.v, jnp.int32(0))
        (x, k, v, _), _ = jax.lax.scan(body, carry, params["layers"])
        return x[0], KVCache(k, v, kv_cache.k_scale, kv_cache.v_scale)

    def compute_logits(self, params, hidden: jax.Array) -> jax.Array:
        """``f32[L, vocab]`` from ``hidden [L, hidden]``."""
        return self._merged(params).logits(hidden[None])[0].astype(jnp.float32)

    def param_shapes(self):
        """The params pytree as ``jax.ShapeDtypeStruct`` leaves in the serving dtype."""
        return jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, self.dtype if jnp.issubdtype(
                s.dtype, jnp.floating) else s.dtype), self._shapes)


def nnx_architecture(name: str, make_module: MakeModule,
                     config_from_dict: Callable[[dict], ModelConfigLike]) -> Architecture:
    """An ``Architecture`` (``models.registry``) that serves ``make_module(cfg, rngs)``; pass it
    to ``register_architecture``. No quantisation (``quant_targets`` None)."""
    def model(cfg: ModelConfigLike, dtype: jnp.dtype = jnp.float32,
              attention_fn: AttentionFn = ragged_paged_attention) -> NNXCausalLM:
        return NNXCausalLM(cfg, dtype, attention_fn, make_module)

    return Architecture(name=name, model=model, config_from_dict=config_from_dict)
