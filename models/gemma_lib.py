"""Gemma 3 checkpoints as Google DeepMind's ``gemma`` library writes them, served by
``models.gemma3`` with no conversion step.

A directory of that library (``gm.ckpts.save_params(params, DIR)``, or a released checkpoint) is
an orbax checkpoint of its Flax params, without a config. ``read_gemma_lib`` reads the tree's
metadata (nothing is allocated), takes every size from the tensors' shapes and the rest of the
config (sliding window, RoPE bases and scaling, layer pattern, query scale) from
``gemma_config.json`` beside the checkpoint when present, else from the library's own Gemma 3
class of the same width (``LIBRARY_CLASSES``). Every tensor is checked before any is read.
``load_gemma_lib_params`` then restores the tree to host memory and maps it onto our layout, one
kind of tensor at a time:

  library (per layer ``layer_{i}/...``)            ours (stacked ``layers/...``, ``[L, ...]``)
  ``attn/q_einsum/w [N, D, H]``                    ``wq [D, N*H]``
  ``attn/kv_einsum/w [2, K, D, H]``                ``wk``, ``wv [D, K*H]``
  ``attn/qkv_einsum/w [3, N, D, H]`` (N == K)      ``wq``, ``wk``, ``wv``
  ``attn/attn_vec_einsum/w [N, H, D]``             ``wo [N*H, D]``
  ``mlp/gating_einsum [2, F, D]`` (``[2, D, F]``   ``w_gate``, ``w_up [D, F]``
  untransposed)
  ``mlp/linear [F, D]``                            ``w_down [F, D]``
  ``{pre_attention,post_attention,pre_ffw,          ``{attn,post_attn,mlp,post_mlp}_norm/weight``
  post_ffw}_norm/scale [D]``, ``attn/_{query,key}    ``{q,k}_norm/weight``: ``1 + scale`` (the
  _norm/scale [H]``                                 library's RMSNorm multiplies by it)
  ``embedder/input_embedding [V, D]``, ``final_norm/scale``   ``embed``, ``final_norm/weight``

Two tree layouts of the library are read (``gemma.gm.ckpts._checkpoint``): NESTED (what
``save_params`` writes: ``model.init()['params']``) and FLAT (the released checkpoints:
``transformer/layer_0/attn/q_einsum`` -> ``{"w"}``); its STACKED layout and Kauldron train
states are refused, naming the library calls that rewrite them as NESTED. The vision encoder of
the 4B+ checkpoints is not read. RoPE is rotate-half in both
(``gm.math.apply_rope``), so q/k columns need no permutation.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from models.checkpoint import import_orbax
from models.config import Gemma3Config
from models.loader import stack_layers

CONFIG_FILE = "gemma_config.json"
TOKENIZER_FILE = "tokenizer.model"
ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")

LIBRARY_CLASSES: dict[int, dict] = {
    640: {"name": "Gemma3_270M", "sliding_window_size": 512, "global_scale_factor": 1.0},
    1152: {"name": "Gemma3_1B", "sliding_window_size": 512, "global_scale_factor": 1.0},
    2560: {"name": "Gemma3_4B", "sliding_window_size": 1024, "global_scale_factor": 8.0,
           "max_position_embeddings": 131072},
    3840: {"name": "Gemma3_12B", "sliding_window_size": 1024, "global_scale_factor": 8.0,
           "max_position_embeddings": 131072},
    5376: {"name": "Gemma3_27B", "sliding_window_size": 1024, "global_scale_factor": 8.0,
           "query_pre_attn_norm": "BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS",
           "max_position_embeddings": 131072},
}
"""The settings shapes cannot show, per model width, as ``gemma.gm.nn._gemma``'s Gemma 3 classes
(gemma 4.0.1) set them; all use RoPE bases 1e4 (local) / 1e6 (global), five local layers to one
global, q/k norms and ``transpose_gating_einsum``."""

DEFAULTS = {"local_base_frequency": 10_000, "global_base_frequency": 1_000_000,
            "local_scale_factor": 1.0, "global_scale_factor": 1.0, "query_pre_attn_norm": "BY_ONE_OVER_SQRT_HEAD_DIM",
            "attention_types": None, "final_logit_softcap": None, "attn_logits_soft_cap": None,
            "transpose_gating_einsum": True, "max_position_embeddings": 32768}
KNOWN_KEYS = frozenset({*DEFAULTS, "sliding_window_size"})


def is_gemma_lib_dir(path: str) -> bool:
    """Whether ``path`` is an orbax checkpoint directory (``_CHECKPOINT_METADATA`` or
    ``_METADATA``) that is not a ``jaxserve convert`` one (those carry ``config.json``)."""
    return (os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json"))
            and any(os.path.isfile(os.path.join(path, m)) for m in ORBAX_MARKERS))


@dataclass(frozen=True)
class GemmaLibCheckpoint:
    """What ``read_gemma_lib`` found: the config, and where each tensor of it is stored.

    Fields:
      path: the checkpoint directory.
      config: our ``Gemma3Config`` for it.
      stored: the stored tree as ``jax.ShapeDtypeStruct`` leaves (its own nesting).
      keys: normalised name (``layer_3/attn/q_einsum/w``) -> the stored leaf's key path.
      gating_transposed: whether ``mlp/gating_einsum`` is ``[2, F, D]``.
      fused_qkv: whether attention is ``qkv_einsum`` (as many kv heads as query heads).
    """

    path: str
    config: Gemma3Config
    stored: object
    keys: dict[str, tuple]
    gating_transposed: bool
    fused_qkv: bool


def _normalise(path: tuple) -> str | None:
    """A stored key path as NESTED's ``/``-joined name; None for what we do not read."""
    parts = [str(getattr(k, "key", k)) for k in path]
    if parts and parts[0].startswith("transformer/"):  # FLAT: "transformer/layer_0/attn/x"
        parts = parts[0].split("/")[1:] + parts[1:]
        if len(parts) >= 3 and parts[-3] == "mlp" and parts[-1] == "w":
            parts = parts[:-1]  # FLAT's mlp/gating_einsum/w is NESTED's mlp/gating_einsum
    name = "/".join(parts)
    if name.startswith(("vision_encoder", "embedder/mm_", "SigLiP")):
        return None
    return name


def _read_sidecar(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    if not isinstance(data, dict) or (unknown := sorted(set(data) - KNOWN_KEYS)):
        raise ValueError(f"{file}: unknown keys {unknown if isinstance(data, dict) else data!r};"
                         f" known (the gemma library's TransformerConfig names): "
                         f"{sorted(KNOWN_KEYS)}")
    return data


def read_gemma_lib(path: str) -> GemmaLibCheckpoint:
    """Check a ``gemma`` library checkpoint from its metadata and derive our config; reads no
    tensor data.

    Raises:
      ValueError: naming the directory and the tensor or setting: no Gemma 3 transformer in the
        tree (e.g. Gemma 2: no q/k norms), a missing tensor, a shape that disagrees with the
        rest, a setting our Gemma 3 model does not have (logit soft-caps, local RoPE scaling,
        a layer pattern other than every k-th layer global), or a width the library defines no
        Gemma 3 class for without ``gemma_config.json``.
    """
    path = os.path.abspath(path)
    ckpt = import_orbax().StandardCheckpointer()
    try:
        meta = ckpt.metadata(path).item_metadata
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds for a bad directory
        raise ValueError(f"{path}: not a readable orbax checkpoint ({e})") from None
    finally:
        ckpt.close()
    if meta is None:
        raise ValueError(f"{path}: the orbax checkpoint has no item metadata")
    stored = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype),
                                    meta.tree)
    keys, shapes = {}, {}
    for p, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]:
        if (name := _normalise(p)) is not None:
            keys[name], shapes[name] = p, leaf.shape

    def need(name: str, ndim: int) -> tuple[int, ...]:
        if name not in shapes:
            raise ValueError(f"{path}: the checkpoint lacks tensor {name!r}")
        if len(shapes[name]) != ndim:
            raise ValueError(f"{path}: tensor {name!r} has shape {shapes[name]}; expected "
                             f"{ndim} dimensions")
        return shapes[name]

    if top := sorted({n.split("/")[0] for n in shapes} & {"params", "opt_state",
                                                           "stacked_layers"}):
        raise ValueError(f"{path}: a {'Kauldron train state' if top[0] != 'stacked_layers' else
                         'STACKED checkpoint'} ({top[0]}/...), which is not read; load it with "
                         f"the library's gm.ckpts.load_params and write the params with "
                         f"gm.ckpts.save_params")
    if "embedder/input_embedding" not in shapes:
        raise ValueError(f"{path}: no Gemma transformer in the checkpoint (no tensor "
                         f"'embedder/input_embedding'; found {sorted(shapes)[:4]}...)")
    vocab, width = need("embedder/input_embedding", 2)
    num_layers = 1 + max((int(m.group(1)) for n in shapes
                          if (m := re.match(r"layer_(\d+)/", n))), default=-1)
    if num_layers == 0:
        raise ValueError(f"{path}: the checkpoint has no layer_0 tensors")
    fused = "layer_0/attn/qkv_einsum/w" in shapes
    if fused:
        _, heads, _, head_dim = need("layer_0/attn/qkv_einsum/w", 4)
        kv_heads = heads
    else:
        heads, _, head_dim = need("layer_0/attn/q_einsum/w", 3)
        kv_heads = need("layer_0/attn/kv_einsum/w", 4)[1]
    ffw = need("layer_0/mlp/linear", 2)[0]
    if "layer_0/attn/_query_norm/scale" not in shapes:
        raise ValueError(f"{path}: tensor 'layer_0/attn/_query_norm/scale' is missing: a Gemma "
                         f"3 checkpoint has q/k norms (Gemma 2 checkpoints are not served)")
    settings = dict(DEFAULTS)
    settings.update({k: v for k, v in LIBRARY_CLASSES.get(width, {}).items() if k != "name"})
    sidecar = _read_sidecar(path)
    if width not in LIBRARY_CLASSES and "sliding_window_size" not in sidecar:
        raise ValueError(
            f"{path}: width {width} is none of the gemma library's Gemma 3 classes "
            f"({', '.join(f'{c['name']}: {w}' for w, c in LIBRARY_CLASSES.items())}); write "
            f"{CONFIG_FILE} beside the checkpoint with the settings of your TransformerConfig "
            f"(docs/models.md#gemma-library-checkpoints)")
    settings.update(sidecar)
    where = os.path.join(path, CONFIG_FILE) if sidecar else f"{path} (width {width})"
    for key in ("final_logit_softcap", "attn_logits_soft_cap"):
        if settings[key] is not None:
            raise ValueError(f"{where}: {key}={settings[key]} is not Gemma 3 (no soft-caps)")
    if float(settings["local_scale_factor"]) != 1.0:
        raise ValueError(f"{where}: local_scale_factor={settings['local_scale_factor']}: the "
                         f"model scales RoPE positions on global layers only")
    pattern = _pattern(settings["attention_types"], num_layers, where)
    scalar = _query_scalar(str(settings["query_pre_attn_norm"]), width, heads, head_dim, where)

    expected = {"pre_attention_norm/scale": (width,), "post_attention_norm/scale": (width,),
                "pre_ffw_norm/scale": (width,), "post_ffw_norm/scale": (width,),
                "attn/_query_norm/scale": (head_dim,), "attn/_key_norm/scale": (head_dim,),
                "attn/attn_vec_einsum/w": (heads, head_dim, width), "mlp/linear": (ffw, width)}
    if fused:
        expected["attn/qkv_einsum/w"] = (3, heads, width, head_dim)
    else:
        expected["attn/q_einsum/w"] = (heads, width, head_dim)
        expected["attn/kv_einsum/w"] = (2, kv_heads, width, head_dim)
    gating = shapes.get("layer_0/mlp/gating_einsum")
    transposed = (bool(settings["transpose_gating_einsum"]) if ffw == width
                  else gating == (2, ffw, width))
    expected["mlp/gating_einsum"] = (2, ffw, width) if transposed else (2, width, ffw)
    for i in range(num_layers):
        for name, shape in expected.items():
            full = f"layer_{i}/{name}"
            if full not in shapes:
                raise ValueError(f"{path}: the checkpoint lacks tensor {full!r}")
            if tuple(shapes[full]) != shape:
                raise ValueError(f"{path}: tensor {full!r} has shape {tuple(shapes[full])}; "
                                 f"the model expects {shape}")
    if tuple(shapes.get("final_norm/scale", ())) != (width,):
        have = shapes.get("final_norm/scale", "missing")
        raise ValueError(f"{path}: tensor 'final_norm/scale' is {have}; the model expects "
                         f"shape {(width,)}")
    try:
        cfg = Gemma3Config(
            vocab_size=vocab, hidden_size=width, intermediate_size=ffw, num_layers=num_layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rope_theta=float(settings["global_base_frequency"]),
            rope_local_theta=float(settings["local_base_frequency"]),
            rope_scaling_factor=float(settings["global_scale_factor"]),
            sliding_window=int(settings["sliding_window_size"]),
            sliding_window_pattern=pattern, query_pre_attn_scalar=scalar,
            max_position_embeddings=int(settings["max_position_embeddings"]),
            name=os.path.basename(os.path.normpath(path)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    return GemmaLibCheckpoint(path, cfg, stored, keys, transposed, fused)


def _pattern(types: list | None, num_layers: int, where: str) -> int:
    """``sliding_window_pattern`` from the library's per-layer ``attention_types`` (None: Gemma
    3's five local layers to one global)."""
    if types is None:
        return 6
    if len(types) != num_layers:
        raise ValueError(f"{where}: attention_types lists {len(types)} layers; the checkpoint "
                         f"has {num_layers}")
    globals_ = [i for i, t in enumerate(types) if t == "GLOBAL"]
    if any(t not in ("GLOBAL", "LOCAL_SLIDING") for t in types):
        raise ValueError(f"{where}: attention_types holds {sorted(set(types))}; expected "
                         f"'GLOBAL' and 'LOCAL_SLIDING'")
    k = globals_[0] + 1 if globals_ else num_layers + 1
    if globals_ != list(range(k - 1, num_layers, k)):
        raise ValueError(f"{where}: attention_types {types} is not 'every k-th layer global', "
                         f"the one pattern the model runs")
    return k


def _query_scalar(norm: str, width: int, heads: int, head_dim: int, where: str) -> float:
    """Our ``query_pre_attn_scalar`` ``s`` (queries times ``s ** -0.5``) for the library's
    ``QueryPreAttentionNormalisation`` name (``_config.query_pre_attn_scalar``)."""
    scalar = {"BY_ONE_OVER_SQRT_HEAD_DIM": float(head_dim),
              "BY_EMBED_DIM_DIV_NUM_HEADS": float(width // heads) ** -2.0,
              "BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS": float(width // heads)}.get(norm)
    if scalar is None:
        raise ValueError(f"{where}: unknown query_pre_attn_norm {norm!r}")
    return scalar


def load_gemma_lib_params(ckpt: GemmaLibCheckpoint, dtype: jnp.dtype) -> dict:
    """Params of ``Gemma3ForCausalLM`` from a checkpoint ``read_gemma_lib`` checked, on the
    default device in ``dtype`` (module doc: the mapping). The tree is restored to host memory
    as numpy arrays in its stored dtype; each stacked leaf is put on the device as it is
    built."""
    ocp = import_orbax()
    as_numpy = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                      ckpt.stored)
    reader = ocp.PyTreeCheckpointer()
    try:
        restored = reader.restore(ckpt.path, restore_args=as_numpy)
    finally:
        reader.close()
    flat = {"/".join(str(getattr(k, "key", k)) for k in p): leaf
            for p, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]}
    by_name = {n: flat["/".join(str(getattr(k, "key", k)) for k in p)]
               for n, p in ckpt.keys.items()}
    cfg = ckpt.config

    def get(name: str) -> np.ndarray:
        return np.asarray(by_name[name])

    def one_plus(name: str) -> dict:
        return {"weight": 1.0 + get(name).astype(np.float32)}

    def layer(i: int) -> dict:
        p = f"layer_{i}/"
        d, f = cfg.hidden_size, cfg.intermediate_size
        if ckpt.fused_qkv:
            q, k, v = get(p + "attn/qkv_einsum/w")
        else:
            q = get(p + "attn/q_einsum/w")
            k, v = get(p + "attn/kv_einsum/w")
        heads_last = lambda w: w.transpose(1, 0, 2).reshape(d, -1)  # [n, D, H] -> [D, n*H]
        gate, up = get(p + "mlp/gating_einsum")
        if ckpt.gating_transposed:
            gate, up = gate.T, up.T
        return {"wq": heads_last(q), "wk": heads_last(k), "wv": heads_last(v),
                "wo": get(p + "attn/attn_vec_einsum/w").reshape(-1, d),
                "w_gate": gate, "w_up": up, "w_down": get(p + "mlp/linear").reshape(f, d),
                "attn_norm": one_plus(p + "pre_attention_norm/scale"),
                "post_attn_norm": one_plus(p + "post_attention_norm/scale"),
                "mlp_norm": one_plus(p + "pre_ffw_norm/scale"),
                "post_mlp_norm": one_plus(p + "post_ffw_norm/scale"),
                "q_norm": one_plus(p + "attn/_query_norm/scale"),
                "k_norm": one_plus(p + "attn/_key_norm/scale")}

    layers = stack_layers([layer(i) for i in range(cfg.num_layers)], dtype)
    params = {"embed": jnp.asarray(get("embedder/input_embedding"), dtype), "layers": layers,
              "final_norm": {"weight": jnp.asarray(one_plus("final_norm/scale")["weight"],
                                                   dtype)}}
    return params
