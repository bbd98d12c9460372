"""Orbax checkpoints of a model's params pytree: the format ``jaxserve convert`` writes and serves.

Layout of ``DIR`` (field by field: docs/models.md#the-directory):

  DIR/config.json            ``cfg.to_dict()`` + ``"architecture"``, ``"format": "jaxserve-orbax"``
                             and, quantised, ``"quantization"`` (int4: ``"int4_format"``)
  DIR/params/                ``StandardCheckpointer`` save, chunks of at most ``CHUNK_BYTES``
  DIR/tokenizer.json, tokenizer_config.json, generation_config.json   the tokenizer's files
  DIR/kv_scales.json         optional: the 8-bit KV cache's calibrated scales

Loading reads ``config.json``, builds the model, and restores the params straight into
``model.param_shapes()`` targets carrying dtype and sharding: no host copy, no re-layout. Under
tensor-parallel ``NamedSharding``s each device reads its slice plus at most the chunks its slice
boundaries cut (hence ``CHUNK_BYTES``; a one-chunk array is decoded whole by every device).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from models.quant import QuantConfig, quantization_of, quantized_shapes
from models.quant_formats import INT4_FORMAT, QuantizedWeight
from models.registry import get_architecture

CONFIG_FILE = "config.json"
KV_SCALES_FILE = "kv_scales.json"
PARAMS_DIR = "params"
FORMAT = "jaxserve-orbax"
CHUNK_BYTES = 1 << 20
"""Upper bound of one stored chunk: small next to a device's slice of a large weight, large
enough that a Llama-3.1-8B checkpoint has ~16k chunks, not millions."""


def import_orbax():
    """``orbax.checkpoint``, imported when a checkpoint is read or written: the import takes
    ~0.25 s of every server's start-up on a 2-core CPU, and most serve a GGUF file."""
    import orbax.checkpoint as ocp

    return ocp


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a ``"format": "jaxserve-orbax"`` config.json and ``params/``."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not (os.path.isfile(cfg_path) and os.path.isdir(os.path.join(path, PARAMS_DIR))):
        return False
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            return json.load(fh).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def save_checkpoint(path: str, cfg, params, dtype: jnp.dtype | None = None) -> None:
    """Write ``params`` and ``cfg`` (a ``ModelConfigLike``) under ``path``; not the tokenizer.

    Args:
      dtype: cast float leaves to it when given (quantised leaves stay as they are).

    Raises:
      ValueError: ``path/params`` exists already (orbax refuses to overwrite).
    """
    target = os.path.join(os.path.abspath(path), PARAMS_DIR)
    if os.path.exists(target):
        raise ValueError(f"{target} exists already; choose a new destination directory")
    if dtype is not None:
        params = jax.tree_util.tree_map(
            lambda x: x if isinstance(x, QuantizedWeight) else jnp.asarray(x, dtype), params,
            is_leaf=lambda x: isinstance(x, QuantizedWeight))
    quant = quantization_of(params)
    os.makedirs(path, exist_ok=True)
    ocp = import_orbax()
    ckpt = ocp.StandardCheckpointer()
    chunked = jax.tree_util.tree_map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), params)
    ckpt.save(target, params, save_args=chunked)
    ckpt.wait_until_finished()
    ckpt.close()
    data = {"format": FORMAT, **cfg.to_dict(), "architecture": cfg.architecture}
    if quant.method != "none":
        data["quantization"] = {"method": quant.method, "group_size": quant.group_size,
                                "embeddings": quant.embeddings}
        if quant.method == "int4":
            data["quantization"]["int4_format"] = INT4_FORMAT
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


def save_kv_scales(path: str, kv_cache_dtype: str, k_scale, v_scale, *, num_tokens: int,
                   percentile: float) -> None:
    """Write ``path/kv_scales.json``: ``f32[num_layers, num_kv_heads]`` scales for "fp8"/"int8"."""
    data = {"kv_cache_dtype": kv_cache_dtype,
            "k_scale": [[float(x) for x in row] for row in k_scale],
            "v_scale": [[float(x) for x in row] for row in v_scale],
            "num_tokens": int(num_tokens), "percentile": float(percentile)}
    with open(os.path.join(path, KV_SCALES_FILE), "w", encoding="utf-8") as fh:
        json.dump(data, fh)
        fh.write("\n")


def read_kv_scales(path: str) -> dict | None:
    """``path/kv_scales.json`` (``k_scale``, ``v_scale``: numpy ``f32[num_layers,
    num_kv_heads]``), or None when absent.

    Raises:
      ValueError: an unreadable file, a missing key, or scales that are not finite and > 0.
    """
    file = os.path.join(path, KV_SCALES_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as fh:
            data = json.load(fh)
        data["k_scale"] = np.asarray(data["k_scale"], np.float32)
        data["v_scale"] = np.asarray(data["v_scale"], np.float32)
        str(data["kv_cache_dtype"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    for key in ("k_scale", "v_scale"):
        a = data[key]
        if a.ndim != 2 or not np.all(np.isfinite(a) & (a > 0)):
            raise ValueError(f"{file}: {key} must be [num_layers][num_kv_heads] of finite "
                             f"positive numbers")
    return data


def read_config(path: str):
    """``path/config.json`` parsed by its architecture's ``config_from_dict``.

    Raises:
      ValueError: unreadable JSON, a missing/unknown ``architecture``, or bad config keys.
    """
    return _read(path)[0]


def read_quantization(path: str):
    """The ``models.quant.QuantConfig`` recorded in ``path/config.json`` ("none": float).

    Raises:
      ValueError: as ``read_config``, or a malformed ``quantization`` entry.
    """
    return _read(path)[1]


def _read(path: str):
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}/{CONFIG_FILE}: {e}") from None
    data.pop("format", None)
    quant = data.pop("quantization", None) or {}
    if not isinstance(quant, dict):
        raise ValueError(f"{path}/{CONFIG_FILE}: bad 'quantization' entry {quant!r}: must be "
                         f"an object with keys method, group_size, embeddings")
    quant = dict(quant)
    int4_format = quant.pop("int4_format", None)
    if "architecture" not in data:
        raise ValueError(f"{path}/{CONFIG_FILE} lacks the key 'architecture'")
    try:
        arch = get_architecture(str(data["architecture"]))
    except ValueError as e:
        raise ValueError(f"{path}/{CONFIG_FILE}: {e}") from None
    try:
        qcfg = QuantConfig(**quant)
    except TypeError as e:
        raise ValueError(f"{path}/{CONFIG_FILE}: bad 'quantization' entry {quant!r}: {e}"
                         ) from None
    if qcfg.method == "int4" and int4_format != INT4_FORMAT:
        have = repr(int4_format) if int4_format else "the symmetric layout of older versions"
        raise ValueError(
            f"{path}: its int4 weights are stored in {have}; this jaxserve reads "
            f"{INT4_FORMAT!r} (asymmetric: f16 scale and u8 zero point per group); convert the "
            f"original model again with --quantization int4")
    return arch.config_from_dict(data), qcfg


def load_checkpoint(path: str, dtype: jnp.dtype, shardings=None):
    """(config, params) of the checkpoint at ``path``, restored straight into place.

    Args:
      path: a directory in ``save_checkpoint``'s layout.
      dtype: the float leaves' dtype after loading (quantised leaves stay as stored).
      shardings: pytree of ``jax.sharding.Sharding`` matching the params; default: device 0.

    Raises:
      ValueError: the stored tree's paths or shapes differ from the model's (naming the path).
    """
    cfg, qcfg = _read(path)
    arch = get_architecture(cfg.architecture)
    model = arch.model(cfg, dtype)
    shapes = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype),
                                    model.param_shapes())
    if qcfg.method != "none":
        if arch.quant_targets is None:
            raise ValueError(f"{path}: architecture {arch.name!r} does not support quantised "
                             f"weights, yet config.json records quantization "
                             f"{qcfg.describe()}")
        shapes = quantized_shapes(shapes, arch.quant_targets, qcfg)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree_util.tree_map(lambda _: one, shapes)
    target = jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    params_dir = os.path.join(os.path.abspath(path), PARAMS_DIR)
    ocp = import_orbax()
    ckpt = ocp.StandardCheckpointer()
    try:
        _check_tree(params_dir, _metadata_tree(ckpt, params_dir), shapes)
        try:
            return cfg, ckpt.restore(params_dir, target)
        except Exception as e:  # noqa: BLE001 (orbax raises bare Exception): a damaged file
            raise ValueError(f"checkpoint {params_dir}: cannot read the weights, a file is "
                             f"damaged or missing: {_first_line(e)}") from None
    finally:
        ckpt.close()


def _metadata_tree(ckpt, params_dir: str):
    """The stored params' metadata tree; ValueError naming ``params_dir`` where it is missing
    or unreadable (a deleted ``_METADATA``, a truncated file)."""
    try:
        meta = ckpt.metadata(params_dir).item_metadata
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"checkpoint {params_dir}: cannot read its metadata: "
                         f"{_first_line(e)}") from None
    if meta is None or getattr(meta, "tree", None) is None:
        raise ValueError(f"checkpoint {params_dir}: no params metadata (_METADATA missing or "
                         "empty): the checkpoint is incomplete")
    return meta.tree


def _first_line(e: BaseException, limit: int = 300) -> str:
    """An exception's first line, at most ``limit`` characters (TensorStore's run long)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."


def stored_params(path: str):
    """The stored params as ``jax.ShapeDtypeStruct`` leaves, from the metadata alone."""
    params_dir = os.path.join(os.path.abspath(path), PARAMS_DIR)
    ocp = import_orbax()
    ckpt = ocp.StandardCheckpointer()
    try:
        tree = _metadata_tree(ckpt, params_dir)
    finally:
        ckpt.close()
    return jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)


def _check_tree(where: str, stored, expected) -> None:
    """Raise ValueError naming the first path whose presence or shape differs."""
    def key(path) -> str:  # orbax stores a dataclass node's fields as dict keys
        return "".join(f"[{k.name!r}]" if isinstance(k, jax.tree_util.GetAttrKey)
                       else jax.tree_util.keystr((k,)) for k in path)

    flat_s = {key(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
    flat_e = {key(p): tuple(s.shape)
              for p, s in jax.tree_util.tree_flatten_with_path(expected)[0]}
    if missing := sorted(set(flat_e) - set(flat_s)):
        raise ValueError(f"checkpoint {where} lacks params {', '.join(missing)}")
    if extra := sorted(set(flat_s) - set(flat_e)):
        raise ValueError(f"checkpoint {where} has params the model does not: "
                         f"{', '.join(extra)}")
    for k, shape in flat_e.items():
        if flat_s[k] != shape:
            raise ValueError(f"checkpoint {where}: param {k} has shape {flat_s[k]}, the model "
                             f"expects {shape}")
